"""A bootstrap under a running job: one that would start a new Spark master (a dead one's
successor has the workers kill the job's executors) or restart a running worker is refused in
one line naming the job, before anything changes; `force` goes on, and so does a bootstrap that
only starts a worker that is not running (what a repair does while its job runs). The checks
run for real in a local shell standing in for the master's SSH session, over a node prefix
under tmp_path with a job dir whose session is alive, as sparknet-submit leaves one."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import invoke
import pytest

from sparknet.cluster import nodes
from sparknet.cluster.address import Endpoint
from sparknet.cluster.spark import bootstrap as boot
from sparknet.cluster.spark.daemons import WORKER_CLASS, Master
from sparknet.cluster.spark.plan import JOB_PID, JOBS_DIR, Node, Plan
from sparknet.cluster.spark.wheel import Wheel


class _Local(invoke.Context):
    def close(self) -> None:
        pass


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    """A one-node plan (its master) whose node is a prefix under tmp_path, reached through a
    local shell; the steps' rounds are recorded, never run."""
    monkeypatch.setattr(nodes, "connect", lambda endpoint, access, timeout=20: _Local())

    def run_all(endpoints, access, fn, timeout, **kw):
        return {e.name: fn(e, _Local()) for e in endpoints}

    monkeypatch.setattr(nodes, "run_all", run_all)
    rounds: list[str] = []

    def run_on_nodes(plan, access, nodes_, steps_for, say, timeout):
        rounds.append("steps")
        raise boot.SparknetError("the steps would run now")

    monkeypatch.setattr(boot, "run_on_nodes", run_on_nodes)
    node = Node(Endpoint("master", "10.0.0.5"), prefix=str(tmp_path / "master"))
    python = Path(node.python)  # the node's venv, as a bootstrap left it: this venv's Python
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    plan = Plan((node,), Wheel(Path("w.whl"), "1", "d"), "s" * 32)
    return plan, tmp_path / "master", rounds


def _alive(argv: list[str]) -> subprocess.Popen:
    """A process in a session of its own (reaped as soon as it ends, as a daemon is)."""
    proc = subprocess.Popen(argv, start_new_session=True)
    threading.Thread(target=proc.wait, daemon=True).start()
    return proc


@pytest.fixture
def job(cluster):
    """A sparknet-submit job running on the master: its job dir, its session's pid file."""
    _plan, prefix, _rounds = cluster
    proc = _alive([sys.executable, "-c", "import time; time.sleep(120)"])
    run = prefix / JOBS_DIR / "20261202-210000-ab12"
    run.mkdir(parents=True)
    (run / JOB_PID).write_text(f"{proc.pid}\n")
    ended = prefix / JOBS_DIR / "20261202-200000-cd34"  # a job that ended: not counted
    ended.mkdir()
    (ended / JOB_PID).write_text(f"{2**22 + 1}\n")
    yield proc
    proc.kill()


def test_a_new_master_under_a_running_job_is_refused_before_anything(cluster, job) -> None:
    plan, prefix, rounds = cluster
    with pytest.raises(boot.JobRunning) as err:
        boot.bootstrap(plan, nodes.Access(Path("k"), Path("kh")))
    line = str(err.value)
    assert "\n" not in line
    assert line.startswith(
        "job 20261202-210000-ab12 runs on the cluster, and this bootstrap would start a new "
        "Spark master on master: its executors would be killed and the job would wait for "
        "them forever; "
    )
    assert line.endswith(
        "wait for it to end or cancel it (`sparknet-submit cancel 20261202-210000-ab12`), or "
        "bootstrap with --force to go on anyway"
    )
    assert rounds == []
    assert sorted(p.name for p in prefix.iterdir()) == [JOBS_DIR, "venv"]  # nothing made there
    assert job.poll() is None


def test_force_goes_on(cluster, job) -> None:
    plan, _prefix, rounds = cluster
    with pytest.raises(boot.SparknetError, match="the steps would run now"):
        boot.bootstrap(plan, nodes.Access(Path("k"), Path("kh")), force=True)
    assert rounds == ["steps"]


def test_without_a_running_job_it_goes_on(cluster) -> None:
    plan, prefix, rounds = cluster
    (prefix / JOBS_DIR / "20261202-200000-cd34").mkdir(parents=True)  # ended: no session
    (prefix / JOBS_DIR / "20261202-200000-cd34" / JOB_PID).write_text(f"{2**22 + 1}\n")
    with pytest.raises(boot.SparknetError, match="the steps would run now"):
        boot.bootstrap(plan, nodes.Access(Path("k"), Path("kh")))
    assert rounds == ["steps"]


def test_starting_a_dead_worker_is_no_harm_restarting_a_live_one_is(
    cluster, job, monkeypatch
) -> None:
    """The master runs as the plan wants: a worker that does not run may start (a repair
    under its job), one that runs with other settings may not restart."""
    plan, prefix, rounds = cluster
    monkeypatch.setattr(Master, "check", lambda self, conn: True)
    with pytest.raises(boot.SparknetError, match="the steps would run now"):
        boot.bootstrap(plan, nodes.Access(Path("k"), Path("kh")))
    assert rounds == ["steps"]

    (prefix / "run").mkdir()
    worker = _alive(
        [sys.executable, "-c", "import time; time.sleep(120)", WORKER_CLASS, str(prefix / "conf")]
    )
    (prefix / "run" / "worker.pid").write_text(f"{worker.pid}\n")
    try:
        with pytest.raises(boot.JobRunning, match=r"would restart the Spark worker on master: "):
            boot.bootstrap(plan, nodes.Access(Path("k"), Path("kh")))
    finally:
        worker.kill()
    assert rounds == ["steps"]
