"""Keeping a cluster whole while a job runs on it: a worker instance gone (a spot
interruption, a terminated instance) or a Spark worker that is no longer registered with the
master (its daemon died) is a loss; the repair is `cluster up`'s own code with its bootstrap,
which launches what is missing (with the capacity fallback across types and zones) and starts
what is not running, and leaves the rest as it is. The job goes on meanwhile: Spark runs a lost
executor's tasks on the remaining ones, and the driver records executors lost and joined in
the round rows of metrics.jsonl.

A lost master is no loss this module repairs: the driver runs there, and with it the job.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from sparknet.cluster import instances, lifecycle
from sparknet.cluster.spec import ClusterSpec
from sparknet.errors import SparknetError

Say = Callable[[str], None]

#: instance states of a member that is gone or going (EC2 ends a spot instance so)
_GOING = frozenset({"shutting-down", "terminated", "stopping", "stopped"})


@dataclass(frozen=True)
class Losses:
    """What is missing from the cluster: whether its master is gone (nothing to repair), and
    one line per worker loss."""

    master_gone: bool
    lines: tuple[str, ...]

    @property
    def repairable(self) -> bool:
        return bool(self.lines) and not self.master_gone


def losses(spec: ClusterSpec, *, endpoint_url: str | None = None) -> Losses:
    """The cluster's losses, from EC2's view (members gone or going) and the Spark master's
    (expected workers not ALIVE). A master node that takes no SSH connection is no worker
    loss: it is said as the master's."""
    ec2 = instances.ec2_client(spec.region, endpoint_url)
    found = instances.find(ec2, spec.name)
    live = [i for i in found if i.state not in _GOING]
    masters = [i for i in live if i.role == "master"]
    if not masters:
        return Losses(True, ("the master instance is gone",))
    lines = [
        f"worker {i.id} is {i.state}" for i in found if i.role == "worker" and i.state in _GOING
    ]
    missing = spec.workers - sum(1 for i in live if i.role == "worker")
    if missing > 0 and not lines:
        lines.append(f"{missing} of {spec.workers} worker instances are gone")
    try:
        health = lifecycle.spark_health(spec, live, endpoint_url=endpoint_url)
    except SparknetError as exc:
        return Losses(True, (f"the master takes no connection ({str(exc).splitlines()[0]})",))
    lines += [p for p in health.problems if "is not registered" in p]
    return Losses(False, tuple(lines))


def repair(spec: ClusterSpec, *, endpoint_url: str | None = None, say: Say) -> None:
    """Launch and bootstrap what is missing: `cluster up` with its bootstrap (idempotent; it
    holds the cluster's lock, so a concurrent `up` or `down` waits or is refused)."""
    lifecycle.up(spec, endpoint_url=endpoint_url, say=say, bootstrap=True)


#: how often an attached submitter checks its cluster for losses while the job runs
CHECK_EVERY_S = 30.0


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
        every_s: float = CHECK_EVERY_S,
    ) -> None:
        self.spec, self.endpoint_url, self.say, self.every_s = spec, endpoint_url, say, every_s
        self._last = time.monotonic()
        self._master_said = False

    def __call__(self) -> None:
        if time.monotonic() - self._last < self.every_s:
            return
        try:
            # the cluster as `up` last made it: a settings file edited since must not resize it
            spec = lifecycle.registered().get(self.spec.name, self.spec)
            found = losses(spec, endpoint_url=self.endpoint_url)
            if found.master_gone:
                if not self._master_said:
                    self.say(f"cluster {self.spec.name}: {found.lines[0]}; nothing to repair")
                    self._master_said = True
            elif found.lines:
                self.say(f"cluster {self.spec.name} lost {'; '.join(found.lines)}: repairing")
                repair(spec, endpoint_url=self.endpoint_url, say=self.say)
                self.say(f"cluster {self.spec.name} repaired; the job goes on")
        except SparknetError as exc:
            first = next(iter(str(exc).splitlines()), type(exc).__name__)
            self.say(f"cluster {self.spec.name}: check or repair failed ({first}); the job goes on")
        finally:
            self._last = time.monotonic()
