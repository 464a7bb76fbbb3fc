"""NetLab on real network namespaces: the shaping shows in round trips and transfer times, the
root namespace cannot get in, every way out (a raise, Ctrl-C, kill -9 and a sweep) leaves
nothing behind, and a Spark standalone cluster runs a job inside."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sparknet.bench.links import (
    DEFAULT_LINKS,
    Link,
    NetLab,
    parse_links,
    sweep_leftovers,
    why_no_delay,
    why_no_namespaces,
)
from sparknet.errors import SparknetError
from tests.conftest import REPO

pytestmark = pytest.mark.integration

_NO_NETNS = why_no_namespaces()
_NO_DELAY = why_no_delay()
needs_netns = pytest.mark.skipif(_NO_NETNS is not None, reason=f"no network lab: {_NO_NETNS}")
needs_delay = pytest.mark.skipif(_NO_DELAY is not None, reason=f"no delayed links: {_NO_DELAY}")

#: this test process's own tag (letters only: names end in the owner's pid), so test processes
#: running side by side (pytest-xdist) never sweep each other's labs
TAG = "t" + "".join(chr(ord("a") + os.getpid() // 26**k % 26) for k in range(3))

#: run inside a namespace: `recv PORT` (prints ready, then the bytes read from the first
#: connection and its peer's address; answers one byte at EOF), `send ADDR PORT BYTES` (prints
#: the seconds until that answer), `echo PORT` (UDP) and `ping ADDR PORT N` (prints the
#: smallest UDP round trip in ms)
TOOLS = """
import socket, sys, time
mode, args = sys.argv[1], sys.argv[2:]
if mode == "recv":
    s = socket.create_server(("0.0.0.0", int(args[0])))
    print("ready", flush=True)
    c, peer = s.accept()
    n = 0
    while b := c.recv(1 << 20):
        n += len(b)
    c.sendall(b"k")
    print(n, peer[0], flush=True)
elif mode == "send":
    c = socket.create_connection((args[0], int(args[1])), timeout=30)
    t0 = time.perf_counter()
    c.sendall(b"x" * int(args[2]))
    c.shutdown(socket.SHUT_WR)
    c.recv(1)
    print(time.perf_counter() - t0, flush=True)
elif mode == "echo":
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("0.0.0.0", int(args[0])))
    print("ready", flush=True)
    while True:
        b, a = s.recvfrom(64)
        s.sendto(b, a)
elif mode == "ping":
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(5)
    rtts = []
    for _ in range(int(args[2])):
        t0 = time.perf_counter()
        s.sendto(b"p", (args[0], int(args[1])))
        s.recvfrom(64)
        rtts.append((time.perf_counter() - t0) * 1000)
    print(min(rtts), flush=True)
"""

#: a process that opens a lab, starts `sleep` in node 1, says so, and waits to be signalled
LAB_CHILD = """
import subprocess, sys, time
from sparknet.bench.links import Link, NetLab
with NetLab(2, Link(10**8, 0.0), tag=sys.argv[1]) as lab:
    sleeper = lab.popen(lab.nodes[1], ["sleep", "120"], stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL)
    print(sleeper.pid, flush=True)
    time.sleep(120)
