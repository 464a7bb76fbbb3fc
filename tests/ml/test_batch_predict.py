"""`sparknet predict` on real local Spark: a Parquet row per input with what names it, the
predictions a plain forward pass of the run's weights gives; a DataFrame keeps its other
columns; the destination appears whole or not at all; refusals are one line before Spark
writes. (A shard split: tests/data/test_imagenet_s3.py.)"""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

import sparknet
from sparknet.data.sources import digits
from sparknet.errors import SparknetError
from sparknet.ml.batch_predict import predict
from tests.conftest import REPO, SPARKNET

pytestmark = pytest.mark.integration


def test_a_row_per_test_sample_as_the_weights_predict_it(spark, digits_run, tmp_path):
    run, final = digits_run
    done = predict(run, "digits", f"parquet:{tmp_path / 'p'}", top_k=3, spark=spark)
    assert (done.rows, done.skipped) == (360, 0)
    table = pq.read_table(tmp_path / "p").to_pandas().sort_values("index")
    assert list(table.columns) == ["index", "label", "prediction", "top_k", "probability"]
    inputs, labels = digits()[1].tensors
    with torch.no_grad():
        logits = sparknet.load_model(run)(inputs)
    assert table["index"].tolist() == list(range(360))
    assert table["label"].tolist() == labels.tolist()
    assert table["prediction"].tolist() == logits.argmax(1).tolist()
    assert np.stack(table["top_k"]).tolist() == logits.topk(3, dim=1).indices.tolist()
    probability = np.stack(table["probability"])
    assert np.allclose(probability, logits.softmax(1).numpy(), atol=1e-6)
    assert (table["prediction"] == table["label"]).mean() == final["eval_accuracy"]


def test_a_frame_keeps_its_other_columns_or_the_ones_named(spark, digits_run, tmp_path):
    run, _ = digits_run
    inputs, _labels = digits()[1].tensors
    rows = [(f"img-{i}", i % 7, x.flatten().tolist()) for i, x in enumerate(inputs[:20])]
    spark.createDataFrame(rows, "id string, `b.atch` int, features array<float>").write.parquet(
        str(tmp_path / "in")
    )
    data = f"parquet:{tmp_path / 'in'}"
    predict(run, data, f"parquet:{tmp_path / 'all'}", spark=spark)
    predict(run, data, f"parquet:{tmp_path / 'id'}", key_cols=["id", "id"], spark=spark)
    every, named = (pq.read_table(tmp_path / n).to_pandas() for n in ("all", "id"))
    assert list(every.columns) == ["id", "b.atch", "prediction", "top_k", "probability"]
    assert list(named.columns) == ["id", "prediction", "top_k", "probability"]
    assert len(named) == 20 and len(named["top_k"][0]) == 5
    with torch.no_grad():
        want = sparknet.load_model(run)(inputs[:20]).argmax(1).tolist()
    assert named.sort_values("id", key=lambda s: s.str[4:].astype(int))["prediction"].tolist() \
        == want  # fmt: skip


