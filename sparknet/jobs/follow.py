"""Following a job that runs on the master, to its outcome.

Its rounds as the driver writes them to the run prefix, its restarts, what the driver does
before its first round, whether it still runs (over an SSH connection opened again when it
breaks or goes silent), and in the end its outcome, its curves and the summary lines.

Separate from the flow because `sparknet-submit attach` follows a job the same way, on a job
some earlier submit started: it needs none of the preflight, the cluster or the teardown."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparknet.cluster import nodes
from sparknet.cluster.aws import autostop
from sparknet.cluster.remote import Conn, ConnectionLost, q, run, succeeds
from sparknet.cluster.spark.plan import JOB_CANCELLED, Node
from sparknet.data.store import open_store
from sparknet.errors import SparknetError
from sparknet.jobs.driver_control import (
    LOG,
    ORPHANED,
    Master,
    driver_log,
    driver_rc,
    how_it_ended,
    job_dir,
    quietly,
    stamp_submitter,
    stop_session,
)
from sparknet.say import Say, command_line
from sparknet.training.report import CURVES, METRICS, STOPPED, is_event, read_metrics, round_rows

#: seconds between two looks at the run prefix and the driver while the job runs
POLL_S = 3.0
#: how long `follow` tries to reach the master again after its SSH connection broke or went
#: silent (a laptop asleep, a Wi-Fi change, a master that stopped answering) before it gives the
#: job up as out of reach; `RECONNECT_ENV` sets other seconds
GRACE_S = 300.0
RECONNECT_ENV = "SPARKNET_RECONNECT_S"


class JobOutOfReach(SparknetError):
    """The master did not answer over SSH for `reconnect_s()`: the job may go on there (it
    outlives the SSH session), so it is neither cancelled nor its cluster taken down."""


def progress_line(row: Mapping[str, Any], total: int, cost: float | None) -> str:
    """One plain line per round: round, loss, accuracy (when evaluated), samples/s, cost."""
    acc = f"  acc {row['eval_accuracy']:.3f}" if "eval_accuracy" in row else ""
    usd = "unknown" if cost is None else f"${cost:.2f}"  # a static cluster's: no price
    return (
        f"round {row['round']}/{total}  loss {row['loss']:.4f}{acc}  "
        f"{row['samples_per_s']:.0f} samples/s  cost {usd}"
    )


def last_error(log: str) -> str | None:
    """The driver's last `error: ...` line (what `sparknet train` prints when it fails)."""
    found = [ln.strip() for ln in log.splitlines() if ln.strip().startswith("error:")]
    return found[-1][len("error:") :].strip() if found else None


@dataclass
class Outcome:
    """How the job ended: its exit code and its metrics rows."""

    rc: int
    rows: list[dict[str, Any]]
    log: str = ""


def follow(
    conn: Conn,
    master: Master,
    run_id: str,
    prefix: str,
    endpoint_url: str | None,
    on_rows: Callable[[list[dict[str, Any]]], None],
    poll_s: float | None = None,
    on_event: Callable[[dict[str, Any]], None] | None = None,
    on_tick: Callable[[], None] | None = None,
    grace_s: float | None = None,
) -> Outcome:
    """Poll metrics.jsonl in the run prefix and the driver on the master until it ends; new
    round rows go to `on_rows` (a round that a restarted driver runs again only once), new
    event rows (a restart) to `on_event`, in file order; the submitter's activity stamp is
    refreshed as it waits, and `on_tick` (the cluster's repair watch) is called every poll.
    A broken SSH connection, or one the master went silent on (every call on it has a
    deadline: `nodes.connection`), is opened again at each poll for `grace_s` (default
    `reconnect_s()`) from the first call that failed (the job runs on without it); past that,
    JobOutOfReach. A job whose supervisor was killed (no exit code) is failed; what it left
    running is stopped (`stop_session`), and the log's last `error:` line says so."""
    grace = reconnect_s() if grace_s is None else grace_s
    poll = POLL_S if poll_s is None else poll_s
    store = open_store(prefix, endpoint_url)
    seen = _Seen()
    last_stamp = 0.0
    lost_since: float | None = None
    lost: ConnectionLost | None = None  # the first failure of a run of them: it says why
    while True:
        asked = time.monotonic()
        try:
            if asked - last_stamp >= autostop.ACTIVITY_EVERY_S / 2:
                stamp_submitter(conn, master.node)
                last_stamp = time.monotonic()
            rc = driver_rc(conn, master.node, run_id)
            why = _killed(conn, master.node, run_id) if rc == -1 else None
        except ConnectionLost as exc:
            lost_since, lost = lost_since or asked, lost or exc
            if time.monotonic() - lost_since >= grace:
                raise JobOutOfReach(
                    f"no answer over SSH from the master ({master.node.endpoint.host}) "
                    f"for {grace:g} s ({lost}); job {run_id} may go on there: "
                    f"`{command_line('sparknet-submit attach', run_id)}` follows it again"
                ) from exc
            _drop(conn)
            time.sleep(poll)
            continue
        lost_since, lost = None, None
        rows = read_metrics(store, events=True)
        seen.dispatch(rows, on_rows, on_event)
        if rc is not None:
            log = driver_log(conn, master.node, run_id) if rc != 0 else ""
            if why:
                log += f"error: {why}\n"
            return Outcome(rc, round_rows(rows), log)
        if on_tick is not None:
            on_tick()
        time.sleep(poll)


