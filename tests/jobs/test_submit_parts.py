"""sparknet-submit's pure parts and its preflight against moto's S3: no Spark, no instance.
The flow end to end is tests/jobs/test_submit.py."""

from __future__ import annotations

import pytest

from sparknet.config import DatasetEntry, TrainConfig
from sparknet.jobs import driver_control, follow, preflight
from sparknet.jobs import submit as flow
from sparknet.training.report import EARLY, STOPPED
from tests.moto_server import amazon_ami


def test_a_dataset_name_resolves_through_datasets_and_a_uri_as_is() -> None:
    datasets = {
        "imagenet": DatasetEntry(uri="s3://data-bkt/imagenet/", endpoint_url="http://m:1"),
        "local": DatasetEntry(uri="/data/tiny"),
    }
    assert preflight.resolve_dataset("imagenet", datasets) == preflight.Dataset(
        "s3://data-bkt/imagenet", "http://m:1"
    )
    assert preflight.resolve_dataset("s3://other-bkt/x/", datasets) == preflight.Dataset(
        "s3://other-bkt/x"
    )
    with pytest.raises(
        preflight.PreflightFailed, match=r"no such dataset .*\(known: imagenet, local\)"
    ):
        preflight.resolve_dataset("imagenet1k", datasets)
    with pytest.raises(preflight.PreflightFailed, match="is /data/tiny, not on S3"):
        preflight.resolve_dataset("local", datasets)


def test_run_prefix_and_run_id() -> None:
    run = preflight.new_run_id(now=0)
    assert run.startswith("19700101-000000-") and len(run) == len("19700101-000000-abcd")
    assert preflight.run_prefix("bkt", "c1", run) == f"s3://bkt/runs/c1/{run}/"


def test_progress_line_and_last_error() -> None:
    row = {"round": 3, "loss": 1.23456, "samples_per_s": 812.4, "eval_accuracy": 0.5}
    assert follow.progress_line(row, 10, 0.4567) == (
        "round 3/10  loss 1.2346  acc 0.500  812 samples/s  cost $0.46"
    )
    del row["eval_accuracy"]
    # a static cluster has no price: said in words, not `$?`
    assert follow.progress_line(row, 10, None) == (
        "round 3/10  loss 1.2346  812 samples/s  cost unknown"
    )
    log = "starting\nerror: first\nround 1\nerror: model 'x' not found; check --model\n"
    assert follow.last_error(log) == "model 'x' not found; check --model"
    assert follow.last_error("Killed\n") is None


def test_a_run_that_reached_its_target_says_so_in_the_submit_summary() -> None:
    """The last row of a run that stopped at its `stop_at` carries the target: the summary
    says at which round it stopped; a run that went every round says nothing of it, and one
    that reached it at its last round says it reached it there, not that it stopped early."""
    rows = [{"round": 1, "eval_accuracy": 0.4}, {"round": 2, "eval_accuracy": 0.91}]
    plain = follow.summary_lines("R1", "s3://b/r/", rows, 12.0, 0.5)
    assert not any(line.startswith(("stopped early", "target reached")) for line in plain)
    rows[-1].update({STOPPED: 0.9, EARLY: True})
    lines = follow.summary_lines("R1", "s3://b/r/", rows, 12.0, 0.5)
    assert "stopped early: round 2: test accuracy 0.9100 reached the target 0.9" in lines
    del rows[-1][EARLY]  # round 2 was the last
    lines = follow.summary_lines("R1", "s3://b/r/", rows, 12.0, 0.5)
    assert "target reached at round 2: test accuracy 0.9100 reached the target 0.9" in lines
    assert not any(line.startswith("stopped early") for line in lines)


def _fake_node(tmp_path, train_script: str):
    """A node whose prefix is tmp_path, with a `venv/bin/sparknet` that runs `train_script`
    and a `venv/bin/python` that is this venv's (it runs the job's supervisor)."""
    import sys

    from sparknet.cluster.address import Endpoint
    from sparknet.cluster.spark.plan import Node

    sparknet = tmp_path / "venv" / "bin" / "sparknet"
    sparknet.parent.mkdir(parents=True)
    sparknet.write_text(f"#!/bin/sh\n{train_script}\n")
    sparknet.chmod(0o755)
    python = sparknet.with_name("python")
    python.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    return Node(Endpoint("master", "127.0.0.1", 22, "me"), "127.0.0.1", str(tmp_path), 0)


