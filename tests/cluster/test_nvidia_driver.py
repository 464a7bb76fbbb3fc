"""The nvidia-driver step on a bare Ubuntu GPU node: what `ubuntu-drivers install --gpgpu`
leaves out (`nvidia-utils-<branch>`, which holds nvidia-smi) is installed for the branch it
chose, so the step's own check, Spark's GPU discovery script and the python-env step's CUDA
version all work after the reboot; a node with NVSwitches also gets NVIDIA's fabric manager,
enabled and running.

The node is a loopback sshd (`tests.sshd.RebootingNode`) whose `apt-get`, `dpkg-query`,
`ubuntu-drivers`, `nvidia-smi` and `systemctl` are the stand-ins of `tests.nvidia_tools`, which
do what the real packages do (see there)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import ClassVar

import pytest

from sparknet.cluster import nodes
from sparknet.cluster.remote import q, run, succeeds
from sparknet.cluster.spark import bootstrap as b
from sparknet.cluster.spark import steps
from sparknet.cluster.spark.bootstrap import NodeReport
from sparknet.cluster.spark.plan import Context, Node, Plan
from sparknet.cluster.spark.spark_conf import GPU_DISCOVERY_SCRIPT
from sparknet.cluster.spark.steps import NvidiaDriver, PythonEnv, Step, driver_branches
from sparknet.cluster.spark.wheel import Wheel
from tests import nvidia_tools
from tests.sshd import RebootingNode

pytestmark = pytest.mark.integration


class Probe(Step):
    """A step after the driver's: runs Spark's GPU discovery script on the node and reads the
    driver's CUDA version as the python-env step does; both go to `found`."""

    name = "probe"
    found: ClassVar[dict[str, str]] = {}

    def check(self, conn) -> bool:
        return "discovery" in Probe.found

    def apply(self, conn) -> None:
        script = self.ctx.node.path("gpus.sh")
        self.run(conn, f"printf %s {q(GPU_DISCOVERY_SCRIPT)} > {q(script)}")
        Probe.found["discovery"] = self.run(conn, f"sh {q(script)}").strip()
        Probe.found["cuda"] = PythonEnv(self.ctx)._driver_cuda(conn) or ""


@pytest.fixture
def gpu_node(tmp_path, monkeypatch):
    """A factory of bare GPU nodes (RebootingNode with the stand-ins), stopped at the end."""
    made: list[RebootingNode] = []

    def make(**tools) -> tuple[RebootingNode, nvidia_tools.NvidiaTools]:
        node = RebootingNode(tmp_path / "node", lag_s=0.1, down_s=0.2)
        made.append(node)
        installed = nvidia_tools.install(node, tmp_path / "state", **tools)
        monkeypatch.setattr(steps, "BOOT_ID", f"cat {q(str(node.boot_id))}")
        monkeypatch.setattr(steps, "PCI_DEVICES", str(installed.pci))
        return node, installed

    yield make
    for node in made:
        node.stop()


def bootstrap(node: RebootingNode, prefix: Path, gpus: int, *, probe: bool = True) -> NodeReport:
    """The nvidia-driver step (and the probe after it), as the bootstrap runs them."""
    prefix.mkdir(exist_ok=True)
    gpu = Node(node.endpoint, address="127.0.0.1", prefix=str(prefix), gpus=gpus)
    plan = Plan((gpu,), Wheel(Path("w.whl"), "1", "d"), "s" * 32)

    def steps_for(ctx: Context) -> list[Step]:
        return [NvidiaDriver(ctx), *([Probe(ctx)] if probe else [])]

    done = b.run_on_nodes(plan, node.access, plan.nodes, steps_for, lambda _: None, timeout=60)
    return done["master"][0]


def test_the_driver_step_installs_the_chosen_branchs_nvidia_smi(gpu_node, tmp_path) -> None:
    """ubuntu-drivers picks 550-server (the archive also has 535-server and the desktop 550,
    whose nvidia-smi would not talk to the loaded driver): after the reboot nvidia-smi works,
    the GPU discovery script offers the 4 GPUs, and nvidia-smi's CUDA version is the branch's;
    a second bootstrap finds the step done and reboots nothing."""
    node, tools = gpu_node(branch="550-server", gpus=4)
    Probe.found = {}
    report = bootstrap(node, tmp_path / "prefix", gpus=4)
    assert report.applied == ("nvidia-driver", "probe")
    assert node.boots == 1
    assert tools.installed() == {
        "ubuntu-drivers-common",
        "nvidia-headless-no-dkms-550-server",
        "linux-modules-nvidia-550-server-aws",
        "nvidia-utils-550-server",
    }
    assert json.loads(Probe.found["discovery"]) == {
        "name": "gpu",
        "addresses": ["0", "1", "2", "3"],
    }
    assert Probe.found["cuda"] == "12.4"
    again = bootstrap(node, tmp_path / "prefix", gpus=4, probe=False)
    assert again.applied == ()
    assert node.boots == 1


def test_a_node_with_nvswitches_gets_the_fabric_manager_running(gpu_node, tmp_path) -> None:
    """An HGX A100 node (p4d: 8 GPUs, 6 NVSwitches): the branch's fabric manager is installed
    and enabled before the reboot, and runs on the boot that loads the driver. Stopped later,
    the step's check sees it (nvidia-smi alone lists the GPUs without it) and the next
    bootstrap starts it again, with no reboot and no package touched."""
    node, tools = gpu_node(branch="570-server", gpus=8, model="NVIDIA A100-SXM4-40GB", nvswitches=6)
    report = bootstrap(node, tmp_path / "prefix", gpus=8, probe=False)
    assert report.applied == ("nvidia-driver",)
    assert node.boots == 1
    assert {"nvidia-utils-570-server", "nvidia-fabricmanager-570"} <= tools.installed()
    assert tools.fabric_manager_enabled()
    assert bootstrap(node, tmp_path / "prefix", gpus=8, probe=False).applied == ()

    with nodes.connect(node.endpoint, node.access) as conn:
        run(conn, "sudo -n systemctl stop nvidia-fabricmanager")
        assert run(conn, "nvidia-smi -L").count("GPU ") == 8
        assert not succeeds(conn, "systemctl is-active --quiet nvidia-fabricmanager")
    installs = tools.apt_installs()
    report = bootstrap(node, tmp_path / "prefix", gpus=8, probe=False)
    assert report.applied == ("nvidia-driver",)
    assert node.boots == 1
    assert tools.apt_installs() == installs  # the working driver is left as it is
    with nodes.connect(node.endpoint, node.access) as conn:
        assert run(conn, "systemctl is-active nvidia-fabricmanager") == "active\n"


def test_a_node_without_nvswitches_gets_no_fabric_manager(gpu_node, tmp_path) -> None:
    """Another vendor's bridge of the same PCI class (0x0680) is no NVSwitch."""
    node, tools = gpu_node(gpus=1)
    bootstrap(node, tmp_path / "prefix", gpus=1, probe=False)
    assert not any(p.startswith("nvidia-fabricmanager") for p in tools.installed())
    assert not tools.fabric_manager_enabled()


def test_the_branch_is_read_from_the_installed_headless_package() -> None:
    listed = (
        "un  nvidia-headless-no-dkms-535-server\n"
        "rc  nvidia-headless-no-dkms-470-server\n"
        "ii  nvidia-headless-no-dkms-550-server-open\n"
    )
    assert driver_branches(listed) == {"550-server"}
    assert driver_branches("ii  nvidia-headless-no-dkms-570\n") == {"570"}
    assert driver_branches("") == set()
