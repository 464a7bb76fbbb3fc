"""sparknet-submit's pure parts and its preflight against moto's S3: no Spark, no instance.
The flow end to end is tests/integration/test_submit.py."""

from __future__ import annotations

import inspect

import pytest

from sparknet import submit as flow
from sparknet.config import DatasetEntry, TrainConfig


def test_a_dataset_name_resolves_through_datasets_and_a_uri_as_is() -> None:
    datasets = {
        "imagenet": DatasetEntry(uri="s3://data-bkt/imagenet/", endpoint_url="http://m:1"),
        "local": DatasetEntry(uri="/data/tiny"),
    }
    assert flow.resolve_dataset("imagenet", datasets) == flow.Dataset(
        "s3://data-bkt/imagenet", "http://m:1"
    )
    assert flow.resolve_dataset("s3://other-bkt/x/", datasets) == flow.Dataset("s3://other-bkt/x")
    with pytest.raises(flow.PreflightFailed, match=r"no such dataset .*\(known: imagenet, local\)"):
        flow.resolve_dataset("imagenet1k", datasets)
    with pytest.raises(flow.PreflightFailed, match="is /data/tiny, not on S3"):
        flow.resolve_dataset("local", datasets)


def test_run_prefix_and_run_id() -> None:
    run = flow.new_run_id(now=0)
    assert run.startswith("19700101-000000-") and len(run) == len("19700101-000000-abcd")
    assert flow.run_prefix("bkt", "c1", run) == f"s3://bkt/runs/c1/{run}/"


def test_progress_line_and_last_error() -> None:
    row = {"round": 3, "loss": 1.23456, "samples_per_s": 812.4, "eval_accuracy": 0.5}
    assert flow.progress_line(row, 10, 0.4567) == (
        "round 3/10  loss 1.2346  acc 0.500  812 samples/s  cost $0.46"
    )
    del row["eval_accuracy"]
    assert flow.progress_line(row, 10, None) == "round 3/10  loss 1.2346  812 samples/s  cost $?"
    log = "starting\nerror: first\nround 1\nerror: model 'x' not found; check --model\n"
    assert flow.last_error(log) == "model 'x' not found; check --model"
    assert flow.last_error("Killed\n") is None


def _fake_node(tmp_path, train_script: str):
    """A node whose prefix is tmp_path, with a `venv/bin/sparknet` that runs `train_script`."""
    from sparknet.cluster.nodes import Endpoint
    from sparknet.cluster.plan import Node

    sparknet = tmp_path / "venv" / "bin" / "sparknet"
    sparknet.parent.mkdir(parents=True)
    sparknet.write_text(f"#!/bin/sh\n{train_script}\n")
    sparknet.chmod(0o755)
    return Node(Endpoint("master", "127.0.0.1", 22, "me"), "127.0.0.1", str(tmp_path), 0)