def _wait_for(predicate, timeout: float = 90.0) -> None:
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
    driver_control.start_driver(Context(), node, "R1", cfg)
    assert time.monotonic() - started < 10
    job = tmp_path / "jobs" / "R1"
    pid = int((job / "driver.pid").read_text())
    # setsid: the pid is its session's (and group's) leader, once nohup and setsid exec'd
    _wait_for(lambda: os.getsid(pid) == pid)
    activity = tmp_path / "autostop" / "activity" / "job-R1"
    _wait_for(activity.exists)
    _wait_for(lambda: "training" in (job / "driver.log").read_text())
    assert driver_control.driver_rc(Context(), node, "R1") is None
    driver_control.cancel_driver(Context(), node, "R1")
    _wait_for(lambda: subprocess.run(["kill", "-0", str(pid)], capture_output=True).returncode)
    assert (
        driver_control.driver_rc(Context(), node, "R1") == -1
    )  # killed: no rc file, counts as failed


def test_a_finished_driver_leaves_its_exit_code_and_removes_its_stamp(tmp_path) -> None:
    from invoke import Context

    # exit 2: `sparknet train`'s own error line, a deliberate end (no restart)
    node = _fake_node(tmp_path, "echo 'error: model not found'; exit 2")
    driver_control.start_driver(Context(), node, "R2", TrainConfig())
    job = tmp_path / "jobs" / "R2"
    _wait_for(lambda: (job / "driver.rc").exists())
    assert driver_control.driver_rc(Context(), node, "R2") == 2
    assert follow.last_error(driver_control.driver_log(Context(), node, "R2")) == "model not found"
    assert not (tmp_path / "autostop" / "activity" / "job-R2").exists()
    assert (tmp_path / "autostop" / "activity").is_dir()


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
    assert len(preflight.check_dataset(preflight.Dataset(uri)).manifest.shards("train")) == 2
    prefix = preflight.run_prefix(bucket, "c1", "R1")
    preflight.check_writable(prefix, None)
    assert s3.list_objects_v2(Bucket=bucket, Prefix="runs/")["KeyCount"] == 0  # probe deleted


def test_preflight_names_a_missing_shard_and_an_unreadable_manifest(s3, bucket) -> None:
    uri = _dataset(s3, bucket, shards=3)
    s3.delete_object(Bucket=bucket, Key="ds/train-000001.tar")
    with pytest.raises(
        preflight.PreflightFailed, match=f"^dataset {uri} does not match its manifest: train-000001"
    ):
        preflight.check_dataset(preflight.Dataset(uri))
    # `sparknet train`'s own check: every shard's size against the manifest, before launch
    s3.put_object(Bucket=bucket, Key="ds/train-000001.tar", Body=b"abcd")
    with pytest.raises(
        preflight.PreflightFailed, match=r"train-000001\.tar has 4 bytes, the manifest"
    ):
        preflight.check_dataset(preflight.Dataset(uri))
    s3.put_object(Bucket=bucket, Key="ds/manifest.json", Body=b"{not json")
    with pytest.raises(preflight.PreflightFailed, match=f"dataset {uri}: .*manifest"):
        preflight.check_dataset(preflight.Dataset(uri))
    with pytest.raises(preflight.PreflightFailed, match=f"dataset s3://{bucket}/nothing-here: "):
        preflight.check_dataset(preflight.Dataset(f"s3://{bucket}/nothing-here"))


def test_preflight_refuses_an_unwritable_prefix(moto_endpoint) -> None:
    with pytest.raises(
        preflight.PreflightFailed, match="run prefix s3://no-such-bkt-x/runs/c/R/ is not"
    ):
        preflight.check_writable(preflight.run_prefix("no-such-bkt-x", "c", "R"), None)


def test_a_reused_cluster_stays_and_a_made_one_goes_unless_keep() -> None:
    from sparknet.cluster.spec import ClusterSpec

    spec = ClusterSpec(name="c1")
    job = preflight.Job(spec, False, False, preflight.Dataset("s3://b-b/x"), None)  # type: ignore[arg-type]
    assert flow.teardown_due(job)
    assert not flow.teardown_due(preflight.Job(spec, False, True, job.dataset, None))  # type: ignore[arg-type]
    assert not flow.teardown_due(preflight.Job(spec, True, False, job.dataset, None))  # type: ignore[arg-type]


def test_a_bad_training_flag_or_provider_is_one_line_and_exit_2(tmp_path) -> None:
    """The shared flags validate as `sparknet train`'s do, before anything is asked of AWS."""
    import subprocess

    from tests.conftest import SPARKNET

    SUBMIT = SPARKNET.with_name("sparknet-submit")

    (tmp_path / "sparknet.yaml").write_text("clusters:\n  c1: {}\n")

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


# --- the jobs started: records, states, cancel, logs, and the refusals ---------------------------


@pytest.fixture
def home(tmp_path, monkeypatch):
    """The registry home (and so the job records) under tmp_path."""
    from sparknet.cluster import registry

    monkeypatch.setenv(registry.HOME_ENV, str(tmp_path / "home"))
    return tmp_path / "home"


