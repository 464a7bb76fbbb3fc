"""Bootstrap: what turns bare nodes into a Spark standalone cluster's machines.

A bootstrap is a list of `Step`s per node (`steps.py`: install and configuration; `daemons.py`:
the master and the workers), each with `check` (already done?) and `apply`; the runner here
applies only the steps whose check fails, on every node at once (`nodes.run_all`), so a second
run changes nothing and says so. A failing step stops its node; the one error names the node,
the step and the last lines of the failed command's output. Then `health.py` checks that every
worker registered. `stop_daemons` undoes the daemons (what `down` runs).

Nothing here puts the secret on a command line or in an error: it travels to the node in a file
(streamed over the SSH channel, `remote.upload`), into a directory only the node's user can open.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparknet.cluster import nodes
from sparknet.cluster.address import Endpoint
from sparknet.cluster.nodes import Access
from sparknet.cluster.remote import TAIL_LINES, CommandFailed, Conn, q, run, tail_lines
from sparknet.cluster.spark.daemons import Autostop, BackstopOff, Master, Worker
from sparknet.cluster.spark.health import ClusterHealth, Expected, cluster_health, master_json
from sparknet.cluster.spark.plan import (
    JOBS_DIR,
    Context,
    Facts,
    Node,
    Plan,
    node_facts,
)
from sparknet.cluster.spark.spark_conf import load_or_create_secret
from sparknet.cluster.spark.steps import PREPARE, Step
from sparknet.cluster.spark.wheel import Wheel, build_wheel, source_checkout
from sparknet.errors import SparknetError
from sparknet.node.command import node_command
from sparknet.say import Say, quiet

# --- the runner ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeReport:
    """Which steps a node applied and which it found done."""

    node: str
    applied: tuple[str, ...] = ()
    skipped: tuple[str, ...] = ()

    def __add__(self, other: NodeReport) -> NodeReport:
        return NodeReport(self.node, self.applied + other.applied, self.skipped + other.skipped)


class StepFailed(SparknetError):
    """A step failed on a node: `node`, `step`, and the last lines of the command's output."""

    def __init__(self, node: str, step: str, what: str, tail: list[str]) -> None:
        last = f": {tail[-1].strip()}" if tail else ""
        super().__init__(f"{node}: step {step} failed ({what}){last}")
        self.node, self.step, self.what, self.tail = node, step, what, tail


def run_steps(node: str, steps: Sequence[Step], conn: Conn, say: Say = quiet) -> NodeReport:
    """Each step in order on one node: skipped when its check says done, else applied and
    checked again (a step whose check still fails is a bug in it, reported like a failure)."""
    applied: list[str] = []
    skipped: list[str] = []
    for step in steps:
        try:
            if step.check(conn):
                skipped.append(step.name)
                continue
            say(f"{node}: {step.name} ...")
            step.apply(conn)
            if not step.check(conn):
                raise CommandFailed("applied, but its check still fails", [])
        except CommandFailed as exc:
            raise StepFailed(node, step.name, exc.what, exc.tail) from None
        applied.append(step.name)
        say(f"{node}: {step.name} done")
    return NodeReport(node, tuple(applied), tuple(skipped))


def gather_facts(conn: Conn, node: Node) -> Facts:
    try:
        return node_facts(conn, node.prefix)
    except CommandFailed as exc:
        raise StepFailed(node.name, "facts", exc.what, exc.tail) from None


@dataclass(frozen=True)
class BootstrapReport:
    """What a bootstrap did on each node, and the cluster's health after it."""

    nodes: dict[str, NodeReport]
    health: ClusterHealth

    @property
    def nothing_to_do(self) -> bool:
        return not any(r.applied for r in self.nodes.values())

    def lines(self) -> list[str]:
        if self.nothing_to_do:
            return [f"nothing to do: every step was already done on all {len(self.nodes)} nodes"]
        out = []
        for r in self.nodes.values():
            did = ", ".join(r.applied) if r.applied else "nothing"
            out.append(f"{r.node}: applied {did} ({len(r.skipped)} steps already done)")
        return out


def run_on_nodes(
    plan: Plan,
    access: Access,
    nodes_: Sequence[Node],
    steps_for: Callable[[Context], list[Step]],
    say: Say,
    timeout: float,
) -> dict[str, tuple[NodeReport, Facts]]:
    """`steps_for(ctx)` on each of `nodes_` in parallel. Step failures are collected into one
    StepFailed-like SparknetError naming every failed node and step, with each one's output."""
    by_name = {n.name: n for n in nodes_}

    def one(endpoint: Endpoint, conn: Conn) -> tuple[NodeReport, Facts] | StepFailed:
        node = by_name[endpoint.name]
        try:
            facts = gather_facts(conn, node)
            ctx = Context(plan, node, facts, access)
            return run_steps(node.name, steps_for(ctx), conn, say), facts
        except StepFailed as exc:
            return exc

    results = nodes.run_all([n.endpoint for n in nodes_], access, one, timeout)
    failed = [r for r in results.values() if isinstance(r, StepFailed)]
    if failed:
        raise BootstrapFailed(failed)
    return {k: v for k, v in results.items() if not isinstance(v, StepFailed)}


