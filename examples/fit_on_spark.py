"""Train on a Spark cluster you already have: `spark-submit` this script (see
docs/spark-cluster.md, "On a Spark cluster you already have").

    PYSPARK_DRIVER_PYTHON=env/bin/python PYSPARK_PYTHON=./env/bin/python \
        spark-submit --master spark://HOST:7077 --archives sparknet-env.tar.gz#env \
        examples/fit_on_spark.py --out runs/digits

It builds a DataFrame of scikit-learn's bundled digits (8x8 images as 64-value `features` arrays
and a `label`), trains with `sparknet.fit` on the session spark-submit made (so on its master)
and prints the run dir and the final test accuracy. Replace the frame with your own
(`spark.read.parquet(...)`, `spark.table(...)`).
"""

from __future__ import annotations

import argparse

from pyspark.sql import DataFrame, SparkSession

import sparknet


def digits_frames(spark: SparkSession, test_fraction: float = 0.2) -> tuple[DataFrame, DataFrame]:
    """The digits as (train, test) frames of `features array<float>, label int`."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    rows = [
        ([float(v) / 16.0 for v in x], int(y))
        for x, y in zip(digits.data, digits.target, strict=True)
    ]
    cut = int(len(rows) * (1 - test_fraction))
    schema = "features array<float>, label int"
    return spark.createDataFrame(rows[:cut], schema), spark.createDataFrame(rows[cut:], schema)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="the run dir (local path or s3://...)")
    parser.add_argument("--workers", type=int, default=2, help="Spark partitions, one worker each")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--tau", type=int, default=10, help="local steps per round")
    args = parser.parse_args()

    spark = SparkSession.builder.appName("sparknet-fit-digits").getOrCreate()
    train, test = digits_frames(spark)
    result = sparknet.fit(
        train, eval_df=test, model="mlp", workers=args.workers, rounds=args.rounds,
        tau=args.tau, batch_size=32, lr=0.05, out=args.out,
    )  # fmt: skip
    print(f"run dir {result.run_dir}: test accuracy {result.final['eval_accuracy']:.3f}")
    spark.stop()


if __name__ == "__main__":
    main()
