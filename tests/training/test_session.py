import re
from pathlib import Path

import pytest

from sparknet.errors import SparknetError
from sparknet.spark_security import RPC_HARDENING, UI_READ_ONLY
from sparknet.training import netbind, transport
from sparknet.training.probe import user_modules
from sparknet.training.session import private_local_dir
from sparknet.training.spark_settings import (
    STICKY_LOCALITY_WAIT,
    check_security_conf,
    driver_address,
    driver_memory_gb,
    embedded_master,
    spark_settings,
    spark_warnings,
    task_cpus,
)
from sparknet.training.transport import partition_threads, threads_per_task


@pytest.mark.parametrize(
    ("master", "workers", "cpus"),
    [
        ("local[2,4]", 2, 1),
        ("local[2,4]", 1, 2),
        ("local[8]", 3, 2),
        ("local[4]", 9, 1),
        ("local", 2, 1),
        ("spark://10.0.0.1:7077", 2, 1),
    ],
)
def test_tasks_share_the_cores_without_oversubscribing(master, workers, cpus):
    assert task_cpus(master, workers) == cpus


def test_embedded_master_retries_failed_tasks():
    assert embedded_master(3) == "local[3,4]"


def test_driver_heap_is_a_quarter_of_memory_within_bounds():
    assert driver_memory_gb(24 * 2**30) == 6
    assert driver_memory_gb(4 * 2**30) == 2
    assert driver_memory_gb(256 * 2**30) == 16


@pytest.mark.parametrize(
    ("cores", "tasks_there", "task_cpus", "gpus", "threads"),
    [
        (8, 2, 1, 0, 4),  # an 8-core executor running 2 tasks
        (8, 1, 1, 0, 8),
        (8, 3, 1, 0, 2),
        (1, 2, 1, 0, 1),  # the test cluster's 1-core workers
        (8, 16, 1, 0, 1),  # more tasks than cores: one thread each, never 0
        (8, 4, 4, 0, 4),  # spark.task.cpus=4: two run at once
        (32, 8, 1, 4, 8),  # 4 GPUs: four tasks at once (cores // gpus)
        (32, 2, 1, 4, 16),  # fewer tasks than GPUs
    ],
)
def test_threads_are_the_executors_cores_over_the_tasks_it_runs_at_once(
    cores, tasks_there, task_cpus, gpus, threads
):
    assert threads_per_task(cores, tasks_there, task_cpus, gpus) == threads


def test_each_partition_gets_the_share_of_the_executor_holding_it():
    placement = {0: "1", 1: "1", 2: "2", 3: "1"}
    cores = {"1": 6, "2": 4}
    assert partition_threads(4, placement, cores) == {0: 2, 1: 2, 2: 4, 3: 2}
    # partition 3 unplaced (its executor lost): an even spread's share of the smallest executor
    assert partition_threads(4, {0: "1", 1: "1", 2: "2"}, cores)[3] == 2
    assert partition_threads(4, {}, {}) == {}  # nothing known: Spark's task cpus decide


def test_user_settings_win_over_sparknets_defaults():
    settings = spark_settings("local[2]", 2, {"spark.task.cpus": "2", "spark.ui.enabled": "false"})
    assert settings["spark.task.cpus"] == "2"
    assert settings["spark.ui.enabled"] == "false"
    assert settings["spark.python.worker.reuse"] == "true"
    assert settings["spark.locality.wait.process"] == STICKY_LOCALITY_WAIT
    assert "spark.executor.resource.gpu.amount" not in settings
    # a user's spark.locality.wait covers the process level too, as it does in Spark
    settings = spark_settings("yarn", 2, {"spark.locality.wait": "1s"})
    assert "spark.locality.wait.process" not in settings


def test_gpus_per_worker_sets_one_gpu_per_task_on_a_cluster_master():
    settings = spark_settings("spark://10.0.0.1:7077", 8, gpus_per_worker=4)
    assert settings["spark.executor.resource.gpu.amount"] == "4"
    assert settings["spark.task.resource.gpu.amount"] == "1"
    assert "spark.task.cpus" not in settings  # threads come from the executors' cores


