"""The submitter seen as a user sees it: what is refused before anything is launched, a second
submit of a cluster's name, what `attach` and `cluster down` say of a cluster and its jobs, and
the messages (help, wrapping, the driver's start-up). sparknet-submit runs in process (typer's
runner), against moto's EC2 and S3, with `up` and `down` replaced by recorders where a test
must prove they were never reached."""

from __future__ import annotations

import json
import sys
import time

import pytest
from typer.testing import CliRunner

from sparknet.cluster import ec2 as aws_provider
from sparknet.cluster import inventory, registry
from sparknet.errors import SparknetError
from sparknet.jobs import driver_control, follow, records
from sparknet.jobs import submit as flow
from tests.moto_server import amazon_ami


def _submit(*args: str):
    from sparknet.cli.submit import submit_app

    return CliRunner().invoke(submit_app, list(args))


def _dataset(bucket: str, shards: int = 3, samples: int = 2) -> str:
    """A shard dataset on moto's S3 under s3://BUCKET/ds: `shards` shards of `samples` each
    (3 bytes, no sha256 metadata: what the size check reads)."""
    import boto3

    from sparknet.data.manifest import ClassInfo, Manifest, ShardInfo

    s3 = boto3.client("s3")
    infos = [
        ShardInfo(name=f"train-{k:06d}.tar", samples=samples, bytes=3, sha256="0" * 64)
        for k in range(shards)
    ]
    classes = [ClassInfo(index=k, wnid=f"n{k:08d}", name=f"c{k}") for k in range(2)]
    manifest = Manifest(classes=classes, splits={"train": infos, "val": infos[:1]})
    s3.put_object(Bucket=bucket, Key="ds/manifest.json", Body=manifest.dumps().encode())
    for info in infos:
        s3.put_object(Bucket=bucket, Key=f"ds/{info.name}", Body=b"abc")
    return f"s3://{bucket}/ds"


def _tagged(name: str) -> list[str]:
    """Instances and security groups on moto's EC2 tagged with cluster `name`."""
    import boto3

    from sparknet.cluster.spec import TAG_CLUSTER

    ec2 = boto3.client("ec2", region_name="us-east-1")
    tag = [{"Name": f"tag:{TAG_CLUSTER}", "Values": [name]}]
    found = [
        i["InstanceId"]
        for r in ec2.describe_instances(Filters=tag)["Reservations"]
        for i in r["Instances"]
    ]
    return found + [
        g["GroupId"] for g in ec2.describe_security_groups(Filters=tag)["SecurityGroups"]
    ]


# --- 7: what `sparknet train` checks before Spark starts, checked before anything is launched --


def test_what_train_refuses_is_refused_before_anything_is_launched(
    home, launches, bucket, tmp_path
) -> None:
    """An unknown --model, fewer train shards than the job's Spark tasks (one per GPU of every
    node: `--workers 3` g5.xlarge instances and the master, 4), a shard whose size is not the
    manifest's: one line each, exit 2, `up` never called, nothing on EC2, nothing written under
    the runs prefix. The same job with none of these gets as far as `up`."""
    import boto3

    uri = _dataset(bucket)
    ami = amazon_ami()  # up's AMI check passes
    (tmp_path / "sparknet.yaml").write_text(
        f"clusters:\n  c1: {{bucket: {bucket}, data_prefix: ds/, ami: {ami}}}\n"
    )
    s3 = boto3.client("s3")
    cases = [
        (("--model", "resnet9000"), "error: unknown model 'resnet9000'"),
        (("--workers", "3"), "error: the dataset has 3 train shards, fewer than its 4 Spark tasks"),
        (
            ("--conf", "spark.network.crypto.saslFallback=true"),
            "error: Spark setting spark.network.crypto.saslFallback=true: anyone on the path",
        ),
    ]
    for args, line in cases:
        done = _submit("--s3", uri, *args)
        assert (done.exit_code, done.stderr.splitlines()[-1:]) == (2, [done.stderr.strip()])
        assert done.stderr.startswith(line), done.stderr
    s3.put_object(Bucket=bucket, Key="ds/train-000001.tar", Body=b"abcd")
    done = _submit("--s3", uri)
    assert done.exit_code == 2 and len(done.stderr.splitlines()) == 1, done.stderr
    assert done.stderr.startswith(f"error: dataset {uri} does not match its manifest: ")
    assert "train-000001.tar has 4 bytes, the manifest says 3" in done.stderr
    assert launches == [] and _tagged("c1") == []
    assert s3.list_objects_v2(Bucket=bucket, Prefix="runs/")["KeyCount"] == 0
    assert not (home / "jobs").exists()
    s3.put_object(Bucket=bucket, Key="ds/train-000001.tar", Body=b"abc")
    passed = _submit("--s3", uri)  # every check passes: on to `up` (a recorder that fails)
    assert passed.stderr.splitlines()[-1] == "error: up was called", passed.stderr
    assert launches == ["up c1", "down c1"]


