"""`sparknet-submit` end to end, as a user runs it (a subprocess): moto's server is the cloud,
moto's instances are loopback sshd nodes (the seam of `node_endpoints.py`, as in
test_cluster_bootstrap.py), the bootstrap starts a real Spark standalone cluster on them, and a
tiny sharded dataset (40 small images) lies in moto's S3.

Stand-in: an EC2 node reaches S3 through its instance role; the loopback nodes' SSH sessions get
moto's endpoint and fake credentials instead (`SetEnv` in tests/sshd.py's sshd config), so the
driver and executors on the master reach moto as a real node reaches S3. Product code copies no
credentials anywhere.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from tests.cluster.test_aws_faults import GONE, _left
from tests.conftest import SPARKNET
from tests.moto_server import amazon_ami
from tests.sshd import daemon_pids, loopback_cluster_entry

pytestmark = pytest.mark.integration

REGION = "us-east-1"
AMI_PARAMETER = "/test/sparknet/submit-ami"
SUBMIT = SPARKNET.with_name("sparknet-submit")
ADDRESSES = {"master": "127.0.0.4", "worker-1": "127.0.0.5"}
#: a job that learns nothing in particular, fast: 2 rounds of 1 step on 16x16 crops
JOB = (
    "--model", "cnn", "--image-size", "16", "--rounds", "2", "--tau", "1", "--batch-size", "4",
    "--eval-every", "0", "--checkpoint-every", "1", "--seed", "0",
)  # fmt: skip


def _client(service: str, endpoint_url: str | None = None):
    """A plain boto3 client; `endpoint_url` moto's own server where a test's AWS_ENDPOINT_URL
    is the fault front (tests/aws_faults.py), so the test's checks meet no fault."""
    import boto3

    return boto3.client(service, region_name=REGION, endpoint_url=endpoint_url)


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    from sparknet.data.shards import write_dataset
    from tests.imagenet_tree import make_tree

    tree = tmp_path_factory.mktemp("tree")
    make_tree(tree, classes=4, train_per_class=8, val_per_class=2)
    dest = tmp_path_factory.mktemp("shards")
    write_dataset(tree, dest, shard_bytes=20_000, seed=0, processes=1)
    return dest


@pytest.fixture
def dataset(shards, bucket) -> str:
    """The shards under s3://BUCKET/tiny on moto; the URI."""
    s3 = _client("s3")
    for f in sorted(shards.iterdir()):
        s3.upload_file(str(f), bucket, f"tiny/{f.name}")
    return f"s3://{bucket}/tiny"


@pytest.fixture
def settings(moto_endpoint, dataset, bucket, tmp_path, monkeypatch):
    """./sparknet.yaml (cwd tmp_path) with one `clusters:` entry (the dataset's bucket, its data
    prefix `tiny/`) and the dataset `tiny`; the registry under tmp_path. The cluster name."""
    from sparknet.cluster import registry

    monkeypatch.setenv(registry.HOME_ENV, str(tmp_path / "home"))
    ami = amazon_ami(REGION)
    _client("ssm").put_parameter(Name=AMI_PARAMETER, Value=ami, Type="String", Overwrite=True)
    name = f"s{uuid.uuid4().hex[:8]}"
    entry = loopback_cluster_entry(REGION, AMI_PARAMETER, bucket=bucket, data_prefix="tiny/")
    doc = {"clusters": {name: entry}, "datasets": {"tiny": {"uri": dataset}}}
    (tmp_path / "sparknet.yaml").write_text(yaml.safe_dump(doc))
    return name


def submit(*args: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(SUBMIT), *args], cwd=cwd, env=os.environ.copy(), capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip


def _live(name: str, moto: str | None = None) -> list:
    from sparknet.cluster.aws import instances

    return [i for i in instances.find(_client("ec2", moto), name) if i.state != "terminated"]


def _torn_down(name: str, root: Path, moto: str | None = None) -> None:
    """No instance of the cluster left, no Spark daemon alive on the nodes, no key pair, no
    role, profile, VPC or security group (asked of `moto` past any fault front)."""
    from sparknet.cluster.aws import keys

    assert _live(name, moto) == []
    for pid in daemon_pids(root, ADDRESSES).values():
        assert not Path(f"/proc/{pid}").exists()
    assert _left(SimpleNamespace(name=name, region=REGION), moto) == GONE
    pairs = _client("ec2", moto).describe_key_pairs(
        Filters=[{"Name": "key-name", "Values": [keys.key_pair_name(name)]}]
    )["KeyPairs"]
    assert pairs == []


def _layout(group, name: str, root: Path) -> None:
    layout = json.loads(group.file.read_text())
    for node, address in ADDRESSES.items():
        layout[f"{name}/{node}/node"] = {"address": address, "prefix": str(root / node)}
    group.file.write_text(json.dumps(layout))


