"""Emulated slow links for `sparknet bench peers`.

An isolated network of Linux network namespaces on one machine, shaped with tc, that a Spark
standalone cluster runs in, removed whole afterwards.

Layout: one bridge in the root namespace with no address (nothing in the root namespace, no
other user of the machine, can reach the lab; only root gets in, through `ip netns exec`), and
per node a namespace holding one end of a veth pair whose other end is a port of the bridge.
Both ends of every veth are shaped, so a packet from node A to node B leaves through two shaped
ends, A's own and the bridge's port towards B: node to node, one-way latency is twice the link's
delay (a round trip four times), and the rate holds on each end.

Every name carries a tag and the creating process's pid (`snb1234n0`, `snb1234h0`, `snb1234b`),
so a later run can tell the leftovers of a process that died (kill -9) and remove them.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparknet import interrupts
from sparknet.errors import SparknetError
from sparknet.processes import alive

# `# lazy: pyspark`: `sparknet bench --help` imports this module; pyspark only to find Spark's
# home for a standalone cluster

_UNITS = {"gbit": 10**9, "mbit": 10**6, "kbit": 10**3}
_LINK_TEXT = re.compile(r"(\d+(?:\.\d+)?)(gbit|mbit|kbit)(?:[:-](\d+(?:\.\d+)?)ms)?")
_ACCEPTED = (
    "links are comma-separated, each `unshaped` or RATE[:DELAY] with RATE a number and kbit, "
    "mbit or gbit and DELAY a number and ms, e.g. unshaped,1gbit:0.5ms,100mbit:10ms"
)


@dataclass(frozen=True)
class Link:
    """One emulated link setting: `rate_bit` bits/s (None: unshaped, no qdisc at all) and the
    one-way delay netem adds on each end of a veth (0 when unshaped)."""

    rate_bit: int | None
    delay_ms: float

    def __post_init__(self) -> None:
        if self.rate_bit is not None and self.rate_bit <= 0:
            raise ValueError(f"rate_bit must be positive or None, not {self.rate_bit}")
        if self.delay_ms < 0 or (self.rate_bit is None and self.delay_ms):
            raise ValueError(f"delay_ms must be >= 0, and 0 when unshaped, not {self.delay_ms}")

    @property
    def name(self) -> str:
        """`unshaped`, or rate and delay: `1gbit-10ms` (parse_links reads it back)."""
        if self.rate_bit is None:
            return "unshaped"
        unit = next((u for u, s in _UNITS.items() if self.rate_bit % s == 0), None)
        rate = f"{self.rate_bit // _UNITS[unit]}{unit}" if unit else f"{self.rate_bit}bit"
        return f"{rate}-{self.delay_ms:g}ms"


DEFAULT_LINKS: tuple[Link, ...] = (
    Link(None, 0.0),
    *(Link(rate, delay) for rate in (10**10, 10**9, 10**8) for delay in (0.5, 10.0)),
)


#: the slowest link a lab makes: below it a run of the benchmark takes hours
MIN_RATE_BIT = 10**6
#: the most Spark workers a lab holds (a namespace each, plus the driver's)
MAX_WORKERS = 64


def parse_links(text: str) -> list[Link]:
    """Links from `unshaped,1gbit:0.5ms,100mbit` (no delay: 0 ms; a Link.name such as
    `1gbit-0.5ms` reads too); SparknetError otherwise."""
    links = []
    for item in (part.strip().lower() for part in text.split(",")):
        match = _LINK_TEXT.fullmatch(item)
        if item == "unshaped":
            links.append(Link(None, 0.0))
        elif match and float(match[1]) * _UNITS[match[2]] >= MIN_RATE_BIT:
            links.append(Link(round(float(match[1]) * _UNITS[match[2]]), float(match[3] or 0)))
        elif match:
            raise SparknetError(f"bad link {item!r}: the slowest link a lab makes is 1mbit")
        else:
            raise SparknetError(f"bad link {item!r}: {_ACCEPTED}")
    return links


@dataclass(frozen=True)
class LabNode:
    """One node of a lab: its namespace, its address there, and its veth's end on the bridge."""

    namespace: str
    address: str
    host_veth: str