# --- 8: two submits of one cluster name ---------------------------------------------------------


def _past_preflight(monkeypatch) -> None:
    """flow.submit's checks of AWS and the data passed at once (what follows them is tested)."""
    from sparknet.jobs.preflight import Checked

    checked = Checked("R1", "s3://b-b/runs/c1/R1/", None)  # type: ignore[arg-type]
    monkeypatch.setattr(flow, "preflight", lambda job: checked)
    monkeypatch.setattr(flow, "check_name_free", lambda spec, endpoint_url: None)
    monkeypatch.setattr(flow, "check_gpu_counts", lambda spec, endpoint_url: None)


def test_a_second_submit_of_a_name_is_refused_and_ends_nothing_of_the_first(
    home, launches, monkeypatch, tmp_path
) -> None:
    """While a submit of c1 runs (its lock held), another is refused up front: exit 2, one
    line, no `up`, no teardown, and no `sparknet cluster down c1` (which would end the first
    one's job). A cluster that another `cluster up/down` holds is none of the submit's either:
    refused as it is found, nothing taken down. Once the first ends, c1 is free again."""
    import os

    (tmp_path / "sparknet.yaml").write_text("clusters:\n  c1: {bucket: b-b}\n")
    _past_preflight(monkeypatch)
    with flow.submit_lock("c1"):
        second = _submit("--s3", "s3://b-b/x")
    assert second.exit_code == 2, second.stderr
    assert second.stderr == (
        f"error: cluster c1 is in use by another sparknet-submit on this machine (PID "
        f"{os.getpid()}); wait for it to end, or give --name NEW to run on a cluster of its own\n"
    )
    assert launches == []

    def busy(spec, **kwargs):
        launches.append(f"up {spec.name}")
        raise registry.ClusterBusy(
            "cluster c1 is busy: another `sparknet cluster up/down` (PID 1) is working on it; "
            "wait for it to end, then run this again"
        )

    monkeypatch.setattr(aws_provider, "up", busy)
    held = _submit("--s3", "s3://b-b/x")
    assert held.exit_code == 2, held.stderr
    assert held.stderr.splitlines()[-1].startswith("error: cluster c1 is busy: another")
    assert "cluster down" not in held.stderr and "teardown" not in held.stderr
    assert launches == ["up c1"]  # and no `down c1`


# --- 11: attach on a made cluster; `cluster down` of one with a job -----------------------------


class _Shell:
    """A local shell standing in for a master's SSH connection (invoke's Context, as Fabric's
    Connection runs commands), with the `close` a connection has."""

    def __init__(self) -> None:
        from invoke import Context

        self.context = Context()

    def run(self, *args, **kwargs):
        return self.context.run(*args, **kwargs)

    def close(self) -> None:
        pass


def _node(tmp_path):
    from sparknet.cluster.address import Endpoint
    from sparknet.cluster.spark.plan import Node

    python = tmp_path / "m" / "venv" / "bin" / "python"  # the master's venv: this one's Python
    python.parent.mkdir(parents=True, exist_ok=True)
    python.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    return Node(Endpoint("master", "127.0.0.1", 22, "me"), "127.0.0.1", str(tmp_path / "m"), 0)