def _reference(spark, dataset: str, out: Path) -> Path:
    """The successful job without a cluster and without a kill, in this process: local Spark,
    the same shards on moto, the same 2 partitions (submit's `workers`: one per Spark worker
    node, the master's included) and the same 1 torch thread per task (the loopback workers
    have 1 core each; a local task has spark.task.cpus = 1), and the transport `auto` picks on
    the cluster (allreduce: a bit-exact comparison needs the same one). Its run dir."""
    from sparknet.training.driver import train
    from tests.helpers import cli_config

    train(
        cli_config(JOB, data=dataset, workers=2, rounds=4, transport="allreduce", out=out),
        spark=spark,
    )
    return out


def _kill_the_driver_after_round_1(
    proc: subprocess.Popen, bucket: str, name: str, root: Path, moto: str | None = None
) -> tuple[str, str]:
    """Once the job started and its round 1 row is in metrics.jsonl on moto, kill -9 the train
    process on the loopback master (its pid file in the job dir); the run id, and the stderr
    read until the job started."""
    run_id = None
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if line.startswith("job ") and " started on the master" in line:
            run_id = line.split()[1]
            break
    assert run_id is not None, "the job did not start"
    s3 = _client("s3", moto)
    deadline = time.monotonic() + 300
    while True:
        assert time.monotonic() < deadline and proc.poll() is None, "no round 1 on S3"
        try:
            body = s3.get_object(Bucket=bucket, Key=f"runs/{name}/{run_id}/metrics.jsonl")["Body"]
            if any('"round"' in ln for ln in body.read().decode().splitlines()):
                break
        except s3.exceptions.NoSuchKey:
            pass
        time.sleep(0.5)
    pid = int((root / "master" / "jobs" / run_id / "train.pid").read_text())
    os.kill(pid, signal.SIGKILL)
    return run_id, "".join(seen)


def _tensors(data: bytes) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """A safetensors file's tensors, exactly: dtype, shape and bytes by name."""
    from safetensors.torch import load

    return {k: (str(v.dtype), tuple(v.shape), v.numpy().tobytes()) for k, v in load(data).items()}


def _a_bad_day(plan, bucket: str) -> None:
    """The faults a submit meets on AWS on a bad day, each a few times (tests/aws_faults.py):
    EC2, IAM and SSM throttle bursts, S3 answers SlowDown to the run dir's writes and reads
    (the submitter's and the driver's on the master) and to the executors' shard reads, fresh
    instances are NotFound by id and missing from tag-filtered describes for 3 s, and the
    instance profile is invalid to RunInstances for its first 5 s. botocore retries throttling
    and 503s; the rest is the product's to wait out."""
    plan.fail("DescribeInstances", "RequestLimitExceeded", times=2)
    plan.fail("RunInstances", "RequestLimitExceeded", times=1)
    plan.fail("TerminateInstances", "RequestLimitExceeded", times=1)
    plan.fail("iam:CreateRole", "Throttling", times=1)
    plan.fail("iam:DeleteRole", "Throttling", times=1)
    plan.fail("ssm:GetParameter", "ThrottlingException", times=1)
    runs = f"/{bucket}/runs/"
    plan.fail("s3:PutObject", "SlowDown", times=2, when=lambda c: c.path.startswith(runs))
    plan.fail("s3:GetObject", "SlowDown", times=2, when=lambda c: c.path.startswith(runs))
    plan.fail("s3:GetObject", "SlowDown", times=2, when=lambda c: c.path.endswith(".tar"))
    plan.unseen_instances_s = 3.0
    plan.unseen_profiles_s = 5.0


