"""Run as a script by test_spark_ml_standalone.py, against a cluster master: a Pipeline with
`SparknetEstimator` fits with its run dirs on S3, transforms on the executors, is saved, its run
dir deleted, loaded and transforms again. Prints a JSON line of what the test checks. (A script:
the test process holds a local SparkContext, and there is one per process.)"""

from __future__ import annotations

import json
import sys

import boto3
import numpy as np
import torch
from pyspark.ml import Pipeline, PipelineModel
from pyspark.ml.feature import VectorAssembler
from pyspark.sql import SparkSession

import sparknet
from sparknet.ml import SparknetEstimator
from tests.ml.test_spark_model import SMALL, _blobs, _outputs


def main(master: str, runs: str, saved: str) -> None:
    spark = SparkSession.builder.master(master).appName("pipeline-on-cluster").getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    train_df, test_df = _blobs(spark, 96, 0), _blobs(spark, 40, 1)
    stages = [
        VectorAssembler(inputCols=["a", "b", "c", "d"], outputCol="vec"),
        SparknetEstimator(inputCol="vec", runsDir=runs, **SMALL),
    ]
    fitted = Pipeline(stages=stages).fit(train_df)
    run = fitted.stages[-1].getOrDefault("runDir")
    out = fitted.transform(test_df)
    feats, pred, prob = _outputs(out, "vec", "prediction", "probability")
    with torch.no_grad():
        want = sparknet.load_model(run)(torch.as_tensor(feats, dtype=torch.float32)).softmax(1)
    fitted.write().save(saved)
    bucket, _, prefix = run.removeprefix("s3://").partition("/")
    s3 = boto3.client("s3")
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix=prefix)["Contents"]]
    s3.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": k} for k in keys]})
    again, again_prob = _outputs(PipelineModel.load(saved).transform(test_df), "prediction",
                                 "probability")  # fmt: skip
    labels = np.array([r.label for r in test_df.select("label").collect()])
    print(json.dumps({
        "run": run,
        "equal_torch": bool(np.array_equal(pred, want.argmax(1).numpy().astype(float))),
        "prob_gap": float(np.abs(prob - want.numpy()).max()),
        "accuracy": float((pred == labels).mean()),
        "loaded_equal": bool(np.array_equal(again, pred) and np.array_equal(again_prob, prob)),
        "deleted": len(keys),
    }))  # fmt: skip
    spark.stop()


if __name__ == "__main__":
    main(*sys.argv[1:])
