"""A local `--out` on a cluster whose executors do not see it: the allreduce transport's rank 0
would write the checkpoints to its own disk and the run fail after its last round, so the
driver proves before round 1 that every executor reads a token it put in the run dir.

Nodes on this machine share its filesystem, so this module starts its own standalone cluster
(a master and one 2-core worker) whose worker runs in a mount namespace of its own with a
tmpfs over the run dir's parent (and a host name of its own): the driver's dir is not there,
as on another machine. Runs go through the CLI in a subprocess (the test process holds a local
SparkContext)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from sparknet.training import rundir, rundir_reach
from sparknet.training.rundir import REACH_TOKEN, RunDir
from tests.conftest import REPO, SPARKNET

pytestmark = [pytest.mark.slow, pytest.mark.integration]

#: the host name of the worker that does not see the driver's dirs
NODE = "nodeb"

#: a small run: two workers, two rounds
RUN = (
    "train", "--data", "digits", "--model", "mlp", "--workers", "2", "--rounds", "2",
    "--tau", "1", "--batch-size", "16", "--seed", "3", "--eval-every", "0",
)  # fmt: skip


@dataclass(frozen=True)
class Apart:
    """A cluster whose one worker sees a tmpfs at `hidden`, not this machine's dir."""

    master: str
    hidden: Path


@pytest.fixture(scope="module")
def apart(tmp_path_factory) -> Iterator[Apart]:
    import pyspark

    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root and unshare(1) for a mount namespace")
    home = Path(pyspark.__file__).parent
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    logs = tmp_path_factory.mktemp("apart")
    hidden = tmp_path_factory.mktemp("hidden")
    env = dict(
        os.environ, SPARK_HOME=str(home), SPARK_LOCAL_IP="127.0.0.1",
        SPARK_MASTER_OPTS="-Dspark.master.rest.enabled=false",
    )  # fmt: skip
    master = f"spark://127.0.0.1:{port}"
    spark_class = str(home / "bin" / "spark-class")
    # the worker's own namespace: its mounts and host name are not this machine's; its own
    # /etc/hosts names it (Java's getLocalHost resolves the host name and fails without)
    hosts = logs / "hosts"
    hosts.write_text(f"127.0.0.1 localhost\n127.0.0.1 {NODE}\n")
    apart_sh = (
        'hostname "$1" && mount --bind "$3" /etc/hosts && mount -t tmpfs none "$2"'
        ' && shift 3 && exec "$@"'
    )
    commands = {
        "master": [spark_class, "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                   "--port", str(port), "--webui-port", "0"],
        "worker": ["unshare", "-m", "-u", "sh", "-c", apart_sh, "sh", NODE, str(hidden), str(hosts),
                   spark_class, "org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1",
                   "--cores", "2", "--memory", "2g", "--webui-port", "0",
                   "--work-dir", str(logs / "work"), master],
    }  # fmt: skip
    procs = []
    try:
        for name, command in commands.items():
            with (logs / f"{name}.log").open("w") as out:
                procs.append(
                    subprocess.Popen(
                        command,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        env=env,
                        start_new_session=True,
                    )
                )
        deadline = time.monotonic() + 90
        while "Successfully registered with master" not in (logs / "worker.log").read_text():
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError(f"the cluster did not come up; logs in {logs}")
            time.sleep(0.2)
        yield Apart(master, hidden)
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def sparknet(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(SPARKNET), *args], cwd=REPO, capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize("transport", ["allreduce", "spark"])
def test_a_dir_the_executors_do_not_see_is_refused_before_round_1_in_one_line(apart, transport):
    """Before the check, both runs failed late: under allreduce (which `auto` takes here, the
    worker being on 127.0.0.1) after the last round, the checkpoint rank 0 wrote being on the
    worker's tmpfs; under spark at the first checkpoint, whose inner optimizer states the
    workers write into a dir they do not have."""
    out = apart.hidden / transport / "r1"  # its own: the worker keeps what a run wrote there
    proc = sparknet(*RUN, "--master", apart.master, "--transport", transport, "--out", str(out))

    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert lines[-1] == (
        f"error: --out {out} is a path on the driver's machine, but the executors on {NODE} do "
        "not see it (Spark's tasks write checkpoint files into it): give an s3:// --out or a "
        "path every node mounts at the same place (NFS, EFS)"
    )
    assert not any("Traceback" in line for line in lines)
    assert "checking that the executors see --out" in lines[-2]
    # nothing written: no token, no run file; the dirs the run made are gone again
    assert list(apart.hidden.iterdir()) == []


def test_executors_that_see_the_dir_pass_and_the_token_is_removed(sc, tmp_path):
    """The local session's executor shares this machine's disk (the shared standalone cluster's
    case rides test_standalone's allreduce runs with a local --out)."""
    run = RunDir.open(str(tmp_path / "seen"))
    run.local.mkdir()

    assert rundir_reach.unseen_hosts(sc, run, 2) == []
    assert not [p for p in run.local.iterdir() if p.name.startswith(REACH_TOKEN)]
    assert list(run.local.iterdir()) == []


def test_a_token_left_by_a_killed_driver_does_not_make_the_dir_foreign(tmp_path):
    """A driver killed during the check leaves its token: the next run starts there all the
    same (the dir holds nothing else)."""
    run = RunDir.open(str(tmp_path / "left"))
    run.local.mkdir()
    (run.local / f"{REACH_TOKEN}0123abcd").write_text("0123abcd")

    rundir.check(run, resume=False)