@pytest.mark.parametrize(
    ("master", "conf", "gpus", "message"),
    [
        ("local[2]", {"spark.master": "yarn"}, 0, "choose the master with --master"),
        ("yarn", {"spark.speculation": "True"}, 0, "without its partition's optimizer state"),
        ("local[4]", {}, 2, "--gpus-per-worker needs a cluster master"),
        ("yarn", {"spark.task.resource.gpu.amount": "0.5"}, 2, "drop one of the two"),
    ],
)
def test_settings_that_would_break_a_run_are_refused_in_one_line(master, conf, gpus, message):
    with pytest.raises(SparknetError, match=message) as exc:
        spark_settings(master, 2, conf, gpus)
    assert "\n" not in str(exc.value)


@pytest.mark.parametrize("value", ["abc", "0", "-1", "1.5", ""])
def test_task_cpus_that_is_not_a_whole_number_of_cores_is_refused(value):
    with pytest.raises(SparknetError, match=f"spark.task.cpus={value}: the cores each task"):
        spark_settings("spark://10.0.0.1:7077", 2, {"spark.task.cpus": value})
    assert spark_settings("yarn", 2, {"spark.task.cpus": " 2"})["spark.task.cpus"] == " 2"


def test_python_workers_not_reused_is_a_warning():
    (line,) = spark_warnings({"spark.python.worker.reuse": "False"})
    assert "imports torch again" in line
    assert spark_warnings({"spark.python.worker.reuse": "true"}) == []
    assert spark_warnings({}) == []


def test_the_workers_check_the_users_modules_not_sparknets_names():
    assert user_modules("mlp", "digits", None) == ()
    assert user_modules("pkg.nets:small", "my_data:load") == ("pkg.nets", "my_data")


class _FakeConf(dict):
    def get(self, key, default=None):
        return super().get(key, default)


class _FakeContext:
    """Just what wait_for_executors reads of a SparkContext; the executors' cores come from a
    monkeypatched `executor_cores` (a real cluster that never gets a slot takes 30 s a run)."""

    master = "spark://10.0.0.1:7077"

    def __init__(self, **conf: str) -> None:
        self.conf = _FakeConf(conf)

    def getConf(self):
        return self.conf


@pytest.fixture
def executors(monkeypatch):
    """A cluster whose executors register as the test says, against a fast clock."""
    registered: list[dict[str, int]] = []
    calls = {"n": 0}

    def cores(_sc):
        calls["n"] += 1
        return dict(registered[min(calls["n"], len(registered)) - 1]) if registered else {}

    monkeypatch.setattr(transport, "executor_cores", cores)
    monkeypatch.setattr(transport, "_seconds", lambda sc, key, default: 6.0)
    monkeypatch.setattr(transport.time, "sleep", lambda s: None)
    clock = {"t": 0.0}

    def monotonic():
        clock["t"] += 0.2
        return clock["t"]

    monkeypatch.setattr(transport.time, "monotonic", monotonic)
    return registered, calls, clock


def test_the_wait_ends_when_the_executors_stop_changing_and_happens_once(executors):
    registered, calls, clock = executors
    registered.extend([{}, {"1": 1}, {"1": 1, "2": 1}])  # then unchanged: 2 slots for 4 tasks
    sc = _FakeContext()
    assert transport.wait_for_executors(sc, 4) == {"1": 1, "2": 1}
    assert clock["t"] < transport.SETTLED_S + 2  # not the 6 s deadline
    before = calls["n"]
    assert transport.wait_for_executors(sc, 4) == {"1": 1, "2": 1}
    assert calls["n"] == before + 1  # the second caller (the anchor) does not wait again


@pytest.mark.parametrize(
    ("conf", "cores", "message"),
    [
        ({"spark.task.cpus": "2"}, {"1": 1, "2": 1}, "at most 1 core(s) and spark.task.cpus=2"),
        ({"spark.task.cpus": "2"}, {}, "needs a worker with at least 2 cores"),
        ({"spark.executor.resource.gpu.amount": "1"}, {}, "no executor with a GPU registered"),
        ({}, {}, "no executor registered in 6 s"),
    ],
)
def test_no_task_slot_after_the_wait_is_one_line_not_a_hang(executors, conf, cores, message):
    registered, _, clock = executors
    registered.append(cores)
    sc = _FakeContext(**conf)
    with pytest.raises(SparknetError, match=re.escape(message)) as exc:
        transport.wait_for_executors(sc, 2)
    assert "\n" not in str(exc.value)
    assert 6.0 < clock["t"] < 8.0  # the whole wait, once
    with pytest.raises(SparknetError, match=re.escape(message)):  # a later run: not a hang
        transport.wait_for_executors(sc, 2)