#: `sparknet train`'s progress lines in its log (stderr, not a terminal) before a round is done:
#: what it waits for ("starting Spark", "round 1 (starting Python workers)"), and a done round;
#: those of `sparknet evaluate` and `predict` (a model's job), which has no round
_STATUS_LINE = (
    r"starting Spark|round [0-9]+ \(.+\)|waiting for Spark.s executors|starting Python workers|"
    r"evaluating on [0-9]+ partitions|predicting into .+"
)
_ROUND_LINE = r"round [0-9]+/[0-9]+ .*"


class DriverStatus:
    """What the driver does before its first round is done (starting Spark, its executors
    registered, their Python workers starting), read from its log on the master: each new
    line once through `say`, as `driver: ...`, then nothing more. Called at every poll of
    `follow` (its `on_tick`); best effort: a failed look is `follow`'s business, not this."""

    def __init__(self, conn: Conn, node: Node, run_id: str, say: Say) -> None:
        self.conn, self.say = conn, say
        self.log = q(f"{job_dir(node, run_id)}/{LOG}")
        self.said = 0
        self.done = False

    def __call__(self) -> None:
        if self.done:
            return
        try:
            text = run(
                self.conn, f"grep -E -x '{_STATUS_LINE}|{_ROUND_LINE}' {self.log} 2>/dev/null; true"
            )
        except Exception:  # the next poll looks again
            return
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        statuses = []
        for line in lines:
            if re.fullmatch(_ROUND_LINE, line):
                self.done = True
                break
            statuses.append(line)
        for line in statuses[self.said :]:
            self.say(f"driver: {line}")
        self.said = max(self.said, len(statuses))


def ticks(*actions: Callable[[], None] | None) -> Callable[[], None]:
    """One `on_tick` that calls each of `actions` (None: none) in turn."""

    def tick() -> None:
        for action in actions:
            if action is not None:
                action()

    return tick


def reconnect_s() -> float:
    """GRACE_S, or the seconds `RECONNECT_ENV` gives (`nodes.seconds_setting`)."""
    return nodes.seconds_setting(RECONNECT_ENV, GRACE_S)


def _killed(conn: Conn, node: Node, run_id: str) -> str | None:
    """Of a job that ended without an exit code (`driver_rc` -1): why, for its last `error:`
    line, once what its supervisor left running (its driver: killed with it, the driver is
    stopped by the death signal it has, see `sparknet.jobs.supervisor`) is gone too, stopped here
    when need be; None for a malformed exit code (the code says it)."""
    jd = job_dir(node, run_id)
    how = how_it_ended(conn, node, run_id)
    if how == "rc":
        return None
    if succeeds(conn, f"test -e {q(jd + '/' + JOB_CANCELLED)}"):
        return "the job was cancelled (`sparknet-submit cancel`)"
    killed = (
        "the job was killed on the master: its supervisor ended without an exit code (a kill "
        "-9, the out-of-memory killer, the node restarted)"
    )
    if how == ORPHANED:
        stop_session(conn, node, run_id)
        return f"{killed}; the driver it left running was stopped"
    return killed


def _drop(conn: Conn) -> None:
    """Close a broken connection, so that its next command opens a new one (Fabric's
    Connection reconnects on `run` once it is closed)."""
    close = getattr(conn, "close", None)
    if close is not None:
        quietly(close)


@dataclass
class _Seen:
    """What `follow` has passed on: the last round, and how many events."""

    round: int = 0
    events: int = 0

    def dispatch(
        self,
        rows: list[dict[str, Any]],
        on_rows: Callable[[list[dict[str, Any]]], None],
        on_event: Callable[[dict[str, Any]], None] | None,
    ) -> None:
        """Pass on what is new in `rows` (all of metrics.jsonl), in order."""
        batch: list[dict[str, Any]] = []
        events = 0
        for row in rows:
            if is_event(row):
                events += 1
                if events <= self.events:
                    continue
                self.events = events
                if batch:
                    on_rows(batch)
                    batch = []
                if on_event is not None:
                    on_event(row)
            elif row["round"] > self.round:
                batch.append(row)
                self.round = row["round"]
        if batch:
            on_rows(batch)


def fetch_results(
    prefix: str, endpoint_url: str | None, dest: Path, names: tuple[str, ...] = (METRICS, CURVES)
) -> list[Path]:
    """The run's files `names` that are there (curves.png and metrics.jsonl) into `dest`
    (runs/RUN/ locally)."""
    store = open_store(prefix, endpoint_url)
    got = []
    for name in names:
        if store.size(name) is not None:
            dest.mkdir(parents=True, exist_ok=True)  # not for a job that wrote nothing
            store.fetch(name, dest / name)
            got.append(dest / name)
    return got


def final_accuracy(rows: list[dict[str, Any]]) -> float | None:
    return next((r["eval_accuracy"] for r in reversed(rows) if "eval_accuracy" in r), None)


def summary_lines(
    run_id: str, prefix: str, rows: list[dict[str, Any]], wall_s: float, cost: float | None
) -> list[str]:
    """What the submitter prints at the end; a run that reached its `stop_at` says at which
    round, and whether that ended it early (its metrics' last row carries the target)."""
    acc = final_accuracy(rows)
    lines = [
        f"run id: {run_id}",
        f"run prefix: {prefix}",
        f"final accuracy: {'n/a' if acc is None else f'{acc:.4f}'}",
    ]
    from sparknet.training.report import target_words  # the words of the row's marker

    if rows and STOPPED in rows[-1] and (target := target_words(rows[-1])) is not None:
        lines.append(": ".join(target) if target[0] == "stopped early" else " ".join(target))
    lines += [
        f"wall time: {wall_s:.0f} s",
        f"estimated cost: {'unknown' if cost is None else f'${cost:.2f}'}",
    ]
    return lines
