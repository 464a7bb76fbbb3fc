"""What a node's Spark daemons run with, as plain text and numbers.

The per-cluster secret, the `spark-defaults.conf`, the GPU discovery script, the worker's cores,
memory and local dirs, and the systemd unit. Pure functions, so they are tested without a node;
`steps.py` and `daemons.py` ship them."""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from sparknet.errors import SparknetError
from sparknet.node import files
from sparknet.spark_security import SECURITY

#: bytes of randomness in a cluster's Spark secret (hex: twice as many characters)
SECRET_BYTES = 32

#: where a node keeps everything sparknet puts there (tests give each loopback node its own)
DEFAULT_PREFIX = "/opt/sparknet"

#: Spark's own default ports; every one can be changed (tests run several clusters on one host)
MASTER_PORT = 7077
MASTER_UI_PORT = 8080
WORKER_UI_PORT = 8081


@dataclass(frozen=True)
class Ports:
    """The ports a cluster's daemons use. 0 lets the kernel choose (the worker's RPC port is
    reached only through the master, which learns it at registration)."""

    master: int = MASTER_PORT
    master_ui: int = MASTER_UI_PORT
    worker: int = 0
    worker_ui: int = WORKER_UI_PORT


def new_secret() -> str:
    """A fresh per-cluster secret for `spark.authenticate` (256 bits, hex)."""
    return secrets.token_hex(SECRET_BYTES)


def load_or_create_secret(path: Path) -> str:
    """The cluster's secret kept in `path` (mode 0600), made on first use.

    Kept, not remade, on a second bootstrap: a new secret would change spark-defaults.conf and so
    restart every daemon. The file is created 0600 in one call (O_EXCL), never readable by others
    even for a moment; a file others can read is refused rather than used."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        if path.stat().st_mode & 0o077:
            raise SparknetError(
                f"{path} (the cluster's Spark secret) is readable by others: chmod 600 {path}"
            ) from None
        secret = path.read_text().strip()
        if not re.fullmatch(r"[0-9a-f]{32,}", secret):
            raise SparknetError(
                f"{path} does not hold a Spark secret: remove it to make a new one"
            ) from None
        return secret
    secret = new_secret()
    with os.fdopen(fd, "w") as out:
        out.write(secret + "\n")
    return secret


def spark_defaults(
    secret: str, python: str, gpus: int = 0, discovery_script: str | None = None
) -> str:
    """The text of a node's `spark-defaults.conf`: read by the master and worker daemons, and by
    a driver started on the node with SPARK_CONF_DIR pointing here (so `sparknet train` on the
    master authenticates without the secret on its command line). `python` is the node's venv
    interpreter, which the executors' Python workers run."""
    settings = {
        **SECURITY,
        "spark.authenticate.secret": secret,
        "spark.pyspark.python": python,
        "spark.pyspark.driver.python": python,
    }
    if gpus:
        if not discovery_script:
            raise ValueError("a node with GPUs needs its discovery script")
        settings["spark.worker.resource.gpu.amount"] = str(gpus)
        settings["spark.worker.resource.gpu.discoveryScript"] = discovery_script
    lines = ["# written by sparknet bootstrap; holds the cluster's secret: keep it 0600"]
    lines += [f"{key} {value}" for key, value in settings.items()]
    return "\n".join(lines) + "\n"


#: Spark's GPU discovery script: the node's GPUs by index as Spark's resource JSON. A failing
#: nvidia-smi fails the script (set -e), so the worker refuses to start instead of offering none.
#: nvidia-smi is in `nvidia-utils-<branch>`, which the nvidia-driver step installs next to the
#: headless driver `ubuntu-drivers install --gpgpu` installs without it.
GPU_DISCOVERY_SCRIPT = files.script("gpus.sh")


#: memory a worker leaves to the OS, the daemons and page cache: 2 GiB plus 10% of the node
HEADROOM_FIXED_MB = 2048
HEADROOM_SHARE = 0.10
#: the master node also runs the driver (sparknet gives it a quarter of memory, 2-16 GiB)
DRIVER_SHARE = 0.25
DRIVER_MIN_MB, DRIVER_MAX_MB = 2048, 16384


def worker_memory_mb(mem_total_kb: int, runs_driver: bool) -> int:
    """What the node's worker offers to executors: MemTotal less headroom (and less the driver's
    share on the master node), at least 1 GiB."""
    total = mem_total_kb // 1024
    keep = HEADROOM_FIXED_MB + int(total * HEADROOM_SHARE)
    if runs_driver:
        keep += min(DRIVER_MAX_MB, max(DRIVER_MIN_MB, int(total * DRIVER_SHARE)))
    return max(1024, total - keep)


def mem_total_kb(meminfo: str) -> int:
    """MemTotal from /proc/meminfo, in KiB."""
    match = re.search(r"^MemTotal:\s+(\d+)\s*kB", meminfo, re.MULTILINE)
    if not match:
        raise SparknetError("the node's /proc/meminfo has no MemTotal line")
    return int(match.group(1))


#: an NVMe device's model string says whether it is instance store or an EBS volume
INSTANCE_STORE_MODEL = "Instance Storage"