def _record(run_id: str, started: float, cluster: str = "c1"):
    from sparknet.jobs import records

    return records.JobRecord(
        run_id, cluster, "us-east-1", f"s3://b-b/runs/{cluster}/{run_id}/", f"/opt/jobs/{run_id}",
        started, 2, None, "http://127.0.0.1:1",
    )  # fmt: skip


def test_job_records_are_written_atomically_and_read_back_oldest_first(home) -> None:
    from sparknet.jobs import records

    newer, older = _record("20261201-120000-aaaa", 200.0), _record("20261201-110000-bbbb", 100.0)
    assert records.save(newer) == home / "jobs" / "20261201-120000-aaaa.json"
    records.save(older)
    assert sorted(p.name for p in (home / "jobs").iterdir()) == [
        "20261201-110000-bbbb.json",
        "20261201-120000-aaaa.json",
    ]  # fmt: skip  (no temp file left)
    assert records.load(newer.run_id) == newer
    assert records.records() == [older, newer]
    (home / "jobs" / "20261201-130000-cccc.json").write_text("{half")
    assert records.load("20261201-130000-cccc") is None  # unreadable: skipped, not fatal
    assert records.records() == [older, newer]
    assert records.load("20990101-000000-dddd") is None
    with pytest.raises(records.UnknownRun, match="is not a run id"):
        records.load("../clusters/c1")


def test_a_jobs_state_from_its_job_dir_and_cancel_ends_its_whole_session(tmp_path) -> None:
    """running, cancelled (the session gone when cancel returns, its TERM-ignoring child
    included: killed after the wait), succeeded, failed RC, gone. A local shell stands in for
    the master's SSH session, as in the driver tests above."""
    import os

    from invoke import Context

    from sparknet.jobs import records

    node = _fake_node(
        tmp_path, 'case "$*" in *J1*) trap "" TERM; sleep 60;; *J2*) exit 0;; *) exit 3;; esac'
    )
    conn = Context()
    for run_id in ("J1", "J2", "J3"):
        driver_control.start_driver(conn, node, run_id, TrainConfig())
    _wait_for(lambda: (tmp_path / "jobs" / "J2" / "driver.rc").exists())
    _wait_for(lambda: (tmp_path / "jobs" / "J3" / "driver.rc").exists())
    assert records.state_of(conn, node, "J1") == "running"
    assert records.state_of(conn, node, "J2") == "succeeded"
    assert records.state_of(conn, node, "J3") == "failed 3"
    assert records.state_of(conn, node, "J4") == "gone"
    leader = int((tmp_path / "jobs" / "J1" / "driver.pid").read_text())
    assert records.cancel(conn, node, "J1", wait_s=1.0) is None
    alive = [
        p for p in os.listdir("/proc")
        if p.isdigit() and _pgrp(p) == leader
    ]  # fmt: skip
    assert alive == []
    assert records.state_of(conn, node, "J1") == "cancelled"
    assert records.cancel(conn, node, "J1") == "cancelled"  # already ended: left as it is
    assert records.cancel(conn, node, "J2") == "succeeded"
    assert not (tmp_path / "jobs" / "J2" / records.CANCELLED).exists()


def _pgrp(pid: str) -> int | None:
    from pathlib import Path

    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[2])
    except (OSError, IndexError, ValueError):
        return None


def test_logs_prints_the_last_lines_then_follows_to_the_end(tmp_path) -> None:
    from invoke import Context

    from sparknet.jobs import records

    go = tmp_path / "go"  # the job's last line waits for it: no race with a busy machine
    node = _fake_node(
        tmp_path,
        f"for i in 1 2 3; do echo line $i; done; while [ ! -e {go} ]; do sleep 0.05; done; "
        "echo last",
    )
    driver_control.start_driver(Context(), node, "L1", TrainConfig())
    _wait_for(lambda: "line 3" in (tmp_path / "jobs" / "L1" / "driver.log").read_text())
    got: list[str] = []
    records.print_log(Context(), node, "L1", 2, False, got.append)
    assert "".join(got) == "line 2\nline 3\n"
    got.clear()

    def shown(text: str) -> None:  # the last line printed: only then does the job go on
        got.append(text)
        go.touch()

    records.print_log(Context(), node, "L1", 1, True, shown, poll_s=0.1)
    assert "".join(got) == "line 3\nlast\n"


