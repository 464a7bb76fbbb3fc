"""Shared fixtures: one real local Spark session for the whole test run."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.jvm import use_quick_java

REPO = Path(__file__).resolve().parents[1]
SPARKNET = Path(sys.executable).with_name("sparknet")

use_quick_java()  # before any JVM starts: every test process and what it starts inherits it
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    # started in the background (`make test &`): Ctrl-C would reach no child the tests signal
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def spark(moto_endpoint):
    """local[2,2]: two task slots, and a failed task is retried once (local mode retries nothing
    unless told). Python workers run from the repo root, so `tests.helpers:...` imports there.
    The moto server starts first: Spark's Python workers inherit AWS_ENDPOINT_URL from the JVM.

    The workers fork from sparknet's daemon, torch already imported (the opt-in of
    `sparknet.training.daemon`): the session outlives hundreds of runs, and Spark starts a new
    worker after a failed task and at times between runs, each one importing torch again
    (test_algorithm.py: 83 -> 61 CPU-s)."""
    from sparknet.training.session import start_session

    os.chdir(REPO)
    daemon = {"spark.python.daemon.module": "sparknet.training.daemon"}
    session = start_session("local[2,2]", workers=2, conf=daemon)
    yield session
    session.stop()


@pytest.fixture(scope="session")
def digits_run(spark, tmp_path_factory) -> tuple[Path, dict]:
    """A finished run on digits (mlp, 3 rounds, evaluated at the end) and its final row, for
    the tests of what uses a run's model; they leave the run dir as it is."""
    from sparknet.config import TrainConfig
    from sparknet.training.driver import train

    out = tmp_path_factory.mktemp("digits") / "run"
    cfg = TrainConfig(model="mlp", workers=2, tau=10, rounds=3, batch_size=32, lr=0.1,
                      eval_every=0, out=out)  # fmt: skip
    return out, train(cfg, spark=spark).final


@pytest.fixture
def sc(spark):
    return spark.sparkContext


@pytest.fixture(scope="session")
def moto_endpoint():
    """A real S3 API (moto's server) on localhost for the whole run, its EC2 tag lookup made
    linear (tests/moto_server.py).

    Spark executors and CLI subprocesses are other processes: they reach it only through
    `AWS_ENDPOINT_URL`, which is set here for them (an in-process mock would be invisible).
    """
    from moto.server import ThreadedMotoServer

    from tests.moto_quotas import answer_ec2_quotas
    from tests.moto_server import quicken_tag_lookup

    quicken_tag_lookup()
    answer_ec2_quotas()  # an account's EC2 vCPU quotas, which moto 5 does not know
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    _host, port = server.get_host_and_port()
    url = f"http://localhost:{port}"
    saved = {k: os.environ.get(k) for k in MOTO_ENV}
    os.environ.update(MOTO_ENV, AWS_ENDPOINT_URL=url)
    yield url
    server.stop()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="session")
def fault_front(moto_endpoint):
    """A second front to the same moto state that answers as AWS does when asked to: throttles,
    capacity and quota refusals, eventual consistency (tests/aws_faults.py)."""
    from tests.aws_faults import FaultFront

    front = FaultFront()
    yield front
    front.stop()