class BootstrapFailed(SparknetError):
    """Steps failed on some nodes. The first line names each node, step and its last output
    line; the lines after it hold each failure's last output lines."""

    def __init__(self, failures: Sequence[StepFailed]) -> None:
        super().__init__("bootstrap failed: " + "; ".join(str(f) for f in failures))
        self.failures = list(failures)
        self.with_details(
            line
            for f in failures
            if f.tail
            for line in [
                f"--- {f.node}, step {f.step}, last output:",
                *(f"  {ln}" for ln in f.tail),
            ]
        )


def bootstrap(
    plan: Plan,
    access: Access,
    *,
    say: Say = quiet,
    timeout: float = 3600,
    health_wait_s: float = 120,
    force: bool = False,
) -> BootstrapReport:
    """Bring `plan`'s nodes to a running, healthy Spark standalone cluster; what was done.

    Two rounds over all nodes at once: the install and conf steps (and the master on the master
    node), then the workers, so no worker starts before its master listens. Then the health
    check, which waits up to `health_wait_s` for every worker to register. The master's
    autostop timer, when the plan has one, starts after its worker; then every node's backstop
    is cancelled (`BackstopOff`: the timer replaces it). Unless `force`, a
    bootstrap that would restart the master (or a running worker) under a running job is
    refused first (`check_jobs_unharmed`), before anything changes."""
    if not force:
        check_jobs_unharmed(plan, access)

    def prepare(ctx: Context) -> list[Step]:
        steps: list[Step] = [cls(ctx) for cls in PREPARE]
        return steps + ([Master(ctx)] if ctx.is_master else [])

    first = run_on_nodes(plan, access, plan.nodes, prepare, say, timeout)

    def daemons(ctx: Context) -> list[Step]:
        timer = ctx.is_master and plan.autostop is not None
        return [Worker(ctx)] + ([Autostop(ctx)] if timer else [])

    second = run_on_nodes(plan, access, plan.nodes, daemons, say, timeout)
    if plan.autostop is not None:
        # the timer runs now: it replaces every node's backstop (none before: a bootstrap cut
        # off earlier leaves each instance to its own)
        run_on_nodes(plan, access, plan.nodes, lambda ctx: [BackstopOff(ctx)], say, timeout)
    reports = {n.name: first[n.name][0] + second[n.name][0] for n in plan.nodes}
    expected = [
        Expected(n.name, n.rpc_host, Context(plan, n, second[n.name][1]).cores, n.gpus)
        for n in plan.nodes
    ]
    health = cluster_health(plan.master, plan.ports, expected, access, wait_s=health_wait_s)
    if not health.ok:
        registered = {w.node for w in health.workers}
        missing = [n for n in plan.nodes if n.name not in registered]
        raise SparknetError(
            "the Spark cluster is not healthy: {problems}", problems="; ".join(health.problems)
        ).with_details(
            line
            for name, lines in _worker_logs(plan, access, missing).items()
            for line in [f"--- {name}, worker log:", *(f"  {ln}" for ln in lines)]
        )
    return BootstrapReport(reports, health)


# --- a job on the cluster -------------------------------------------------------------------------


class JobRunning(SparknetError):
    """A bootstrap would start or restart the Spark master, or restart a running worker, while
    a job runs on the cluster."""


def check_jobs_unharmed(plan: Plan, access: Access) -> None:
    """Refuse (`JobRunning`, one line) a bootstrap that would start or restart the Spark
    master, or restart a running worker, while a job runs on the cluster: a new master has
    the workers kill the executors of every application it does not know (the job's driver
    then waits for executors that never come), and a restarted worker kills its own. A job is
    a sparknet-submit job whose session is alive on the master (what `cluster down` ends), or
    an application the master lists as running. Starting a worker that does not run harms
    nothing: a repair does that while its job runs."""
    conn = nodes.connect(plan.master.endpoint, access)
    try:
        runs = running_jobs(conn, plan.master)
        jobs = [f"job {run_id}" for run_id in runs]
        jobs = jobs or [f"application {app}" for app in _active_apps(conn, plan)]
    finally:
        conn.close()
    if not jobs:
        return
    harm = _restarts(plan, access)
    if harm:
        more = f" (and {len(jobs) - 1} more)" if len(jobs) > 1 else ""
        how = f" (`sparknet-submit cancel {runs[0]}`)" if runs else ""
        raise JobRunning(
            "{job}{more} runs on the cluster, and this bootstrap would {harm}: its executors "
            "would be killed and the job would wait for them forever; wait for it to end or "
            "cancel it{how}, or bootstrap with {@force} to go on anyway",
            job=jobs[0],
            more=more,
            harm="; ".join(harm),
            how=how,
        )