@pytest.mark.parametrize(
    ("data", "out", "extra", "message"),
    [
        ("digits", "csv:/tmp/x", {}, "--out csv:/tmp/x: write predictions as parquet:PATH"),
        ("digits", "parquet:{tmp}/p", {"top_k": 11},
         "--top-k 11: the model has 10 classes; pass 1 to 10"),
        ("digits", "parquet:{tmp}/p", {"split": "val"},
         "--split names a split of a shard dataset; digits is not one"),
        ("parquet:{tmp}/in", "parquet:{tmp}/p", {"key_cols": ["nope"]},
         "parquet:{tmp}/in has no column 'nope' (it has: features); pass --key-col with "
         "columns it has"),
        ("digits", "parquet:{tmp}/taken", {}, "{tmp}/taken exists: choose another --out, or "
         "remove it"),
        ("digits", "parquet:{tmp}/file/p", {}, "{tmp}/file/p: {tmp}/file is a file; choose "
         "another --out"),
        ("parquet:{tmp}/nope", "parquet:{tmp}/p", {},
         "parquet:{tmp}/nope: no such file or directory; fix the path"),
    ],
    ids=["not-parquet", "top-k", "split", "key-col", "exists", "under-a-file", "no-input"],
)  # fmt: skip
def test_refusals_are_one_line_and_write_nothing(spark, digits_run, tmp_path, data, out, extra,
                                                 message):  # fmt: skip
    run, _ = digits_run
    spark.createDataFrame([([0.0] * 64,)], "features array<float>").write.parquet(
        str(tmp_path / "in")
    )
    (tmp_path / "taken").mkdir()
    (tmp_path / "file").write_bytes(b"")
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(SparknetError) as exc:
        predict(run, data.format(tmp=tmp_path), out.format(tmp=tmp_path), spark=spark, **extra)
    assert str(exc.value) == message.format(tmp=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_the_cli_says_how_many_rows_it_wrote(digits_run, tmp_path):
    run, _ = digits_run
    done = subprocess.run(
        [str(SPARKNET), "predict", str(run), "--data", "digits", "--out",
         f"parquet:{tmp_path / 'p'}", "--top-k", "2"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"{tmp_path / 'p'}: 360 rows"
    assert len(pq.read_table(tmp_path / "p")["top_k"][0]) == 2
    assert [p.name for p in tmp_path.iterdir()] == ["p"]  # no temp dir left beside it


def test_an_s3_destination_is_written_by_the_tasks_and_marked_whole(
    spark, digits_run, moto_endpoint, bucket
):
    """pyspark has no S3 filesystem for Hadoop: each task puts its partition's object
    through boto3 (an executor reaches moto through AWS_ENDPOINT_URL), `_SUCCESS` last; an
    existing destination and a missing bucket are refused before Spark runs a task."""
    import boto3
    import pyarrow as pa

    run, _ = digits_run
    s3 = boto3.client("s3", endpoint_url=moto_endpoint)
    out = f"s3://{bucket}/pred/p"
    done = predict(run, "digits", f"parquet:{out}", workers=2, spark=spark,
                   endpoint_url=moto_endpoint)  # fmt: skip
    assert done.rows == 360
    keys = sorted(o["Key"] for o in s3.list_objects_v2(Bucket=bucket)["Contents"])
    assert keys[0] == "pred/p/_SUCCESS" and len(keys) == 3, keys  # 2 partitions
    parts = [
        pq.read_table(pa.BufferReader(s3.get_object(Bucket=bucket, Key=k)["Body"].read()))
        for k in keys[1:]
    ]
    table = pa.concat_tables(parts).to_pandas().sort_values("index")
    assert list(table.columns) == ["index", "label", "prediction", "top_k", "probability"]
    inputs, _labels = digits()[1].tensors
    with torch.no_grad():
        want = sparknet.load_model(run)(inputs).argmax(1).tolist()
    assert table["prediction"].tolist() == want
    for target, message in (
        (out, f"{out} exists: choose another --out, or remove it"),
        ("s3://no-such-bucket-sn/p", "--out: "),
    ):
        with pytest.raises(SparknetError) as exc:
            predict(run, "digits", f"parquet:{target}", spark=spark, endpoint_url=moto_endpoint)
        assert str(exc.value).startswith(message) and "\n" not in str(exc.value)
    assert len(s3.list_objects_v2(Bucket=bucket)["Contents"]) == 3
    # a write killed before its _SUCCESS: refused, unless told to replace it
    s3.delete_object(Bucket=bucket, Key="pred/p/_SUCCESS")
    with pytest.raises(SparknetError, match=r"never finished: --replace-unfinished deletes it"):
        predict(run, "digits", f"parquet:{out}", spark=spark, endpoint_url=moto_endpoint)
    # ... but only its own parts where a write id is given (a job's restart), and never
    # what is no part of predictions
    with pytest.raises(SparknetError, match=r"exists: choose another --out, or remove it$"):
        predict(run, "digits", f"parquet:{out}", spark=spark, endpoint_url=moto_endpoint,
                replace_unfinished=True, write_id="job-2")  # fmt: skip
    s3.put_object(Bucket=bucket, Key="dataset/manifest.json", Body=b"{}")
    with pytest.raises(SparknetError, match=r"exists: choose another --out, or remove it$"):
        predict(run, "digits", f"parquet:s3://{bucket}/dataset", spark=spark,
                endpoint_url=moto_endpoint, replace_unfinished=True)  # fmt: skip
    assert s3.get_object(Bucket=bucket, Key="dataset/manifest.json")["Body"].read() == b"{}"
    # Spark's own parts (no _SUCCESS) are no unfinished write of predict's; an object of the
    # destination's very name is refused as a local file would be
    spark_part = "spark/part-00000-0b7c1a2e-1111-2222-3333-444455556666-c000.parquet"
    s3.put_object(Bucket=bucket, Key=spark_part, Body=b"x")
    s3.put_object(Bucket=bucket, Key="file.txt", Body=b"hello")
    for where in ("spark", "file.txt"):
        with pytest.raises(SparknetError, match=r"exists: choose another --out, or remove it$"):
            predict(run, "digits", f"parquet:s3://{bucket}/{where}", spark=spark,
                    endpoint_url=moto_endpoint, replace_unfinished=True)  # fmt: skip
    assert s3.get_object(Bucket=bucket, Key=spark_part)["Body"].read() == b"x"
    again = predict(run, "digits", f"parquet:{out}", spark=spark, endpoint_url=moto_endpoint,
                    replace_unfinished=True)  # fmt: skip
    first = set(keys[1:])
    keys = sorted(o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix="pred/")["Contents"])
    assert again.rows == 360 and keys[0] == "pred/p/_SUCCESS" and not first & set(keys), keys
    assert json.loads(s3.get_object(Bucket=bucket, Key="pred/p/_SUCCESS")["Body"].read()) == {
        "rows": 360, "parts": [k.rsplit("/", 1)[1] for k in keys[1:]],
    }  # fmt: skip
    # a whole one is never replaced
    with pytest.raises(SparknetError, match="exists: choose another --out"):
        predict(run, "digits", f"parquet:{out}", spark=spark, endpoint_url=moto_endpoint,
                replace_unfinished=True)  # fmt: skip

    # two writes into one destination at once: the one that sees the other's parts gives up
    # and deletes its own (never the other's)
    def another_comes_in(line: str) -> None:
        if line.startswith("predicting into"):
            s3.put_object(Bucket=bucket, Key="race/part-00000-other.parquet", Body=b"x")

    with pytest.raises(SparknetError, match=r"another write into s3://\S+/race came in .*"
                       r"\(part-00000-other.parquet\); this one is deleted"):  # fmt: skip
        predict(run, "digits", f"parquet:s3://{bucket}/race", spark=spark,
                endpoint_url=moto_endpoint, on_status=another_comes_in)  # fmt: skip
    left = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix="race/")["Contents"]]
    assert left == ["race/part-00000-other.parquet"]