def test_list_shows_the_jobs_of_a_cluster_without_a_master_as_gone(home, moto_endpoint) -> None:
    """No instance of c1 on moto: its jobs are `cluster gone`, oldest first; nothing else is
    asked of it (no SSH)."""
    from sparknet.cluster.spec import ClusterSpec
    from sparknet.jobs import records

    records.save(_record("20261201-120000-aaaa", 200.0))
    records.save(_record("20261201-110000-bbbb", 100.0))
    listed = records.listing(lambda name, region: ClusterSpec(name=name, region=region))
    assert [(item.record.run_id, item.state) for item in listed] == [
        ("20261201-110000-bbbb", records.GONE), ("20261201-120000-aaaa", records.GONE),
    ]  # fmt: skip
    with pytest.raises(records.ClusterGone, match="cluster c1 has no running master"):
        records.locate("20261201-120000-aaaa", None, lambda n, r: ClusterSpec(name=n, region=r))


def _submit_cli(tmp_path, monkeypatch, *args: str):
    """sparknet-submit in process (typer's runner: no interpreter start per case) in tmp_path,
    its registry home there, AWS at a port nothing listens on: a refusal that asked AWS
    anything would say so instead of its own line."""
    from typer.testing import CliRunner

    from sparknet.cli.submit import submit_app
    from sparknet.cluster import registry

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(registry.HOME_ENV, str(tmp_path / "home"))
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    return CliRunner().invoke(submit_app, list(args))


def test_detach_and_autostop_refusals_are_one_line_exit_2_before_anything(
    tmp_path, monkeypatch
) -> None:
    (tmp_path / "sparknet.yaml").write_text("clusters:\n  c0: {autostop_minutes: 0}\n  c1: {}\n")
    cases = {
        ("--autostop", "0"): "error: --autostop 0 turns the timer off only with --keep",
        ("--autostop", "0", "--detach"): "error: --autostop 0 turns the timer off only with",
        ("--cluster", "c1", "--autostop", "5"): "error: --autostop applies to a cluster",
        ("--name", "c0", "--detach"): "error: cluster c0's autostop is off (autostop_minutes",
    }
    for args, line in cases.items():
        name = [] if "--cluster" in args or "--name" in args else ["--name", "c1"]
        done = _submit_cli(tmp_path, monkeypatch, "--s3", "s3://bkt/x", *name, *args)
        assert done.exit_code == 2, (args, done.stderr)
        assert done.stderr.startswith(line) and len(done.stderr.splitlines()) == 1, done.stderr
    # with --keep, both are the user's choice: past the flags, to the dataset check (AWS)
    kept = _submit_cli(
        tmp_path, monkeypatch, "--s3", "s3://bkt/x", "--name", "c0", "--detach", "--keep"
    )
    assert kept.stderr.startswith("error: dataset s3://bkt/x"), kept.stderr
    assert not (tmp_path / "home" / "jobs").exists()


def test_attach_of_an_unknown_run_and_submit_without_s3_are_one_line_exit_2(
    tmp_path, monkeypatch
) -> None:
    for command in ("attach", "logs", "cancel"):
        done = _submit_cli(tmp_path, monkeypatch, command, "20261201-000000-abcd")
        assert done.exit_code == 2, done.stderr
        assert done.stderr == (
            f"error: no job 20261201-000000-abcd in {tmp_path / 'home' / 'jobs'}; give --cluster "
            "NAME to look for it on that cluster's master\n"
        )
    bare = _submit_cli(tmp_path, monkeypatch, "--keep")
    assert (bare.exit_code, bare.stderr) == (
        2, "error: --s3 DATASET is required (a name from datasets: or s3://bucket/prefix); or a "
        "command: evaluate, predict, attach, logs, cancel, list\n",
    )  # fmt: skip
    assert _submit_cli(tmp_path, monkeypatch, "list").stdout == ""


def test_a_detached_submit_prints_its_run_and_what_ends_the_cluster(capsys) -> None:
    from sparknet.cli.submit import _print_detached
    from sparknet.cluster.spec import ClusterSpec

    spec = ClusterSpec(name="c1", autostop_minutes=17)
    made = preflight.Job(spec, False, False, preflight.Dataset("s3://b-b/x"), None, detach=True)  # type: ignore[arg-type]
    _print_detached(made, "R1", "s3://b-b/runs/c1/R1/")
    out, err = capsys.readouterr()
    assert out == "run id: R1\nrun prefix: s3://b-b/runs/c1/R1/\n"
    assert "`sparknet-submit attach R1` follows it" in err
    assert "its autostop timer terminates it 17 minutes after its last job ends" in " ".join(
        err.split()
    )
    _print_detached(preflight.Job(spec, True, False, made.dataset, None, detach=True), "R2", "p")  # type: ignore[arg-type]
    assert "stays up (reused with --cluster); its autostop timer terminates it 17 minutes" in (
        " ".join(capsys.readouterr().err.split())
    )