def _active_apps(conn: Conn, plan: Plan) -> list[str]:
    """The ids of the applications the master lists as running; none where it does not answer
    (a dead master knows of none)."""
    try:
        listed = master_json(conn, plan.master.python, plan.ports.master_ui).get("activeapps", [])
    except (CommandFailed, ValueError, AttributeError):
        return []
    return [str(app.get("id")) for app in listed if isinstance(app, dict)]


def _restarts(plan: Plan, access: Access) -> list[str]:
    """What the bootstrap would do to the daemons that harms a running job, per node: start
    or restart the master, restart a running worker (a changed setting, a new version)."""

    def harm(endpoint: Endpoint, conn: Conn) -> list[str]:
        node = next(n for n in plan.nodes if n.name == endpoint.name)
        ctx = Context(plan, node, gather_facts(conn, node))
        out = []
        master = Master(ctx)
        if ctx.is_master and not master.check(conn):
            verb = "restart" if master.running(conn) else "start a new"
            out.append(f"{verb} Spark master on {node.name}")
        worker = Worker(ctx)
        if worker.running(conn) and not worker.check(conn):
            out.append(f"restart the Spark worker on {node.name}")
        return out

    found = nodes.run_all([n.endpoint for n in plan.nodes], access, harm, timeout=300)
    return [what for n in plan.nodes for what in found[n.name]]


def _worker_logs(plan: Plan, access: Access, missing: Sequence[Node]) -> dict[str, list[str]]:
    """The last lines of the workers' logs on `missing` nodes (what a worker that did not
    register says about why); nothing for a node that cannot be asked."""

    def tail(endpoint: Endpoint, conn: Conn) -> list[str]:
        node = next(n for n in missing if n.name == endpoint.name)
        log = q(node.path("logs", "worker.out"))
        return tail_lines(run(conn, f"tail -n {TAIL_LINES} {log} 2>/dev/null; true"))

    try:
        return nodes.run_all([n.endpoint for n in missing], access, tail, timeout=60)
    except SparknetError:
        return {}


def prepare_plan(
    nodes_: Sequence[Node], secret_file: Path, wheel_dir: Path, **settings: Any
) -> Plan:
    """A Plan for `nodes_` (the master first): the cluster's secret from `secret_file` (made
    0600 on first use), the sparknet wheel built from this checkout into `wheel_dir`, and the
    other Plan fields from `settings` (ports, python_env, ...)."""
    wheel = build_wheel(source_checkout(), wheel_dir)
    return Plan(tuple(nodes_), wheel, load_or_create_secret(secret_file), **settings)


def stop_daemons(nodes_: Sequence[Node], access: Access, timeout: float = 120) -> None:
    """`stop_node` on every node at once: what `down` does before it terminates instances, and
    all it does to a static cluster's machines (the install, venv and wheel, stays for the next
    `up`, which writes the conf and units again). A node whose daemons would not stop is a
    NodesFailed naming it."""
    nodes.run_all(
        [n.endpoint for n in nodes_], access, lambda e, c: stop_on(nodes_, e.name, c), timeout
    )


def stop_on(nodes_: Sequence[Node], name: str, conn: Conn) -> None:
    """`stop_node` on node `name` of the cluster's `nodes_`, over its open connection."""
    # stopping reads only the nodes' paths and facts from a plan: no wheel, no secret
    plan = Plan(tuple(nodes_), Wheel(Path("unused.whl"), "", ""), "")
    node = next(n for n in plan.nodes if n.name == name)
    stop_node(Context(plan, node, node_facts(conn, node.prefix)), conn)


def running_jobs(conn: Conn, node: Node) -> list[str]:
    """The run ids of the sparknet-submit jobs whose session is alive on `node` (the master:
    where `cluster down` finds the jobs it ends, `end_jobs`); none where the node has no venv
    (no job could run there)."""
    command = node_command(node.python, "jobs-live", node.path(JOBS_DIR), unless_absent=True)
    out = run(conn, command)
    return sorted(line.strip() for line in out.splitlines() if line.strip())


def end_jobs(node: Node, conn: Conn) -> None:
    """End the process session of every sparknet-submit job still running on `node` (SIGTERM
    to its supervisor's process group: the driver and its Spark driver JVM with it), marked as
    cancelled: without the daemons it could never finish, and on a static host, which stays
    up, nothing else would ever end it."""
    run(conn, node_command(node.python, "jobs-end", node.path(JOBS_DIR), unless_absent=True))


def stop_node(ctx: Context, conn: Conn) -> None:
    """Stop the node's autostop timer, worker and master (by pid file or systemd unit), remove what
    would start them again or let a client in: their systemd units, then the conf file with
    the cluster's secret, only once both stopped (CommandFailed else). Both on every node, not
    only the plan's master: a static cluster whose hosts were reordered has its master
    elsewhere, and stopping a daemon that does not run is no error. Jobs still running there
    are ended first (`end_jobs`)."""
    end_jobs(ctx.node, conn)
    Autostop(ctx).stop(conn, remove=True)
    Worker(ctx).stop(conn, remove=True)
    Master(ctx).stop(conn, remove=True)
    run(conn, f"rm -f {q(ctx.node.path('conf', 'spark-defaults.conf'))}")
