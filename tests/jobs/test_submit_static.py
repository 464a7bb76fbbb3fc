"""`sparknet-submit --provider static`: the job on machines the user already has, as a user
runs it (a subprocess). Two real sshd on 127.0.0.1 are the hosts (their keys in the user's
known_hosts), the bootstrap starts a real Spark standalone cluster on them, the tiny sharded
dataset lies in moto's S3 (test_submit.py's fixtures), and no EC2 call is made: nothing of
EC2 is in this test's moto. Stand-in, as in test_submit.py: the hosts' SSH sessions get moto's
endpoint and fake credentials, where real hosts have credentials of their own.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import uuid
from pathlib import Path

import pytest
import yaml

from tests.jobs.test_submit import (  # noqa: F401 (fixtures)
    JOB,
    SUBMIT,
    _client,
    dataset,
    shards,
    submit,
)
from tests.sshd import daemon_pids, static_cluster_entry

pytestmark = pytest.mark.integration

ADDRESSES = {"master": "127.0.0.6", "worker-1": "127.0.0.7"}


@pytest.fixture
def static_settings(moto_endpoint, dataset, sshd_nodes, tmp_path, monkeypatch):  # noqa: F811
    """./sparknet.yaml (cwd tmp_path) with the hosts of a cluster (its `provider` left to the
    flag) and the dataset `tiny`; the registry under tmp_path. The name and the nodes."""
    from sparknet.cluster import registry
    from sparknet.cluster.node_endpoints import ENDPOINTS_ENV

    monkeypatch.setenv(registry.HOME_ENV, str(tmp_path / "home"))
    group = sshd_nodes(2)  # after moto: the hosts' sessions get its endpoint
    name = f"t{uuid.uuid4().hex[:8]}"
    entry = static_cluster_entry(group, name, ADDRESSES, tmp_path, gpus_per_node=0)
    monkeypatch.setenv(ENDPOINTS_ENV, str(tmp_path / "endpoints.json"))
    # a second cluster with a host whose key the user never checked
    unknown = {**entry, "hosts": [*entry["hosts"], "root@127.0.0.1:1"]}
    doc = {"clusters": {name: entry, f"{name}u": unknown}, "datasets": {"tiny": {"uri": dataset}}}
    (tmp_path / "sparknet.yaml").write_text(yaml.safe_dump(doc))
    yield name
    if registry.registered().get(name) is not None:
        from sparknet.cluster import static

        static.down(registry.registered()[name])


@pytest.mark.slow
def test_submit_on_static_hosts_trains_and_stops_spark(static_settings, bucket, tmp_path):
    from sparknet.cluster import registry

    name = static_settings
    # refused before anything starts or is written, one line each, exit 2: EC2 settings on a
    # static cluster (even where they say the default), --detach of a cluster the submit
    # brings up (no autostop timer would end its Spark), a host whose key is not trusted, a
    # bad check interval
    static = ("--provider", "static", "--name", name, "--s3", "tiny", *JOB)
    refusals = {
        "--spot": f"--spot: EC2 flags, not for static cluster {name} (its machines are its "
        "`hosts:`); leave it out",
        "--autostop=30": f"--autostop: EC2 flags, not for static cluster {name}",
        "--detach": f"--detach on static cluster {name}, which this submit brings up",
        f"--name={name}u": "no host key for worker-2 (root@127.0.0.1:1) in ",
        "": "SPARKNET_REPAIR_CHECK_S='abc': give a number of seconds from 1 to 86400",
    }
    for flag, why in refusals.items():
        env = {**os.environ, "SPARKNET_REPAIR_CHECK_S": "abc" if not flag else "30"}
        refused = subprocess.run(
            [str(SUBMIT), *static, *([flag] if flag else [])], cwd=tmp_path, env=env,
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert refused.returncode == 2 and why in refused.stderr, (flag, refused.stderr)
        assert len(refused.stderr.splitlines()) == 1, refused.stderr
    assert daemon_pids(tmp_path, ADDRESSES) == {} and not (tmp_path / "home" / "clusters").exists()

    proc = subprocess.Popen(
        [str(SUBMIT), *static], cwd=tmp_path,
        env=os.environ.copy(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    seen, pids = [], {}
    timer = threading.Timer(300, proc.kill)  # a submitter that hangs fails the test
    timer.start()
    try:
        for line in proc.stderr:  # to the end (communicate() would skip what the loop buffered)
            seen.append(line)
            if not pids and line.startswith("round "):  # the Spark daemons while the job runs
                pids = daemon_pids(tmp_path, ADDRESSES)
        stdout = proc.stdout.read()
        proc.wait(timeout=60)
    finally:
        timer.cancel()
    done = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, "".join(seen))
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"static cluster {name}: 2 hosts" in done.stderr
    rounds = [ln.split()[1] for ln in done.stderr.splitlines() if ln.startswith("round ")]
    assert rounds == ["1/2", "2/2"], done.stderr[-3000:]
    assert f"taking cluster {name} down" in done.stderr
    out = dict(ln.split(": ", 1) for ln in done.stdout.splitlines() if ": " in ln)
    run_id = out["run id"]
    # the run prefix in the dataset's bucket (a static cluster's hosts have no role of ours)
    assert out["run prefix"] == f"s3://{bucket}/runs/{name}/{run_id}/"
    assert out["estimated cost"] == "unknown"
    listed = _client("s3").list_objects_v2(Bucket=bucket, Prefix=f"runs/{name}/{run_id}/")
    keys = {o["Key"].rsplit("/", 1)[-1] for o in listed["Contents"]}
    assert {"model.safetensors", "metrics.jsonl", "config.yaml"} <= keys
    assert (tmp_path / "runs" / run_id / "curves.png").read_bytes()[:4] == b"\x89PNG"
    # the job ran on the hosts' Spark (2 executors), which is stopped again; the machines and
    # their install stay, and nothing of EC2 was made
    job = tmp_path / "master" / "jobs" / run_id
    assert (job / "driver.rc").read_text().strip() == "0"
    rows = [json.loads(r) for r in (tmp_path / "runs" / run_id / "metrics.jsonl").open()]
    assert [r["executors"] for r in rows] == [2, 2]
    assert sorted(pids) == ["master/master", "master/worker", "worker-1/worker"]
    assert not any(Path(f"/proc/{pid}").exists() for pid in pids.values())
    assert name not in registry.registered()
    assert (tmp_path / "worker-1" / "venv" / "bin" / "python").exists()
    assert (
        _client("ec2").describe_instances(
            Filters=[{"Name": "tag:sparknet:cluster", "Values": [name]}]
        )["Reservations"]
        == []
    )
