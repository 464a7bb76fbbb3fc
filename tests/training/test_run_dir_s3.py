"""A run dir on S3 (moto's server): the same files as a local one, a resume as exact, the same
checks and a lock. Real local Spark (local[2,2]); its executors write their inner optimizer
states to moto themselves, through AWS_ENDPOINT_URL."""

from __future__ import annotations

import json
import os
import subprocess

import boto3
import pytest

import sparknet
from sparknet.config import TrainConfig, load_train_config
from sparknet.errors import SparknetError
from sparknet.training import rundir
from sparknet.training.driver import train
from sparknet.training.report import read_metrics
from sparknet.training.rundir import read_run_config
from tests.conftest import REPO, SPARKNET
from tests.helpers import assert_state_equal, load_run_model

pytestmark = pytest.mark.integration

#: sgd with momentum and inner_state keep: a resume is exact only if the workers' states are too
SMALL = {
    "model": "mlp", "workers": 2, "tau": 2, "batch_size": 8, "eval_every": 2,
    "momentum": 0.9, "inner_state": "keep",
}  # fmt: skip


def _keys(s3, bucket: str, prefix: str) -> dict[str, bytes]:
    """Every object under the prefix, relative names -> bytes."""
    out = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
        for obj in page.get("Contents", []):
            body = s3.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read()
            out[obj["Key"][len(prefix) + 1 :]] = body
    return out


def test_an_interrupted_s3_run_resumes_to_the_bytes_of_an_uninterrupted_local_one(
    spark, tmp_path, bucket, moto_endpoint
):
    s3 = boto3.client("s3", endpoint_url=moto_endpoint)
    local = tmp_path / "local"
    train(TrainConfig(rounds=4, checkpoint_every=1, out=local, **SMALL), spark=spark)

    uri = f"s3://{bucket}/runs/a"
    cfg = TrainConfig(rounds=4, checkpoint_every=1, out=uri, **SMALL)

    def interrupt(row):
        if row["round"] == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(cfg, spark=spark, on_round=interrupt)
    stored = _keys(s3, bucket, "runs/a")
    assert {k for k in stored if not k.startswith(("checkpoints/", "events."))} == {
        "config.yaml", "metrics.jsonl", "model.json", "best.json",
    }  # fmt: skip
    for rnd in (1, 2):  # the workers wrote their own states into each checkpoint
        ckpt = f"checkpoints/round-{rnd:05d}/"
        assert {k[len(ckpt) :] for k in stored if k.startswith(ckpt)} == {
            "config.yaml", "weights.safetensors", "state.json",
            "inner/partition-00000.pt", "inner/partition-00001.pt",
        }  # fmt: skip
    assert [r["round"] for r in read_metrics(uri)] == [1, 2]
    # a run killed while writing round 3's checkpoint: files, but no manifest
    s3.put_object(
        Bucket=bucket, Key="runs/a/checkpoints/round-00003/weights.safetensors", Body=b"x"
    )
    s3.put_object(Bucket=bucket, Key="runs/a/checkpoints/round-00003/inner/partition-00000.pt",
                  Body=b"x")  # fmt: skip

    base = read_run_config(uri)
    result = train(load_train_config(base=base, environ={}), resume=True, spark=spark)
    assert result.run_dir == uri and [r["round"] for r in result.metrics] == [1, 2, 3, 4]
    stored = _keys(s3, bucket, "runs/a")
    assert stored["model.safetensors"] == (local / "model.safetensors").read_bytes()
    loaded = sparknet.load_model(uri, moto_endpoint).state_dict()  # the model, from S3
    assert_state_equal(loaded, load_run_model(local))
    assert stored["curves.png"][:8] == b"\x89PNG\r\n\x1a\n"
    assert [json.loads(x)["round"] for x in stored["metrics.jsonl"].splitlines()] == [1, 2, 3, 4]
    assert (
        stored["checkpoints/round-00003/weights.safetensors"]
        == (local / "checkpoints/round-00003/weights.safetensors").read_bytes()
    )
    assert rundir.LOCK not in stored  # released at the end

    # TensorBoard: one event file per run (the interrupted one and the resume), uploaded to S3;
    # read back, the scalars are the metrics rows'
    events = tmp_path / "events"
    events.mkdir()
    for name in (k for k in stored if k.startswith("events.out.tfevents.")):
        (events / name).write_bytes(stored[name])
    assert len(list(events.iterdir())) == 2
    losses = [(r["round"], pytest.approx(r["loss"])) for r in result.metrics]
    assert _scalars(events, "train/loss") == losses
    assert _scalars(local, "train/loss") == [
        (r["round"], pytest.approx(r["loss"])) for r in read_metrics(local)
    ]