def test_a_detached_job_keeps_its_cluster_but_a_failed_detach_tears_it_down() -> None:
    from sparknet.cluster.spec import ClusterSpec

    job = preflight.Job(
        ClusterSpec(name="c1"), False, False, preflight.Dataset("s3://b-b/x"), None, detach=True
    )  # type: ignore[arg-type]
    assert not flow.teardown_due(job, detached=True)  # the driver runs: autostop ends it later
    assert flow.teardown_due(job, detached=False)  # failed before the driver started


# --- the submitter's own failures: a taken name, a lost link, a teardown, an interrupt ---------


def test_a_submit_that_makes_its_cluster_refuses_a_name_that_already_runs(moto_endpoint) -> None:
    """An instance tagged with the cluster's name on moto's EC2: a submit without --cluster
    must not take it over (its teardown would end it and the jobs on it); another name and
    a terminated one are free."""
    import boto3

    from sparknet.cluster.spec import TAG_CLUSTER, ClusterSpec

    ec2 = boto3.client("ec2", endpoint_url=moto_endpoint, region_name="us-east-1")
    ami = amazon_ami()
    tags = [{"ResourceType": "instance", "Tags": [{"Key": TAG_CLUSTER, "Value": "taken-c"}]}]
    made = ec2.run_instances(
        ImageId=ami, InstanceType="t3.micro", MinCount=1, MaxCount=1, TagSpecifications=tags
    )["Instances"][0]["InstanceId"]
    try:
        with pytest.raises(preflight.PreflightFailed) as refused:
            preflight.check_name_free(ClusterSpec(name="taken-c"), moto_endpoint)
        assert str(refused.value) == (
            "cluster taken-c already runs; pass --cluster taken-c to reuse it, or --name NEW "
            "to make another"
        )
        preflight.check_name_free(ClusterSpec(name="free-c"), moto_endpoint)
    finally:
        ec2.terminate_instances(InstanceIds=[made])
    preflight.check_name_free(ClusterSpec(name="taken-c"), moto_endpoint)


def test_ssh_errors_of_a_command_are_connection_lost_not_paramikos() -> None:
    import paramiko
    from paramiko.ssh_exception import NoValidConnectionsError

    from sparknet.cluster import remote

    for raw in (
        NoValidConnectionsError({("10.0.0.1", 22): ConnectionRefusedError("refused")}),
        paramiko.SSHException("SSH session not active"),
        OSError("Socket is closed"),
        EOFError(),
    ):
        conn = _Dropping(down=range(0, 10**6), error=raw)
        with pytest.raises(remote.ConnectionLost, match="SSH connection lost"):
            remote.run(conn, "true")
        with pytest.raises(remote.ConnectionLost):  # no answer is not a "no"
            remote.succeeds(conn, "true")


class _Dropping:
    """A connection to the node whose link is down for the calls numbered in `down`: each
    raises what paramiko raises for a closed transport (the rest run in a local shell, which
    stands in for the master's SSH session). `close()` counts reconnects."""

    def __init__(self, down: range, error: BaseException | None = None) -> None:
        from invoke import Context

        self.local, self.down, self.calls, self.closed = Context(), down, 0, 0
        self.error = error

    def run(self, command: str, **kwargs):
        import paramiko

        self.calls += 1
        if self.calls in self.down:
            raise self.error or paramiko.SSHException("SSH session not active")
        return self.local.run(command, **kwargs)

    def close(self) -> None:
        self.closed += 1


def test_follow_survives_an_ssh_drop_and_gives_a_job_out_of_reach_up_after_the_grace(
    tmp_path,
) -> None:
    """The link drops for six polls while the job runs: follow reconnects (closes the broken
    connection) and ends with the job's exit code; a link that stays down past the grace is
    JobOutOfReach, which names `attach`, and the job is not cancelled."""
    from invoke import Context

    node = _fake_node(tmp_path, "sleep 2; exit 0")
    master = driver_control.Master(node, None, "spark://x:7077", 1)  # type: ignore[arg-type]
    driver_control.start_driver(Context(), node, "S1", TrainConfig())
    runs = tmp_path / "prefix"
    runs.mkdir()
    conn = _Dropping(down=range(2, 8))
    outcome = follow.follow(conn, master, "S1", str(runs), None, lambda rows: None, poll_s=0.1)
    assert outcome.rc == 0 and conn.closed >= 1 and conn.calls > 8

    driver_control.start_driver(Context(), _fake_node_again(tmp_path, node), "S2", TrainConfig())
    down = _Dropping(down=range(2, 10**6))
    with pytest.raises(follow.JobOutOfReach, match="`sparknet-submit attach S2` follows it again"):
        follow.follow(down, master, "S2", str(runs), None, lambda rows: None, 0.05, grace_s=0.5)
    assert (
        driver_control.driver_rc(Context(), node, "S2") is None
    )  # it runs on: nothing cancelled it
    driver_control.cancel_driver(Context(), node, "S2")


