"""Keeping a cluster whole while a job runs on it.

A worker instance gone (a spot interruption, a terminated instance), a spot worker with EC2's
two-minute interruption notice (`spot`), or a Spark worker that is no longer registered with the
master (its daemon died) is a loss; the repair is `cluster up`'s own code with its bootstrap,
which launches what is missing (with the capacity fallback across types and zones) and starts
what is not running, and leaves the rest as it is. A noticed worker is terminated first (EC2
takes it within two minutes anyway), so that `up` counts it as gone and its replacement starts
at once. The job goes on meanwhile: Spark runs a lost executor's tasks on the remaining ones,
and the driver records executors lost and joined in the round rows of metrics.jsonl.

A lost master is no loss this module repairs: the driver runs there, and with it the job.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from sparknet.cluster import address, node_endpoints, nodes, provider, registry, spark_nodes, static
from sparknet.cluster.aws import instances, spot
from sparknet.cluster.aws.instances import Instance
from sparknet.cluster.records import Interrupted
from sparknet.cluster.remote import q, run
from sparknet.cluster.spark.health import ClusterHealth
from sparknet.cluster.spec import ClusterSpec
from sparknet.errors import SparknetError, first_line
from sparknet.say import Say

#: instance states of a member that is gone or going (EC2 ends a spot instance so)
_GOING = frozenset({"shutting-down", "terminated", "stopping", "stopped"})


@dataclass(frozen=True)
class Losses:
    """What is missing from the cluster: whether its master is gone (nothing to repair), one
    line per worker loss, the spot workers with an interruption notice among them, and what
    could not be checked (a spot worker whose notice could not be read)."""

    master_gone: bool
    lines: tuple[str, ...]
    noticed: tuple[str, ...] = ()
    unchecked: tuple[str, ...] = ()


def losses(spec: ClusterSpec, *, endpoint_url: str | None = None) -> Losses:
    """The cluster's losses, from EC2's view (members gone or going), the Spark master's
    (expected workers not ALIVE) and the spot workers' own (an interruption notice). A master
    node that takes no SSH connection, or whose Spark master does not answer, is no worker
    loss: it is said as the master's. A gone or going worker is a loss only while fewer than
    `workers` live (a noticed one, terminated, is shutting down for minutes after its
    replacement came). A static cluster's losses are the Spark master's alone (its hosts are
    the user's: none is replaced, a worker that is not registered is started again)."""
    if not provider.of(spec).LAUNCHES:
        return _static_losses(spec)
    ec2 = instances.ec2_client(spec.region, endpoint_url)
    found = instances.find(ec2, spec.name)
    live = [i for i in found if i.state not in _GOING]
    masters = [i for i in live if i.role == "master"]
    if not masters:
        return Losses(True, ("the master instance is gone",))
    lines: list[str] = []
    missing = spec.workers - sum(1 for i in live if i.role == "worker")
    if missing > 0:
        going = [i for i in found if i.role == "worker" and i.state in _GOING]
        lines += [f"worker {i.id} is {i.state}" for i in going] or [
            f"{missing} of {spec.workers} worker instances are gone"
        ]
    try:
        health = spark_nodes.spark_health(spec, live, endpoint_url=endpoint_url)
    except SparknetError as exc:
        return Losses(True, (f"the master takes no connection ({first_line(exc)})",))
    if (silent := _master_silent(health)) is not None:
        return Losses(True, (silent,))
    lines += [p for p in health.problems if "is not registered" in p]
    running = [i for i in live if i.state == "running"]
    noticed, unchecked = spot_notices(spec, running, endpoint_url=endpoint_url)
    lines += [
        f"worker {i} has a spot interruption notice ({n.action} at {n.time})"
        for i, n in noticed.items()
    ]
    return Losses(False, tuple(lines), tuple(noticed), tuple(unchecked))


def _static_losses(spec: ClusterSpec) -> Losses:
    if static.registered_spec(spec.name) is None:
        return Losses(True, ("it was taken down (`sparknet cluster down`)",))
    try:
        health = static.health(spec)
    except SparknetError as exc:
        return Losses(True, (f"the master takes no connection ({first_line(exc)})",))
    if (silent := _master_silent(health)) is not None:
        return Losses(True, (silent,))
    return Losses(False, tuple(p for p in health.problems if "is not registered" in p))


def _master_silent(health: ClusterHealth) -> str | None:
    """The health's problem that the Spark master daemon does not answer (its node does): no
    worker loss, and nothing a repair of the workers mends."""
    return next((p for p in health.problems if p.startswith("the master does not answer")), None)


#: how long one node may take to answer the notice check (IMDS answers in milliseconds)
NOTICE_CHECK_S = 15.0


def spot_notices(
    spec: ClusterSpec, running: list[Instance], *, endpoint_url: str | None = None
) -> tuple[dict[str, spot.Notice], list[str]]:
    """Instance id -> the interruption notice of each spot worker among the cluster's `running`
    instances that has one, asked over SSH of each node's own metadata service; and one line
    per node that could not be asked (it counts as unnoticed: if it is going, EC2's state or
    the Spark master says so soon)."""
    ids = {n: i.id for n, i in node_endpoints.node_names(running) if i.role == "worker" and i.spot}
    if not ids:
        return {}, []
    found: dict[str, spot.Notice] = {}
    try:
        ec2 = instances.ec2_client(spec.region, endpoint_url)
        access = spark_nodes.reach(spec, ec2, running)
        plan = {n.name: n for n in spark_nodes.plan_nodes(spec, ec2, running)}
    except SparknetError as exc:
        return found, [f"the workers ({first_line(exc)})"]

    def ask(endpoint: address.Endpoint, conn) -> None:
        out = run(
            conn, f"{q(plan[endpoint.name].python)} -m sparknet.cluster.aws.spot", NOTICE_CHECK_S
        )
        try:
            notice = spot.parse(out)
        except ValueError as exc:
            raise SparknetError(f"not a notice: {out.strip()[:80]!r}") from exc
        if notice is not None:
            found[ids[endpoint.name]] = notice

    try:
        nodes.run_all(
            [plan[n].endpoint for n in ids], access, ask, NOTICE_CHECK_S, connect_timeout=5
        )
    except nodes.NodesFailed as exc:  # what the others answered is in `found`
        return found, [f"{name} ({nodes.describe(e)})" for name, e in exc.failures.items()]
    return found, []


def repair(
    spec: ClusterSpec,
    *,
    endpoint_url: str | None = None,
    say: Say,
    noticed: tuple[str, ...] = (),
) -> None:
    """Launch and bootstrap what is missing: `cluster up` with its bootstrap (idempotent; it
    holds the cluster's lock, so a concurrent `up` or `down` waits or is refused). `noticed`
    spot workers are terminated first, without waiting: `up` counts a shutting-down instance
    as gone and launches its replacement."""
    if noticed:
        say(f"terminating {', '.join(noticed)} before EC2 does: replacements launch now")
        ec2 = instances.ec2_client(spec.region, endpoint_url)
        instances.terminate(ec2, list(noticed), wait=False)
    provider.of(spec).up(spec, endpoint_url=endpoint_url, say=say, bootstrap=True, any_owner=False)


#: how often an attached submitter checks its cluster for losses while the job runs
CHECK_EVERY_S = 30.0
#: seconds that replace CHECK_EVERY_S (a test checks every few seconds)
CHECK_EVERY_ENV = "SPARKNET_REPAIR_CHECK_S"


def check_every_s() -> float:
    """CHECK_EVERY_S, or the seconds `CHECK_EVERY_ENV` gives (`nodes.seconds_setting`)."""
    return nodes.seconds_setting(CHECK_EVERY_ENV, CHECK_EVERY_S)


class Watch:
    """What an attached submitter calls as it follows a job (`submit.follow`'s `on_tick`):
    every `every_s` it looks for losses and repairs them, saying what it saw and did. A
    failed check or repair is said and the job goes on with the executors it has; a lost
    master is said once (the job ends with it)."""

    def __init__(
        self,
        spec: ClusterSpec,
        *,
        endpoint_url: str | None = None,
        say: Say,
        every_s: float | None = None,
    ) -> None:
        self.spec, self.endpoint_url, self.say = spec, endpoint_url, say
        self.every_s = check_every_s() if every_s is None else every_s
        self._last = time.monotonic()
        self._master_said = False
        self._unchecked_said: set[str] = set()

    def __call__(self) -> None:
        if time.monotonic() - self._last < self.every_s:
            return
        try:
            # the cluster as `up` last made it: a settings file edited since must not resize it
            spec = registry.registered().get(self.spec.name, self.spec)
            found = losses(spec, endpoint_url=self.endpoint_url)
            for line in found.unchecked:
                node = line.split(" ", 1)[0]
                if node not in self._unchecked_said:  # once per node: it may never be readable
                    self._unchecked_said.add(node)
                    self.say(f"cluster {self.spec.name}: no spot notice can be read of {line}")
            if found.master_gone:
                if not self._master_said:
                    self.say(f"cluster {self.spec.name}: {found.lines[0]}; nothing to repair")
                    self._master_said = True
            elif found.lines:
                self.say(f"cluster {self.spec.name} lost {'; '.join(found.lines)}: repairing")
                repair(spec, endpoint_url=self.endpoint_url, say=self.say, noticed=found.noticed)
                self.say(f"cluster {self.spec.name} repaired; the job goes on")
        except Interrupted as exc:
            # Ctrl-C or SIGTERM during the repair's `up`, which says it as its own error: an
            # interrupt of the submitter all the same, never a repair that merely failed
            raise KeyboardInterrupt(str(exc)) from exc
        except SparknetError as exc:
            why = first_line(exc)
            self.say(f"cluster {self.spec.name}: check or repair failed ({why}); the job goes on")
        finally:
            self._last = time.monotonic()