def _ip(*args: str, check: bool = True) -> str:
    """Run `ip` or `tc` (args[0]); its stdout, or SparknetError with its stderr when `check`."""
    done = subprocess.run(list(args), capture_output=True, text=True)
    if check and done.returncode != 0:
        raise SparknetError(f"`{' '.join(args)}` failed: {done.stderr.strip() or done.returncode}")
    return done.stdout


def _probe(*commands: tuple[str, ...]) -> str | None:
    """Run commands (NS: the namespace) in a throw-away namespace; None, or the first error."""
    name = f"snb{os.getpid()}n999"  # named as a lab's node: a killed probe's is swept too
    try:
        try:
            _ip("ip", "netns", "add", name)
        except SparknetError as exc:
            return f"ip netns add failed: {exc}"
        for command in commands:
            _ip(*(name if arg == "NS" else arg for arg in command))
        return None
    except SparknetError as exc:
        return str(exc)
    finally:
        _ip("ip", "netns", "del", name, check=False)


def why_no_namespaces() -> str | None:
    """None when a lab can be made here (tried for real: a namespace with a bridge, a veth pair
    and a tbf qdisc, then deleted); else a short reason."""
    if os.geteuid() != 0:
        return "not root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"no `{tool}` command"
    return _probe(
        ("ip", "-n", "NS", "link", "add", "name", "probe0", "type", "bridge"),
        ("ip", "-n", "NS", "link", "add", "name", "v0", "type", "veth", "peer", "name", "v1"),
        ("tc", "-n", "NS", "qdisc", "add", "dev", "v0", "root", "tbf", "rate", "1gbit",
         "burst", "1mb", "limit", "2mb"),
    )  # fmt: skip


