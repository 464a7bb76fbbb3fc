"""The autostop timer on an EC2 cluster's master: an idle cluster terminates itself.

When nothing has happened on the cluster for `minutes`, it terminates every instance of the
cluster (itself included), so a cluster that a submitter forgot, or lost with its laptop, stops
costing money. Until it runs, each instance's backstop (a power-off its user data schedules at
each boot: `userdata`) ends it instead; once the timer runs, the bootstrap cancels every node's
backstop (`daemons.BackstopOff`), and the timer alone ends the cluster.

Everything lives in the master's state dir, ``<prefix>/autostop/`` (`state_dir`):

- ``settings.json``: the cluster's name, its region and the minutes (0: off), written by the
  bootstrap's `daemons.Autostop` step;
- ``started``: its mtime is when the timer started (`run` touches it);
- ``activity/``: a job's supervisor and an attached submitter each keep a file here and touch it
  at least every `ACTIVITY_EVERY_S` seconds while they run (`activity_command`). The newest mtime
  of these files, of the dir itself (a file made or removed changes it, so a stamp removed when
  a job ends still counts as its last activity) and of ``started`` is the last activity;
- ``deadline.json``: what the last check found (`write_deadline`): `cluster status` reads it;
- ``autostop.log``: one line per check: what it decided, and why.

The deadline is the last activity plus `minutes`. A check (`check`) reads the files, decides
(`decide`), and past the deadline terminates the cluster's instances through the default
credential chain (on EC2: the instance role, which may terminate only its own cluster's).
`run` is a loop that checks every `CHECK_EVERY_S` seconds: a process of its own (a systemd unit
or a process in its own session, as the Spark daemons run) rather than a cron entry or a
systemd timer, because it then runs the same way on every node image, with or without systemd,
and is started, checked and stopped exactly as the daemons are. A failed check (AWS refuses, the
network is down) is one log line; the next check tries again. Nothing in a check raises out of
the loop.

    python -m sparknet.cluster.aws.autostop check --state DIR [--now EPOCH]
    python -m sparknet.cluster.aws.autostop run --state DIR [--every SECONDS]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

#: the state dir under a node's install prefix, and the files in it
STATE_DIR = "autostop"
SETTINGS = "settings.json"
STARTED = "started"
ACTIVITY = "activity"
DEADLINE = "deadline.json"
LOG = "autostop.log"

#: how often `run` checks: a cluster outlives its deadline by at most this much
CHECK_EVERY_S = 30
#: the longest gap between two touches of whatever counts as activity (a job's supervisor, an
#: attached submitter); a check just before a touch sees the last one this old, so the touchers
#: run well more often (the supervisor every third of it): a deadline can be one minute
ACTIVITY_EVERY_S = 60
#: a deadline file older than this means the timer is not checking (`status_line` says so)
STALE_AFTER_S = 3 * CHECK_EVERY_S + 30
#: the instance states that still cost or may start again: terminated by the timer
TERMINATE_STATES = ("pending", "running", "stopping", "stopped")


# --- settings and where things are -------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    """What the timer of one cluster needs: whose instances, where, and after how long."""

    cluster: str
    region: str
    #: minutes without activity before the cluster is terminated; 0: the timer is off
    minutes: int

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Settings:
        """The settings in `text`; ValueError naming what is wrong (a hand-edited file)."""
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        cluster, region, minutes = data.get("cluster"), data.get("region"), data.get("minutes")
        if not isinstance(cluster, str) or not cluster:
            raise ValueError("cluster is not a name")
        if not isinstance(region, str) or not region:
            raise ValueError("region is not a name")
        if isinstance(minutes, bool) or not isinstance(minutes, int) or minutes < 0:
            raise ValueError(f"minutes {minutes!r} is not a whole number >= 0")
        return cls(cluster, region, minutes)


def state_dir(prefix: str) -> str:
    """The timer's state dir under a node's install prefix."""
    return f"{prefix.rstrip('/')}/{STATE_DIR}"


def activity_command(prefix: str, name: str) -> str:
    """The shell command that records activity named `name` (e.g. ``job-RUN``, ``submitter-PID``)
    on the master whose install prefix is `prefix`: what a job's supervisor and an attached
    submitter run at least every ACTIVITY_EVERY_S seconds while they run."""
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"activity name {name!r} is not a file name")
    where = f"{state_dir(prefix)}/{ACTIVITY}"
    return f"mkdir -p {shlex.quote(where)} && touch {shlex.quote(f'{where}/{name}')}"


def record_activity(state: Path, name: str) -> None:
    """`activity_command`'s Python twin, for a process on the master itself (a job's
    supervisor): touch ``activity/<name>`` in the state dir `state`."""
    activity_command("/", name)  # the same check of the name
    (state / ACTIVITY).mkdir(parents=True, exist_ok=True)
    (state / ACTIVITY / name).touch()


# --- the decision ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Decision:
    """What one check decided: `off`, `wait` (until `deadline`), `terminate`, or `error` (the
    state cannot be read: nothing is done, and the next check looks again)."""

    action: str
    why: str
    deadline: float | None = None
    settings: Settings | None = None


def _mtime(path: Path) -> float | None:
    try:
        return path.stat(follow_symlinks=False).st_mtime
    except OSError:
        return None


def last_activity(state: Path) -> float | None:
    """The newest mtime of ``started``, ``activity/`` and the files in it (None: none of them
    exists). A file that vanishes or cannot be read while listing is skipped."""
    found = [_mtime(state / STARTED), _mtime(state / ACTIVITY)]
    try:
        entries = list(os.scandir(state / ACTIVITY))
    except OSError:
        entries = []
    for entry in entries:
        try:
            found.append(entry.stat(follow_symlinks=False).st_mtime)
        except OSError:
            continue
    times = [t for t in found if t is not None]
    return max(times) if times else None


def decide(state: Path, now: float) -> Decision:
    """What the timer does at `now` (epoch seconds): never terminate on a state it cannot read,
    since then it does not know which cluster, nor since when it idles."""
    try:
        settings = Settings.from_json((state / SETTINGS).read_text())
    except (OSError, ValueError) as exc:
        return Decision("error", f"cannot read {state / SETTINGS}: {_one_line(exc)}")
    if settings.minutes == 0:
        return Decision("off", "autostop_minutes is 0", settings=settings)
    last = last_activity(state)
    if last is None:
        return Decision(
            "error", f"no {STARTED} stamp and no {ACTIVITY}/ in {state}", settings=settings
        )
    deadline = last + settings.minutes * 60
    since = f"last activity {clock(last)}, {settings.minutes} min"
    if now < deadline:
        return Decision("wait", f"until {clock(deadline)} ({since})", deadline, settings)
    return Decision("terminate", f"idle past {clock(deadline)} ({since})", deadline, settings)


# --- acting on it ------------------------------------------------------------------------------


def terminate_cluster(settings: Settings) -> list[str]:
    """Terminate the cluster's instances in pending, running, stopping or stopped state (found by
    the `sparknet:cluster` tag in its region), with the default credential chain; the ids.
    A SparknetError in one line when AWS refuses or cannot be reached."""
    from sparknet.cluster.aws import instances  # boto3: only when it terminates, not every check

    ec2 = instances.ec2_client(settings.region, max_attempts=3)
    found = instances.find(ec2, settings.cluster)
    ids = [i.id for i in found if i.state in TERMINATE_STATES]
    instances.terminate(ec2, ids, wait=False)
    return ids


def check(
    state: Path, now: float, terminate: Callable[[Settings], list[str]] = terminate_cluster
) -> Decision:
    """One check: decide, terminate when due, write the deadline file and one log line. An
    error (AWS's, a file's) is in the log line and the deadline file; it never raises."""
    decision = decide(state, now)
    line = f"{decision.action}: {decision.why}"
    if decision.action == "terminate" and decision.settings is not None:
        s = decision.settings
        try:
            ids = terminate(s)
        except Exception as exc:  # AWS refused, the network is down: the next check retries
            decision = Decision("error", _one_line(exc), decision.deadline, s)
            line += f"; failed: {decision.why}; retrying at the next check"
        else:
            done = f"terminated {' '.join(ids)}" if ids else "no instance left to terminate"
            line += f"; {done} of cluster {s.cluster} in {s.region}"
    _record(state, now, decision, line)
    return decision


def _record(state: Path, now: float, decision: Decision, line: str) -> None:
    """The deadline file and the log line; a state dir that cannot be written is said on
    stderr (the process's own log), not raised."""
    try:
        write_deadline(state, now, decision)
        with open(state / LOG, "a") as log:
            log.write(f"{iso(now)} {line}\n")
    except OSError as exc:
        print(f"{iso(now)} cannot write to {state}: {_one_line(exc)}", file=sys.stderr)
    print(f"{iso(now)} {line}", flush=True)


def write_deadline(state: Path, now: float, decision: Decision) -> None:
    """``deadline.json``: the decision, its deadline (epoch seconds or null) and when it was
    checked; replaced at once, so a reader never sees half of it."""
    data = {
        "action": decision.action,
        "deadline": decision.deadline,
        "checked": now,
        "why": decision.why,
    }
    new = state / f"{DEADLINE}.new"
    new.write_text(json.dumps(data, sort_keys=True) + "\n")
    new.replace(state / DEADLINE)


# --- what `cluster status` shows ---------------------------------------------------------------


def status_line(text: str | None, now: float) -> str:
    """`cluster status`'s line from the deadline file's `text` (None: there is none):
    ``autostop: in 23 min (14:05 UTC)``, ``autostop: off`` or ``autostop: unknown: <why>``."""
    if text is None:
        return "autostop: unknown: the master has no deadline file (no timer installed)"
    try:
        data = json.loads(text)
        action, checked, deadline = data["action"], float(data["checked"]), data["deadline"]
    except (ValueError, KeyError, TypeError) as exc:
        return f"autostop: unknown: the deadline file is unreadable ({_one_line(exc)})"
    if action == "off":
        return "autostop: off"
    if now - checked > STALE_AFTER_S:
        return f"autostop: unknown: the timer has not checked since {clock(checked)}"
    if action == "error" and deadline is None:
        return f"autostop: unknown: {data.get('why', 'the timer cannot read its state')}"
    if deadline is None:
        return f"autostop: unknown: no deadline ({action})"
    deadline = float(deadline)
    if action == "error":
        return f"autostop: due since {clock(deadline)}, retrying: {data.get('why', '')}"
    if deadline <= now:
        return f"autostop: due since {clock(deadline)}, terminating"
    minutes = max(1, round((deadline - now) / 60))
    return f"autostop: in {minutes} min ({clock(deadline)})"


def read_command(prefix: str) -> str:
    """The shell command that prints the master's deadline file, or nothing when there is none."""
    path = shlex.quote(f"{state_dir(prefix)}/{DEADLINE}")
    return f"cat {path} 2>/dev/null; true"


# --- small helpers -----------------------------------------------------------------------------


def clock(epoch: float) -> str:
    """``14:05 UTC``: how the log and status name a time."""
    return datetime.fromtimestamp(epoch, UTC).strftime("%H:%M UTC")


def iso(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


# --- the process -------------------------------------------------------------------------------


def run(state: Path, every_s: float = CHECK_EVERY_S) -> None:
    """Touch ``started`` (the timer starts now), then check every `every_s` seconds, forever."""
    (state / ACTIVITY).mkdir(parents=True, exist_ok=True)
    (state / STARTED).touch()
    while True:
        try:
            check(state, time.time())
        except Exception as exc:  # never end the loop: the next check may succeed
            print(f"{iso(time.time())} check failed: {_one_line(exc)}", flush=True)
        time.sleep(every_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sparknet.cluster.aws.autostop")
    sub = parser.add_subparsers(dest="command", required=True)
    one = sub.add_parser("check", help="check once: terminate the cluster if past its deadline")
    one.add_argument("--state", type=Path, required=True)
    one.add_argument("--now", type=float, default=None, help="epoch seconds; default: now")
    loop = sub.add_parser("run", help=f"check every {CHECK_EVERY_S} s, forever")
    loop.add_argument("--state", type=Path, required=True)
    loop.add_argument("--every", type=float, default=CHECK_EVERY_S)
    args = parser.parse_args(argv)
    if not args.state.is_dir():
        print(
            f"error: {args.state} is not a directory; give the timer's state dir", file=sys.stderr
        )
        return 2
    if args.command == "run":
        run(args.state, args.every)
    decision = check(args.state, time.time() if args.now is None else args.now)
    return 1 if decision.action == "error" else 0


if __name__ == "__main__":
    sys.exit(main())