def test_a_python_error_in_a_task_is_named_not_sparks_wrapper(spark):
    from sparknet.ml.batch_predict import _reason

    def fail(batches):
        raise SparknetError("shard val-000006.tar does not match its sha256")
        yield from batches

    with pytest.raises(Exception) as exc:
        spark.range(2).mapInArrow(fail, "id long").collect()
    assert _reason(exc.value) == "shard val-000006.tar does not match its sha256"
    from pyspark.sql import functions as F

    with pytest.raises(Exception) as exc:
        spark.range(1).select(F.raise_error(F.lit("sparknet: a row's 'x' is null"))).collect()
    assert _reason(exc.value) == "a row's 'x' is null"


#: a process whose memory runs out in the model's forward pass, as an executor's does: the
#: batch is made first, then the address space capped just above what the process holds
_OUT_OF_MEMORY = """
import resource, sys
import numpy as np
from sparknet.ml.predict import ColumnInput, Predictor
from sparknet.training.saved_model import SavedModel
predictor = Predictor(SavedModel.read(sys.argv[1]), ColumnInput("features", False, 64), 0, "cpu")
batch = np.zeros((400_000, 64), dtype=np.float32)
held = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (held + 64 * 2**20, resource.RLIM_INFINITY))
try:
    predictor(batch)
except Exception as exc:
    print(type(exc).__name__, exc)
"""


def test_a_batch_that_does_not_fit_in_memory_is_one_line_naming_batch_size(digits_run):
    """The CPU's allocator fails as a plain RuntimeError, a GPU's as torch.OutOfMemoryError:
    either is the one line that says to lower batchSize (the GPU's is not run here: no GPU)."""
    run, _ = digits_run
    done = subprocess.run(
        [str(SPARKNET.with_name("python")), "-c", _OUT_OF_MEMORY, str(run)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.stdout.strip() == (
        "SparknetError a batch of 400000 does not fit in the memory of cpu: set batchSize lower"
    ), done.stdout + done.stderr[-2000:]