def why_no_delay() -> str | None:
    """None when links with a delay can be made here: the kernel has the netem qdisc (some, such
    as small VM kernels, have tbf but no netem); else a short reason."""
    netem = ("tc", "-n", "NS", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms")
    reason = why_no_namespaces()
    if reason is None and _probe(netem):
        return "the kernel has no netem qdisc (CONFIG_NET_SCH_NETEM)"
    return reason


def shaping(dev: str, link: Link) -> list[list[str]]:
    """The tc commands (without `tc [-n NS]`) that shape `dev`'s egress to `link`: netem for
    the delay, tbf under it for the rate. tbf's bucket holds 4 ms of the rate (rate/HZ at HZ
    250; measured here, 1 ms lost 10% of 1 Gbit/s and 10 ms lost more at 10 Gbit/s) and at
    least two 64 KiB GSO packets; its queue that and 5 ms more. netem's queue holds twice what
    is in flight during the delay, in MTU-sized packets."""
    if link.rate_bit is None:
        return []
    rate_bytes = link.rate_bit // 8
    burst = max(rate_bytes // 250, 128 * 1024)
    limit = burst + max(rate_bytes // 200, 64 * 1024)
    tbf = ["tbf", "rate", f"{link.rate_bit}bit", "burst", str(burst), "limit", str(limit)]
    if not link.delay_ms:
        return [["qdisc", "add", "dev", dev, "root", "handle", "1:", *tbf]]
    packets = max(1000, int(2 * rate_bytes * link.delay_ms / 1000 / 1500))
    return [
        ["qdisc", "add", "dev", dev, "root", "handle", "1:", "netem",
         "delay", f"{link.delay_ms:g}ms", "limit", str(packets)],
        ["qdisc", "add", "dev", dev, "parent", "1:1", "handle", "2:", *tbf],
    ]  # fmt: skip


def link_bytes(root_pid: int, veths: list[str]) -> int:
    """rx + tx bytes of `veths` as the network namespace of process `root_pid` sees them.

    /proc/PID/net/dev shows PID's namespace, not the reader's: a process inside a lab namespace
    (a benchmark driver on node 0) reads the bridge-side veths through the pid of a process in
    the root namespace (NetLab.root_pid, its creator). A packet from node to node counts twice:
    it leaves the sender's link and enters the receiver's."""
    seen = {}
    for line in Path(f"/proc/{root_pid}/net/dev").read_text().splitlines()[2:]:
        name, _, fields = line.partition(":")
        seen[name.strip()] = int(fields.split()[0]) + int(fields.split()[8])
    missing = [veth for veth in veths if veth not in seen]
    if missing:
        raise SparknetError(f"no {', '.join(missing)} in /proc/{root_pid}/net/dev: lab gone?")
    return sum(seen[veth] for veth in veths)


def _names(what: str) -> list[str]:
    """Names of the network namespaces (`netns`) or of the root namespace's links (`link`)."""
    key = "name" if what == "netns" else "ifname"
    return [entry[key] for entry in json.loads(_ip("ip", "-j", what, "list") or "[]")]


def _namespace_pids(namespaces: list[str]) -> list[int]:
    """The processes inside the namespaces (not this one, in case it is in one)."""
    out = "".join(_ip("ip", "netns", "pids", ns, check=False) for ns in namespaces)
    return [int(pid) for pid in out.split() if int(pid) != os.getpid()]


def _end(pids: Callable[[], list[int]], groups: Callable[[], list[int]] = list) -> None:
    """SIGTERM the processes `pids()` lists and the process groups `groups()` lists; after 5 s,
    SIGKILL what is left."""
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 2.0)):
        targets = pids()
        for pid, kill in [*((g, os.killpg) for g in groups()), *((p, os.kill) for p in targets)]:
            with contextlib.suppress(ProcessLookupError):
                kill(pid, sig)
        deadline = time.monotonic() + wait
        while targets and time.monotonic() < deadline:
            targets = [pid for pid in targets if alive(pid)]
            time.sleep(0.05)


def _remove(namespaces: list[str], links: list[str], dirs: list[Path]) -> tuple[list, list]:
    """Remove each, the processes in the namespaces first; (removed, left): what was there and
    is gone, what is still there. A missing item is skipped; one that fails stops no other."""
    _end(lambda: _namespace_pids(namespaces))

    def present() -> set[str]:
        return {*_names("link"), *_names("netns"), *(str(d) for d in dirs if d.exists())}

    before = present()
    for link in links:  # a veth takes its peer in the namespace and both qdiscs with it
        if link in before:
            _ip("ip", "link", "del", link, check=False)
    for namespace in namespaces:
        if namespace in before:
            _ip("ip", "netns", "del", namespace, check=False)
    for folder in dirs:
        shutil.rmtree(folder, ignore_errors=True)
    after = present()
    asked = [*links, *namespaces, *map(str, dirs)]
    return [x for x in asked if x in before - after], [x for x in asked if x in after]


def _check_tag(tag: str) -> None:
    if not re.fullmatch(r"[a-z]{1,6}", tag):
        raise ValueError(f"tag must be 1-6 lowercase letters (names end in pid digits): {tag!r}")


def _sweep(tag: str, stale: Callable[[int], bool]) -> list[str]:
    """Remove the lab items named with `tag` whose owner pid is `stale`; what was removed."""
    _check_tag(tag)
    item, folder = re.compile(rf"{tag}(\d+)[bnh]\d*"), re.compile(rf"{tag}(\d+)-\w+")
    namespaces = [n for n in _names("netns") if (m := item.fullmatch(n)) and stale(int(m[1]))]
    links = [n for n in _names("link") if (m := item.fullmatch(n)) and stale(int(m[1]))]
    links.sort(key=lambda n: n.endswith("b"))  # the bridge after its ports
    tmp = Path(tempfile.gettempdir())
    dirs = [p for p in tmp.iterdir() if (m := folder.fullmatch(p.name)) and stale(int(m[1]))]
    return _remove(namespaces, links, dirs)[0]


def sweep_leftovers(tag: str = "snb") -> list[str]:
    """Remove the namespaces (and processes in them), links and temp folders named with `tag`
    whose owning process is gone (a lab whose process was killed -9); what was removed. Names
    without the tag, or of a live process, are never touched."""
    return _sweep(tag, lambda pid: not alive(pid))


#: (tag, pid) of the labs open in this process: two at once would share names
_OPEN: set[tuple[str, int]] = set()


def die_with_parent() -> None:
    """In a child before its exec: SIGKILL when the process that started it dies (Linux's
    PR_SET_PDEATHSIG, kept across the exec of `ip netns exec` and of what it runs)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Ctrl-C (and SIGTERM under the CLI's handler) waits until the block ends, so a clean-up
    is not cut half way; the KeyboardInterrupt comes right after it."""
    held = []
    plain = threading.current_thread() is threading.main_thread() and (
        signal.getsignal(signal.SIGINT) is signal.default_int_handler
    )
    if plain:
        signal.signal(signal.SIGINT, lambda *_: held.append(True))
    try:
        with interrupts.deferred():
            yield
    finally:
        if plain:
            signal.signal(signal.SIGINT, signal.default_int_handler)
    if held:
        raise KeyboardInterrupt


@contextlib.contextmanager
def _lock(wait_s: float = 120.0) -> Iterator[None]:
    """One lab at a time picks its /24 and puts its addresses up (held across both: a lab's
    addresses show only inside its namespaces, so two labs could pick the same one). The lock
    lives in a root-only dir and is opened without following links: a world-writable lock dir
    would let any user hold it forever, or plant a link that root then creates a file through."""
    folder = Path("/run/sparknet")
    folder.mkdir(mode=0o700, exist_ok=True)
    if folder.is_symlink() or folder.stat().st_uid != 0 or folder.stat().st_mode & 0o077:
        raise SparknetError(f"{folder} must be a dir only root can write: remove it")
    fd = os.open(folder / "netlab.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise SparknetError(
                        f"another lab held {folder}/netlab.lock for {wait_s:g} s; try again"
                    ) from None
                time.sleep(0.2)
        yield
    finally:
        os.close(fd)


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 in 10.0.0.0/8 (then 172.16.0.0/12) that no address or route of the machine, and no
    address in any namespace, overlaps; where the search starts depends on the pid."""
    used = []
    for namespace in [None, *_names("netns")]:
        where = ["-n", namespace] if namespace else []
        for entry in json.loads(_ip("ip", *where, "-j", "-4", "addr", check=False) or "[]"):
            used += [f"{a['local']}/{a['prefixlen']}" for a in entry.get("addr_info", [])]
    routes = json.loads(_ip("ip", "-j", "-4", "route", "show", "table", "all") or "[]")
    used += [r["dst"] for r in routes if r.get("dst", "default") != "default"]
    taken = [ipaddress.ip_network(u, strict=False) for u in used]
    for block in map(ipaddress.ip_network, ("10.0.0.0/8", "172.16.0.0/12")):
        count = block.num_addresses >> 8
        for k in range(count):
            net = ipaddress.ip_network((int(block[0]) + ((os.getpid() + k) % count << 8), 24))
            if not any(net.overlaps(t) for t in taken):
                return net
    raise SparknetError("no free /24 in 10.0.0.0/8 or 172.16.0.0/12 for the network lab")


class NetLab:
    """`nodes` namespaces on a bridge, every veth end shaped to `link`; a context manager.

    >>> with NetLab(3, Link(10**9, 0.5)) as lab:
    ...     master = lab.standalone(lab.nodes[1:], lab.nodes[1], cores=1)
    ...     lab.popen(lab.nodes[0], [sys.executable, "driver.py", master]).wait()
    """

    def __init__(self, nodes: int, link: Link, tag: str = "snb") -> None:
        _check_tag(tag)
        if not 1 <= nodes <= 240 or len(f"{tag}{4194304}h{nodes - 1}") > 15:
            raise ValueError(f"nodes must be 1..240 and names <= 15 chars with tag {tag!r}")
        self.link, self.tag, self.size = link, tag, nodes
        self.nodes: list[LabNode] = []
        self.root_pid = 0  # from __enter__: the creator, whose /proc/PID/net/dev counters() reads
        self._procs: list[subprocess.Popen] = []
        self._dir: Path | None = None
        self._masters = 0
        self._closed = False

    def __enter__(self) -> NetLab:
        reason = why_no_delay() if self.link.delay_ms else None
        if reason:
            raise SparknetError(f"link {self.link.name} has a delay, but {reason}: use 0 ms here")
        if (self.tag, os.getpid()) in _OPEN:
            raise SparknetError(f"a NetLab with tag {self.tag} is open here: use another tag")
        self.root_pid, self.nodes, self._closed = os.getpid(), [], False
        prefix = f"{self.tag}{self.root_pid}"
        _OPEN.add((self.tag, self.root_pid))
        try:
            # dead owners' leftovers, and this process's own from a lab whose exit failed
            _sweep(self.tag, lambda pid: pid == self.root_pid or not alive(pid))
            self._dir = Path(tempfile.mkdtemp(prefix=f"{prefix}-"))
            with _lock():
                self._build(prefix, _free_subnet())
            for node in self.nodes:
                for command in shaping(node.host_veth, self.link):
                    _ip("tc", *command)
                for command in shaping("eth0", self.link):
                    _ip("tc", "-n", node.namespace, *command)
        except BaseException:
            self.close()
            raise
        return self

    def _build(self, prefix: str, net: ipaddress.IPv4Network) -> None:
        """The bridge and the nodes, IPv4 only: the bridge gets no IPv6 link-local address the
        root namespace could reach the nodes by, and no IPv6 chatter (~100 bytes/s a link)
        shows in counters()."""
        ipv6 = Path("/proc/sys/net/ipv6/conf")
        off = ["net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1"]
        _ip("ip", "link", "add", f"{prefix}b", "type", "bridge")
        for i in range(self.size):
            node = LabNode(f"{prefix}n{i}", str(net[10 + i]), f"{prefix}h{i}")
            self.nodes.append(node)
            ns = ("ip", "-n", node.namespace)
            _ip("ip", "netns", "add", node.namespace)
            if ipv6.exists():  # before the veth arrives, which then takes `default`
                _ip("ip", "netns", "exec", node.namespace, "sysctl", "-qw", *off)
            _ip(*ns, "link", "set", "lo", "up")
            _ip("ip", "link", "add", node.host_veth, "type", "veth",
                "peer", "name", "eth0", "netns", node.namespace)  # fmt: skip
            _ip(*ns, "addr", "add", f"{node.address}/24", "dev", "eth0")
            _ip(*ns, "link", "set", "eth0", "up")
        for dev in [f"{prefix}b", *(node.host_veth for node in self.nodes)]:
            if ipv6.exists():
                (ipv6 / dev / "disable_ipv6").write_text("1")
            port = ["master", f"{prefix}b"] if dev != f"{prefix}b" else []
            _ip("ip", "link", "set", dev, *port, "up")

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        left = self.close()
        if left and exc_type is None:  # else the exception in flight says more
            raise SparknetError(f"could not remove {', '.join(left)}: `ip netns/link del` them")

    def close(self) -> list[str]:
        """End the processes started here (their process groups) and all in the namespaces,
        then remove namespaces, veths (with their qdiscs), the bridge and the temp folder; what
        could not be removed. Once per lab (later calls do nothing: another lab of this tag may
        hold the names by then); a missing item is no error, one that fails to go stops no
        other."""
        if not self.root_pid or self._closed:
            return []
        self._closed = True
        prefix = f"{self.tag}{self.root_pid}"
        names = [f"{prefix}n{i}" for i in range(self.size)]
        with _signals_held():
            try:  # a reaped leader's pid, its group's id, could be another process's by now
                _end(
                    lambda: _namespace_pids(names),
                    lambda: [p.pid for p in self._procs if p.poll() is None],
                )
                for proc in self._procs:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(timeout=1)
                veths = [f"{prefix}h{i}" for i in range(self.size)]
                dirs = [self._dir] if self._dir else []
                return _remove(names, [*veths, f"{prefix}b"], dirs)[1]
            finally:
                _OPEN.discard((self.tag, self.root_pid))

    def node_env(self, node: LabNode, env: dict[str, str] | None = None) -> dict[str, str]:
        """This process's environment plus `env`; unless `env` says otherwise Spark binds to the
        node's address, runs its Python workers on this Python (the venv's) and keeps its
        scratch files in the lab's temp folder (gone with the lab, even after a SIGKILL)."""
        own = {"SPARK_LOCAL_IP": node.address, "PYSPARK_PYTHON": sys.executable,
               "SPARK_LOCAL_DIRS": str(self._dir)}  # fmt: skip
        return {**os.environ, **own, **(env or {})}

    def popen(
        self, node: LabNode, argv: list[str], env: dict[str, str] | None = None, **kw: Any
    ) -> subprocess.Popen:
        """Start `argv` inside `node`'s namespace (`ip netns exec`), in a session of its own;
        the lab ends its process group on exit, and the kernel kills it when this process dies
        without an exit (kill -9): a lab's leftovers then are its namespaces, for the next
        lab's sweep, not a cluster training on. `env` adds to the environment (`node_env`)."""
        ns_argv = ["ip", "netns", "exec", node.namespace, *argv]
        proc = subprocess.Popen(
            ns_argv, env=self.node_env(node, env), start_new_session=True,
            preexec_fn=die_with_parent, **kw,
        )  # fmt: skip
        self._procs.append(proc)
        return proc

    def counters(self) -> int:
        """Bytes that crossed the lab's links so far (link_bytes: a packet from node to node
        counts twice), read in the root namespace through this lab's creator, `root_pid`."""
        return link_bytes(self.root_pid, [node.host_veth for node in self.nodes])

    def standalone(
        self,
        workers: list[LabNode],
        master: LabNode,
        cores: int,
        memory: str = "2g",
        env: dict[str, str] | None = None,
        timeout: float = 120.0,
    ) -> str:
        """Start a Spark standalone master on `master` and a worker on each of `workers`, wait
        until all have registered; the master's URL. Logs, work and local dirs live in the
        lab's temp folder; the REST server is off, the web UIs on free ports. The workers start
        once the master listens: a worker that finds no master retries only after 5-15 s."""
        import pyspark  # lazy: pyspark

        if self._dir is None:
            raise SparknetError("NetLab.standalone() runs inside `with NetLab(...) as lab:`")
        home = Path(pyspark.__file__).parent
        logs = self._dir / f"spark{self._masters}"
        logs.mkdir()
        port = str(7077 + self._masters)
        self._masters += 1
        base = {"SPARK_HOME": str(home), "SPARK_MASTER_OPTS": "-Dspark.master.rest.enabled=false",
                **(env or {})}  # fmt: skip
        started: list[subprocess.Popen] = []
        deadline = time.monotonic() + timeout

        def start(node: LabNode, log: str, daemon: str, *args: str) -> None:
            argv = [str(home / "bin" / "spark-class"), f"org.apache.spark.deploy.{daemon}", *args]
            with (logs / log).open("w") as out:
                started.append(self.popen(node, argv, base, stdout=out, stderr=subprocess.STDOUT))

        def wait(what: str, needle: str, count: int) -> None:
            while (logs / "master.log").read_text(errors="replace").count(needle) < count:
                if time.monotonic() > deadline or any(p.poll() is not None for p in started):
                    tails = [(log.name, log.read_text(errors="replace").split("\n")[-4:])
                             for log in sorted(logs.glob("*.log"))]  # fmt: skip
                    said = " | ".join(f"{name}: {' / '.join(lines)}" for name, lines in tails)
                    raise SparknetError(f"{what} in the lab within {timeout:g} s: {said}")
                time.sleep(0.1)

        start(master, "master.log", "master.Master", "--host", master.address, "--port", port,
              "--webui-port", "0")  # fmt: skip
        wait("no Spark master started", "Starting Spark master at", 1)
        url = f"spark://{master.address}:{port}"
        for i, node in enumerate(workers):
            start(node, f"worker{i}.log", "worker.Worker", "--host", node.address,
                  "--cores", str(cores), "--memory", memory, "--webui-port", "0",
                  "--work-dir", str(logs / f"work{i}"), url)  # fmt: skip
        wait(f"not all {len(workers)} Spark workers registered", "Registering worker", len(workers))
        return url