def _fake_node_again(tmp_path, node):
    """The same node, its `sparknet` now a long job."""
    (tmp_path / "venv" / "bin" / "sparknet").write_text("#!/bin/sh\nsleep 60\n")
    return node


def test_a_malformed_exit_code_is_a_failure_not_a_traceback(tmp_path) -> None:
    from invoke import Context

    from sparknet.jobs import records

    node = _fake_node(tmp_path, "exit 0")
    job = tmp_path / "jobs" / "M1"
    job.mkdir(parents=True)
    (job / "driver.rc").write_text("12x\n")
    assert driver_control.driver_rc(Context(), node, "M1") == -1
    assert records.state_of(Context(), node, "M1") == "failed -1"
    assert driver_control.parse_rc(" 3\n") == 3


def test_logs_follow_counts_bytes_so_invalid_utf8_shifts_nothing(tmp_path) -> None:
    """A byte that is no UTF-8 is shown as U+FFFD (3 bytes once encoded): the next read must
    still begin right after it, not 2 bytes further."""
    from invoke import Context

    from sparknet.jobs import records

    node = _fake_node(tmp_path, r"echo start; sleep 1; printf 'x\377y\n'; sleep 1; echo 'line two'")
    driver_control.start_driver(Context(), node, "U1", TrainConfig())
    _wait_for(lambda: "start" in (tmp_path / "jobs" / "U1" / "driver.log").read_text())
    got: list[str] = []
    records.print_log(Context(), node, "U1", 1, True, got.append, poll_s=0.1)
    assert "".join(got) == "start\nx\ufffdy\nline two\n"


def test_ctrl_c_right_after_the_driver_starts_cancels_it(tmp_path, monkeypatch) -> None:
    """The interrupt comes as the start is said (after start_driver returned, before follow):
    the driver's session must be gone, not left running untracked on a cluster that stays up.
    A local shell stands in for the master's SSH session."""
    import os
    import subprocess

    from invoke import Context

    from sparknet.cluster import nodes
    from sparknet.cluster.spec import ClusterSpec

    class Local(Context):
        def close(self) -> None:
            pass

    node = _fake_node(tmp_path, "sleep 60")
    master = driver_control.Master(node, None, "spark://x:7077", 1)  # type: ignore[arg-type]
    monkeypatch.setattr(nodes, "connect", lambda endpoint, access: Local())
    job = preflight.Job(
        ClusterSpec(name="c1"), True, False, preflight.Dataset("s3://b-b/x"), TrainConfig()
    )

    def say(line: str) -> None:
        if line.startswith("job K1 started"):
            raise KeyboardInterrupt

    for start in (
        lambda: flow._run_driver(job, master, "K1", "p/", TrainConfig(), say, lambda r, c: None),
        lambda: flow.start_detached(master, "K1", "p/", TrainConfig(), say),
    ):
        with pytest.raises(KeyboardInterrupt):
            start()
        leader = int((tmp_path / "jobs" / "K1" / "driver.pid").read_text())
        _wait_for(lambda pid=leader: subprocess.run(["kill", "-0", str(pid)]).returncode != 0)
        assert [p for p in os.listdir("/proc") if p.isdigit() and _pgrp(p) == leader] == []


def _flow_without_aws(monkeypatch, *, up=None, down=None) -> None:
    """flow.submit past its preflight with `aws_provider.up`/`down` replaced: what they raise
    (an interrupt while up runs, AWS out of reach while down runs) cannot be had from moto on
    demand."""
    from sparknet.cluster import ec2 as aws_provider
    from sparknet.jobs.preflight import Checked

    checked = Checked("R1", "s3://b-b/runs/c1/R1/", None)  # type: ignore[arg-type]
    monkeypatch.setattr(flow, "preflight", lambda job: checked)
    monkeypatch.setattr(flow, "check_name_free", lambda spec, endpoint_url: None)
    monkeypatch.setattr(flow, "check_gpu_counts", lambda spec, endpoint_url: None)
    monkeypatch.setattr(aws_provider, "up", up)
    monkeypatch.setattr(aws_provider, "down", down)


def _interrupt(*args, **kwargs):
    raise KeyboardInterrupt


def _aws_gone(*args, **kwargs):
    from sparknet.errors import SparknetError

    raise SparknetError("cannot reach AWS (EC2 at http://127.0.0.1:9)")


