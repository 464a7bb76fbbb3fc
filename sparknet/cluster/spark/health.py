"""Whether a Spark standalone cluster is healthy, as the master's JSON tells it.

Every expected worker registered with the master and ALIVE, with the cores and GPUs expected,
and no other worker ALIVE; the JSON is the master's `:8080/json/`, read on the master node over
SSH."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass

from sparknet.cluster import nodes
from sparknet.cluster.nodes import Access
from sparknet.cluster.remote import CommandFailed, Conn, run
from sparknet.cluster.spark.plan import Node
from sparknet.cluster.spark.spark_conf import Ports
from sparknet.errors import SparknetError
from sparknet.node.command import node_command
from sparknet.spark_security import UI_HOST

# --- health --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Expected:
    """A worker the master should have: the node, its address, its cores and GPUs (None: any
    count; `status` of a static cluster does not ask each host how many it has)."""

    node: str
    address: str
    cores: int | None
    gpus: int | None = 0


@dataclass(frozen=True)
class WorkerState:
    """One worker as the master's JSON shows it."""

    node: str
    address: str
    state: str
    cores: int
    memory_mb: int
    gpus: int


@dataclass(frozen=True)
class ClusterHealth:
    """What `cluster status` prints: the master, each expected worker, and what is wrong."""

    master_url: str
    workers: tuple[WorkerState, ...]
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.problems

    def lines(self) -> list[str]:
        out = [f"Spark master {self.master_url}: " + ("healthy" if self.ok else "UNHEALTHY")]
        for w in self.workers:
            out.append(
                f"  {w.node} ({w.address}): {w.state}, {w.cores} cores, "
                f"{w.memory_mb} MiB, {w.gpus} GPUs"
            )
        out += [f"  problem: {p}" for p in self.problems]
        return out


def judge(master_json: dict, master_url: str, expected: Sequence[Expected]) -> ClusterHealth:
    """Compare the master's JSON (`/json/`) with the workers the cluster should have."""
    alive = {w.get("host"): w for w in master_json.get("workers", []) if w.get("state") == "ALIVE"}
    states, problems = [], []
    for want in expected:
        got = alive.get(want.address)
        if got is None:
            problems.append(
                f"{want.node}'s worker ({want.address}) is not registered with the master"
            )
            continue
        gpus = len(((got.get("resources") or {}).get("gpu") or {}).get("addresses") or [])
        state = WorkerState(
            want.node, want.address, got["state"], int(got.get("cores", 0)),
            int(got.get("memory", 0)), gpus,
        )  # fmt: skip
        states.append(state)
        if want.cores is not None and state.cores != want.cores:
            problems.append(f"{want.node}'s worker offers {state.cores} cores, not {want.cores}")
        if want.gpus is not None and state.gpus != want.gpus:
            problems.append(f"{want.node}'s worker offers {state.gpus} GPUs, not {want.gpus}")
    problems += _unexpected(master_json, {want.address for want in expected})
    return ClusterHealth(master_url, tuple(states), tuple(problems))


def _unexpected(master_json: dict, addresses: set[str]) -> list[str]:
    """A problem per ALIVE worker at an address no expected node has: a host dropped from a
    cluster whose worker still runs (with the cluster's secret) and still takes tasks."""
    return [
        f"a worker nobody expects is registered at {w.get('host')} ({w.get('cores', 0)} cores)"
        for w in master_json.get("workers", [])
        if w.get("state") == "ALIVE" and w.get("host") not in addresses
    ]


def master_json(conn: Conn, python: str, ui_port: int) -> dict:
    """The master's state as JSON, read on the master node (its UI binds 127.0.0.1 there) by
    `sparknet.node` in the node's venv (`python`). A node whose venv is not there (a bootstrap
    that ended before it, a static host only registered) runs no Spark master of this install:
    CommandFailed saying so, as a master that does not answer."""
    command = node_command(python, "master-json", UI_HOST, ui_port, unless_absent=True)
    out = run(conn, command, timeout=30)
    if not out.strip():
        why = f"{python} has no sparknet.node: no venv yet, or one an older sparknet made"
        raise CommandFailed("no answer", [f"{why}; `sparknet cluster bootstrap` installs it"])
    return json.loads(out)


def cluster_health(
    master: Node,
    ports: Ports,
    expected: Sequence[Expected],
    access: Access,
    *,
    wait_s: float = 0,
    connect_timeout: float = 20,
) -> ClusterHealth:
    """The cluster's health, asked of the master until it is healthy or `wait_s` has passed
    (workers register within seconds of starting). A master that does not answer is a
    problem, not an exception: `cluster status` prints it; a master node that takes no SSH
    connection within `connect_timeout` is a SparknetError."""
    url = f"spark://{master.rpc_host}:{ports.master}"
    deadline = time.monotonic() + wait_s
    conn = nodes.connect(master.endpoint, access, connect_timeout)
    try:
        while True:
            try:
                health = judge(master_json(conn, master.python, ports.master_ui), url, expected)
            except (CommandFailed, ValueError) as exc:
                what = exc.tail[-1] if isinstance(exc, CommandFailed) and exc.tail else str(exc)
                health = ClusterHealth(url, (), (f"the master does not answer ({what})",))
            if health.ok or time.monotonic() >= deadline:
                return health
            time.sleep(0.5)
    finally:
        conn.close()


def require_healthy(
    master: Node, ports: Ports, expected: Sequence[Expected], access: Access, wait_s: float = 0
) -> ClusterHealth:
    """`cluster_health`, or one SparknetError naming what is wrong (the missing worker)."""
    health = cluster_health(master, ports, expected, access, wait_s=wait_s)
    if not health.ok:
        raise SparknetError(f"the Spark cluster is not healthy: {'; '.join(health.problems)}")
    return health