"""

DRIVER = """
import sys
from pyspark import SparkConf, SparkContext
conf = SparkConf().set("spark.ui.enabled", "false").set("spark.executor.memory", "512m")
sc = SparkContext(sys.argv[1], "lab", conf=conf)
print("result", sc.parallelize(range(4), 2).map(lambda x: x * x).sum(), flush=True)
sc.stop()
"""


def tool(lab: NetLab, node: int, *args: object) -> subprocess.Popen:
    return lab.popen(lab.nodes[node], [sys.executable, "-c", TOOLS, *map(str, args)],
                     stdout=subprocess.PIPE, text=True)  # fmt: skip


def serve(lab: NetLab, node: int, *args: object) -> subprocess.Popen:
    """A listening tool, once it listens."""
    proc = tool(lab, node, *args)
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    return proc


def round_trip_ms(lab: NetLab) -> float:
    serve(lab, 1, "echo", 9000)
    return float(tool(lab, 0, "ping", lab.nodes[1].address, 9000, 10).communicate(timeout=30)[0])


def leftovers(prefix: str) -> list[str]:
    """Lines about namespaces, links and qdiscs of the lab whose names start with `prefix`
    (`t123` from tag t and pid 123: its own `t123n0`, `t123h0`, `t123b`, not `t1234n0`'s)."""
    out = subprocess.run("ip netns list; ip -o link; tc qdisc show", shell=True,
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    own = re.compile(rf"\b{prefix}[bnh]")
    return [line for line in out.splitlines() if own.search(line)]


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_parse_links_reads_rates_and_delays_and_names_them():
    links = parse_links("unshaped, 1gbit:0.5ms,100MBIT:10ms,10gbit,2.5gbit:1ms")
    assert links == [Link(None, 0.0), Link(10**9, 0.5), Link(10**8, 10.0), Link(10**10, 0.0),
                     Link(2_500_000_000, 1.0)]  # fmt: skip
    assert [link.name for link in links] == [
        "unshaped", "1gbit-0.5ms", "100mbit-10ms", "10gbit-0ms", "2500mbit-1ms"]  # fmt: skip
    assert [link.name for link in DEFAULT_LINKS] == [
        "unshaped", "10gbit-0.5ms", "10gbit-10ms", "1gbit-0.5ms", "1gbit-10ms",
        "100mbit-0.5ms", "100mbit-10ms"]  # fmt: skip
    assert parse_links(",".join(link.name.replace("-", ":") for link in DEFAULT_LINKS)) == list(
        DEFAULT_LINKS
    )


@pytest.mark.parametrize("text", ["unshaped,0mbit", "999kbit", "0.5mbit"])
def test_parse_links_refuses_a_rate_below_one_mbit(text):
    with pytest.raises(SparknetError, match=r"the slowest link a lab makes is 1mbit$"):
        parse_links(text)


@pytest.mark.parametrize(
    "text, item",
    [("1gbps", "1gbps"), ("", ""), ("1gbit:10", "1gbit:10"), ("unshaped:1ms", "unshaped:1ms")],
)  # fmt: skip
def test_parse_links_refuses_bad_text_saying_what_it_accepts(text, item):
    with pytest.raises(SparknetError) as err:
        parse_links(text)
    assert str(err.value) == (
        f"bad link {item!r}: links are comma-separated, each `unshaped` or RATE[:DELAY] with RATE "
        "a number and kbit, mbit or gbit and DELAY a number and ms, e.g. "
        "unshaped,1gbit:0.5ms,100mbit:10ms"
    )


@needs_netns
def test_unshaped_round_trip_is_short():
    with NetLab(2, Link(None, 0.0), tag=TAG) as lab:
        assert round_trip_ms(lab) < 5


@needs_netns
@needs_delay
def test_round_trip_crosses_four_delayed_ends():
    """Node to node a packet leaves two shaped ends (its own, the bridge's port towards the
    other node): 2 x 10 ms one way, 40 ms there and back."""
    with NetLab(2, Link(10**8, 10.0), tag=TAG) as lab:
        assert 38 <= round_trip_ms(lab) < 60


@needs_netns
def test_delay_without_netem_is_refused_up_front():
    if _NO_DELAY is None:
        pytest.skip("this kernel has netem")
    with (
        pytest.raises(SparknetError, match="link 1gbit-10ms has a delay, but"),
        NetLab(2, Link(10**9, 10.0), tag=TAG),
    ):
        pass
    assert leftovers(f"{TAG}{os.getpid()}") == []


@needs_netns
@pytest.mark.parametrize("text", ["100mbit", pytest.param("100mbit:10ms", marks=needs_delay)])
def test_transfer_takes_the_time_the_rate_says_and_counters_see_it(text):
    (link,) = parse_links(text)
    size = 3_000_000
    with NetLab(2, link, tag=TAG) as lab:
        receiver = serve(lab, 1, "recv", 9001)
        before = lab.counters()
        sender = tool(lab, 0, "send", lab.nodes[1].address, 9001, size)
        seconds = float(sender.communicate(timeout=60)[0])
        assert receiver.communicate(timeout=10)[0].split()[0] == str(size)
        grown = lab.counters() - before
        # a process inside node 0 reads the same counters, through the creator's pid
        veths = [node.host_veth for node in lab.nodes]
        code = f"import sparknet.bench.links as m; print(m.link_bytes({lab.root_pid}, {veths}))"
        inside = lab.popen(lab.nodes[0], [sys.executable, "-c", code], cwd=REPO, text=True,
                           stdout=subprocess.PIPE).communicate(timeout=30)[0]  # fmt: skip
        assert before + grown <= int(inside) <= lab.counters()
    at_rate = size * 8 / 10**8  # 0.24 s; tbf's 128 KiB buckets let a little through at once
    assert 0.8 * at_rate < seconds < 5 * at_rate + 1
    assert grown >= 2 * size  # out of the sender's link, into the receiver's


@needs_netns
def test_root_namespace_cannot_reach_a_node():
    """The root namespace has no route to the lab: its connection leaves by the default route
    (where, on some machines, an upstream proxy accepts any connection) and never reaches the
    listener, whose first connection is node 1's."""
    with NetLab(2, Link(None, 0.0), tag=TAG) as lab:
        receiver = serve(lab, 0, "recv", 9002)
        try:
            with socket.create_connection((lab.nodes[0].address, 9002), timeout=1.5) as conn:
                conn.sendall(b"from the root namespace")
        except OSError:
            pass  # no default route, or one that refuses
        tool(lab, 1, "send", lab.nodes[0].address, 9002, 10).communicate(timeout=30)
        assert receiver.communicate(timeout=10)[0].split() == ["10", lab.nodes[1].address]


@needs_netns
@pytest.mark.parametrize("raises", [False, True])
def test_exit_removes_namespaces_links_qdiscs_and_processes(raises):
    prefix = f"{TAG}{os.getpid()}"
    expect = pytest.raises(RuntimeError) if raises else contextlib.nullcontext()
    with expect, NetLab(2, Link(10**9, 0.0), tag=TAG) as lab:
        sleeper = lab.popen(lab.nodes[1], ["sleep", "120"])
        folder = lab._dir
        assert len(leftovers(prefix)) >= 7  # 2 namespaces, bridge, 2 veths, 2 qdiscs
        if raises:
            raise RuntimeError("the body failed")
    assert leftovers(prefix) == []
    assert sleeper.poll() is not None
    assert folder is not None and not folder.exists()


def start_lab_child() -> tuple[subprocess.Popen, int]:
    """A process running a lab; its sleeper's pid, once the lab is up."""
    child = subprocess.Popen([sys.executable, "-c", LAB_CHILD, TAG], cwd=REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert child.stdout is not None
    line = child.stdout.readline()
    assert line.strip().isdigit(), child.communicate(timeout=30)
    return child, int(line)


@needs_netns
def test_ctrl_c_to_a_process_running_a_lab_removes_it():
    child, sleeper = start_lab_child()
    assert leftovers(f"{TAG}{child.pid}")
    child.send_signal(signal.SIGINT)
    _, err = child.communicate(timeout=30)
    assert child.returncode == -signal.SIGINT and "KeyboardInterrupt" in err
    assert leftovers(f"{TAG}{child.pid}") == []
    assert not alive(sleeper)


@needs_netns
def test_sweep_removes_what_a_killed_process_left_and_spares_live_labs():
    child, sleeper = start_lab_child()
    with NetLab(1, Link(None, 0.0), tag=TAG) as live:
        child.kill()
        child.wait(timeout=30)
        dead = f"{TAG}{child.pid}"
        # what the lab started dies with it (the kernel's parent-death signal); its namespaces
        # and links stay for a sweep
        deadline = time.monotonic() + 10
        while alive(sleeper) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert leftovers(dead) and not alive(sleeper)
        other = f"{TAG}x{child.pid}n0"  # another tag's, of the same dead pid
        subprocess.run(["ip", "netns", "add", other], check=True)
        try:
            removed = sweep_leftovers(TAG)
            assert {f"{dead}n0", f"{dead}n1", f"{dead}h0", f"{dead}h1", f"{dead}b"} <= set(removed)
            assert leftovers(dead) == []
            # neither a live owner's lab nor a name without the tag is touched
            assert f"{live.nodes[0].namespace} " in "\n".join(leftovers(f"{TAG}{os.getpid()}"))
            assert other in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                           text=True, check=True).stdout  # fmt: skip
        finally:
            subprocess.run(["ip", "netns", "del", other], check=True)


@needs_netns
def test_standalone_cluster_in_the_lab_runs_a_driver_from_node_0(tmp_path):
    with NetLab(3, Link(10**9, 0.0), tag=TAG) as lab:
        node0, *workers = lab.nodes
        master = lab.standalone(workers, node0, cores=1, memory="1g")
        assert master == f"spark://{node0.address}:7077"
        driver = lab.popen(node0, [sys.executable, "-c", DRIVER, master], cwd=tmp_path,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
        out, err = driver.communicate(timeout=120)
        assert "result 14" in out, err[-3000:]
        pids = [int(pid) for node in lab.nodes for pid in subprocess.run(
            ["ip", "netns", "pids", node.namespace], capture_output=True, text=True, check=True
        ).stdout.split()]  # fmt: skip
        assert len(pids) >= 3  # master and workers, still up
    assert not [pid for pid in pids if alive(pid)]
    assert leftovers(f"{TAG}{os.getpid()}") == []