def _scalars(log_dir, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_the_run_dir_checks_hold_on_s3_and_refuse_before_spark(bucket, moto_endpoint):
    """No Spark here: every refusal comes before it (one started would fail on the data)."""
    s3 = boto3.client("s3", endpoint_url=moto_endpoint)
    uri = f"s3://{bucket}/runs/b"
    with pytest.raises(SparknetError, match=rf"^nothing to resume: {uri} is not a sparknet run"):
        train(TrainConfig(out=uri, **SMALL), resume=True)

    s3.put_object(Bucket=bucket, Key="runs/b/notes.txt", Body=b"mine")
    with pytest.raises(SparknetError, match="is not empty and is not a sparknet run dir"):
        train(TrainConfig(out=uri, **SMALL))

    s3.delete_object(Bucket=bucket, Key="runs/b/notes.txt")
    s3.put_object(Bucket=bucket, Key="runs/b/config.yaml", Body=TrainConfig(**SMALL).to_yaml())
    s3.put_object(Bucket=bucket, Key="runs/b/metrics.jsonl", Body=b"{}\n")
    s3.put_object(Bucket=bucket, Key="runs/b/checkpoints/round-00001/state.json", Body=b"{}")
    with pytest.raises(SparknetError, match=f"^{uri} already holds a run; pass --resume"):
        train(TrainConfig(out=uri, **SMALL))
    assert set(_keys(s3, bucket, "runs/b")) == {
        "config.yaml",
        "metrics.jsonl",
        "checkpoints/round-00001/state.json",
    }  # fmt: skip: nothing added, the lock removed again

    with pytest.raises(SparknetError, match=r"^--out s3://\S+: a run needs its own prefix"):
        train(TrainConfig(out=f"s3://{bucket}", **SMALL))

    # an object's key is a file, as a local --out that is a file: refused, nothing written
    with pytest.raises(SparknetError, match=r"^--out \S+/metrics.jsonl: that is an object"):
        train(TrainConfig(out=f"{uri}/metrics.jsonl", **SMALL), resume=True)
    assert len(_keys(s3, bucket, "runs/b")) == 3


def test_a_second_run_on_the_same_s3_out_refuses_until_the_lock_is_stale(
    spark, bucket, moto_endpoint, monkeypatch
):
    s3 = boto3.client("s3", endpoint_url=moto_endpoint)
    uri = f"s3://{bucket}/runs/c"
    cfg = TrainConfig(rounds=1, out=uri, **SMALL)
    held = rundir.RunDir.open(uri)
    with rundir.locked(held):  # a first run holds it
        with pytest.raises(
            SparknetError, match=rf"^another sparknet run \(\S+:\d+\) is using {uri}"
        ):
            train(cfg)
        assert set(_keys(s3, bucket, "runs/c")) == {rundir.LOCK}
    assert _keys(s3, bucket, "runs/c") == {}  # released

    # a run that died leaves its lock; once older than STALE_S it is taken over
    s3.put_object(Bucket=bucket, Key=f"runs/c/{rundir.LOCK}", Body=b'{"owner": "gone:1"}')
    with pytest.raises(SparknetError, match="gone:1"):
        train(cfg)
    monkeypatch.setattr(rundir, "STALE_S", 0.0)
    result = train(cfg, spark=spark)
    assert [r["round"] for r in result.metrics] == [1]
    assert rundir.LOCK not in _keys(s3, bucket, "runs/c")


def test_a_lock_taken_over_stops_the_run_that_lost_it(bucket, moto_endpoint):
    s3 = boto3.client("s3", endpoint_url=moto_endpoint)
    run = rundir.RunDir.open(f"s3://{bucket}/runs/d")
    with rundir.locked(run) as lock:
        before = lock.etag
        lock.renew()
        assert lock.etag != before  # renewed: a new write
        lock.check()
        s3.put_object(Bucket=bucket, Key=f"runs/d/{rundir.LOCK}", Body=b'{"owner": "other:2"}')
        lock.renew()
        with pytest.raises(SparknetError, match="lost its lock"):
            lock.check()
        # every write or delete through the run dir's store checks the lock first
        with pytest.raises(SparknetError, match="lost its lock"):
            run.store.write_bytes("metrics.jsonl", b"{}\n")
        with pytest.raises(SparknetError, match="lost its lock"):
            run.store.delete([rundir.LOCK])
    assert set(_keys(s3, bucket, "runs/d")) == {rundir.LOCK}
    # the lock it lost is the other run's: left in place
    assert s3.get_object(Bucket=bucket, Key=f"runs/d/{rundir.LOCK}")["Body"].read() == (
        b'{"owner": "other:2"}'
    )


def test_a_run_whose_renewals_fail_for_long_counts_its_lock_as_lost(bucket, moto_endpoint):
    """Renewals that fail (S3 unreachable) for LOST_AFTER_S stop the run's writes before another
    run may take the lock over as stale (the clock is moved, not waited for)."""
    s3 = boto3.client("s3", endpoint_url=moto_endpoint)
    run = rundir.RunDir.open(f"s3://{bucket}/runs/f")
    with rundir.locked(run) as lock:
        run.store.write_bytes("metrics.jsonl", b"")
        lock.written_at -= rundir.LOST_AFTER_S + 1
        with pytest.raises(SparknetError, match=r"could not renew its lock .* for \d+ s"):
            run.store.write_bytes("curves.png", b"x")
        with pytest.raises(SparknetError, match="lost its lock"):
            lock.check()
    assert set(_keys(s3, bucket, "runs/f")) == {rundir.LOCK, "metrics.jsonl"}


def test_s3_problems_are_one_line_before_spark_starts(moto_endpoint, tmp_path):
    """Through the CLI: a missing bucket and missing credentials are one line, exit 2, and no
    JVM is started (each ends within seconds)."""
    import os

    env = dict(os.environ, AWS_EC2_METADATA_DISABLED="true")
    proc = subprocess.run(
        [str(SPARKNET), "train", "--rounds", "1", "--out", "s3://no-such-bucket-x/runs/a"],
        cwd=REPO, capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "error: bucket no-such-bucket-x does not exist; create it or fix the URI "
        "(s3://no-such-bucket-x/runs/a)"
    ]
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        env.pop(key)
    env.update(
        AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"), AWS_CONFIG_FILE=str(tmp_path / "none")
    )
    proc = subprocess.run(
        [str(SPARKNET), "train", "--rounds", "1", "--out", "s3://some-bucket/runs/a"],
        cwd=REPO, capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: no AWS credentials found"), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_on_a_standalone_cluster_the_executors_write_and_read_the_inner_states_on_s3(
    standalone, bucket, moto_endpoint
):
    """The shared standalone cluster (two workers on 127.0.0.1), through the CLI as a user runs
    it: `--out s3://...`, then `--resume --out s3://...` with more rounds and no other setting
    (they come back from S3). The executors put their optimizer states into the S3 checkpoint,
    and after the resume (a new run id, so no executor-local state) they read them back from
    S3: no round misses one."""
    uri = f"s3://{bucket}/runs/cluster"
    where = ("train", "--master", standalone.master, "--out", uri)
    first = (
        "--workers", "2", "--tau", "1", "--momentum", "0.9", "--inner-state", "keep",
        "--eval-every", "0", "--checkpoint-every", "1", "--rounds", "2",
    )  # fmt: skip
    for extra in (first, ("--resume", "--rounds", "3")):
        proc = subprocess.run(
            [str(SPARKNET), *where, *extra], cwd=REPO, capture_output=True, text=True, timeout=400
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert uri in proc.stdout.replace("\n", "").replace("│", "").replace(" ", "")
    assert [r["inner_state_misses"] for r in read_metrics(uri)] == [0, 0, 0]
    settings = read_run_config(uri)  # the first run's, kept by the resume
    assert (settings["tau"], settings["momentum"], settings["rounds"]) == (1, 0.9, 3)
    s3 = boto3.client("s3", endpoint_url=moto_endpoint)
    stored = _keys(s3, bucket, "runs/cluster")
    assert {"model.safetensors", "curves.png"} <= set(stored)
    for rnd in (1, 2, 3):
        for k in (0, 1):
            assert f"checkpoints/round-{rnd:05d}/inner/partition-{k:05d}.pt" in stored


def test_denied_access_to_the_run_dir_is_one_line_before_spark(moto_endpoint):
    """moto enforces a bucket policy that denies everything: the answer is AWS's 403."""
    s3 = boto3.client("s3", endpoint_url=moto_endpoint)
    s3.create_bucket(Bucket="denied-runs")
    statement = {
        "Effect": "Deny", "Principal": "*", "Action": "s3:*",
        "Resource": ["arn:aws:s3:::denied-runs", "arn:aws:s3:::denied-runs/*"],
    }  # fmt: skip
    policy = {"Version": "2012-10-17", "Statement": [statement]}
    s3.put_bucket_policy(Bucket="denied-runs", Policy=json.dumps(policy))
    with pytest.raises(SparknetError) as exc:
        train(TrainConfig(out="s3://denied-runs/runs/a", **SMALL))
    assert str(exc.value).startswith("access to s3://denied-runs/runs/a was denied (403); ")
    assert "\n" not in str(exc.value)


def test_a_lock_write_whose_answer_was_lost_is_still_the_runs_own(bucket, moto_endpoint):
    """A PUT that S3 applied but whose answer was lost is retried by the client and gets 412:
    the lock object holds this run's token, so the lock is kept (renewal and acquire alike)."""
    run = rundir.RunDir.open(f"s3://{bucket}/runs/g")
    with rundir.locked(run) as lock:
        lock.renewals += 1  # a renewal's first try: applied, but the run never saw the answer
        applied = lock._put(IfMatch=lock.etag)
        lock.renew()
        lock.check()
        assert lock.etag == applied and not lock.lost
    again = rundir.S3Lock(run.store)
    again._put(IfNoneMatch="*")  # the first try of acquire's PUT, its answer lost
    again.acquire()
    try:
        again.check()
        assert again.etag is not None
    finally:
        again.release()


def test_a_lock_left_by_a_dead_process_of_this_host_is_taken_over_at_once(bucket, moto_endpoint):
    import socket

    s3 = boto3.client("s3", endpoint_url=moto_endpoint)
    dead = subprocess.Popen(["true"])
    dead.wait()
    key = f"runs/h/{rundir.LOCK}"
    owner = f"{socket.gethostname()}:{dead.pid}"
    s3.put_object(Bucket=bucket, Key=key, Body=json.dumps({"owner": owner}).encode())
    run = rundir.RunDir.open(f"s3://{bucket}/runs/h")
    with rundir.locked(run) as lock:
        lock.check()
    assert rundir.LOCK not in _keys(s3, bucket, "runs/h")

    alive = f"{socket.gethostname()}:{os.getpid()}"
    s3.put_object(Bucket=bucket, Key=key, Body=json.dumps({"owner": alive}).encode())
    with pytest.raises(SparknetError) as exc, rundir.locked(run):
        pass
    assert f"delete s3://{bucket}/{key} to take the dir now" in str(exc.value)


def test_a_killed_runs_event_temp_dir_is_reused_and_removed_by_the_next(bucket, moto_endpoint):
    """An S3 run dir's local event dir is one per run dir: a run killed before removing it
    (its writer left open, the dir left) leaves it to the next run, which cleans it."""
    from sparknet.training.rounds import RunEvents

    run = rundir.RunDir.open(f"s3://{bucket}/runs/k")
    cfg = TrainConfig(**SMALL)
    killed = RunEvents(run, cfg, 0)
    killed.round({"round": 1, "loss": 1.0})
    left = killed.temp
    assert left is not None and left.is_dir()
    nxt = RunEvents(run, cfg, 1)
    assert nxt.temp == left
    nxt.close()
    killed.log.close()
    assert not left.exists()