def test_user_modules_leave_out_what_is_not_a_reference():
    assert user_modules("mlp", "s3://bucket/imagenet") == ()
    assert user_modules("resnet18", "/data/shards") == ()


def test_stopping_a_session_mutes_what_its_python_workers_still_print(capfd):
    """The JVM's Python workers write to the JVM's stderr pipe: once stop_quietly starts, a
    worker's traceback (BrokenPipeError from a cancelled task) is not shown. A stand-in for
    the session: stopping one that has no JVM is quiet too, which is the point here."""
    from sparknet.training import session
    from sparknet.training.jvm_stderr import HeldStderr

    class NoJvm:
        """Every attribute stop_quietly reaches for is missing, as in a session whose JVM died."""

    held = HeldStderr()
    held.release(show=True)
    stand_in = NoJvm()
    session._JVM_STDERR[stand_in] = held
    held.write(b"round 1 shown\n")
    session.stop_quietly(stand_in)
    held.write(b"BrokenPipeError: [Errno 32] Broken pipe\n")
    err = capfd.readouterr().err
    assert err == "round 1 shown\n"


def test_a_java_trace_printed_while_the_context_stops_is_left_out(capfd):
    """When the master kills the application, the JVM's context stops before the run's Python
    side hears of it, and Scala's default reporter prints a RejectedExecutionException (a
    callback handed to a pool that just ended) with `printStackTrace`, outside log4j. Those
    lines are left out; the round lines around them and a Python worker's traceback (whose
    last line reads like a Java trace's first) stay."""
    from sparknet.training.jvm_stderr import HeldStderr

    held = HeldStderr()
    held.release(show=True)
    for line in (
        b"round 108/400  loss 0.1707\n",
        b"java.util.concurrent.RejectedExecutionException: Task scala.concurrent.impl.Promise$T"
        b"ransformation@1 rejected from java.util.concurrent.ThreadPoolExecutor@2[Terminated, "
        b"pool size = 0, active threads = 0, queued tasks = 0, completed tasks = 6]\n",
        b"\tat java.base/java.util.concurrent.ThreadPoolExecutor.reject(ThreadPoolExecutor.j"
        b"ava:833)\n",
        b"\tat org.apache.spark.rpc.netty.NettyRpcEnv.org$apache$spark$rpc$netty$NettyRpcEnv$$onFa"
        b"ilure$1(NettyRpcEnv.scala:217)\n",
        b"Caused by: java.lang.InterruptedException\n",
        b"\t... 12 more\n",
        b'Exception in thread "dispatcher-event-loop-1" java.lang.IllegalStateException: stopped\n',
        b"\tat org.apache.spark.rpc.netty.Dispatcher.postMessage(Dispatcher.scala:1)\n",
        b"round 109/400  loss 0.0485\n",
        b"Traceback (most recent call last):\n",
        b'  File "worker.py", line 1, in step\n',
        b"    loss.backward()\n",
        b"torch.OutOfMemoryError: CUDA out of memory\n",
    ):
        held.write(line)
    assert capfd.readouterr().err == (
        "round 108/400  loss 0.1707\nround 109/400  loss 0.0485\n"
        'Traceback (most recent call last):\n  File "worker.py", line 1, in step\n'
        "    loss.backward()\ntorch.OutOfMemoryError: CUDA out of memory\n"
    )