def _wait_for(predicate, timeout: float = 20.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_the_driver_starts_detached_and_returns_at_once(tmp_path) -> None:
    """The start command comes back while the driver runs (its shell holds no pipe of the
    caller's), the pid file names the driver's session, whose end is a cancel; the job's
    autostop stamp exists while it runs. A local shell stands in for the node's SSH session:
    the same command, the same pipes."""
    import os
    import subprocess
    import time

    from invoke import Context

    node = _fake_node(tmp_path, "echo training; sleep 60")
    cfg = TrainConfig()
    started = time.monotonic()
    flow.start_driver(Context(), node, "R1", cfg)
    assert time.monotonic() - started < 10
    job = tmp_path / "jobs" / "R1"
    pid = int((job / "driver.pid").read_text())
    assert os.getsid(pid) == pid  # setsid: the pid is its session's (and group's) leader
    activity = tmp_path / "autostop" / "activity" / "job-R1"
    _wait_for(activity.exists)
    _wait_for(lambda: "training" in (job / "driver.log").read_text())
    assert flow.driver_rc(Context(), node, "R1") is None
    flow.cancel_driver(Context(), node, "R1")
    _wait_for(lambda: subprocess.run(["kill", "-0", str(pid)], capture_output=True).returncode)
    assert flow.driver_rc(Context(), node, "R1") == -1  # killed: no rc file, counts as failed


def test_a_finished_driver_leaves_its_exit_code_and_removes_its_stamp(tmp_path) -> None:
    from invoke import Context

    node = _fake_node(tmp_path, "echo 'error: model not found'; exit 3")
    flow.start_driver(Context(), node, "R2", TrainConfig())
    job = tmp_path / "jobs" / "R2"
    _wait_for(lambda: (job / "driver.rc").exists())
    assert flow.driver_rc(Context(), node, "R2") == 3
    assert flow.last_error(flow.driver_log(Context(), node, "R2")) == "model not found"
    assert not (tmp_path / "autostop" / "activity" / "job-R2").exists()
    assert (tmp_path / "autostop" / "activity").is_dir()


def test_submit_shares_every_training_flag_of_train() -> None:
    from sparknet.cli import train as train_command
    from sparknet.cli.submit import NOT_SHARED, submit

    train_flags = set(inspect.signature(train_command.train).parameters) - NOT_SHARED
    submit_flags = set(inspect.signature(submit).parameters)
    assert train_flags <= submit_flags
    assert {"s3", "cluster", "workers", "keep", "spot", "instance_type"} <= submit_flags


@pytest.fixture
def s3(moto_endpoint, bucket):
    import boto3

    return boto3.client("s3", endpoint_url=moto_endpoint)


def _dataset(s3, bucket: str, shards: int = 2) -> str:
    from sparknet.data.manifest import ClassInfo, Manifest, ShardInfo

    infos = [
        ShardInfo(name=f"train-{k:06d}.tar", samples=1, bytes=3, sha256="0" * 64)
        for k in range(shards)
    ]
    classes = [ClassInfo(index=k, wnid=f"n{k:08d}", name=f"c{k}") for k in range(2)]
    manifest = Manifest(classes=classes, splits={"train": infos})
    s3.put_object(Bucket=bucket, Key="ds/manifest.json", Body=manifest.dumps().encode())
    for info in infos:
        s3.put_object(Bucket=bucket, Key=f"ds/{info.name}", Body=b"abc")
    return f"s3://{bucket}/ds"


def test_preflight_passes_a_whole_dataset_and_a_writable_prefix(s3, bucket) -> None:
    uri = _dataset(s3, bucket)
    assert flow.check_dataset(flow.Dataset(uri)) == 2
    prefix = flow.run_prefix(bucket, "c1", "R1")
    flow.check_writable(prefix, None)
    assert s3.list_objects_v2(Bucket=bucket, Prefix="runs/")["KeyCount"] == 0  # probe deleted


def test_preflight_names_a_missing_shard_and_an_unreadable_manifest(s3, bucket) -> None:
    uri = _dataset(s3, bucket, shards=3)
    s3.delete_object(Bucket=bucket, Key="ds/train-000001.tar")
    with pytest.raises(
        flow.PreflightFailed, match=r"1 shard\(s\) .* missing \(first: train-000001"
    ):
        flow.check_dataset(flow.Dataset(uri))
    s3.put_object(Bucket=bucket, Key="ds/manifest.json", Body=b"{not json")
    with pytest.raises(flow.PreflightFailed, match=f"dataset {uri}: .*manifest"):
        flow.check_dataset(flow.Dataset(uri))
    with pytest.raises(flow.PreflightFailed, match=f"dataset s3://{bucket}/nothing-here: "):
        flow.check_dataset(flow.Dataset(f"s3://{bucket}/nothing-here"))


def test_preflight_refuses_an_unwritable_prefix(moto_endpoint) -> None:
    with pytest.raises(
        flow.PreflightFailed, match="run prefix s3://no-such-bkt-x/runs/c/R/ is not"
    ):
        flow.check_writable(flow.run_prefix("no-such-bkt-x", "c", "R"), None)


def test_a_reused_cluster_stays_and_a_made_one_goes_unless_keep() -> None:
    from sparknet.cluster.spec import ClusterSpec

    spec = ClusterSpec(name="c1")
    job = flow.Job(spec, False, False, flow.Dataset("s3://b-b/x"), None)  # type: ignore[arg-type]
    assert flow.teardown_due(job)
    assert not flow.teardown_due(flow.Job(spec, False, True, job.dataset, None))  # type: ignore[arg-type]
    assert not flow.teardown_due(flow.Job(spec, True, False, job.dataset, None))  # type: ignore[arg-type]


def test_a_bad_training_flag_or_provider_is_one_line_and_exit_2(tmp_path) -> None:
    """The shared flags validate as `sparknet train`'s do, before anything is asked of AWS."""
    import subprocess

    from tests.conftest import SPARKNET

    SUBMIT = SPARKNET.with_name("sparknet-submit")

    def submit(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(SUBMIT), "--s3", "s3://bkt/x", "--name", "c1", *args],
            cwd=tmp_path, capture_output=True, text=True, timeout=60,
        )  # fmt: skip

    bad = submit("--lr", "-1")
    assert (bad.returncode, bad.stderr) == (
        2, "error: invalid setting lr: Input should be greater than 0 (got -1.0)\n"
    )  # fmt: skip
    static = submit("--provider", "static")
    assert static.returncode == 2 and static.stderr.startswith("error: cluster c1: invalid")
    assert len(static.stderr.splitlines()) == 1