def test_an_interrupt_says_teardown_done_only_when_it_is(tmp_path, monkeypatch) -> None:
    (tmp_path / "sparknet.yaml").write_text("clusters:\n  c1: {}\n")
    downs: list[str] = []
    cases = [
        # down fails: its error and what ends the instances, never "done"
        ((), _aws_gone, "error: interrupted; taking cluster c1 down failed: cannot reach AWS "),
        # --keep: no teardown; the cluster stays up, said with its autostop minutes
        (("--keep",), _aws_gone, "error: interrupted; the cluster stays up (see above)\n"),
        # down ran and worked
        ((), lambda spec, **kw: downs.append(spec.name), "error: interrupted; teardown done\n"),
    ]
    for args, down, line in cases:
        _flow_without_aws(monkeypatch, up=_interrupt, down=down)
        done = _submit_cli(tmp_path, monkeypatch, "--s3", "s3://b-b/x", *args)
        assert done.exit_code == 130, done.stderr
        last = done.stderr.splitlines()[-1] + "\n"
        assert last.startswith(line), done.stderr
        assert "teardown done" not in done.stderr or line.endswith("teardown done\n")
        if "--keep" in args:
            assert "cluster c1 stays up (--keep); its autostop timer terminates it 30 minutes" in (
                " ".join(done.stderr.split())
            )
    assert downs == ["c1"]


def test_submit_refusals_of_name_with_cluster_and_autostop_0_in_the_settings(
    tmp_path, monkeypatch
) -> None:
    (tmp_path / "sparknet.yaml").write_text("clusters:\n  c0: {autostop_minutes: 0}\n")
    both = _submit_cli(tmp_path, monkeypatch, "--s3", "s3://b/x", "--name", "a", "--cluster", "b")
    assert (both.exit_code, both.stderr) == (
        2, "error: --name a names a cluster to make and --cluster b one to reuse; give one of "
        "them\n",
    )  # fmt: skip
    off = _submit_cli(tmp_path, monkeypatch, "--s3", "s3://bkt/x", "--name", "c0")
    assert off.exit_code == 2 and off.stderr == (
        "error: cluster c0's autostop is off (autostop_minutes: 0), which is allowed only with "
        "--keep: give --autostop MINUTES, or --keep to keep it on purpose\n"
    )


def test_endpoint_url_reaches_a_bare_s3_uri() -> None:
    assert preflight.resolve_dataset("s3://b-b/x/", {}, "http://127.0.0.1:5") == preflight.Dataset(
        "s3://b-b/x", "http://127.0.0.1:5"
    )


def test_preflight_of_a_made_cluster_needs_its_bucket_and_the_data_under_its_data_prefix(
    s3, bucket
) -> None:
    """The node role reads only s3://BUCKET/DATA_PREFIX and writes only the cluster's runs
    prefix (no `bucket:`: no S3 at all), so a submit that would fail once the cluster is up and
    paid for is refused first, one line; the run prefix is the cluster's `cluster_runs_prefix`."""

    from sparknet.cluster.spec import ClusterSpec

    uri = _dataset(s3, bucket, shards=3)  # s3://BUCKET/ds: a shard for each of 3 Spark tasks

    def checked(spec: ClusterSpec, reused: bool = False) -> tuple[str, str]:
        job = preflight.Job(spec, reused, False, preflight.Dataset(uri), TrainConfig())
        found = preflight.preflight(job)
        return found.run_id, found.prefix

    with pytest.raises(preflight.PreflightFailed, match=r"^cluster c1 has no `bucket:` in its"):
        checked(ClusterSpec(name="c1"))
    with pytest.raises(
        preflight.PreflightFailed,
        match=f"^dataset {uri} is outside s3://{bucket}/datasets/, the only",
    ):
        checked(ClusterSpec(name="c1", bucket=bucket))
    with pytest.raises(preflight.PreflightFailed, match="is outside"):  # a prefix match, as IAM's
        checked(ClusterSpec(name="c1", bucket=bucket, data_prefix="dsx/"))
    assert s3.list_objects_v2(Bucket=bucket, Prefix="runs/")["KeyCount"] == 0  # nothing written
    ami = amazon_ami()  # up's AMI check passes
    spec = ClusterSpec(
        name="c1", bucket=bucket, data_prefix="ds/", runs_prefix="team/runs/", ami=ami
    )
    run_id, prefix = checked(spec)
    assert prefix == f"s3://{bucket}/team/runs/c1/{run_id}/"
    assert prefix.startswith(f"s3://{bucket}/{spec.cluster_runs_prefix}")
    assert (
        preflight.runs_bucket(ClusterSpec(name="c1"), preflight.Dataset(uri), reused=True) == bucket
    )