def test_attach_to_an_ended_job_says_how_it_ended_and_that_its_cluster_is_still_up(
    home, monkeypatch, tmp_path
) -> None:
    """A job that ended (succeeded after its 3 rounds) before `attach` came: one line says so,
    its rounds are not replayed, the summary follows; the cluster its submit made is said to
    be still up, with its cost so far and the autostop minutes that end it."""
    from sparknet.cluster import nodes
    from sparknet.cluster.spec import ClusterSpec

    node = _node(tmp_path)
    job = tmp_path / "m" / "jobs" / "R1"
    job.mkdir(parents=True)
    (job / "driver.pid").write_text("999999999\n")
    (job / "driver.rc").write_text("0\n")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    rows = [
        {"round": r, "loss": 1.0 / r, "samples": 10, "samples_per_s": 100.0,
         "seconds": {"total": 0.1}}
        for r in (1, 2, 3)
    ]  # fmt: skip
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    record = records.JobRecord(
        "R1", "c1", "us-east-1", f"{run_dir}/", str(job), time.time() - 60, 3, made=True
    )
    spec = ClusterSpec(name="c1", autostop_minutes=17)
    master = driver_control.Master(node, None, "spark://x:7077", 1)  # type: ignore[arg-type]
    monkeypatch.setattr(records, "locate", lambda *a: records.Located(record, spec, master))
    monkeypatch.setattr(nodes, "connect", lambda *a: _Shell())
    monkeypatch.setattr(aws_provider, "cost_so_far", lambda spec, endpoint_url: 1.234)
    done = _submit("attach", "R1")
    assert done.exit_code == 0, done.stderr
    err = done.stderr.splitlines()
    assert err[0] == "job R1 already ended (succeeded) after round 3 of 3"
    assert not [ln for ln in err if ln.startswith("round ")]  # not replayed
    assert err[-1] == (
        "cluster c1 stays up (made by sparknet-submit; cost so far $1.23); its autostop timer "
        "terminates it 17 minutes after its last job ends with no submitter attached "
        "(`sparknet cluster down c1` ends it sooner)"
    )
    assert "run id: R1" in done.stdout and "estimated cost: $1.23" in done.stdout
    assert (tmp_path / "runs" / "R1" / "metrics.jsonl").exists()


def test_cluster_down_names_the_jobs_it_cancels_and_asks_on_a_terminal(home, monkeypatch) -> None:
    """With job R1 running on the master: not on a terminal, `down` says it cancels R1 and
    goes on; on a terminal it asks, and a no leaves everything as it is (exit 1); --yes
    does not ask."""
    from sparknet.cli.cluster import cluster_app, life
    from sparknet.cluster.records import DownReport

    downs: list[str] = []

    def down(spec, **kwargs):
        downs.append(spec.name)
        return DownReport(spec.name, spec.region, [], [], None)

    monkeypatch.setattr(aws_provider, "down", down)
    monkeypatch.setattr(driver_control, "jobs_on", lambda *args, **kwargs: ["R1"])
    runner = CliRunner()
    said = "cluster c1 runs job R1: taking it down cancels it (`sparknet-submit cancel RUN`"
    script = runner.invoke(cluster_app, ["down", "c1"])
    assert script.exit_code == 0, script.stderr
    assert said in script.stderr and downs == ["c1"]
    monkeypatch.setattr(life, "_on_terminal", lambda: True)
    declined = runner.invoke(cluster_app, ["down", "c1"], input="n\n")
    assert declined.exit_code == 1 and downs == ["c1"], declined.stderr
    assert "cancel it and take cluster c1 down? [y/N]" in declined.stderr
    assert declined.stderr.splitlines()[-1].endswith(
        "error: cluster c1 not taken down: job R1 runs on; `--yes` takes it down without asking"
    )  # (the runner does not echo the answer's newline)
    confirmed = runner.invoke(cluster_app, ["down", "c1"], input="y\n")
    assert confirmed.exit_code == 0 and downs == ["c1", "c1"], confirmed.stderr
    yes = runner.invoke(cluster_app, ["down", "c1", "--yes"])
    assert yes.exit_code == 0 and "[y/N]" not in yes.stderr and downs == ["c1"] * 3


def test_the_jobs_running_on_a_master_are_found_there(home, monkeypatch, tmp_path) -> None:
    """`cluster down` asks the master which jobs' sessions are alive: a running one is named,
    one that ended is not; a master that does not answer names none (down goes on)."""
    from sparknet.cluster import nodes, registry
    from sparknet.cluster.aws import owner
    from sparknet.cluster.spec import ClusterSpec
    from sparknet.config import TrainConfig

    node = _node(tmp_path)  # its venv's python: this venv's
    bin_dir = tmp_path / "m" / "venv" / "bin"
    (bin_dir / "sparknet").write_text('#!/bin/sh\ncase "$*" in *J1*) sleep 60;; esac\n')
    for exe in bin_dir.iterdir():
        exe.chmod(0o755)
    shell = _Shell()
    for run_id in ("J1", "J2"):
        driver_control.start_driver(shell, node, run_id, TrainConfig())
    master = driver_control.Master(node, None, "spark://x:7077", 1)  # type: ignore[arg-type]
    monkeypatch.setattr(aws_provider, "master_running", lambda spec, endpoint_url: True)
    monkeypatch.setattr(driver_control, "master_of", lambda spec, endpoint_url: master)
    monkeypatch.setattr(nodes, "connect", lambda *a, **k: shell)
    spec = ClusterSpec(name="c1")
    mine = {"any_owner": True}  # any owner: no AWS here to read owner tags from
    assert (
        driver_control.jobs_on(spec, None, **mine) == []
    )  # not bootstrapped from here: nothing asked
    registry.secret_file("c1").parent.mkdir(parents=True, exist_ok=True)
    registry.secret_file("c1").write_text("s")
    try:
        deadline = time.monotonic() + 60  # J2's session ends at once, J1's runs on
        while (found := driver_control.jobs_on(spec, None, **mine)) != ["J1"]:
            assert time.monotonic() < deadline, found
            time.sleep(0.1)
    finally:
        records.cancel(shell, node, "J1", wait_s=5)

    def unreachable(*args, **kwargs):
        raise SparknetError("no route to host")

    monkeypatch.setattr(nodes, "connect", unreachable)
    assert driver_control.jobs_on(spec, None, **mine) == []

    def theirs(spec, owner, endpoint_url=None):
        raise inventory.NotYours("cluster c1 in us-east-1 belongs to bob")

    monkeypatch.setattr(nodes, "connect", lambda *a, **k: pytest.fail("logged in to theirs"))
    monkeypatch.setattr(owner, "caller_owner", lambda region, endpoint_url: "me")
    monkeypatch.setattr(inventory, "check_owner", theirs)
    assert driver_control.jobs_on(spec, None) == []  # down refuses it; nothing of theirs asked