@pytest.mark.parametrize("master", ["local[2]", "spark://127.0.0.1:7077", "yarn"])
def test_every_driver_keeps_rpc_encryption_from_being_talked_down_and_its_ui_from_killing(master):
    """As the cluster's daemons run (spark-defaults.conf): the executors get these from the
    driver, so a driver without them would leave its executors open to the downgrade."""
    settings = spark_settings(master, 2)
    assert {k: settings[k] for k in (*RPC_HARDENING, *UI_READ_ONLY)} == {
        "spark.network.crypto.saslFallback": "false",
        "spark.network.crypto.cipher": "AES/GCM/NoPadding",
        "spark.network.crypto.authEngineVersion": "2",
        "spark.ui.killEnabled": "false",
    }


def test_a_standalone_driver_binds_the_address_it_reaches_the_master_from(monkeypatch):
    """Never whatever the machine's first address is: SPARK_LOCAL_IP where set (a job's
    supervisor gives the node's cluster address), else the address the route to the master
    leaves from; a user's own setting wins; local masters stay as they were."""
    monkeypatch.delenv("SPARK_LOCAL_IP", raising=False)
    keys = ("spark.driver.host", "spark.driver.bindAddress")

    def bound(master: str, conf: dict | None = None) -> list:
        settings = spark_settings(master, 2, conf)
        return [settings.get(k) for k in keys]

    assert bound("spark://127.0.0.2:7077") == ["127.0.0.1", "127.0.0.1"]  # loopback's source
    others = [str(ip) for _, ip in netbind._ipv4_interfaces() if not ip.is_loopback]
    for address in others[:1]:  # this machine's own address: the route leaves from it
        assert bound(f"spark://{address}:7077") == [address, address]
    assert driver_address("spark://no-such-host.invalid:7077") is None  # Spark's error says so
    monkeypatch.setenv("SPARK_LOCAL_IP", "127.0.0.3")
    assert bound("spark://127.0.0.2:7077,127.0.0.4:7077") == ["127.0.0.3", "127.0.0.3"]
    assert bound("spark://127.0.0.2:7077", {"spark.driver.host": "h"}) == ["h", None]
    # a bindAddress alone is what the driver advertises too (the JVM's own default host would
    # be loopback: it starts with SPARK_LOCAL_IP=127.0.0.1 for its UI)
    given = {"spark.driver.bindAddress": "10.0.0.7"}
    assert bound("spark://127.0.0.2:7077", given) == ["10.0.0.7", "10.0.0.7"]
    assert bound("local[2]") == bound("yarn") == [None, None]


class _StoppableContext:
    """Just what `stopped_from_outside` asks a SparkContext: whether it is stopped."""

    def __init__(self, stopped: bool) -> None:
        self._jsc = self
        self.stopped = stopped

    def sc(self):
        return self

    def isStopped(self) -> bool:
        return self.stopped


def test_an_application_ended_from_outside_is_one_line_naming_why():
    from sparknet.training import session

    killed = RuntimeError("Job aborted: Master removed our application: KILLED")
    line = str(session.stopped_from_outside(_StoppableContext(stopped=False), _wrapped(killed)))
    assert line.startswith("Spark stopped the application while it ran (the master removed it")
    assert "--resume" in line
    assert session.stopped_from_outside(_StoppableContext(stopped=False), RuntimeError("x")) is None
    assert "its context stopped" in str(
        session.stopped_from_outside(_StoppableContext(stopped=True), RuntimeError("x"))
    )
    ours = _StoppableContext(stopped=True)
    session._STOPPED_HERE.add(ours)  # sparknet stopped it (an interrupt, a failed stage)
    assert session.stopped_from_outside(ours, RuntimeError("x")) is None


def _wrapped(cause: BaseException) -> SparknetError:
    try:
        raise SparknetError("a Spark task failed after all retries") from cause
    except SparknetError as exc:
        return exc


