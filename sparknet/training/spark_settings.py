"""The Spark settings a run's session gets, and the checks on the user's own.

Kept apart from `session`, which starts and stops the JVM and holds its process state: these are
plain functions of the master and the settings, checked before any Spark starts (the CLI,
`sparknet-submit`'s pre-launch check) and asked of a master by the transports
(`is_local_master`), none of which needs a session.
"""

from __future__ import annotations

import os
import re
import socket
import sys
from collections.abc import Mapping
from pathlib import Path

from sparknet.errors import Placeholder, SettingError, SparknetError
from sparknet.spark_security import RPC_HARDENING, SECURITY, UI_READ_ONLY

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
        # see `sparknet bench startup` for why)
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
        raise SettingError(
            "Spark setting spark.master={value}: choose the master with {@master}",
            setting="spark_conf",
            value=conf["spark.master"],
        )
    if conf.get("spark.speculation", "false").strip().lower() == "true":
        raise SparknetError(
            "Spark setting spark.speculation=true: a speculative copy of a task would train on "
            "another executor without its partition's optimizer state; drop it"
        )
    if gpus_per_worker and is_local_master(master):
        raise SettingError(
            "{@gpus_per_worker} needs a cluster master ({@master=cluster}, yarn, k8s://...); "
            "{master} runs every task in one process, where a task trains on cuda:0 when there "
            "is a GPU",
            setting="gpus_per_worker", value=gpus_per_worker, master=master,
            cluster=Placeholder("spark://..."),
        )  # fmt: skip
    if "spark.task.cpus" in conf and not _positive_int(conf["spark.task.cpus"]):
        raise SparknetError(
            f"Spark setting spark.task.cpus={conf['spark.task.cpus']}: the cores each task "
            "takes must be a whole number, at least 1"
        )
    if gpus_per_worker and (given := [k for k in GPU_KEYS if k in conf]):
        raise SettingError(
            "{@gpus_per_worker} sets {key}; drop one of the two (the Spark setting or "
            "{@gpus_per_worker})",
            setting="gpus_per_worker",
            value=gpus_per_worker,
            key=given[0],
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