def instance_store_dirs(mounts: str, nvme_models: Mapping[str, str], prefix: str) -> list[str]:
    """Spark's local dirs (shuffle, spill, cached blocks) on the node's instance store, one per
    mounted disk: NVMe devices whose model says "Instance Storage" (EBS volumes are NVMe too on
    Nitro instances, and say "Elastic Block Store"), or /mnt when it is its own mount (older
    instance types mount their ephemeral disk there). Empty when there is none: the caller uses
    `prefix`/work. `mounts` is /proc/mounts; `nvme_models` maps a device name (nvme1n1) to its
    /sys/block/<dev>/device/model."""
    out: list[str] = []
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 2:
            continue
        device, target = fields[0], fields[1].replace("\\040", " ")
        if target in ("/", "/boot", "/boot/efi") or target.startswith(prefix):
            continue
        disk = re.sub(r"p\d+$", "", device.removeprefix("/dev/"))
        on_store = INSTANCE_STORE_MODEL in nvme_models.get(disk, "")
        if on_store or (target == "/mnt" and device.startswith("/dev/")):
            out.append(f"{target.rstrip('/')}/sparknet")
    return sorted(dict.fromkeys(out))


def parse_nvme_models(text: str) -> dict[str, str]:
    """`grep -H . /sys/block/nvme*/device/model` output as {device: model}."""
    models = {}
    for line in text.splitlines():
        path, sep, model = line.partition(":")
        match = re.match(r"/sys/block/([^/]+)/device/model$", path)
        if sep and match:
            models[match.group(1)] = model.strip()
    return models


def java_major(version_text: str) -> int | None:
    """The major version in `java -version` output (`openjdk version "17.0.15"`, `"1.8.0_402"`)."""
    match = re.search(r'version "(\d+)(?:\.(\d+))?', version_text)
    if not match:
        return None
    major = int(match.group(1))
    return int(match.group(2) or 0) if major == 1 else major


#: the oldest torch the nodes may run: the allreduce rendezvous makes its TCPStore from a socket
#: it already listens on (`training/netbind.py`), which the libuv store of torch before 2.8 never
#: accepts on (every rank waits out its timeout)
TORCH_MIN = (2, 8)

#: PyTorch's wheel indexes by CUDA version, newest first (a driver runs every older toolkit): only
#: those with a torch of TORCH_MIN or newer (2.8 was built for 12.6, 12.8 and 12.9; 2.9-2.11 for
#: 12.6, 12.8 and 13.0; 2.12 on for 12.6, 13.0 and 13.2). cu124's newest torch is 2.6, cu118's 2.7.
TORCH_CUDA_BUILDS = ("13.2", "13.0", "12.9", "12.8", "12.6")
#: PyTorch's own wheel index; `<root>/cpu` and `<root>/cu<NNN>`
TORCH_INDEX_ROOT = "https://download.pytorch.org/whl"


def torch_index_url(driver_cuda: str | None) -> str:
    """The PyTorch wheel index for a node: the newest CUDA build the driver runs (`nvidia-smi`
    prints the highest CUDA version it supports), or the CPU build on a node without a GPU. A
    driver older than every build with a torch of TORCH_MIN is refused in one line."""
    if not driver_cuda:
        return f"{TORCH_INDEX_ROOT}/cpu"
    have = tuple(int(p) for p in driver_cuda.split(".")[:2])
    for build in TORCH_CUDA_BUILDS:
        if tuple(int(p) for p in build.split(".")) <= have:
            return f"{TORCH_INDEX_ROOT}/cu{build.replace('.', '')}"
    floor = ".".join(map(str, TORCH_MIN))
    raise SparknetError(
        f"the node's NVIDIA driver supports CUDA {driver_cuda}, but torch {floor} or newer (what "
        f"the allreduce rendezvous needs) is built for CUDA {TORCH_CUDA_BUILDS[-1]} and newer: "
        "use an image with a newer driver (the Deep Learning AMI's), or set bootstrap: "
        f"python_env to an env on the nodes with a torch {floor}+ that runs there"
    )


def systemd_unit(
    description: str, user: str, env: Mapping[str, str], argv: Sequence[str], stamp: str
) -> str:
    """A systemd service running one Spark daemon in the foreground (as spark-class does),
    restarted when it dies. `stamp` (a hash of what the daemon runs with) is written into the
    unit so a changed configuration reads as a changed unit, and so a restart."""
    environment = " ".join(_unit_word(f"{k}={v}", always=True) for k, v in env.items())
    exec_start = " ".join(_unit_word(w.replace("$", "$$")) for w in argv)  # $: a variable there
    return files.template(
        "daemon.service", stamp=stamp, description=description, user=user,
        environment=environment, exec_start=exec_start,
    )  # fmt: skip


def _unit_word(word: str, always: bool = False) -> str:
    """`word` as systemd splits a unit's command line and Environment=: quoted (where it holds a
    space, a quote or a backslash, or `always`), `%` doubled (a specifier otherwise), so a path
    with a space stays one word."""
    word = word.replace("%", "%%")
    if not always and word and not any(c.isspace() or c in "\\\"'" for c in word):
        return word
    return '"' + word.replace("\\", "\\\\").replace('"', '\\"') + '"'
