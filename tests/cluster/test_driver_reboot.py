"""The nvidia-driver step on a GPU node without the driver: it installs it, reboots the node,
waits for it to answer again with its pinned host key, checks `nvidia-smi`, and the bootstrap
goes on over a fresh connection; a node that does not come back fails in one line.

The node is a loopback sshd (`tests.sshd.RebootingNode`) whose reboot kills its sshd and every
connection, changes its boot id and starts the sshd again. `apt-get`, `ubuntu-drivers`,
`nvidia-smi` and the rest are the stand-ins of `tests.nvidia_tools` on its PATH: the driver
"loads" only at a boot after its install."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from sparknet.cluster import nodes
from sparknet.cluster.remote import q, succeeds
from sparknet.cluster.spark import bootstrap as b
from sparknet.cluster.spark import steps
from sparknet.cluster.spark.plan import Context, Node, Plan
from sparknet.cluster.spark.steps import NvidiaDriver, Step
from sparknet.cluster.spark.wheel import Wheel
from tests import nvidia_tools
from tests.sshd import RebootingNode

pytestmark = pytest.mark.integration


@pytest.fixture
def rebooting(tmp_path, monkeypatch):
    """A factory of RebootingNodes with the driver's tools, whose boot id the step reads; each
    is stopped (every process of its sshd killed) at the end."""
    made: list[RebootingNode] = []

    def make(**kwargs) -> RebootingNode:
        node = RebootingNode(tmp_path / f"node{len(made)}", **kwargs)
        made.append(node)
        tools = nvidia_tools.install(node, node.bin.parent / "nvidia")
        monkeypatch.setattr(steps, "BOOT_ID", f"cat {q(str(node.boot_id))}")
        monkeypatch.setattr(steps, "PCI_DEVICES", str(tools.pci))
        return node

    yield make
    for node in made:
        node.stop()


class BootIdAfter(Step):
    """A step after the driver's: writes the boot id it sees over its connection to a file."""

    name = "after"

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.mark = ctx.node.path("after")

    def check(self, conn) -> bool:
        return succeeds(conn, f"test -s {q(self.mark)}")

    def apply(self, conn) -> None:
        self.run(conn, f"{steps.BOOT_ID} > {q(self.mark)}")


def bootstrap_driver(node: RebootingNode, prefix: Path) -> dict:
    """The nvidia-driver step and one after it, as the bootstrap runs them, on a node that
    should offer one GPU."""
    gpu = Node(node.endpoint, address="127.0.0.1", prefix=str(prefix), gpus=1)
    prefix.mkdir()
    plan = Plan((gpu,), Wheel(Path("w.whl"), "1", "d"), "s" * 32)
    steps_for = lambda ctx: [NvidiaDriver(ctx), BootIdAfter(ctx)]  # noqa: E731
    return b.run_on_nodes(plan, node.access, plan.nodes, steps_for, lambda _: None, timeout=60)


@pytest.mark.parametrize("hold", [False, True], ids=["reboot-returns", "connection-drops"])
def test_the_driver_step_reboots_the_node_and_the_bootstrap_goes_on(
    rebooting, tmp_path, hold
) -> None:
    """The reboot command returns at once (systemd's) or the connection drops under it; either
    way the node's old sshd serves a while after it (lag_s), and the step must not take that
    for the node back: the driver then loads only on the new boot."""
    node = rebooting(lag_s=0.3, down_s=0.5, hold=hold)
    done = bootstrap_driver(node, tmp_path / "prefix")
    report, _facts = done["master"]
    assert report.applied == ("nvidia-driver", "after")
    assert node.boots == 1
    # the next step ran on the new boot, over a connection to the restarted sshd
    assert (tmp_path / "prefix" / "after").read_text() == node.boot_id.read_text()


def test_a_node_that_does_not_come_back_fails_in_one_line(rebooting, tmp_path, monkeypatch):
    monkeypatch.setenv(steps.REBOOT_WAIT_ENV, "1.5")
    node = rebooting(lag_s=0.2, back=False)
    started = time.monotonic()
    with pytest.raises(b.BootstrapFailed) as caught:
        bootstrap_driver(node, tmp_path / "prefix")
    assert time.monotonic() - started < 10
    line = str(caught.value)
    assert "\n" not in line
    assert line.startswith(
        "bootstrap failed: master: step nvidia-driver failed (told to reboot to load the "
        "NVIDIA driver, the node was not back over SSH within 1.5 s ("
    )
    assert "run the bootstrap again once it answers" in line
    assert not (tmp_path / "prefix" / "after").exists()


def test_the_wait_for_a_rebooted_node_ends_with_its_run(rebooting, tmp_path, monkeypatch):
    """The bootstrap stops waiting (here its timeout; Ctrl-C does the same): the thread still
    waiting for the node to come back ends too, not minutes later (Python waits for it at
    exit). The run's 8 s leave the step's commands before the reboot time on a loaded machine."""
    monkeypatch.setenv(steps.REBOOT_WAIT_ENV, "600")
    monkeypatch.setattr(nodes, "RECONNECT_SLICE_S", 0.5)
    node = rebooting(lag_s=0.1, back=False)
    gpu = Node(node.endpoint, address="127.0.0.1", prefix=str(tmp_path), gpus=1)
    plan = Plan((gpu,), Wheel(Path("w.whl"), "1", "d"), "s" * 32)
    before = set(threading.enumerate())
    with pytest.raises(nodes.NodesFailed, match="master: still running after 8 s"):
        b.run_on_nodes(
            plan, node.access, plan.nodes, lambda ctx: [NvidiaDriver(ctx)], lambda _: None, 8
        )
    assert node.boots == 1  # it was waiting for the node, not stuck before the reboot
    left = [t for t in threading.enumerate() if t not in before and t.name.startswith("sparknet")]
    for thread in left:
        thread.join(timeout=3)
    assert not [t for t in left if t.is_alive()]


def test_a_node_back_whose_boot_id_cannot_be_read_is_named_so(rebooting, tmp_path, monkeypatch):
    """A node that comes back from its reboot but whose boot id cannot be read: the one line
    says it answers and what failed (it said "not back over SSH within ... (exited 1)")."""
    monkeypatch.setenv(steps.REBOOT_WAIT_ENV, "1")
    node = rebooting(lag_s=0.1, down_s=0.2)
    # readable before the reboot (the step notes it), unreadable on the next boot
    first = tmp_path / "first-boot"
    monkeypatch.setattr(
        steps,
        "BOOT_ID",
        f"[ -e {q(str(first))} ] || cat {q(str(node.boot_id))} > {q(str(first))}; "
        f'[ "$(cat {q(str(node.boot_id))})" = "$(cat {q(str(first))})" ] || '
        "{ echo 'cat: boot_id: Permission denied' >&2; exit 1; }; "
        f"cat {q(str(node.boot_id))}",
    )
    try:
        bootstrap_driver(node, tmp_path / "prefix")
        raise AssertionError("the bootstrap went on")
    except b.BootstrapFailed as exc:
        line = str(exc)
    assert node.boots == 1
    assert "\n" not in line
    assert "(it answers, but `" in line
    assert "exited 1: cat: boot_id: Permission denied)" in line