@pytest.fixture
def aws_faults(fault_front, monkeypatch):
    """This test's `FaultPlan`, empty: the test adds faults to it. AWS_ENDPOINT_URL points at
    the front for the test and the processes it starts; `moto_endpoint` still reaches moto
    directly (no faults), for the test's own checks."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", fault_front.url)
    yield fault_front.new_plan()
    fault_front.new_plan()


#: fake credentials and region for moto; AWS_ENDPOINT_URL is added by the fixture
MOTO_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_ENDPOINT_URL": "",
}


@pytest.fixture
def bucket(moto_endpoint):
    """A fresh, empty bucket on the moto server; its name."""
    import uuid

    import boto3

    name = f"test-{uuid.uuid4().hex[:12]}"
    s3 = boto3.client("s3", endpoint_url=moto_endpoint)
    s3.create_bucket(Bucket=name)
    yield name


@dataclass(frozen=True)
class Standalone:
    """A Spark standalone cluster on 127.0.0.1: a master and two 1-core workers."""

    master: str
    log_dir: Path
    work_dirs: tuple[Path, ...]
    #: start worker i's daemon again, after a test killed it for good (the tests after it need
    #: both workers); returns once it has registered with the master. Stopped with the cluster.
    restart_worker: Callable[[int], None] = field(compare=False)


#: how the cluster's daemons start; each runs in its own session so the fixture can end them all
_DAEMON = "org.apache.spark.deploy.{}"


@pytest.fixture(scope="session")
def standalone(moto_endpoint, tmp_path_factory) -> Standalone:
    """One real standalone cluster for every test that needs one (starting it costs ~15 s).

    The pip pyspark has no sbin/start-*.sh: the daemons run through `spark-class` (see the field
    notes). Workers inherit this process's environment, so their executors reach the moto server
    through AWS_ENDPOINT_URL. Ports are free ones; the master's REST server is off (its port is
    fixed at 6066, so two test runs on one machine would collide)."""
    import socket
    import subprocess
    import time

    import pyspark

    home = Path(pyspark.__file__).parent
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    logs = tmp_path_factory.mktemp("standalone")
    env = dict(
        os.environ, SPARK_HOME=str(home), SPARK_LOCAL_IP="127.0.0.1",
        SPARK_MASTER_OPTS="-Dspark.master.rest.enabled=false",
    )  # fmt: skip
    master = f"spark://127.0.0.1:{port}"
    spark_class = str(home / "bin" / "spark-class")
    procs: list[subprocess.Popen] = []

    def start(name: str, *args: str) -> subprocess.Popen:
        with (logs / f"{name}.log").open("w") as out:
            procs.append(
                subprocess.Popen(
                    [spark_class, *args],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,
                )
            )
        return procs[-1]

    start("master", _DAEMON.format("master.Master"), "--host", "127.0.0.1", "--port", str(port),
          "--webui-port", "0")  # fmt: skip
    work_dirs = tuple(logs / f"work{i}" for i in range(2))

    def start_worker(log: str, work: Path) -> tuple[str, subprocess.Popen]:
        return log, start(
            log, _DAEMON.format("worker.Worker"), "--host", "127.0.0.1", "--cores", "1",
            "--memory", "2g", "--webui-port", "0", "--work-dir", str(work), master,
        )  # fmt: skip

    def registered(workers: list[tuple[str, subprocess.Popen]]) -> None:
        deadline = time.monotonic() + 90
        while not all(
            "Successfully registered with master" in (logs / f"{log}.log").read_text()
            for log, _ in workers
        ):
            if time.monotonic() > deadline or any(
                p.poll() is not None for p in (procs[0], *(w for _, w in workers))
            ):
                raise RuntimeError(f"the standalone cluster did not come up; logs in {logs}")
            time.sleep(0.2)

    def restart_worker(i: int) -> None:
        # a log of its own: the first one says "registered" already
        registered([start_worker(f"worker{i}-{len(procs)}", work_dirs[i])])

    first = [start_worker(f"worker{i}", work) for i, work in enumerate(work_dirs)]
    try:
        registered(first)
        yield Standalone(master, logs, work_dirs, restart_worker)
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


#: the modules whose tests use the standalone cluster: under `make test` (two test processes,
#: pytest-xdist) they form one unit of work, so one process runs them all and the cluster starts
#: once; every other module is a unit of its own, so a module-scoped fixture (a Terraform apply,
#: a built wheel) is made once
STANDALONE_MODULES = frozenset(
    (
        "tests/training/test_standalone.py",
        "tests/training/test_frozen_worker.py",
        "tests/training/test_lost_worker.py",
        "tests/training/test_spark_submit.py",
        "tests/training/test_run_dir_s3.py",
        "tests/bench/test_bench_distributor.py",
        "tests/ml/test_spark_ml_standalone.py",
    )
)


#: integration modules of several minutes each (clusters brought up and trained on): started
#: first, so that none of them begins late and becomes the suite's tail
LONG_MODULES = frozenset(
    (
        "tests/jobs/test_submit.py",
        "tests/jobs/test_submit_detach.py",
        "tests/cluster/test_cluster_bootstrap.py",
    )
)


#: modules that spend a minute or more mostly waiting (on the disk, the network, a mirror), not
#: computing: started before everything else, so that their wait overlaps the CPU-bound tests
#: instead of lengthening the suite's tail (test_bare_node.py: about 110 s, most of it unpacking
#: a Debian root and installing from package mirrors)
WAITING_MODULES = frozenset(("tests/cluster/test_bare_node.py",))


def _unit(nodeid: str) -> str:
    """The unit of work a test belongs to, from its id alone (the scheduler sees nothing else)."""
    path = nodeid.split("::", 1)[0]
    return "standalone" if path in STANDALONE_MODULES else path


def pytest_xdist_make_scheduler(config, log):
    """Units by module, the standalone modules together (xdist's own `loadgroup` marks do not
    reach the scheduler under pytest 9: it rewrites a private attribute that no longer sets the
    test id)."""
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False  # collection order (see below), not test counts

    class ByModule(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit(nodeid)

    return ByModule(config, log)


def pytest_collection_modifyitems(config, items) -> None:
    """A test that uses the standalone cluster outside STANDALONE_MODULES would start a second
    cluster in the other test process: refused. In each test process the units run longest first
    (the scheduler hands them out in collection order): the modules that mostly wait, the
    standalone unit, the long integration modules, the other integration modules (marked
    `integration`), then the quick tests, which fill the gaps at the end."""
    strays = sorted(
        {i.nodeid.split("::")[0] for i in items if "standalone" in i.fixturenames}
        - STANDALONE_MODULES
    )
    if strays:
        raise pytest.UsageError(f"add {', '.join(strays)} to STANDALONE_MODULES in conftest.py")
    if hasattr(config, "workerinput"):

        def rank(item) -> int:
            unit = _unit(item.nodeid)
            if unit in WAITING_MODULES:
                return 0
            if unit == "standalone":
                return 1
            if unit in LONG_MODULES:
                return 2
            return 3 if item.get_closest_marker("integration") else 4

        items.sort(key=rank)


@pytest.fixture
def sshd_nodes(tmp_path):
    """A factory of loopback SSH nodes: `sshd_nodes(3)` starts three real sshd processes on
    127.0.0.1 (own ports, config dirs and host keys, one client key; host keys pinned unless
    `pin=False`) and returns a `tests.sshd.SshNodes`; every sshd it started is stopped by PID at
    the end of the test."""
    from tests.sshd import start_nodes

    started = []

    def make(count: int = 1, *, pin: bool = True):
        group = start_nodes(tmp_path / f"nodes{len(started)}", count, pin=pin)
        started.append(group)
        return group

    yield make
    for group in started:
        group.stop()


@pytest.fixture
def moto_nodes(tmp_path, monkeypatch):
    """A factory of `tests.sshd.MotoNodes`: `moto_nodes("c1", 2)` maps cluster c1's master and
    2 workers on moto to loopback sshd nodes through `SPARKNET_NODE_ENDPOINTS` (set for this
    test and the CLI subprocesses it starts); every sshd is stopped by PID at the end of the
    test."""
    from sparknet.cluster.node_endpoints import ENDPOINTS_ENV
    from tests.sshd import MotoNodes

    made: list[MotoNodes] = []
    root = tmp_path / "moto-nodes"
    root.mkdir()
    monkeypatch.setenv(ENDPOINTS_ENV, str(root / "endpoints.json"))

    def make(cluster: str, workers: int = 0) -> MotoNodes:
        group = MotoNodes(root / cluster, cluster, workers, root / "endpoints.json")
        made.append(group)
        return group

    yield make
    for group in made:
        group.stop()