# --- 12: the messages ----------------------------------------------------------------------------


def test_the_driver_says_what_it_does_before_its_first_round(tmp_path) -> None:
    """Between "job started" and round 1, the submitter relays the driver's progress lines
    from its log (starting Spark, its executors registered, ...), each once, and stops once
    a round is done; other lines of the log (Spark's own) are not relayed."""
    node = _node(tmp_path)
    log = tmp_path / "m" / "jobs" / "S1" / "driver.log"
    log.parent.mkdir(parents=True)
    said: list[str] = []
    status = follow.DriverStatus(_Shell(), node, "S1", said.append)
    status()  # no log yet
    log.write_text("starting Spark\n26/12/02 WARN NativeCodeLoader: no native library\n")
    status()
    status()
    with log.open("a") as out:
        out.write("round 1 (2 executors registered (2 cores))\nround 1 (starting Python workers)\n")
    status()
    with log.open("a") as out:
        out.write("round 1/4  loss 2.3000  812 samples/s  1.0 s\nround 2 (something)\n")
    status()
    status()
    assert said == [
        "driver: starting Spark",
        "driver: round 1 (2 executors registered (2 cores))",
        "driver: round 1 (starting Python workers)",
    ]


def test_name_without_a_clusters_entry_says_so_and_lists_the_known_ones(
    home, launches, tmp_path
) -> None:
    (tmp_path / "sparknet.yaml").write_text("clusters:\n  alpha: {}\n  beta: {}\n")
    done = _submit("--s3", "s3://b-b/x", "--name", "gamma")
    assert (done.exit_code, done.stderr) == (
        2,
        "error: --name gamma: no such entry in sparknet.yaml's clusters: "
        "(known: alpha, beta); a cluster is made from its entry\n",
    )
    assert launches == []


def test_a_bad_workers_is_said_to_count_instances(home, launches, tmp_path) -> None:
    """sparknet-submit's --workers counts worker instances (the Spark tasks are `--set
    workers`): its refusal names the flag and what it counts."""
    (tmp_path / "sparknet.yaml").write_text("clusters:\n  c1: {bucket: b-b}\n")
    instances = _submit("--s3", "s3://b-b/x", "--name", "c1", "--workers", "1000")
    assert (instances.exit_code, instances.stderr) == (
        2,
        "error: cluster c1: --workers 1000 (worker instances): Input should be less than or "
        "equal to 250 (got 1000)\n",
    )
    assert launches == []


def test_help_shows_no_type_after_a_switch_and_workers_counts_instances() -> None:
    from sparknet.cli import app as sparknet_app
    from sparknet.cli.submit import submit_app

    runner = CliRunner()
    for app, args in ((submit_app, ["--help"]), (sparknet_app, ["cluster", "down", "--help"])):
        shown = runner.invoke(app, args, env={"COLUMNS": "200"}).stdout
        assert "--help" in shown and "<bool>" not in shown, shown
        assert "<str>" in shown  # options that take a value keep theirs
    shown = runner.invoke(submit_app, ["--help"], env={"COLUMNS": "200"}).stdout
    assert "worker instances of the cluster to make (EC2 machines, not Spark tasks" in shown


