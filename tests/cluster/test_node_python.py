"""A node's Python is read before anything installs and checked against what the node must run
(its pyspark's and sparknet's Requires-Python), and an env's torch against the oldest torch the
rendezvous works with: a node that cannot run them fails in one line, before the torch download.

The loopback node is this machine, whose python3 is the submitter's; a stand-in `python3` first on
the node's PATH reports another version, as a real node's older interpreter would (no Python 3.10
is installed here to run). It answers only `--version`: any other use fails loudly, so a step
that ran it would show."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import invoke
import pytest

from sparknet.cluster import nodes
from sparknet.cluster.address import Endpoint
from sparknet.cluster.spark import bootstrap as b
from sparknet.cluster.spark import plan as plan_module
from sparknet.cluster.spark.plan import Context, Facts, Node, Plan
from sparknet.cluster.spark.spark_conf import Ports
from sparknet.cluster.spark.steps import PYTHON_FIX, NodePython, PythonEnv
from sparknet.cluster.spark.wheel import build_wheel
from tests.sshd import free_port, start_nodes

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
#: prints an env's site-packages
PURELIB = "import sysconfig; print(sysconfig.get_paths()['purelib'])"


def stand_in(bin_dir: Path, name: str, body: str) -> None:
    bin_dir.mkdir(exist_ok=True)
    tool = bin_dir / name
    tool.write_text(f"#!/bin/sh\n{body}\n")
    tool.chmod(0o755)


def test_a_node_whose_python3_is_too_old_is_refused_before_anything_installs(tmp_path) -> None:
    bin_dir = tmp_path / "bin"
    stand_in(
        bin_dir, "python3",
        '[ "$*" = --version ] && { echo "Python 3.10.12"; exit 0; }\n'
        f'echo "python3 $* run" >> {tmp_path}/ran; exit 99',
    )  # fmt: skip
    for tool in ("apt-get", "sudo"):  # nothing may install: each records that it ran
        stand_in(bin_dir, tool, f'echo "{tool} $*" >> {tmp_path}/ran; exit 99')
    group = start_nodes(tmp_path / "ssh", 1, env={"PATH": f"{bin_dir}:{os.environ['PATH']}"})
    prefix = tmp_path / "prefix"
    try:
        node = Node(group.endpoints[0], address="127.0.0.2", prefix=str(prefix))
        wheel = build_wheel(REPO, tmp_path / "dist")
        ports = Ports(master=free_port(), master_ui=free_port(), worker_ui=0)
        plan = Plan((node,), wheel, "ab" * 32, ports=ports, worker_cores=1, worker_memory_mb=1024)
        with pytest.raises(b.BootstrapFailed) as caught:
            # force: no job check first (it asks the master node's python3 for Spark's JSON)
            b.bootstrap(plan, group.access, force=True)
    finally:
        group.stop()
    pyspark = importlib.metadata.version("pyspark")
    assert str(caught.value) == (
        "bootstrap failed: master: step python failed (python3 is Python 3.10.12, but pyspark "
        f"{pyspark} needs Python >=3.11 and sparknet {wheel.version} needs Python >=3.11: "
        f"{PYTHON_FIX})"
    )
    assert not prefix.exists()  # not even the prefix's directories
    assert not (tmp_path / "ran").exists()


def test_an_env_with_torch_older_than_2_8_is_refused_in_one_line(tmp_path, monkeypatch) -> None:
    """`bootstrap: python_env` names an env whose torch is 2.7.1 (its metadata, laid over a
    fresh venv): the python-env step refuses it, naming the env, its torch and what is needed,
    before it would import torch."""
    env = tmp_path / "env"
    subprocess.run(
        [str(Path(sys.executable).parent / "uv"), "venv", "-q", "--python", sys.executable,
         str(env)],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    site = subprocess.run(
        [str(env / "bin" / "python"), "-c", PURELIB],
        check=True, capture_output=True, text=True, timeout=60,
    ).stdout.strip()  # fmt: skip
    info = Path(site) / "torch-2.7.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.7.1\n")
    node = Node(Endpoint("master", "127.0.0.1"), prefix=str(tmp_path / "prefix"))
    plan = Plan((node,), build_wheel(REPO, tmp_path / "dist"), "s", python_env=str(env))
    facts = Facts(os.environ.get("USER") or "root", os.getuid(), 1, 1 << 22, False, ())
    monkeypatch.chdir(tmp_path)
    with pytest.raises(b.StepFailed) as caught:
        b.run_steps("master", [PythonEnv(Context(plan, node, facts))], invoke.Context())
    assert str(caught.value) == (
        f"master: step python-env failed ({env} has no torch that fits this node: give "
        "bootstrap: python_env an env with torch 2.8+, or leave it unset for a fresh venv with "
        "one): torch 2.7.1 is older than 2.8, which the allreduce rendezvous needs"
    )
    assert not (tmp_path / "prefix" / "venv").exists()


def env_with_torch(env: Path, version: str) -> Path:
    """A venv of this machine's Python whose metadata says it has torch `version` (no torch
    files: the bootstrap reads an AMI env's torch by its metadata)."""
    subprocess.run(
        [str(Path(sys.executable).parent / "uv"), "venv", "-q", "--python", sys.executable,
         str(env)],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    site = subprocess.run(
        [str(env / "bin" / "python"), "-c", PURELIB],
        check=True, capture_output=True, text=True, timeout=60,
    ).stdout.strip()  # fmt: skip
    info = Path(site) / f"torch-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
    return env


def test_an_image_env_with_old_torch_and_an_old_python3_is_refused_first_for_the_real_reason(
    tmp_path, monkeypatch
) -> None:
    """A 22.04 PyTorch AMI as the probe found it: its env's Python (here this machine's 3.11)
    would run pyspark, but its torch 2.3.1 is too old, so the venv would be made from python3,
    which is 3.10. The first step refuses, naming the env, its torch and python3; nothing is
    installed. The AMI env's place is the one stand-in beyond python3: the facts command is
    pointed at the test's env instead of /opt/pytorch (this machine has none, and the tests
    that run alongside must not find one)."""
    env = env_with_torch(tmp_path / "env", "2.3.1")
    monkeypatch.setattr(plan_module, "AMI_TORCH_ENVS", (str(env),))
    bin_dir = tmp_path / "bin"
    stand_in(
        bin_dir, "python3",
        '[ "$*" = --version ] && { echo "Python 3.10.12"; exit 0; }\n'
        f'echo "python3 $* run" >> {tmp_path}/ran; exit 99',
    )  # fmt: skip
    for tool in ("apt-get", "sudo", "nvidia-smi"):  # nothing may install: each records it ran
        stand_in(bin_dir, tool, f'echo "{tool} $*" >> {tmp_path}/ran; exit 99')
    group = start_nodes(tmp_path / "ssh", 1, env={"PATH": f"{bin_dir}:{os.environ['PATH']}"})
    prefix = tmp_path / "prefix"
    try:
        node = Node(group.endpoints[0], address="127.0.0.2", prefix=str(prefix))
        wheel = build_wheel(REPO, tmp_path / "dist")
        ports = Ports(master=free_port(), master_ui=free_port(), worker_ui=0)
        plan = Plan((node,), wheel, "ab" * 32, ports=ports, worker_cores=1, worker_memory_mb=1024)
        with pytest.raises(b.BootstrapFailed) as caught:
            b.bootstrap(plan, group.access, force=True)
    finally:
        group.stop()
    pyspark = importlib.metadata.version("pyspark")
    assert str(caught.value) == (
        f"bootstrap failed: master: step python failed (the image's env {env} has torch 2.3.1 "
        "(sparknet needs 2.8+), so the venv is made from python3, and python3 is Python 3.10.12, "
        f"but pyspark {pyspark} needs Python >=3.11 and sparknet {wheel.version} needs Python "
        f">=3.11: {PYTHON_FIX})"
    )
    assert not prefix.exists()
    assert not (tmp_path / "ran").exists()
    assert (env / "bin" / "python").exists()  # the image's env is left as it was


def test_an_image_env_on_python_3_10_with_old_torch_does_not_stop_a_python3_that_fits(
    tmp_path, monkeypatch
) -> None:
    """The reverse: the image's env has Python 3.10 and torch 2.3.1, so the venv is made from
    python3 (this machine's 3.11), which runs what the node installs: the first step passes.
    The env's python is a stand-in answering the facts command's probe as a 3.10 env would (no
    Python 3.10 is installed here); it records any other use."""
    env = tmp_path / "env"
    env.mkdir()
    stand_in(
        env / "bin", "python",
        'case "$*" in -c*importlib.metadata*) echo "3.10.12 2.3.1"; exit 0;; esac\n'
        f'echo "env python $* run" >> {tmp_path}/ran; exit 99',
    )  # fmt: skip
    monkeypatch.setattr(plan_module, "AMI_TORCH_ENVS", (str(env),))
    group = start_nodes(tmp_path / "ssh", 1)
    try:
        node = Node(group.endpoints[0], address="127.0.0.2", prefix=str(tmp_path / "prefix"))
        plan = Plan((node,), build_wheel(REPO, tmp_path / "dist"), "ab" * 32)
        conn = nodes.connect(node.endpoint, group.access)
        try:
            facts = b.gather_facts(conn, node)
            ctx = Context(plan, node, facts)
            report = b.run_steps("master", [NodePython(ctx)], conn)
        finally:
            conn.close()
    finally:
        group.stop()
    assert [(e.path, e.python, e.torch) for e in facts.envs] == [(str(env), "3.10.12", "2.3.1")]
    assert ctx.base_env is None  # the venv will be python3's
    assert report.skipped == ("python",) and report.applied == ()
    assert not (tmp_path / "ran").exists()