@pytest.mark.parametrize(
    ("master", "key", "value"),
    [
        ("spark://10.0.0.1:7077", "spark.network.crypto.saslFallback", "true"),
        ("local[2]", "spark.network.crypto.saslFallback", "True"),
        ("yarn", "spark.network.crypto.cipher", "AES/CTR/NoPadding"),
        ("spark://10.0.0.1:7077", "spark.network.crypto.authEngineVersion", "1"),
        ("spark://10.0.0.1:7077", "spark.ui.killEnabled", "true"),
        ("spark://10.0.0.1:7077", "spark.authenticate", "false"),
        ("spark://10.0.0.1:7077", "spark.network.crypto.enabled", "false"),
        ("spark://10.0.0.1:7077", "spark.io.encryption.enabled", "false"),
        ("spark://10.0.0.1:7077", "spark.driver.bindAddress", "0.0.0.0"),
        ("spark://10.0.0.1:7077", "spark.driver.host", "::"),
        ("local[2]", "spark.driver.bindAddress", "0.0.0.0"),
    ],
)
def test_no_user_setting_talks_the_security_down(monkeypatch, master, key, value):
    """`--conf`, the settings file's `spark:` section and a resumed run's settings all reach
    `spark_settings` (and `driver.prepare`, which `sparknet-submit` runs before launching):
    a setting that would undo the hardening is one line naming it, never applied."""
    monkeypatch.delenv("SPARK_LOCAL_IP", raising=False)
    with pytest.raises(SparknetError, match=f"^Spark setting {re.escape(key)}={re.escape(value)}"):
        spark_settings(master, 2, {key: value})
    with pytest.raises(SparknetError) as exc:
        check_security_conf(master, {key: value})
    assert "\n" not in str(exc.value) and "drop it" in str(exc.value)
    # the same values as sparknet's own pass (spelt in any case); a user's own address too
    same = {**RPC_HARDENING, **UI_READ_ONLY, "spark.authenticate": "TRUE"}
    assert spark_settings(master, 2, {k: v.lower() for k, v in same.items()})
    assert spark_settings(master, 2, {"spark.driver.bindAddress": "10.0.0.7"})


def test_security_settings_a_local_or_yarn_master_leaves_to_spark_are_not_refused():
    """Authentication and encryption are the `spark://` cluster's (its daemons need them);
    a local or YARN driver never had them from sparknet."""
    for master in ("local[2]", "yarn"):
        assert spark_settings(master, 2, {"spark.authenticate": "false"})
        assert spark_settings(master, 2, {"spark.io.encryption.enabled": "false"})


def test_spark_local_ip_of_every_interface_is_refused(monkeypatch):
    monkeypatch.setenv("SPARK_LOCAL_IP", "0.0.0.0")
    with pytest.raises(SparknetError, match=r"^SPARK_LOCAL_IP=0\.0\.0\.0 listens on every"):
        spark_settings("spark://10.0.0.1:7077", 2)


def test_the_driver_gets_a_private_local_dir_unless_the_user_chose_one(monkeypatch):
    monkeypatch.delenv("SPARK_LOCAL_DIRS", raising=False)
    made = private_local_dir({"spark.app.name": "sparknet"})
    try:
        assert made and Path(made).stat().st_mode & 0o777 == 0o700
    finally:
        Path(made).rmdir()
    assert private_local_dir({"spark.local.dir": "/scratch"}) is None
    monkeypatch.setenv("SPARK_LOCAL_DIRS", "/scratch")
    assert private_local_dir({}) is None


@pytest.mark.parametrize(
    "key",
    [
        "spark.authenticate.secret",
        "spark.hadoop.fs.s3a.secret.key",
        "spark.hadoop.fs.s3a.access.key",
        "spark.hadoop.fs.s3a.session.token",
        "spark.executorEnv.AWS_SECRET_ACCESS_KEY",
        "spark.ssl.keyStorePassword",
    ],
)
def test_a_credential_in_a_spark_setting_is_refused_without_echoing_it(key):
    """`--conf` and `spark:` settings are recorded in the run's config.yaml (on S3 too)."""
    with pytest.raises(SparknetError, match=f"^Spark setting {re.escape(key)} holds a credential"):
        spark_settings("spark://10.0.0.1:7077", 2, {key: "Zm9vYmFyc2VjcmV0"})
    with pytest.raises(SparknetError) as exc:
        check_security_conf("local[2]", {key: "Zm9vYmFyc2VjcmV0"})
    assert "Zm9vYmFyc2VjcmV0" not in str(exc.value)
    for fine in ("spark.authenticate.secret.file", "spark.hadoop.fs.s3a.aws.credentials.provider"):
        assert spark_settings("spark://10.0.0.1:7077", 2, {fine: "x"})[fine] == "x"