def test_the_gpus_of_a_job_are_every_spark_worker_nodes_and_mixed_counts_are_refused(
    moto_endpoint,
) -> None:
    """Every node runs a Spark worker, the master too: tasks are the sum of their GPUs, one
    count per node; a CPU master with GPU workers is refused before launch (moto's EC2 knows
    the types' GPUs, as AWS's DescribeInstanceTypes does), and on a running cluster alike."""
    from sparknet.cluster.address import Endpoint
    from sparknet.cluster.spark.plan import Node
    from sparknet.cluster.spec import ClusterSpec

    four = preflight.SparkWorkers("spark://x:7077", (4, 4))
    node = Node(Endpoint("master", "127.0.0.1", 22, "me"), "127.0.0.1", "/opt/sparknet", 4)
    master = driver_control.Master(node, None, "spark://x:7077", 2)  # type: ignore[arg-type]
    assert preflight.workers_of(master) == four  # no counts listed: the master's, every node
    cfg = preflight.job_config(TrainConfig(), preflight.Dataset("s3://b-b/x"), "s3://b-b/r/", four)
    assert (cfg.gpus_per_worker, cfg.workers) == (4, 8)
    mixed = preflight.SparkWorkers("spark://x:7077", (0, 1, 1))
    with pytest.raises(preflight.PreflightFailed, match=r"cluster c1's nodes have different GPU"):
        preflight.job_config(
            TrainConfig(), preflight.Dataset("s3://b-b/x"), "s3://b-b/r/", mixed, "c1"
        )
    cpu_master = ClusterSpec(name="c1", master_type="m5.xlarge", instance_types=["g5.xlarge"])
    with pytest.raises(preflight.PreflightFailed, match=r"\(g5.xlarge: 1, m5.xlarge: 0\)"):
        preflight.check_gpu_counts(cpu_master, moto_endpoint)
    preflight.check_gpu_counts(ClusterSpec(name="c1"), moto_endpoint)  # g5.xlarge everywhere


def test_a_model_jobs_driver_scores_the_copy_in_its_run_prefix(tmp_path, moto_endpoint, bucket):
    """`sparknet-submit evaluate|predict`: the node's command reads the model copy and writes
    into the job's run prefix (or predict's --out); an AWS cluster's nodes write only under
    its own runs, so an --out elsewhere, on local disk, or already there is refused; the
    supervisor runs a job.yaml's `command:` (again on a restart) instead of training."""
    import boto3

    from sparknet.cluster.spec import ClusterSpec
    from sparknet.errors import SparknetError
    from sparknet.jobs.model_jobs import REPORT, ModelTask, check_output
    from sparknet.jobs.supervisor import Job
    from sparknet.training.evaluation import CONFUSION_PNG, EVALUATION_JSON

    assert REPORT == (EVALUATION_JSON, CONFUSION_PNG)  # named there without torch

    prefix = "s3://b-b/runs/c1/R1/"
    evaluate = ModelTask("evaluate", "/runs/mine", split="train")
    assert evaluate.args(prefix, "s3://b-b/data/d", "http://m:1") == [
        "evaluate", "s3://b-b/runs/c1/R1", "--data", "s3://b-b/data/d", "--split", "train",
        "--endpoint-url", "http://m:1", "--report", "s3://b-b/runs/c1/R1",
    ]  # fmt: skip
    predict = ModelTask("predict", "/runs/mine", top_k=2)
    assert predict.args(prefix, "s3://b-b/data/d", None) == [
        "predict", "s3://b-b/runs/c1/R1", "--data", "s3://b-b/data/d", "--out",
        "parquet:s3://b-b/runs/c1/R1/predictions", "--replace-unfinished", "--write-id", "R1",
        "--top-k", "2",
    ]  # fmt: skip
    spec = ClusterSpec(name="c1", bucket=bucket)
    boto3.client("s3", endpoint_url=moto_endpoint).put_object(
        Bucket=bucket, Key="runs/c1/taken/part-0.parquet", Body=b"x"
    )
    for out, why in (
        ("parquet:/tmp/p", "a cluster writes predictions to S3"),
        (f"parquet:s3://{bucket}/elsewhere/p", f"may write only under s3://{bucket}/runs/c1/"),
        (f"parquet:s3://{bucket}/runs/c1/taken", "exists: choose another --out"),
    ):
        with pytest.raises(SparknetError, match=why):
            check_output(ModelTask("predict", "r", out=out), spec, bucket, moto_endpoint)
    check_output(ModelTask("predict", "r", out=f"parquet:s3://{bucket}/runs/c1/p"), spec, bucket,
                 moto_endpoint)  # fmt: skip

    (tmp_path / "job.yaml").write_text(
        TrainConfig(out="s3://b-b/runs/c1/R1").to_yaml() + "command: [evaluate, x, --data, d]\n"
    )
    job = Job.read(tmp_path)
    assert job.train_args(resume=False) == job.train_args(resume=True) == [
        "evaluate", "x", "--data", "d",
    ]  # fmt: skip
