"""The Spark session a training run uses: an embedded local one by default, or `--master`."""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from py4j.protocol import Py4JError
from pyspark import SparkContext
from pyspark.errors import PySparkException
from pyspark.sql import SparkSession

from sparknet.cluster.spark_conf import RPC_HARDENING, SECURITY, UI_HOST, UI_READ_ONLY
from sparknet.errors import SparknetError

#: Local mode retries nothing unless told to; a demanding user expects a flaky task to be retried.
LOCAL_MAX_TASK_FAILURES = 4


#: glibc hands large tensors back to the kernel after every step and faults them in again on the
#: next (~12k page faults a step, ~10% of a small CNN's step time); a worker allocates the same
#: sizes every step, so Spark's Python workers keep them (set for the executors only).
MALLOC_THRESHOLD = 1 << 30


def embedded_master(cores: int | None = None) -> str:
    return f"local[{cores or os.cpu_count() or 1},{LOCAL_MAX_TASK_FAILURES}]"


def is_local_master(master: str) -> bool:
    """`local` or `local[...]`: one JVM runs every task (`local-cluster[...]` is a cluster)."""
    return master == "local" or master.startswith("local[")


def task_cpus(master: str, workers: int) -> int:
    """Cores per task on the embedded master: all cores shared evenly, never oversubscribed."""
    if not master.startswith("local["):
        return 1
    cores = int(master[len("local[") :].split(",")[0].rstrip("]").replace("*", "0") or 0)
    cores = cores or os.cpu_count() or 1
    return max(1, cores // min(workers, cores))


def driver_memory_gb(total_bytes: int | None = None) -> int:
    """A quarter of the machine's memory, 2 to 16 GiB.

    Every update passes through the driver JVM's heap on its way back, and Spark's default 1 GiB
    does not hold two 100 MB results: the task-result thread dies of OutOfMemoryError and, in
    local mode, the job then waits forever instead of failing.
    """
    if total_bytes is None:
        total_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(2, min(16, total_bytes // 4 // 2**30))


def find_java() -> str:
    """The java binary Spark's launcher will use (JAVA_HOME first, as spark-class does)."""
    home = os.environ.get("JAVA_HOME")
    java = str(Path(home) / "bin" / "java") if home else shutil.which("java")
    if not java or not os.access(java, os.X_OK):
        where = f"JAVA_HOME={home} has no bin/java" if home else "no java on PATH"
        raise SparknetError(
            f"Spark needs Java 17+ and found {where}: install it (e.g. apt-get install -y "
            "openjdk-17-jre-headless) or point JAVA_HOME at it"
        )
    return java


#: How long a task waits for the executor holding its partition's cached block (and so its
#: inner optimizer state) while another executor is free. Spark's default (spark.locality.wait,
#: 3 s) runs it elsewhere after 3 s without a launch at that level, in the middle of a round. A
#: task whose executor dies while it runs would wait this long for the dead one: the round's job
#: is then cancelled and run again (`transport.STALL_S`).
STICKY_LOCALITY_WAIT = "24h"

#: GPU settings `--gpus-per-worker` makes (executor: N GPUs; task: one of them)
GPU_KEYS = ("spark.executor.resource.gpu.amount", "spark.task.resource.gpu.amount")


def spark_settings(
    master: str, workers: int, conf: Mapping[str, str] | None = None, gpus_per_worker: int = 0
) -> dict[str, str]:
    """Every setting sparknet gives its session: its own defaults, then the user's `conf`
    (`--conf`, the settings file's `spark:` section), which wins. A user setting that would
    break a run is refused with one line (SparknetError)."""
    conf = dict(conf or {})
    check_user_conf(master, conf, gpus_per_worker)
    memory_gb = driver_memory_gb()
    log4j = Path(__file__).with_name("log4j2.properties")
    settings = {
        "spark.app.name": "sparknet",
        "spark.pyspark.python": sys.executable,
        "spark.pyspark.driver.python": sys.executable,
        "spark.ui.showConsoleProgress": "false",
        "spark.broadcast.compress": "false",  # float weights do not compress
        "spark.driver.memory": f"{memory_gb}g",
        "spark.executorEnv.MALLOC_MMAP_THRESHOLD_": str(MALLOC_THRESHOLD),
        "spark.executorEnv.MALLOC_TRIM_THRESHOLD_": str(MALLOC_THRESHOLD),
        "spark.driver.maxResultSize": f"{memory_gb // 2}g",
        "spark.driver.extraJavaOptions": f"-Dlog4j2.configurationFile={log4j.as_uri()}",
        # a Python worker lives for the whole run: it imports torch and sparknet once (the
        # opt-in daemon, `sparknet.training.daemon`, does so once per executor; not the default:
        # see benchmarks/startup.py for why)
        "spark.python.worker.reuse": "true",
        "spark.locality.wait.process": STICKY_LOCALITY_WAIT,
        # as the cluster's daemons run: no RPC encryption that can be talked down (executors
        # get these from the driver), a UI that cannot kill
        **RPC_HARDENING,
        **UI_READ_ONLY,
    }
    if (address := driver_address(master)) and not DRIVER_ADDRESS_KEYS & conf.keys():
        settings.update(dict.fromkeys(DRIVER_ADDRESS_KEYS, address))
    elif address and "spark.driver.host" not in conf:  # the user's bindAddress alone: advertise
        # it (Spark's default host would be the JVM's SPARK_LOCAL_IP, 127.0.0.1: `_ui_on_loopback`)
        settings["spark.driver.host"] = conf["spark.driver.bindAddress"]
    if "spark.locality.wait" in conf:  # the user's wait for every level, this one included
        del settings["spark.locality.wait.process"]
    if is_local_master(master):
        settings["spark.task.cpus"] = str(task_cpus(master, workers))
    elif gpus_per_worker:
        settings.update(dict(zip(GPU_KEYS, (str(gpus_per_worker), "1"), strict=True)))
    settings.update(conf)
    return settings


#: where the driver's RPC and block manager listen, and what it tells the executors to reach
DRIVER_ADDRESS_KEYS = frozenset({"spark.driver.host", "spark.driver.bindAddress"})


def driver_address(master: str) -> str | None:
    """The address a driver of a standalone master (`spark://...`) binds and advertises, never
    a wildcard nor whatever the machine's first address is: SPARK_LOCAL_IP where it is set (a
    job's supervisor sets the node's cluster address, the one the bootstrap gave Spark), else
    the address this machine reaches the master from. None for other masters (local ones stay
    on loopback; YARN and Kubernetes choose their own)."""
    if not master.startswith("spark://"):
        return None
    if local := os.environ.get("SPARK_LOCAL_IP", "").strip():
        if local in _WILDCARDS:
            raise SparknetError(
                f"SPARK_LOCAL_IP={local} listens on every interface: set it to this node's "
                "cluster address, or unset it"
            )
        return local
    first = master[len("spark://") :].split(",")[0]
    host, _, port = first.rpartition(":")
    return _source_address(host.strip("[]") or first, int(port) if port.isdigit() else 7077)


def _source_address(host: str, port: int) -> str | None:
    """The local address the kernel sends from to `host` (a UDP connect sends nothing)."""
    try:
        family, kind, proto, _, peer = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.connect(peer)
            return str(probe.getsockname()[0])
    except (OSError, UnicodeError):
        return None  # an unknown master: Spark's own error says so


#: the cluster's Spark settings no user setting may talk down, each with what it would open
#: (sparknet sets the first group on every driver; the cluster's daemons run with all of them)
_HARDENED = {
    "spark.network.crypto.saslFallback": "anyone on the path could strip the RPC encryption",
    "spark.network.crypto.cipher": "an unauthenticated cipher lets the path rewrite RPC traffic",
    "spark.network.crypto.authEngineVersion": "the old auth engine goes with the weak cipher",
    **dict.fromkeys(UI_READ_ONLY, "anyone reaching a web UI could kill stages and the app"),
}
_CLUSTER_ONLY = dict.fromkeys(
    ("spark.authenticate", "spark.network.crypto.enabled", "spark.io.encryption.enabled"),
    "the cluster's Spark traffic or its spilled blocks would travel or sit in plaintext",
)
#: Spark settings that hold a credential (never the value in a message: the name alone)
_CREDENTIAL = re.compile(
    r"^spark\.authenticate\.secret$|\.(secret|access|session)\.(key|token)$|password$"
    r"|oauthtoken$|AWS_(SECRET_ACCESS_KEY|SESSION_TOKEN|ACCESS_KEY_ID)$",
    re.IGNORECASE,
)
#: addresses that mean every interface
_WILDCARDS = frozenset({"0.0.0.0", "::", "[::]", "0:0:0:0:0:0:0:0", "*", "0"})


def check_security_conf(master: str, conf: Mapping[str, str]) -> None:
    """Security by default with no way to talk it down: a user setting that weakens Spark's
    RPC hardening or the read-only UIs (any master), turns authentication or encryption off (a
    `spark://` cluster's), or binds the driver to every interface is refused."""
    if held := next((key for key in conf if _CREDENTIAL.search(key)), None):
        raise SparknetError(
            f"Spark setting {held} holds a credential, which the run's config.yaml (and a "
            "submitted job's settings) would keep: drop it (a cluster's Spark secret is on its "
            "nodes; AWS credentials come from the AWS chain or the instance profile)"
        )
    wanted = {**RPC_HARDENING, **UI_READ_ONLY}
    if master.startswith("spark://"):
        wanted |= {key: SECURITY[key] for key in _CLUSTER_ONLY}
    reasons = {**_HARDENED, **_CLUSTER_ONLY}
    for key, value in conf.items():
        if key in wanted and value.strip().lower() != wanted[key].lower():
            raise SparknetError(
                f"Spark setting {key}={value}: {reasons[key]}; sparknet runs {wanted[key]} and "
                "lets no setting change it: drop it"
            )
        if key in DRIVER_ADDRESS_KEYS and value.strip() in _WILDCARDS:
            raise SparknetError(
                f"Spark setting {key}={value} listens on every interface; drop it (sparknet "
                "binds the driver to the node's cluster address) or give one of this machine's "
                "addresses"
            )


def check_user_conf(master: str, conf: Mapping[str, str], gpus_per_worker: int) -> None:
    """Refuse the few Spark settings that contradict a sparknet setting, break a run or talk
    its security down."""
    check_security_conf(master, conf)
    if "spark.master" in conf:
        raise SparknetError(
            f"Spark setting spark.master={conf['spark.master']}: choose the master with --master"
        )
    if conf.get("spark.speculation", "false").strip().lower() == "true":
        raise SparknetError(
            "Spark setting spark.speculation=true: a speculative copy of a task would train on "
            "another executor without its partition's optimizer state; drop it"
        )
    if gpus_per_worker and is_local_master(master):
        raise SparknetError(
            f"--gpus-per-worker needs a cluster master (--master spark://..., yarn, k8s://...); "
            f"{master} runs every task in one process, where a task trains on cuda:0 when "
            "there is a GPU"
        )
    if "spark.task.cpus" in conf and not _positive_int(conf["spark.task.cpus"]):
        raise SparknetError(
            f"Spark setting spark.task.cpus={conf['spark.task.cpus']}: the cores each task "
            "takes must be a whole number, at least 1"
        )
    if gpus_per_worker and (given := [k for k in GPU_KEYS if k in conf]):
        raise SparknetError(
            f"--gpus-per-worker sets {given[0]}; drop one of the two (the Spark setting or "
            "--gpus-per-worker)"
        )


def _positive_int(value: str) -> bool:
    return value.strip().isdigit() and int(value) >= 1


def spark_warnings(conf: Mapping[str, str]) -> list[str]:
    """What a user setting costs that sparknet lets through: one line each."""
    out = []
    if conf.get("spark.python.worker.reuse", "true").strip().lower() == "false":
        out.append(
            "Spark setting spark.python.worker.reuse=false: every task starts a new Python "
            "worker that imports torch again (seconds per task, every round); drop it"
        )
    return out


def start_session(
    master: str | None,
    workers: int,
    conf: Mapping[str, str] | None = None,
    gpus_per_worker: int = 0,
) -> SparkSession:
    """A new SparkSession whose Python workers use this interpreter (and so see torch), with
    `spark_settings`: sparknet's defaults and the user's `conf` on top."""
    master = master or embedded_master()
    settings = spark_settings(master, workers, conf, gpus_per_worker)
    find_java()
    for line in spark_warnings(conf or {}):
        print(f"warning: {line}", file=sys.stderr, flush=True)
    # PySpark's driver picks the executors' Python from this variable, not from the conf.
    os.environ.setdefault("PYSPARK_PYTHON", settings["spark.pyspark.python"])
    builder = SparkSession.builder.master(master)
    for key, value in settings.items():
        builder = builder.config(key, value)
    if is_local_master(master) or master.startswith("local-cluster"):
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")  # everything stays on loopback
    if private := private_local_dir(settings):
        builder = builder.config("spark.local.dir", private)
    jvm_stderr = _HeldStderr()
    try:
        with _gateway_killed_on_failure(jvm_stderr):
            try:
                with _keep_sigint_handler(), _ui_on_loopback(master):
                    session = builder.getOrCreate()
            except (PySparkException, Py4JError) as exc:
                raise SparknetError(_start_failure(master, conf or {}, exc, jvm_stderr)) from exc
            session.sparkContext.setLogLevel("FATAL")  # failures reach the user as SparknetError
    except BaseException:
        if private:
            shutil.rmtree(private, ignore_errors=True)
        raise
    if private:
        _LOCAL_DIRS[session] = private
        atexit.register(shutil.rmtree, private, True)  # a session stopped without stop_quietly
    _quiet_accumulator_server(session.sparkContext)
    jvm_stderr.release(show=True)
    _JVM_STDERR[session] = jvm_stderr
    return session


#: the private local dir of each session sparknet started (`private_local_dir`), removed at stop
_LOCAL_DIRS: weakref.WeakKeyDictionary[SparkSession, str] = weakref.WeakKeyDictionary()


def private_local_dir(settings: Mapping[str, str]) -> str | None:
    """A new dir only this user may enter (0700) for the driver's Spark local dir, unless the
    user chose one (`spark.local.dir`, SPARK_LOCAL_DIRS): Spark makes its `blockmgr-*` (cached
    and spilled blocks: training data, weights) and `spark-*` (the files a job ships) with the
    umask's modes, 0755, right in /tmp, where another user of the host could read them.
    Executors of a cluster keep their worker's own dirs (SPARK_EXECUTOR_DIRS wins)."""
    if "spark.local.dir" in settings or os.environ.get("SPARK_LOCAL_DIRS", "").strip():
        return None
    return tempfile.mkdtemp(prefix="sparknet-spark-")


@contextlib.contextmanager
def _ui_on_loopback(master: str):
    """The driver's JVM of a standalone master starts with SPARK_LOCAL_IP=127.0.0.1: Spark's
    web UI binds that variable's address, else every interface (RPC and block manager bind
    `spark.driver.bindAddress`, set by `spark_settings`). This process's own variable is put
    back: it is where `driver_address` finds the node's address next time. The UI has no
    authentication: `sparknet cluster tunnel` is the way in."""
    if not master.startswith("spark://"):
        yield
        return
    before = os.environ.get("SPARK_LOCAL_IP")
    os.environ["SPARK_LOCAL_IP"] = UI_HOST
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("SPARK_LOCAL_IP", None)
        else:
            os.environ["SPARK_LOCAL_IP"] = before


def _quiet_accumulator_server(sc) -> None:
    """PySpark's accumulator server prints a traceback (socketserver's `handle_error`) when the
    JVM's connection ends in the middle of an update: a JVM killed with the CLI, by a signal to
    the whole process group (a CI job's timeout, a service manager's stop). The user gets the
    one `error: interrupted` line; any other error in the server still prints."""
    server = getattr(sc, "_accumulatorServer", None)
    if server is None:
        return
    loud = server.handle_error

    def handle_error(request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], EOFError | ConnectionError):
            loud(request, client_address)

    server.handle_error = handle_error


def _start_failure(
    master: str, conf: Mapping[str, str], exc: Exception, jvm_stderr: _HeldStderr
) -> str:
    """One line for a session that did not start: the JVM's own exception message where it gave
    one (a bad setting: Spark's launcher refuses it and exits), with the user's settings named;
    otherwise PySpark's, with the usual causes, and the JVM's held stderr shown after all."""
    java = jvm_stderr.exception_message() or _java_message(exc)
    if java is not None and "stopped SparkContext" in java:
        java = None  # the master dropped the application: see below
    yours = ", ".join(f"{k}={v}" for k, v in conf.items())
    jvm_stderr.release(show=java is None)
    if java is not None:
        settings = f" (your Spark settings: {yours})" if yours else ""
        return f"could not start Spark (master {master}): {java}{settings}"
    if isinstance(exc, Py4JError):  # the JVM started, then gave up (stopped, or gone)
        return (
            f"could not start Spark (master {master}): the session stopped while starting; "
            "check that the master is reachable from here and has a worker with free cores"
        )
    return (
        f"could not start Spark (master {master}): {_first_line(exc)}; check "
        "that Java 17+ is installed (java on PATH or JAVA_HOME) and that the master is "
        "reachable"
    )


def _first_line(exc: Exception) -> str:
    """str(exc)'s first line; a Py4J error's str asks the JVM, which may be gone."""
    try:
        text = str(exc).strip()
    except Exception:
        return type(exc).__name__
    return text.splitlines()[0] if text else type(exc).__name__


def _java_message(exc: Exception) -> str | None:
    """The message of the Java exception behind a Py4J error (e.g. SparkContext's own checks)."""
    java = getattr(exc, "java_exception", None)
    text = _first_line(java) if java is not None else ""
    first = text if text != type(java).__name__ else ""
    _, sep, message = first.partition(": ")
    return message.strip() or None if sep else None


#: the stderr forwarder of each session start_session launched (what stop_quietly mutes)
_JVM_STDERR: weakref.WeakKeyDictionary[SparkSession, _HeldStderr] = weakref.WeakKeyDictionary()


#: the first line of a Java stack trace printed outside log4j (`printStackTrace`, Scala's
#: default reporter, the JVM's uncaught-exception handler): a fully qualified exception class
_JAVA_TRACE = re.compile(
    rb'^(?:Exception in thread "[^"]*" )?'
    rb"(?:[a-z_][\w$]*\.)+[A-Z][\w$]*(?:Exception|Error)(?::|\s*$)"
)
#: the lines that go on a Java stack trace
_JAVA_TRACE_BODY = (b"\tat ", b"\t... ", b"Caused by: ", b"\tSuppressed: ", b"\t\t")


class _HeldStderr:
    """The gateway JVM's stderr, held while the session starts: a setting Spark refuses prints a
    Java stack trace there that the one-line error says already. Shown once the session is up,
    or when a failure is not explained by it. Once shown, Java stack traces are left out: with
    log4j at fatal, the only ones printed are races of a context stopping (a callback rejected
    by a pool that just ended, when the master kills the application); what failed reaches the
    user as sparknet's one line."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: list[bytes] | None = []
        self._show = True
        self._in_trace = False
        self._after_frame = False
        self.closed = threading.Event()  # the JVM closed its stderr (it exited)

    def write(self, line: bytes) -> None:
        with self._lock:
            if self._held is not None:
                self._held.append(line)
                return
            # a Python traceback's last line (`torch.OutOfMemoryError: ...`) reads like a Java
            # trace's first: it follows the traceback's frames, indented by spaces
            header = not self._after_frame and bool(_JAVA_TRACE.match(line))
            self._after_frame = line.startswith(b"  ")
            self._in_trace = header or (self._in_trace and line.startswith(_JAVA_TRACE_BODY))
            if self._in_trace:
                return
        if self._show:
            with contextlib.suppress(OSError):
                os.write(2, line)

    def exception_message(self) -> str | None:
        """`message` of an `Exception in thread "main" x.y.SomeException: message` line (a
        JVM that exited has a moment to have its last lines read)."""
        self.closed.wait(1.0)
        with self._lock:
            lines = list(self._held or [])
        for raw in lines:
            line = raw.decode(errors="replace").strip()
            if line.startswith("Exception in thread"):
                _, sep, message = line.partition("Exception: ")
                if sep and message.strip():
                    return message.strip()
        return None

    def release(self, show: bool) -> None:
        """Write what is held (if `show`), and from now on pass lines through (or drop them)."""
        with self._lock:
            held, self._held, self._show = self._held or [], None, show
        if show:
            for line in held:
                with contextlib.suppress(OSError):
                    os.write(2, line)


@contextlib.contextmanager
def _gateway_killed_on_failure(jvm_stderr: _HeldStderr):
    """Kill the JVM PySpark launches when the session does not come up (Ctrl-C or SIGTERM while
    Spark starts): PySpark only waits for it, so it would live on as an orphan holding its
    multi-GiB heap, and later print pages of NoSuchFileException for the connection file PySpark
    removed. The launch is seen by wrapping the `Popen` PySpark's gateway module calls."""
    from pyspark import java_gateway

    started: list = []
    real = java_gateway.Popen

    def popen(*args, **kwargs):
        kwargs.setdefault("stderr", subprocess.PIPE)
        proc = real(*args, **kwargs)
        started.append(proc)
        if proc.stderr is not None:
            threading.Thread(
                target=_forward_jvm_stderr, args=(proc.stderr, jvm_stderr), daemon=True
            ).start()
        return proc

    java_gateway.Popen = popen
    try:
        yield
    except BaseException:
        for proc in started:
            with contextlib.suppress(Exception):
                proc.kill()
                proc.wait(timeout=10)
        raise
    finally:
        java_gateway.Popen = real


#: what the JVM prints on every start that says nothing to a sparknet user: the module warning
#: (Spark adds the module) and Spark's note for shells, which it prints whatever log4j says
_JVM_NOISE = (
    b"WARNING: Using incubator modules: ",
    b'Setting default log level to "',
    b"To adjust logging level use sc.setLogLevel(",
)


def _forward_jvm_stderr(pipe, out: _HeldStderr) -> None:
    """Copy the gateway JVM's stderr to `out`, less `_JVM_NOISE`. It keeps reading to the end
    whatever happens to our stderr: a JVM blocked on a full pipe would hang the run."""
    for line in iter(pipe.readline, b""):
        if not line.startswith(_JVM_NOISE):
            out.write(line)
    out.closed.set()


@contextlib.contextmanager
def _keep_sigint_handler():
    """PySpark's SparkContext installs a SIGINT handler that calls into the JVM (cancelAllJobs)
    from inside whatever JVM call Ctrl-C interrupted: py4j then logs pages of reentrancy
    tracebacks. A session sparknet owns is stopped on any interrupt anyway, so the handler in
    place before (Python's KeyboardInterrupt, or the CLI's) stays."""
    main = threading.current_thread() is threading.main_thread()
    before = signal.getsignal(signal.SIGINT) if main else None
    try:
        yield
    finally:
        if main and before is not None:
            signal.signal(signal.SIGINT, before)


#: contexts sparknet stopped itself (`stop_quietly`) while they still ran
_STOPPED_HERE: weakref.WeakSet[SparkContext] = weakref.WeakSet()

#: what Spark's standalone scheduler says when the master drops the application (killed on
#: the master's UI, or failed there), in the job failures it causes
_REMOVED = re.compile(r"Master removed our application: (\w+)")


def stopped_from_outside(sc: SparkContext, exc: BaseException) -> str | None:
    """One line for a run whose Spark application was ended under it, by the master (killed
    there, or failed) or by anything else that stopped its context, not by sparknet; None
    when it still runs, or sparknet stopped it. `exc` is what the run raised (a job's
    failure, or a call into the stopped context): its text may name the master's reason.
    From then on the JVM's stderr is muted: its threads print stack traces as it stops."""
    removed = _REMOVED.search(_chain_text(exc))
    if not removed:
        if sc in _STOPPED_HERE:
            return None
        try:
            if not sc._jsc.sc().isStopped():
                return None
        except Exception:  # the JVM is gone: stopped all the same
            pass
    for session, held in list(_JVM_STDERR.items()):
        if session.sparkContext is sc:
            held.release(show=False)
    why = f"the master removed it: {removed.group(1)}" if removed else "its context stopped"
    return (
        f"Spark stopped the application while it ran ({why}): it was killed on the master or "
        "given up there; to go on from the last checkpoint, run again with --resume"
    )


def _chain_text(exc: BaseException) -> str:
    """The messages of `exc` and the exceptions behind it (a Py4J error's str asks the JVM,
    which may be gone: skipped then)."""
    parts, seen = [], set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        with contextlib.suppress(Exception):
            parts.append(str(current))
        with contextlib.suppress(Exception):
            parts.append(str(getattr(current, "java_exception", "") or ""))
        current = current.__cause__ or current.__context__
    return "\n".join(parts)


def stop_quietly(session: SparkSession) -> None:
    """Stop a session sparknet started, in one piece after an interrupt too: cancel what still
    runs, then mute the JVM's stderr, where stopping in the middle of a job prints stack traces
    (RejectedExecutionException from futures that complete after their pool shut down). The
    JVM may be gone already (SIGTERM to the process group): its py4j error must not replace
    the interrupt the user sees. The JVM's Python workers write to the same pipe: a worker whose
    task is cancelled while it sends its result prints a BrokenPipeError traceback there."""
    with contextlib.suppress(Exception):
        if not session.sparkContext._jsc.sc().isStopped():
            _STOPPED_HERE.add(session.sparkContext)
    held = _JVM_STDERR.get(session)
    if held is not None:
        held.release(show=False)
    with contextlib.suppress(Exception):
        session.sparkContext.cancelAllJobs()
        jvm = session.sparkContext._jvm
        jvm.System.setErr(jvm.java.io.PrintStream(jvm.java.io.OutputStream.nullOutputStream()))
    with contextlib.suppress(Exception):
        session.stop()
    if (private := _LOCAL_DIRS.pop(session, None)) is not None:
        shutil.rmtree(private, ignore_errors=True)


#: how long the probe job may take: it starts every executor's Python workers, which import
#: torch first under the opt-in daemon (seconds); a job no executor can run would wait forever
PROBE_LIMIT_S = 120.0


def user_modules(*specs: str | None) -> tuple[str, ...]:
    """The modules of `package.module:factory` specs (`--model`, `--data`), which the Python
    workers import too; other names are sparknet's own. The caller leaves out a `--data` that
    names a DataFrame (`parquet:PATH`, `table:NAME`) or a `datasets:` entry."""
    from sparknet.imports import is_reference

    return tuple(spec.partition(":")[0] for spec in specs if spec and is_reference(spec))


def check_python_workers(spark: SparkSession, tasks: int, modules: Sequence[str] = ()) -> None:
    """Fail before the first training job when Spark's Python workers cannot import sparknet
    (a user's session started without PYSPARK_PYTHON runs them on `python3` from PATH), or the
    user's `modules` (`user_modules`: on a cluster they resolve against the executor's
    directory, not the driver's), instead of after every task's retries."""
    sc = spark.sparkContext
    names = ("sparknet", *modules)

    def probe(_):
        # defined here, so pickled by value: unpickling it on the executors needs no sparknet
        import importlib.util
        import sys as worker_sys

        def lost(name: str) -> bool:
            try:
                return importlib.util.find_spec(name) is None
            except (ImportError, ValueError):
                return True

        return worker_sys.executable, [name for name in names if lost(name)]

    fix = (
        "set PYSPARK_PYTHON (spark-submit: spark.pyspark.python) to a Python that has sparknet, "
        f"e.g. {sys.executable}, before the SparkSession starts"
    )
    from sparknet.training.transport import wait_for_executors

    # on a cluster: once its executors are there, so the probe starts every one's Python workers
    # before round 1, rather than during it
    wait_for_executors(sc, tasks)
    try:
        found = _collect_within(sc, sc.parallelize(range(tasks), tasks).map(probe), PROBE_LIMIT_S)
    except (Py4JError, PySparkException) as exc:
        cause = _worker_failure(exc)
        raise SparknetError(f"Spark's Python workers did not start ({cause}); {fix}") from exc
    if missing := sorted({exe for exe, lost in found if "sparknet" in lost}):
        raise SparknetError(
            f"Spark's Python workers ({', '.join(missing)}) cannot import sparknet: {fix}"
        )
    if lost := sorted({name for _, names_lost in found for name in names_lost}):
        raise SparknetError(
            f"Spark's Python workers cannot import {', '.join(lost)} (your --model/--data "
            "module): ship it to every executor (--conf spark.submit.pyFiles=FILE.py or a .zip, "
            "--conf spark.executorEnv.PYTHONPATH=DIR on every worker, or install it in their "
            "Python)"
        )


def _collect_within(sc, rdd, limit_s: float) -> list:
    """`rdd.collect()`, cancelled after `limit_s` seconds with a SparknetError: a job whose
    tasks no executor can take (no GPU, too few cores) waits in Spark forever."""
    group = f"sparknet-probe-{id(rdd)}"
    out: dict = {}

    def run() -> None:
        sc.setJobGroup(group, "sparknet: Python workers", interruptOnCancel=True)
        try:
            out["rows"] = rdd.collect()
        except BaseException as exc:  # handed to the caller's thread
            out["error"] = exc

    from pyspark import InheritableThread

    thread = InheritableThread(target=run, daemon=True)
    thread.start()
    thread.join(limit_s)
    if thread.is_alive():
        sc.cancelJobGroup(group)
        thread.join(10)
        raise SparknetError(
            f"Spark's Python workers did not start in {limit_s:.0f} s: no executor took the "
            "probe's tasks (check the executors' cores, GPUs and memory against the tasks')"
        )
    if "error" in out:
        raise out["error"]
    return out["rows"]


def _worker_failure(exc: Exception) -> str:
    """Why Python workers failed: the worker's own exception line where there is one, else the
    JVM's (e.g. "EOFException occurred while reading the port number from pyspark.daemon's
    stdout" for a PYSPARK_PYTHON that is not a Python)."""
    from sparknet.training.transport import describe_task_failure

    cause = describe_task_failure(exc)
    if not cause.startswith("An error occurred while calling"):
        return cause
    for line in str(getattr(exc, "java_exception", "") or exc).splitlines():
        _, sep, message = line.partition("Exception: ")
        if sep and message.strip():
            return message.strip()
    return cause