@pytest.mark.slow
def test_submit_trains_on_a_new_cluster_and_takes_it_down(
    settings, dataset, moto_nodes, bucket, spark, tmp_path, moto_endpoint, aws_faults
):
    """One cluster life, twice submitted, every AWS call of the submitter, the driver and the
    executors (the nodes' sessions get AWS_ENDPOINT_URL from this test's environment: the fault
    front) under `_a_bad_day`'s faults; the checks ask moto past the front."""
    name = settings
    moto = moto_endpoint
    plan = aws_faults
    _a_bad_day(plan, bucket)
    group = moto_nodes(name, 1)
    _layout(group, name, tmp_path)
    with group.watch(_client("ec2", moto)):
        # a signal to the submitter once the job runs: 128 + it, teardown done (SIGTERM alone:
        # Ctrl-C takes the same handler, and its 130 is test_submit_parts.py's)
        proc = subprocess.Popen(
            [str(SUBMIT), "--s3", "tiny", *JOB], cwd=tmp_path, env=os.environ.copy(),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        seen = []
        for line in proc.stderr:
            seen.append(line)
            if line.startswith("job ") and " started on the master" in line:
                proc.send_signal(signal.SIGTERM)
                break
        _out, err = proc.communicate(timeout=300)
        assert proc.returncode == 143, "".join(seen) + err
        assert "error: interrupted (SIGTERM); teardown done" in err
        # before the teardown the job was cancelled as `cancel` does, and waited for: marked,
        # no exit code, its driver ended in order (no traceback in its log)
        run = seen[-1].split()[1]
        job = tmp_path / "master" / "jobs" / run
        assert f"job {run} cancelled\n" in err, err
        assert (job / "cancelled").exists() and not (job / "driver.rc").exists()
        assert "Traceback" not in (job / "driver.log").read_text()
        _torn_down(name, tmp_path, moto)
    refused = set(plan.codes())
    assert {"RequestLimitExceeded", "Throttling", "InvalidParameterValue"} <= refused, refused
    plan.clear()
    _a_bad_day(plan, bucket)
    group.stop()
    with group.watch(_client("ec2", moto)):
        # the driver (the train process, not its supervisor) killed once round 1 is on S3: the
        # job resumes from its last checkpoint (a later round's when rounds outran the poll)
        # and ends as an uninterrupted run would
        proc = subprocess.Popen(
            [str(SUBMIT), "--s3", "tiny", *JOB, "--rounds", "4", "--max-restarts", "1"],
            cwd=tmp_path, env=os.environ.copy(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        killed, before = _kill_the_driver_after_round_1(proc, bucket, name, tmp_path, moto)
        stdout, stderr = proc.communicate(timeout=600)
    done = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, before + stderr)
    assert done.returncode == 0, done.stderr[-3000:]
    # every fault met the submit, and it went through them as through none
    hit = {(action, code) for action, code in plan.injected}
    assert {
        ("DescribeInstances", "RequestLimitExceeded"), ("RunInstances", "RequestLimitExceeded"),
        ("RunInstances", "InvalidParameterValue"), ("TerminateInstances", "RequestLimitExceeded"),
        ("CreateRole", "Throttling"), ("DeleteRole", "Throttling"),
        ("GetParameter", "ThrottlingException"), ("PutObject", "SlowDown"),
        ("GetObject", "SlowDown"),
    } <= hit, plan.injected  # fmt: skip
    # the run dir's PUTs and GETs and the shards' GETs, which are the executors' (the
    # submitter checks the shards with HEADs), each met its 2 SlowDowns
    assert [f.hit for f in plan.faults[-3:]] == [2, 2, 2], plan.injected
    # the tag-filtered describes lagged behind the launches
    assert "lagging" in plan.codes(), plan.injected
    plan.clear()
    assert "bootstrapping 2 nodes" in done.stderr and "master: spark-master done" in done.stderr
    # what the driver does before round 1, from its log on the master
    assert "driver: starting Spark" in done.stderr, done.stderr[-3000:]
    # (both executors, or the first alone where the second came after it had settled: the
    # driver goes on with what registered, `wait_for_executors`, on a loaded machine)
    registered = r"driver: round 1 \([12] executors registered"
    assert re.search(registered, done.stderr), done.stderr[-3000:]
    # one plain line per round (no TTY), each once though a round ran twice, the restart's
    # line, then the summary
    restarts = [ln for ln in done.stderr.splitlines() if ln.startswith("driver died")]
    assert len(restarts) == 1, done.stderr[-3000:]
    assert re.fullmatch(
        r"driver died \(killed by SIGKILL\); restart 1/1 from (round [1-4]|the start)", restarts[0]
    )
    rounds = [ln for ln in done.stderr.splitlines() if ln.startswith("round ")]
    assert [ln.split()[1] for ln in rounds] == ["1/4", "2/4", "3/4", "4/4"], done.stderr[-3000:]
    assert all("samples/s" in ln and "cost $" in ln for ln in rounds)
    out = dict(ln.split(": ", 1) for ln in done.stdout.splitlines() if ": " in ln)
    run_id, prefix = out["run id"], out["run prefix"]
    assert run_id == killed
    assert prefix == f"s3://{bucket}/runs/{name}/{run_id}/"
    assert 0.0 <= float(out["final accuracy"]) <= 1.0
    assert out["estimated cost"].startswith("$")
    keys = {
        o["Key"][len(f"runs/{name}/{run_id}/") :]
        for o in _client("s3", moto).list_objects_v2(
            Bucket=bucket, Prefix=f"runs/{name}/{run_id}/"
        )["Contents"]
    }
    assert {"model.safetensors", "metrics.jsonl", "config.yaml"} <= keys
    assert {k.split("/")[1] for k in keys if k.startswith("checkpoints/")} == {
        f"round-{r:05d}" for r in (2, 3, 4)
    }  # the newest three (keep_checkpoints' default); the best, round 4's, among them
    local = tmp_path / "runs" / run_id
    assert (local / "curves.png").read_bytes()[:4] == b"\x89PNG"
    rows = [json.loads(r) for r in (local / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows if "round" in r] == [1, 2, 3, 4]
    events = [r for r in rows if "event" in r]
    assert [(e["event"], e["attempt"], e["reason"]) for e in events] == [
        ("restart", 1, "killed by SIGKILL")
    ]
    # the same weights as an uninterrupted run with the same seed (local Spark, 2 partitions)
    config = _client("s3", moto).get_object(Bucket=bucket, Key=f"runs/{name}/{run_id}/config.yaml")
    assert yaml.safe_load(config["Body"].read())["train"]["transport"] == "allreduce"
    reference = _reference(spark, dataset, tmp_path / "reference")
    assert _tensors(_client("s3", moto).get_object(
        Bucket=bucket, Key=f"runs/{name}/{run_id}/model.safetensors")["Body"].read()
    ) == _tensors((reference / "model.safetensors").read_bytes())  # fmt: skip
    # the driver ran detached on the master, in its job dir, and ended 0; it and the attached
    # submitter kept the autostop timer's activity (the job's stamp goes as the job ends)
    job = tmp_path / "master" / "jobs" / run_id
    assert (job / "driver.rc").read_text().strip() == "0"
    log = (job / "driver.log").read_text()
    assert "round 4/4" in log and "driver died (killed by SIGKILL); restart 1/1" in log
    activity = tmp_path / "master" / "autostop" / "activity"
    assert any(p.name.startswith("submitter-") for p in activity.iterdir())
    assert not (activity / f"job-{run_id}").exists()
    assert activity.stat().st_mtime >= (job / "job.yaml").stat().st_mtime
    _torn_down(name, tmp_path, moto)


def test_a_launch_aws_refuses_ends_the_submit_in_one_line_and_leaves_nothing(
    settings, bucket, tmp_path, moto_endpoint, aws_faults
):
    """A new account's 0 vCPUs for G instances, which EC2 says only at RunInstances (the
    quota read before it said enough): the submit exits non-zero with one `error:` line naming
    the refusal and the quota to ask for, no traceback, and its clean-up leaves nothing of the
    cluster in moto (checked past the front) and nothing in the runs prefix."""
    name = settings
    refused = aws_faults.fail("RunInstances", "VcpuLimitExceeded", times=None)
    done = submit("--s3", "tiny", *JOB, cwd=tmp_path, timeout=300)
    assert done.returncode != 0, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    errors = [ln for ln in done.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, done.stderr
    assert "VcpuLimitExceeded" in errors[0], errors[0]
    assert "Running On-Demand G and VT instances" in errors[0], errors[0]
    assert refused.hit == 1  # the master's: a quota is regional, no other AZ is asked
    _torn_down(name, tmp_path, moto_endpoint)
    s3 = _client("s3", moto_endpoint)
    assert s3.list_objects_v2(Bucket=bucket, Prefix="runs/")["KeyCount"] == 0


def test_preflight_refusals_launch_nothing(settings, bucket, tmp_path):
    """An unknown dataset name, a --cluster that does not exist and a missing shard: one line,
    exit 2, no instance on moto, nothing in the runs prefix."""
    name = settings
    unknown = submit("--s3", "nope", *JOB, cwd=tmp_path, timeout=120)
    assert unknown.returncode == 2, unknown.stderr
    assert unknown.stderr.strip() == (
        "error: --s3 nope: no such dataset in datasets: (known: tiny); give a name from "
        "sparknet.yaml's datasets: or an s3://bucket/prefix"
    )
    gone = submit("--s3", "tiny", "--cluster", "no-such-cluster", *JOB, cwd=tmp_path, timeout=120)
    assert gone.returncode == 2, gone.stderr
    assert gone.stderr.startswith("error: --cluster no-such-cluster: no cluster no-such-cluster")
    assert len(gone.stderr.splitlines()) == 1
    s3 = _client("s3")
    shard = next(
        o["Key"]
        for o in s3.list_objects_v2(Bucket=bucket, Prefix="tiny/")["Contents"]
        if o["Key"].endswith(".tar")
    )
    s3.delete_object(Bucket=bucket, Key=shard)
    missing = submit("--s3", "tiny", *JOB, cwd=tmp_path, timeout=120)
    assert missing.returncode == 2, missing.stderr
    assert missing.stderr.startswith(
        f"error: dataset s3://{bucket}/tiny does not match its manifest: "
    )
    assert shard.split("/")[-1] in missing.stderr
    assert len(missing.stderr.splitlines()) == 1
    assert _live(name) == []
    assert _client("s3").list_objects_v2(Bucket=bucket, Prefix="runs/")["KeyCount"] == 0
