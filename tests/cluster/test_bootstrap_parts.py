"""The bootstrap's pure parts (spark-defaults, the secret file, the GPU discovery script, worker
sizes, local dirs, the systemd unit, the health verdict) and its step runner, run locally
through `invoke.Context` (the same `run` as a Fabric Connection)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import invoke
import pytest
from packaging.specifiers import SpecifierSet

from sparknet.cluster.address import Endpoint
from sparknet.cluster.remote import q, succeeds, upload
from sparknet.cluster.spark import bootstrap as b
from sparknet.cluster.spark import spark_conf as sc
from sparknet.cluster.spark.daemons import MASTER_CLASS, UNIT_SCRIPT, WORKER_CLASS, Master, Worker
from sparknet.cluster.spark.health import (
    ClusterHealth,
    Expected,
    WorkerState,
    judge,
    master_json,
)
from sparknet.cluster.spark.plan import (
    FACTS_SCRIPT,
    PIP_NETWORK,
    AmiEnv,
    Context,
    Facts,
    Node,
    Plan,
    parse_facts,
    python_problem,
    python_version,
)
from sparknet.cluster.spark.steps import PYTHON_FIX, TORCH_FITS, NodePython, Step
from sparknet.cluster.spark.wheel import Wheel
from sparknet.cluster.spec import BootstrapSettings
from sparknet.errors import SparknetError
from sparknet.node import files

# --- the GPU discovery script ---------------------------------------------------------------


def fake_nvidia_smi(bin_dir: Path, output: str, code: int = 0) -> None:
    """An `nvidia-smi` that answers only the query the script makes. There is no GPU on this
    machine: the real one cannot run here, so this stands in for it on PATH."""
    bin_dir.mkdir(exist_ok=True)
    tool = bin_dir / "nvidia-smi"
    tool.write_text(
        "#!/bin/sh\n"
        '[ "$*" = "--query-gpu=index --format=csv,noheader" ] || { echo "bad args: $*" >&2; '
        "exit 64; }\n"
        f"printf '{output}'\nexit {code}\n"
    )
    tool.chmod(0o755)


def discover(tmp_path: Path) -> subprocess.CompletedProcess:
    script = tmp_path / "gpus.sh"
    script.write_text(sc.GPU_DISCOVERY_SCRIPT)
    script.chmod(0o700)
    env = dict(os.environ, PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    return subprocess.run([str(script)], env=env, capture_output=True, text=True, timeout=10)


def test_gpu_discovery_prints_sparks_resource_json_from_nvidia_smi(tmp_path) -> None:
    fake_nvidia_smi(tmp_path / "bin", "0\\n1\\n2\\n3\\n")
    done = discover(tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"name": "gpu", "addresses": ["0", "1", "2", "3"]}


def test_gpu_discovery_of_one_gpu(tmp_path) -> None:
    fake_nvidia_smi(tmp_path / "bin", "0\\n")
    assert json.loads(discover(tmp_path).stdout) == {"name": "gpu", "addresses": ["0"]}


def test_gpu_discovery_fails_when_nvidia_smi_fails(tmp_path) -> None:
    """A worker whose script fails refuses to start, rather than offering no GPUs."""
    fake_nvidia_smi(tmp_path / "bin", "NVIDIA-SMI has failed\\n", code=9)
    done = discover(tmp_path)
    assert done.returncode != 0
    assert "addresses" not in done.stdout


# --- spark-defaults and the secret -----------------------------------------------------------


def settings(text: str) -> dict[str, str]:
    return dict(line.split(" ", 1) for line in text.splitlines() if not line.startswith("#"))


def test_spark_defaults_turn_on_auth_and_encryption_and_turn_off_rest() -> None:
    """Encryption nobody on the path can talk down (no SASL fallback, an authenticated cipher,
    auth engine v2), and UIs that cannot kill."""
    got = settings(sc.spark_defaults("s3cret", "/opt/sparknet/venv/bin/python"))
    assert got == {
        "spark.authenticate": "true",
        "spark.network.crypto.enabled": "true",
        "spark.network.crypto.saslFallback": "false",
        "spark.network.crypto.cipher": "AES/GCM/NoPadding",
        "spark.network.crypto.authEngineVersion": "2",
        "spark.io.encryption.enabled": "true",
        "spark.master.rest.enabled": "false",
        "spark.ui.killEnabled": "false",
        "spark.authenticate.secret": "s3cret",
        "spark.pyspark.python": "/opt/sparknet/venv/bin/python",
        "spark.pyspark.driver.python": "/opt/sparknet/venv/bin/python",
    }


def test_spark_defaults_of_a_gpu_node_offer_its_gpus_through_the_script() -> None:
    got = settings(sc.spark_defaults("s", "/p", gpus=4, discovery_script="/opt/c/gpus.sh"))
    assert got["spark.worker.resource.gpu.amount"] == "4"
    assert got["spark.worker.resource.gpu.discoveryScript"] == "/opt/c/gpus.sh"
    assert "spark.worker.resource.gpu.amount" not in settings(sc.spark_defaults("s", "/p"))


def test_the_secret_file_is_made_0600_once_and_kept(tmp_path) -> None:
    path = tmp_path / "reg" / "spark-secret"
    first = sc.load_or_create_secret(path)
    assert len(first) == 2 * sc.SECRET_BYTES and int(first, 16) >= 0
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sc.load_or_create_secret(path) == first
    assert sc.load_or_create_secret(tmp_path / "other") != first


def test_a_secret_file_others_can_read_is_refused(tmp_path) -> None:
    path = tmp_path / "spark-secret"
    path.write_text("ab" * 32)
    path.chmod(0o644)
    with pytest.raises(SparknetError, match=r"readable by others: chmod 600 "):
        sc.load_or_create_secret(path)


def test_the_plan_never_shows_the_secret() -> None:
    plan = Plan((Node(Endpoint("master", "h")),), Wheel(Path("w"), "1", "d"), "s3cret-x")
    assert "s3cret-x" not in repr(plan)


# --- sizes, dirs, versions -------------------------------------------------------------------


def test_worker_memory_leaves_headroom_and_the_drivers_share_on_the_master() -> None:
    kb = 16 * 1024 * 1024  # 16 GiB
    assert sc.worker_memory_mb(kb, runs_driver=False) == 16384 - 2048 - 1638
    assert sc.worker_memory_mb(kb, runs_driver=True) == 16384 - 2048 - 1638 - 4096
    assert sc.worker_memory_mb(2 * 1024 * 1024, runs_driver=True) == 1024  # floor


def test_mem_total_from_meminfo() -> None:
    assert sc.mem_total_kb("MemTotal:       32594124 kB\nMemFree: 1 kB\n") == 32594124
    with pytest.raises(SparknetError):
        sc.mem_total_kb("nothing")


MOUNTS = """\
/dev/nvme0n1p1 / ext4 rw 0 0
/dev/nvme0n1p15 /boot/efi vfat rw 0 0
/dev/nvme1n1 /opt/dlami/nvme ext4 rw 0 0
/dev/nvme2n1 /data ext4 rw 0 0
tmpfs /run tmpfs rw 0 0
"""
MODELS = """\
/sys/block/nvme0n1/device/model:Amazon Elastic Block Store
/sys/block/nvme1n1/device/model:Amazon EC2 NVMe Instance Storage
/sys/block/nvme2n1/device/model:Amazon Elastic Block Store
"""


def test_local_dirs_go_on_instance_store_not_on_ebs() -> None:
    models = sc.parse_nvme_models(MODELS)
    assert models["nvme1n1"] == "Amazon EC2 NVMe Instance Storage"
    assert sc.instance_store_dirs(MOUNTS, models, "/opt/sparknet") == ["/opt/dlami/nvme/sparknet"]
    assert sc.instance_store_dirs("/dev/xvdb /mnt ext4 rw 0 0\n", {}, "/opt/sparknet") == [
        "/mnt/sparknet"
    ]
    assert sc.instance_store_dirs(MOUNTS, {}, "/opt/sparknet") == []  # no instance store


@pytest.mark.parametrize(
    ("text", "major"),
    [
        ('openjdk version "17.0.15" 2025-04-15', 17),
        ('openjdk version "21" 2023-09-19', 21),
        ('java version "1.8.0_402"', 8),
        ("bash: java: command not found", None),
    ],
)
def test_java_major(text, major) -> None:
    assert sc.java_major(text) == major


def test_torch_index_follows_the_drivers_cuda() -> None:
    assert sc.torch_index_url(None).endswith("/whl/cpu")
    assert sc.torch_index_url("12.6").endswith("/whl/cu126")
    assert sc.torch_index_url("12.7").endswith("/whl/cu126")
    assert sc.torch_index_url("12.8").endswith("/whl/cu128")
    assert sc.torch_index_url("13.1").endswith("/whl/cu130")
    assert sc.torch_index_url("13.3").endswith("/whl/cu132")


@pytest.mark.parametrize("cuda", ["11.2", "12.2", "12.4", "12.5"])
def test_a_driver_whose_cuda_has_no_torch_2_8_is_refused_in_one_line(cuda) -> None:
    """cu124's newest torch is 2.6, cu121's 2.5, cu118's 2.7: all older than the rendezvous
    needs, so a driver below CUDA 12.6 gets no index."""
    with pytest.raises(SparknetError) as caught:
        sc.torch_index_url(cuda)
    assert str(caught.value) == (
        f"the node's NVIDIA driver supports CUDA {cuda}, but torch 2.8 or newer (what the "
        "allreduce rendezvous needs) is built for CUDA 12.6 and newer: use an image with a "
        "newer driver (the Deep Learning AMI's), or set bootstrap: python_env to an env on the "
        "nodes with a torch 2.8+ that runs there"
    )


def test_torch_older_than_2_8_does_not_fit(tmp_path) -> None:
    """The fits check reads torch's version from its metadata: a 2.7 one (a dist-info ahead of
    the real torch on the path) fails with its line; the env's own (2.8 or newer) passes."""
    fake = tmp_path / "torch-2.7.1+cu126.dist-info"
    fake.mkdir()
    (fake / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.7.1+cu126\n")
    code = [sys.executable, "-c", files.script(TORCH_FITS), "2.8", "--quick"]
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    old = subprocess.run(code, env=env, capture_output=True, text=True, timeout=60)
    assert old.returncode == 1
    assert old.stderr.strip() == (
        "torch 2.7.1+cu126 is older than 2.8, which the allreduce rendezvous needs"
    )
    assert subprocess.run(code, capture_output=True, timeout=60).returncode == 0


def test_systemd_unit_runs_the_daemon_with_its_env_and_stamp() -> None:
    unit = sc.systemd_unit(
        "sparknet Spark master", "ubuntu", {"SPARK_HOME": "/v/pyspark"},
        ["/v/pyspark/bin/spark-class", MASTER_CLASS, "--host", "10.0.0.5"], "abc123",
    )  # fmt: skip
    lines = unit.splitlines()
    assert lines[0] == "# written by sparknet bootstrap; stamp abc123"
    assert "User=ubuntu" in lines
    assert 'Environment="SPARK_HOME=/v/pyspark"' in lines
    assert f"ExecStart=/v/pyspark/bin/spark-class {MASTER_CLASS} --host 10.0.0.5" in lines
    assert "Restart=on-failure" in lines


def test_a_unit_keeps_each_word_whole_whatever_the_path() -> None:
    """A prefix with a space, a quote, `%` or `$` stays one word of ExecStart and of
    Environment= as systemd splits them (quotes, backslash escapes; `%%` and `$$` for the
    literal characters, which systemd would otherwise expand)."""
    import shlex

    prefix = '/srv/my nodes/100% "$HOME"'
    argv = [f"{prefix}/bin/spark-class", MASTER_CLASS, "--host", "10.0.0.5"]
    unit = sc.systemd_unit("m", "ubuntu", {"SPARK_HOME": prefix}, argv, "s").splitlines()
    (exec_start,) = [ln.removeprefix("ExecStart=") for ln in unit if ln.startswith("ExecStart=")]
    (env,) = [ln.removeprefix("Environment=") for ln in unit if ln.startswith("Environment=")]
    assert shlex.split(exec_start.replace("%%", "%").replace("$$", "$")) == argv
    assert shlex.split(env.replace("%%", "%")) == [f"SPARK_HOME={prefix}"]


FACTS = """@user
ubuntu
@uid
1000
@nproc
8
@meminfo
MemTotal:       32594124 kB
@systemd
yes
@mounts
{mounts}@nvme
{models}@envs
/opt/pytorch 3.12.3 2.9.1+cu128
/opt/conda/envs/pytorch
@python
Python 3.12.3
"""


def test_facts_from_one_command() -> None:
    facts = parse_facts(FACTS.format(mounts=MOUNTS, models=MODELS), "/opt/sparknet")
    assert facts == Facts(
        "ubuntu", 1000, 8, 32594124, True, ("/opt/dlami/nvme/sparknet",),
        (AmiEnv("/opt/pytorch", "3.12.3", "2.9.1+cu128"), AmiEnv("/opt/conda/envs/pytorch")),
        "3.12.3",
    )  # fmt: skip


def test_the_env_probe_reads_an_envs_python_and_torch_without_importing_it(tmp_path) -> None:
    """What the facts script runs in each AMI env, run here with the repo's venv as one."""
    python = tmp_path / "env" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    out = subprocess.run(
        ["sh", "-s", "--", str(tmp_path / "env"), str(tmp_path / "none")],
        input=files.script(FACTS_SCRIPT), capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert out.split("@envs\n")[1].split("@python")[0].split() == [
        str(tmp_path / "env"),
        ".".join(map(str, sys.version_info[:3])),
        importlib.metadata.version("torch"),
    ]


@pytest.mark.parametrize(
    ("text", "version"),
    [
        ("Python 3.10.12", "3.10.12"),
        ("Python 3.13.0rc1", "3.13.0"),
        ("bash: line 1: python3: command not found", None),
        ("", None),
    ],
)
def test_the_nodes_python_version(text, version) -> None:
    assert python_version(text) == version


def test_a_python_is_judged_against_what_the_node_installs() -> None:
    needs = {"pyspark 4.3.0": SpecifierSet(">=3.11"), "sparknet 0.1.0": SpecifierSet(">=3.11")}
    assert python_problem("python3", "3.12.3", needs) is None
    assert python_problem("python3", "3.10.12", needs) == (
        "python3 is Python 3.10.12, but pyspark 4.3.0 needs Python >=3.11 and sparknet 0.1.0 "
        "needs Python >=3.11"
    )
    assert python_problem("/opt/env/bin/python", None, needs) == (
        "the node has no /opt/env/bin/python, and pyspark 4.3.0 needs Python >=3.11 and "
        "sparknet 0.1.0 needs Python >=3.11"
    )
    # the submitter's pyspark says what it needs (the node installs the same release)
    plan = Plan((Node(Endpoint("m", "h")),), Wheel(Path("w.whl"), "1", "d"), "s")
    needed = importlib.metadata.metadata("pyspark")["Requires-Python"]
    assert plan.python_needs() == {f"pyspark {plan.pyspark_version}": SpecifierSet(needed)}


def index_flags(index: str, **kw) -> str:
    node = Node(Endpoint("m", "h"))
    plan = Plan((node,), Wheel(Path("w.whl"), "1", "d"), "s", package_index=index)
    return Context(plan, node, Facts("u", 1000, 1, 1 << 22, False, ())).index_flags(**kw)


def test_the_package_index_setting_says_where_pip_looks() -> None:
    """`pytorch` (the default): torch from PyTorch's index for the driver's CUDA, the rest from
    the node's pip configuration; `node`: everything from it; a URL: everything from that."""
    assert index_flags("pytorch") == ""
    assert index_flags("pytorch", torch=True) == "--index-url https://download.pytorch.org/whl/cpu"
    assert index_flags("pytorch", torch=True, torch_for_cuda="12.9") == (
        "--index-url https://download.pytorch.org/whl/cu129"
    )
    assert index_flags("node") == index_flags("node", torch=True) == ""
    url = "https://pypi.corp.example/simple"
    assert (
        index_flags(url)
        == index_flags(url, torch=True, torch_for_cuda="12.9")
        == (f"--index-url {url}")
    )
    assert BootstrapSettings().package_index == "pytorch"
    for bad in ("pypi", "pypi.corp.example/simple", "https://a b", "ftp://m/simple"):
        with pytest.raises(ValueError, match="give pytorch, node, or an index URL"):
            BootstrapSettings(package_index=bad)


def test_the_nodes_pip_gives_up_on_a_silent_index_soon_but_retries_a_failed_download(
    tmp_path,
) -> None:
    """pip's own default is 5 retries of 15 s per request: minutes before it says anything. The
    20 s timeout bounds that (it is a read timeout: a flowing download never hits it); the
    retries stay 3, so two 5xx in a row do not fail a multi-GB torch download."""
    node = Node(Endpoint("m", "h"), prefix=str(tmp_path))
    plan = Plan((node,), Wheel(Path("w.whl"), "1", "d"), "s", package_index="node")
    ctx = Context(plan, node, Facts("u", 1000, 1, 1 << 22, False, ()))
    pip = ctx.pip_install(invoke.Context())
    want = f"{tmp_path}/venv/bin/python -m pip install -q --disable-pip-version-check"
    assert pip == f"{want} {PIP_NETWORK}"
    # an index is an option of `install`: pip refuses it before the command
    url = Plan((node,), plan.wheel, "s", package_index="https://mirror.example/simple")
    with_url = Context(url, node, ctx.facts).pip_install(invoke.Context())
    assert with_url == f"{want} {PIP_NETWORK} --index-url https://mirror.example/simple"
    # and a real pip takes that command line (`--help` ends it once every option is parsed)
    real = with_url.replace(f"{tmp_path}/venv/bin/python", sys.executable)
    done = subprocess.run(f"{real} --help", shell=True, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert PIP_NETWORK == "--retries 3 --timeout 20"


def test_the_venv_is_laid_over_the_plans_env_else_the_amis() -> None:
    node = Node(Endpoint("master", "h"))
    wheel = Wheel(Path("w.whl"), "1", "d")
    ami = Facts("ubuntu", 1000, 8, 1 << 24, True, (), (AmiEnv("/opt/pytorch", "3.12.3", "2.8.0"),))
    bare = Facts("ubuntu", 1000, 8, 1 << 24, True, ())
    assert Context(Plan((node,), wheel, "s"), node, ami).base_env == "/opt/pytorch"
    assert Context(Plan((node,), wheel, "s"), node, bare).base_env is None
    given = Plan((node,), wheel, "s", python_env="/srv/env/")
    assert Context(given, node, ami).base_env == "/srv/env"
    # an AMI env whose torch is too old (or missing) is passed over for the next, else python3
    old = AmiEnv("/opt/pytorch", "3.11.9", "2.3.1+cu121")
    fits = AmiEnv("/opt/conda/envs/pytorch", "3.12.3", "2.10.0")
    two = Facts("ubuntu", 1000, 8, 1 << 24, True, (), (old, fits))
    assert Context(Plan((node,), wheel, "s"), node, two).base_env == "/opt/conda/envs/pytorch"
    for only in (old, AmiEnv("/opt/pytorch", "3.12.3"), AmiEnv("/opt/pytorch")):
        facts = Facts("ubuntu", 1000, 8, 1 << 24, True, (), (only,))
        assert Context(Plan((node,), wheel, "s"), node, facts).base_env is None


def node_python(envs: tuple[AmiEnv, ...], python3: str, **plan) -> tuple[str | None, str]:
    """NodePython's verdict on a node with `envs` and a `python3` of version `python3`, and the
    part of it that names what the node installs (`python_problem`'s words for 3.10)."""
    node = Node(Endpoint("master", "h"))
    p = Plan((node,), Wheel(Path("w.whl"), "1", "d"), "s", **plan)
    facts = Facts("ubuntu", 1000, 8, 1 << 24, True, (), envs, python3)
    needs = python_problem("python3", "3.10.12", p.python_needs())
    # the AMI envs' Pythons are facts: no command runs on the node (a stand-in that refuses)
    return NodePython(Context(p, node, facts)).problem(None), needs  # type: ignore[arg-type]


def test_the_python_checked_first_is_the_one_the_venv_will_be_made_from() -> None:
    """A 22.04 PyTorch AMI: its env has Python 3.11 but torch 2.3, so the venv is made from
    python3, which is 3.10: refused, naming the env passed over and why."""
    old = AmiEnv("/opt/pytorch", "3.11.9", "2.3.1+cu121")
    problem, needs = node_python((old,), "3.10.12")
    assert problem == (
        "the image's env /opt/pytorch has torch 2.3.1+cu121 (sparknet needs 2.8+), so the venv is "
        f"made from python3, and {needs}"
    )
    assert needs.startswith("python3 is Python 3.10.12, but pyspark ")
    none = AmiEnv("/opt/conda/envs/pytorch", "3.12.3")
    assert node_python((none,), "3.10.12")[0] == (
        "the image's env /opt/conda/envs/pytorch has no torch (sparknet needs 2.8+), so the venv "
        f"is made from python3, and {needs}"
    )
    # the reverse: the env's Python is 3.10, but its torch is too old, so it is not used, and
    # python3 (3.12) makes the venv: accepted
    assert node_python((AmiEnv("/opt/pytorch", "3.10.12", "2.3.1"),), "3.12.3")[0] is None
    # an env whose torch fits is used: its own Python is what must fit, whatever python3 is
    fits_old_python = AmiEnv("/opt/pytorch", "3.10.12", "2.8.0")
    refused = node_python((fits_old_python,), "3.12.3")[0]
    assert refused == needs.replace("python3 is", "/opt/pytorch/bin/python is")
    assert node_python((AmiEnv("/opt/pytorch", "3.12.3", "2.8.0"),), "3.10.12")[0] is None
    # with nothing passed over the words are python_problem's alone
    assert node_python((), "3.10.12")[0] == needs
    assert PYTHON_FIX.endswith("with one and torch 2.8+")


# --- the runner, locally ----------------------------------------------------------------------


class Touch(Step):
    """Done when its file exists; applying makes it."""

    def __init__(self, name: str, path: Path) -> None:
        self.name, self.path = name, path

    def check(self, conn) -> bool:
        return succeeds(conn, f"test -e {q(str(self.path))}")

    def apply(self, conn) -> None:
        self.run(conn, f"touch {q(str(self.path))}")


class Noisy(Step):
    """Never done; applying prints 20 lines and exits 3."""

    name = "noisy"

    def __init__(self) -> None:
        pass

    def check(self, conn) -> bool:
        return False

    def apply(self, conn) -> None:
        self.run(conn, "for i in $(seq 20); do echo line$i; done; echo oops >&2; exit 3")


class Liar(Touch):
    """Its apply does nothing, so its check still fails after it."""

    def apply(self, conn) -> None:
        pass


def test_steps_apply_once_then_skip(tmp_path) -> None:
    steps = [Touch("a", tmp_path / "a"), Touch("b", tmp_path / "b")]
    (tmp_path / "a").touch()
    said: list[str] = []
    first = b.run_steps("node", steps, invoke.Context(), said.append)
    assert first == b.NodeReport("node", applied=("b",), skipped=("a",))
    assert said == ["node: b ...", "node: b done"]
    assert b.run_steps("node", steps, invoke.Context()) == b.NodeReport("node", (), ("a", "b"))


def test_a_failing_step_names_node_step_and_its_last_lines(tmp_path) -> None:
    later = Touch("later", tmp_path / "later")
    with pytest.raises(b.StepFailed) as caught:
        b.run_steps("worker-3", [Touch("a", tmp_path / "a"), Noisy(), later], invoke.Context())
    exc = caught.value
    assert str(exc) == "worker-3: step noisy failed (exited 3): oops"
    assert (exc.node, exc.step) == ("worker-3", "noisy")
    assert exc.tail == [f"line{i}" for i in range(12, 21)] + ["oops"]
    assert not (tmp_path / "later").exists()  # a node stops at its first failed step
    whole = b.BootstrapFailed([exc])
    assert (
        str(whole).splitlines()[0]
        == "bootstrap failed: worker-3: step noisy failed (exited 3): oops"
    )
    assert str(whole).splitlines()[1:3] == ["--- worker-3, step noisy, last output:", "  line12"]


def test_a_step_whose_check_fails_after_apply_is_a_failure(tmp_path) -> None:
    with pytest.raises(b.StepFailed, match=r"^n: step liar failed \(applied, but its check"):
        b.run_steps("n", [Liar("liar", tmp_path / "x")], invoke.Context())


def test_upload_makes_the_file_with_its_mode_in_one_piece(tmp_path) -> None:
    target = tmp_path / "conf" / "spark-defaults.conf"
    target.parent.mkdir()
    upload(invoke.Context(), b"secret stuff\n", str(target), 0o600)
    assert target.read_bytes() == b"secret stuff\n"
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert sorted(p.name for p in target.parent.iterdir()) == ["spark-defaults.conf"]


def test_report_says_nothing_to_do() -> None:
    health = ClusterHealth("spark://m:7077", (), ())
    idle = b.BootstrapReport({"m": b.NodeReport("m", (), ("a", "b"))}, health)
    assert idle.nothing_to_do
    assert idle.lines() == ["nothing to do: every step was already done on all 1 nodes"]
    busy = b.BootstrapReport({"m": b.NodeReport("m", ("b",), ("a",))}, health)
    assert busy.lines() == ["m: applied b (1 steps already done)"]


# --- health -----------------------------------------------------------------------------------

MASTER_JSON = {
    "status": "ALIVE",
    "workers": [
        {"host": "10.0.0.5", "state": "ALIVE", "cores": 4, "memory": 12000,
         "resources": {"gpu": {"name": "gpu", "addresses": ["0"]}}},
        {"host": "10.0.0.6", "state": "DEAD", "cores": 4, "memory": 12000, "resources": {}},
        {"host": "10.0.0.7", "state": "ALIVE", "cores": 2, "memory": 6000, "resources": {}},
    ],
}  # fmt: skip


def test_health_names_the_missing_worker_and_wrong_cores_and_gpus() -> None:
    expected = [
        Expected("master", "10.0.0.5", 4, gpus=1),
        Expected("worker-1", "10.0.0.6", 4, gpus=1),
        Expected("worker-2", "10.0.0.7", 4, gpus=1),
    ]
    health = judge(MASTER_JSON, "spark://10.0.0.5:7077", expected)
    assert not health.ok
    assert health.problems == (
        "worker-1's worker (10.0.0.6) is not registered with the master",
        "worker-2's worker offers 2 cores, not 4",
        "worker-2's worker offers 0 GPUs, not 1",
    )
    assert health.workers[0] == WorkerState("master", "10.0.0.5", "ALIVE", 4, 12000, 1)
    assert health.lines()[0] == "Spark master spark://10.0.0.5:7077: UNHEALTHY"


def test_health_of_a_good_cluster() -> None:
    expected = [Expected("master", "10.0.0.5", 4, gpus=1), Expected("w", "10.0.0.7", None)]
    health = judge(MASTER_JSON, "spark://10.0.0.5:7077", expected)
    assert health.ok
    assert health.lines() == [
        "Spark master spark://10.0.0.5:7077: healthy",
        "  master (10.0.0.5): ALIVE, 4 cores, 12000 MiB, 1 GPUs",
        "  w (10.0.0.7): ALIVE, 2 cores, 6000 MiB, 0 GPUs",
    ]


def test_a_worker_nobody_expects_is_a_problem() -> None:
    """A host dropped from a static cluster whose worker still runs (and still holds the secret)
    shows: its ALIVE worker at an address no expected node has. A DEAD one is history."""
    expected = [Expected("master", "10.0.0.5", 4, gpus=1)]
    health = judge(MASTER_JSON, "spark://10.0.0.5:7077", expected)
    assert health.problems == ("a worker nobody expects is registered at 10.0.0.7 (2 cores)",)
    assert not health.ok
    assert [w.node for w in health.workers] == ["master"]


def test_a_master_node_without_sparknet_does_not_answer_and_says_why(tmp_path) -> None:
    """The master's JSON is read on the node by its venv's `sparknet.node`; a node whose venv
    is not there (a host only registered, a bootstrap cut off before it) runs no master of
    this install: the status says the master does not answer, and why."""
    python = str(tmp_path / "venv" / "bin" / "python")
    with pytest.raises(b.CommandFailed) as caught:
        master_json(invoke.Context(), python, 1)
    assert caught.value.tail == [
        f"{python} has no sparknet.node: no venv yet, or one an older sparknet made; "
        "`sparknet cluster bootstrap` installs it"
    ]
    with pytest.raises(b.CommandFailed) as caught:  # sparknet there, nothing listening
        master_json(invoke.Context(), sys.executable, 1)
    assert caught.value.tail[-1].startswith("urllib.error.URLError: <urlopen error")


# --- a systemd node, recorded ------------------------------------------------------------------


class Recorder:
    """Stands in for a Fabric Connection to a real node with systemd (none here: this machine's
    init is not systemd): records each command and each file streamed to the node, and answers
    the one query the daemon step makes (where pyspark is)."""

    def __init__(self, failing: str = "", stderr: str = "") -> None:
        self.commands: list[str] = []
        self.files: dict[str, bytes] = {}
        self.client = self
        #: a command holding `failing` exits 1 printing `stderr` (a check that fails on the node)
        self.failing, self.stderr = failing, stderr

    def run(self, command: str, **kwargs):
        from invoke.runners import Result

        self.commands.append(command)
        if self.failing and self.failing in command:
            return Result(stderr=self.stderr, exited=1, command=command)
        out = (
            "/v/lib/python3.11/site-packages/pyspark\n"
            if "sparknet.node spark-home" in command
            else ""
        )
        return Result(stdout=out, exited=0, command=command)

    def exec_command(self, command: str, timeout=None):
        from types import SimpleNamespace

        self.commands.append(command)
        target = command.split("cat > ", 1)[1].split(" ", 1)[0].strip("'").removesuffix(".new")
        channel = SimpleNamespace(shutdown_write=lambda: None, recv_exit_status=lambda: 0)
        stdin = SimpleNamespace(
            write=lambda data: self.files.__setitem__(target, data), channel=channel
        )
        return stdin, SimpleNamespace(channel=channel), SimpleNamespace(read=lambda: b"")


def test_on_a_systemd_node_the_worker_is_a_unit_the_unit_script_starts() -> None:
    node = Node(Endpoint("worker-1", "203.0.113.9"), address="10.0.0.6", gpus=2)
    master = Node(Endpoint("master", "203.0.113.8"), address="10.0.0.5")
    plan = Plan((master, node), Wheel(Path("w.whl"), "1", "d"), "topsecret" * 4)
    facts = Facts("ubuntu", 1000, 8, 32 * 1024 * 1024, True, ("/opt/dlami/nvme/sparknet",))
    conn = Recorder()
    Worker(Context(plan, node, facts)).apply(conn)
    unit = conn.files["/opt/sparknet/run/sparknet-worker.service"].decode()
    lines = unit.splitlines()
    assert "User=ubuntu" in lines
    assert "StandardOutput=append:/opt/sparknet/logs/worker.out" in lines
    (start,) = [ln for ln in lines if ln.startswith("ExecStart=")]
    assert start == (
        "ExecStart=/v/lib/python3.11/site-packages/pyspark/bin/spark-class "
        f"{WORKER_CLASS} --host 10.0.0.6 --port 0 --webui-port 8081 --cores 8 "
        f"--memory {sc.worker_memory_mb(32 * 1024 * 1024, False)}m "
        "--work-dir /opt/sparknet/work spark://10.0.0.5:7077"
    )
    (env,) = [ln for ln in lines if ln.startswith("Environment=")]
    assert '"SPARK_LOCAL_IP=127.0.0.1"' in env  # the UIs: loopback only
    assert '"SPARK_LOCAL_DIRS=/opt/dlami/nvme/sparknet"' in env
    assert '"SPARK_CONF_DIR=/opt/sparknet/conf"' in env
    assert conn.commands[-1] == (
        "sh -s -- start sparknet-worker.service /opt/sparknet/run/sparknet-worker.service "
        "/etc/systemd/system/sparknet-worker.service"
    )
    assert all(plan.secret not in c for c in conn.commands)
    assert plan.secret not in unit


def test_on_a_systemd_master_the_autostop_timer_is_a_unit_with_its_settings() -> None:
    """The timer's settings go to the state dir, the old deadline file first goes (the step
    waits for the new timer's first check), and the unit runs the timer's loop."""
    from sparknet.cluster.aws.autostop import Settings
    from sparknet.cluster.spark.daemons import Autostop

    ctx = systemd_master()
    settings = Settings("exp1", "eu-west-1", 45)
    plan = Plan(ctx.plan.nodes, ctx.plan.wheel, ctx.plan.secret, autostop=settings)
    conn = Recorder()
    Autostop(Context(plan, ctx.node, ctx.facts)).apply(conn)
    assert conn.commands[0] == (
        "mkdir -p /opt/sparknet/autostop/activity && rm -f /opt/sparknet/autostop/deadline.json"
    )
    written = conn.files["/opt/sparknet/autostop/settings.json"].decode()
    assert Settings.from_json(written) == settings
    lines = conn.files["/opt/sparknet/run/sparknet-autostop.service"].decode().splitlines()
    assert "User=ubuntu" in lines
    assert (
        "ExecStart=/opt/sparknet/venv/bin/python -m sparknet.cluster.aws.autostop run --state "
        "/opt/sparknet/autostop"
    ) in lines
    assert conn.commands[-2].startswith("sh -s -- start sparknet-autostop.service ")
    assert "/opt/sparknet/autostop/deadline.json" in conn.commands[-1]  # the first check


def test_the_autostop_timer_is_done_only_with_todays_settings_written() -> None:
    """A changed setting (minutes) restarts the timer: the unit's stamp covers them, and the
    settings file the timer reads must say them too (a file written by hand, or half gone)."""
    from sparknet.cluster.aws.autostop import Settings
    from sparknet.cluster.spark.daemons import Autostop

    ctx = systemd_master()
    settings = Settings("exp1", "eu-west-1", 45)
    plan = Plan(ctx.plan.nodes, ctx.plan.wheel, ctx.plan.secret, autostop=settings)
    step = Autostop(Context(plan, ctx.node, ctx.facts))

    class Node(Recorder):
        def __init__(self, written: str) -> None:
            super().__init__()
            self.written = written

        def run(self, command: str, **kwargs):
            from invoke.runners import Result

            if command.startswith("cat /opt/sparknet/autostop/settings.json"):
                return Result(stdout=self.written, exited=0, command=command)
            return super().run(command, **kwargs)

    assert step.check(Node(settings.to_json()))
    assert not step.check(Node(Settings("exp1", "eu-west-1", 30).to_json()))
    assert not step.check(Node(""))


def test_a_plan_needs_nodes_with_distinct_names() -> None:
    wheel = Wheel(Path("w.whl"), "1", "d")
    with pytest.raises(SparknetError, match="at least one node"):
        Plan((), wheel, "s")
    twice = (Node(Endpoint("master", "a")), Node(Endpoint("master", "b")))
    with pytest.raises(SparknetError, match="node names repeat: master, master"):
        Plan(twice, wheel, "s")


def systemd_master(name: str = "master") -> Context:
    """A Context of node `name` on a systemd node of a two-node plan whose master is `master`."""
    nodes = (Node(Endpoint("master", "203.0.113.8"), address="10.0.0.5"),
             Node(Endpoint("worker-1", "203.0.113.9"), address="10.0.0.6"))  # fmt: skip
    plan = Plan(nodes, Wheel(Path("w.whl"), "1", "d"), "topsecret" * 4)
    node = next(n for n in nodes if n.name == name)
    return Context(plan, node, Facts("ubuntu", 1000, 8, 32 * 1024 * 1024, True, ()))


UNIT = "/etc/systemd/system/sparknet-master.service"


def test_stopping_a_systemd_daemon_for_good_disables_and_removes_its_unit() -> None:
    """`down` of a static cluster leaves the machines running: a unit still enabled would
    start Spark again at the next boot, so `remove` goes to the unit script (which disables
    and deletes it), a plain stop only stops it."""
    conn = Recorder()
    Master(systemd_master()).stop(conn, remove=True)
    assert conn.commands == [f"sh -s -- remove sparknet-master.service {UNIT}"]
    conn = Recorder()
    Master(systemd_master()).stop(conn)
    assert conn.commands == ["sh -s -- stop sparknet-master.service"]


def unit_script(tmp_path: Path, state: str, *args: str) -> tuple[subprocess.CompletedProcess, list]:
    """The unit script (`daemons.UNIT_SCRIPT`) run with `args` by a login user (uid 1000) on a
    node whose `systemctl` is a stand-in (this machine's init is not systemd) that says the
    unit is in `state`, and whose `sudo` runs the command: its result, and what ran, in order
    (`sudo ...` for each command sudo ran, then each call of systemctl)."""
    tools, log = tmp_path / "bin", tmp_path / "ran.log"
    tools.mkdir(exist_ok=True)
    log.unlink(missing_ok=True)
    for name, body in {
        "id": "echo 1000",
        "sudo": f'[ "$1" = -n ] && shift; echo "sudo $*" >> {log}; exec "$@"',
        "systemctl": f'echo "systemctl $*" >> {log}; [ "$1" = is-active ] && echo {state}; true',
    }.items():
        (tools / name).write_text(f"#!/bin/sh\n{body}\n")
        (tools / name).chmod(0o755)
    env = dict(os.environ, PATH=f"{tools}:{os.environ['PATH']}")
    done = subprocess.run(
        ["sh", "-s", "--", *args], input=files.script(UNIT_SCRIPT), env=env,
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    return done, log.read_text().splitlines() if log.exists() else []


def test_the_unit_script_installs_and_restarts_the_unit_through_sudo(tmp_path) -> None:
    staged, unit = tmp_path / "staged.service", tmp_path / "etc" / "u.service"
    staged.write_text("[Unit]\n")
    unit.parent.mkdir()
    done, ran = unit_script(tmp_path, "active", "start", "u.service", str(staged), str(unit))
    assert done.returncode == 0, done.stderr
    assert unit.read_text() == "[Unit]\n" and stat.S_IMODE(unit.stat().st_mode) == 0o644
    assert [r for r in ran if r.startswith("sudo")] == [
        f"sudo install -m 0644 {staged} {unit}", "sudo systemctl daemon-reload",
        "sudo systemctl enable -q u.service", "sudo systemctl restart u.service",
    ]  # fmt: skip


def test_the_unit_script_fails_when_a_unit_stays_active_or_installed(tmp_path) -> None:
    """A unit never installed is no error; one still running (or starting: a restart loop),
    or with `remove` still installed, fails the run saying which on stderr."""
    unit = tmp_path / "sparknet-master.service"
    for state in ("inactive", "unknown", "failed"):
        done, ran = unit_script(tmp_path, state, "stop", "sparknet-master.service")
        assert done.returncode == 0, done.stderr
        assert ran[0] == "sudo systemctl stop sparknet-master.service"
    for state in ("active", "activating", "deactivating"):
        done, _ = unit_script(tmp_path, state, "stop", "sparknet-master.service")
        assert done.returncode == 1
        assert done.stderr.strip() == f"sparknet-master.service is still {state}"
    unit.touch()
    done, ran = unit_script(tmp_path, "inactive", "remove", "sparknet-master.service", str(unit))
    assert done.returncode == 0, done.stderr
    assert not unit.exists()
    assert [r for r in ran if r.startswith("sudo")] == [
        "sudo systemctl stop sparknet-master.service",
        "sudo systemctl disable -q sparknet-master.service", f"sudo rm -f {unit}",
        "sudo systemctl daemon-reload",
    ]  # fmt: skip
    unit.mkdir()  # what `rm -f` cannot remove: the unit stays installed
    done, _ = unit_script(tmp_path, "inactive", "remove", "sparknet-master.service", str(unit))
    assert done.returncode == 1
    assert done.stderr.strip().endswith(f"{unit} is still there")


def test_a_unit_that_will_not_stop_fails_the_node_and_keeps_the_conf() -> None:
    """sudoers changed: `sudo -n systemctl stop` fails and the master stays up. Stopping the
    node fails, naming the unit, and the conf with the secret is not deleted: a unit still
    enabled would start the master at the next boot, and without its conf it would start
    with no authentication."""
    stderr = "sudo: a password is required\nsparknet-worker.service is still active\n"
    conn = Recorder("remove sparknet-worker.service", stderr)
    with pytest.raises(b.CommandFailed) as caught:
        b.stop_node(systemd_master(), conn)
    assert str(caught.value) == (
        "could not stop and remove sparknet-worker.service (sparknet-worker.service is still "
        "active); the login user needs sudo without a password (sudo -n) for systemctl"
    )
    assert caught.value.tail == ["sudo: a password is required",
                                 "sparknet-worker.service is still active"]  # fmt: skip
    assert not any("spark-defaults.conf" in c for c in conn.commands)


def test_stopping_a_node_stops_both_daemons_even_off_the_first_node() -> None:
    """A static cluster whose hosts were reordered has its master on another node than the
    first: every node stops its master and its worker (and an autostop timer, which only the
    master of an EC2 cluster has), then deletes its conf."""
    conn = Recorder()
    b.stop_node(systemd_master("worker-1"), conn)
    stops = [c.split()[4] for c in conn.commands if c.startswith("sh -s -- remove ")]
    assert stops == [
        "sparknet-autostop.service", "sparknet-worker.service", "sparknet-master.service",
    ]  # fmt: skip
    assert conn.commands[-1] == "rm -f /opt/sparknet/conf/spark-defaults.conf"