def test_a_long_line_to_a_file_is_not_wrapped(capsys) -> None:
    """Progress and notes on stderr that is no terminal (a log file, CI): each line whole,
    not cut at rich's 80 columns."""
    from sparknet.cli.common import console

    line = "error-like note naming s3://bucket/a/long/prefix/of/a/run " * 4
    console.print(line.strip(), markup=False, highlight=False)
    assert capsys.readouterr().err == line.strip() + "\n"


# --- what sparknet-submit sets itself, and errors in its own words -----------------------------


@pytest.mark.parametrize(
    ("item", "instead"),
    [
        ("out=s3://b-b/myrun", "the run dir is the job's run prefix"),
        ("data=s3://other/x", "the dataset is --s3"),
        ("train.master=spark://h:7077", "the master is the cluster's"),
        ("gpus_per_worker=4", "a node's GPUs are its instance type's"),
        ("endpoint_url=http://nowhere:1", "use --endpoint-url"),
    ],
)
def test_a_set_of_what_submit_sets_itself_is_refused_naming_what_sets_it(
    home, launches, tmp_path, item: str, instead: str
) -> None:
    """`--set out=...` (and data, master, gpus_per_worker, endpoint_url) was dropped without a
    word, even by a dry run that said every check passed; `--set workers=N` stays the job's."""
    (tmp_path / "sparknet.yaml").write_text("clusters:\n  c1: {bucket: b-b}\n")
    done = _submit("--s3", "s3://b-b/x", "--dry-run", "--set", item)
    key = item.partition("=")[0].removeprefix("train.")
    assert (done.exit_code, done.stdout) == (2, ""), done.output
    assert done.stderr.startswith(f"error: --set {key}: sparknet-submit sets it itself; "), (
        done.stderr
    )
    assert instead in done.stderr and len(done.stderr.splitlines()) == 1
    assert launches == []


def test_submit_errors_name_no_flag_it_lacks_and_aws_hints_carry_the_endpoint(
    home, launches, bucket, moto_endpoint, tmp_path
) -> None:
    """A cluster not found in its region points at the entry's `region:` (sparknet-submit has no
    --region); the `aws ec2 ...` hint reaches the endpoint the user gave; a setting a node
    cannot use names --set, never a flag only `sparknet train` has."""
    from sparknet.cli.submit import spelt

    uri = _dataset(bucket)
    (tmp_path / "sparknet.yaml").write_text(
        f"clusters:\n  c1: {{bucket: {bucket}, data_prefix: ds/, ami: {amazon_ami()}}}\n"
    )
    endpoint = ("--endpoint-url", moto_endpoint)
    missing = _submit("--s3", uri, "--dry-run", "--cluster", "c1", *endpoint)
    assert missing.exit_code == 2, missing.output
    assert "--region" not in missing.stderr, missing.stderr
    assert "check the name and the cluster's `region:` in sparknet.yaml" in missing.stderr
    offered = _submit("--s3", uri, "--dry-run", "--instance-type", "p9.huge", *endpoint)
    assert offered.exit_code == 2, offered.output
    assert (
        "(aws ec2 describe-instance-type-offerings --region us-east-1 --endpoint-url "
        f"{moto_endpoint})" in offered.stderr
    ), offered.stderr
    assert spelt("rounds", 3) == "--rounds 3"
    assert spelt("gpus_per_worker", 4) == "--set gpus_per_worker=4"
    assert spelt("region") == "the cluster's `region:` in sparknet.yaml"


def test_an_ec2_flag_for_a_static_cluster_is_refused_as_a_flag_to_leave_out(
    home, launches, tmp_path
) -> None:
    """`--spot` (or `--provider aws`) for a static cluster was refused as if it were in the
    YAML ("remove them", "set provider: static"): the flag is what to leave out."""
    key = tmp_path / "id"
    key.write_text("k")
    (tmp_path / "sparknet.yaml").write_text(
        "clusters:\n  st: {provider: static, bucket: b-b, key_file: id, "
        "hosts: [u@h1:22, u@h2:22]}\n"
    )
    spot = _submit("--s3", "s3://b-b/x", "--name", "st", "--dry-run", "--spot")
    assert (spot.exit_code, spot.stderr) == (
        2,
        "error: --spot: EC2 flags, not for static cluster st (its machines are its `hosts:`); "
        "leave it out\n",
    )
    aws = _submit("--s3", "s3://b-b/x", "--name", "st", "--dry-run", "--provider", "aws")
    assert aws.exit_code == 2 and aws.stderr.endswith("; leave --provider out\n"), aws.stderr
    assert "remove" not in spot.stderr + aws.stderr and launches == []
