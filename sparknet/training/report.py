"""What a run reports: `metrics.jsonl` and `curves.png`, in its run dir.

`metrics.jsonl` holds one object per round, and one per event of the job (a restart of its
driver, `{"event": "restart", ...}`, written by the job's supervisor); the run dir is a local dir
or an S3 prefix, reached through its store."""

from __future__ import annotations

import io
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from sparknet.data.store import MissingObjectError, Store, open_store

if TYPE_CHECKING:
    from sparknet.training.worker import EvalResult, WorkerReport

# `# lazy: matplotlib` (~0.5 s): only curves.png needs it; every executor's task and
# `sparknet-submit` import this module for its rows

METRICS = "metrics.jsonl"
CURVES = "curves.png"
#: the key that makes a metrics.jsonl row an event's (a restart), not a round's
EVENT = "event"
#: a metrics row's key saying the run ended at that round's evaluation, which reached the target
#: (its value): before its last round or at it. Only the row of the round the run ended at has
#: it: a resumed run that goes on past that round takes it off
STOPPED = "stopped_at_target"
#: with `STOPPED`, where the run ended before its last round (true)
EARLY = "stopped_early"


def target_words(row: dict[str, Any]) -> tuple[str, str] | None:
    """What a run's summary says of its last `row` where it reached its target: ("stopped
    early", "round N: test accuracy A reached the target T") where rounds were left, ("target
    reached", "at round N: ...") at the last round; None where it carries no target."""
    target = row.get(STOPPED)
    if target is None or row.get("eval_accuracy") is None:
        return None
    said = f"test accuracy {row['eval_accuracy']:.4f} reached the target {target:g}"
    if row.get(EARLY):
        return "stopped early", f"round {row['round']}: {said}"
    return "target reached", f"at round {row['round']}: {said}"


def is_event(row: dict[str, Any]) -> bool:
    return EVENT in row


def round_rows(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rounds' rows of `rows`, without the event rows."""
    return [r for r in rows if not is_event(r)]


def read_metrics(run_dir: Store | str | Path, *, events: bool = False) -> list[dict[str, Any]]:
    """The round rows of a run dir's metrics.jsonl ([] when it has none); with `events`, its
    event rows too, all in file order."""
    store = open_store(str(run_dir)) if isinstance(run_dir, str | Path) else run_dir
    try:
        text = store.read_bytes(METRICS).decode()
    except MissingObjectError:
        return []
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    return rows if events else round_rows(rows)


class MetricsLog:
    """metrics.jsonl, rewritten whole after each round (S3 has no append; a reader always sees
    whole rows); on resume, drops the round rows past the checkpoint first. Event rows stay:
    they record what happened to the job (a restart), not a round that runs again."""

    def __init__(self, store: Store, keep_rounds: int) -> None:
        self.store = store
        self.rows = [
            r for r in read_metrics(store, events=True) if is_event(r) or r["round"] <= keep_rounds
        ]
        self._write()

    @property
    def rounds(self) -> list[dict[str, Any]]:
        """The round rows (what a run's result and curves are made of)."""
        return round_rows(self.rows)

    def append(self, row: dict[str, Any]) -> None:
        """Add a row; a round's takes the target's marker off the rounds before it (a resumed
        run that goes on did not end there)."""
        if not is_event(row):
            for old in round_rows(self.rows):
                old.pop(STOPPED, None)
                old.pop(EARLY, None)
        self.rows.append(row)
        self._write()

    def keep(self, rounds: int) -> list[dict[str, Any]]:
        """Drop the round rows past `rounds` (a stage restarted from the checkpoint after
        `rounds` runs those rounds again); returns them."""
        kept = [r for r in self.rows if is_event(r) or r["round"] <= rounds]
        dropped = [r for r in self.rows if not is_event(r) and r["round"] > rounds]
        if dropped:
            self.rows = kept
            self._write()
        return dropped

    def _write(self) -> None:
        self.store.write_bytes(METRICS, "".join(json.dumps(r) + "\n" for r in self.rows).encode())


def plot_curves(rows: Iterable[dict[str, Any]], store: Store) -> None:
    """Loss and accuracy against round and against wall time, one PNG; below them the learning
    rates (each round's first inner step's, and its outer step's) where the rows have them."""
    import matplotlib  # lazy: matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: matplotlib

    rows = round_rows(rows)
    evals = [r for r in rows if "eval_accuracy" in r]
    rates = [r for r in rows if "lr" in r]  # a run from before rates were recorded has none
    fig, axes = plt.subplots(
        3 if rates else 2, 2, figsize=(10, 10 if rates else 7), constrained_layout=True
    )
    for col, (xkey, xlabel) in enumerate((("round", "round"), ("elapsed_s", "wall time (s)"))):
        ax = axes[0][col]
        ax.plot([r[xkey] for r in rows], [r["loss"] for r in rows], label="train loss")
        ax.plot([r[xkey] for r in evals], [r["eval_loss"] for r in evals], "o-", label="test loss")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("loss")
        ax.set_yscale("log")
        ax.legend()
        ax = axes[1][col]
        ax.plot([r[xkey] for r in evals], [r["eval_accuracy"] for r in evals], "o-")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("test accuracy")
        ax.set_ylim(0, 1)
        if rates:
            _plot_rates(axes[2][col], rates, xkey, xlabel)
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=100)
    plt.close(fig)
    store.write_bytes(CURVES, png.getvalue())


def _plot_rates(ax, rows: list[dict[str, Any]], xkey: str, xlabel: str) -> None:
    """The inner lr (each round's first step's) and, under nesterov, the outer lr."""
    ax.plot([r[xkey] for r in rows], [r["lr"] for r in rows], ".-")
    outer = [r for r in rows if "outer_lr" in r]
    if outer:
        twin = ax.twinx()
        twin.plot([r[xkey] for r in outer], [r["outer_lr"] for r in outer], "C1.-")
        twin.set_ylabel("outer lr", color="C1")
        twin.set_ylim(bottom=0)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("inner lr")
    ax.set_ylim(bottom=0)


#: a metrics row's key, true in the first round of a process, a replay or an all-reduce stage:
#: that round holds the start-up (the Python workers' torch import, the data's open), so a
#: throughput figure leaves it out
START_UP = "start_up"


def round_row(
    done: int,
    reports: Sequence[WorkerReport],
    round_s: float,
    broadcast_s: float,
    start_up: bool = False,
) -> dict[str, Any]:
    """A round's metrics.jsonl row from its workers' reports; `broadcast_s`: the driver's part
    of getting the weights out (0 where the workers hold them); `start_up`: see `START_UP`.
    `slowest_worker` is the partition whose load and compute took longest, `slowest_behind_s`
    how much longer than the median worker's: a straggler shows here (it is never failed while
    it makes progress)."""
    samples = sum(r.samples for r in reports)
    took = [r.load_s + r.compute_s for r in reports]
    slowest = max(range(len(reports)), key=took.__getitem__)
    missed = sorted(r.partition for r in reports if r.inner_state_miss)
    load_s = broadcast_s + max(r.load_s for r in reports)
    compute_s = max(r.compute_s for r in reports)
    return {
        "round": done,
        "samples": samples,
        "loss": float(np.mean([r.loss for r in reports])),
        "seconds": {
            "broadcast": load_s,
            "compute": compute_s,
            "aggregate": max(0.0, round_s - load_s - compute_s),
            "total": round_s,
        },
        "samples_per_s": samples / round_s,
        "inner_state_misses": sum(r.inner_state_miss for r in reports),
        **({"inner_state_missed": missed} if missed else {}),
        "skipped_samples": sum(r.skipped for r in reports),
        "skipped_steps": sum(r.skipped_steps for r in reports),
        "slowest_worker": reports[slowest].partition,
        "slowest_behind_s": took[slowest] - float(np.median(took)),
        **({START_UP: True} if start_up else {}),
    }


def eval_row(ev: EvalResult) -> dict[str, Any]:
    """The evaluation's fields of a round's row (none when the test set gave no sample)."""
    if ev.count == 0:
        return {"eval_skipped_samples": ev.skipped} if ev.skipped else {}
    return {
        "eval_loss": ev.loss_sum / ev.count,
        "eval_accuracy": ev.correct / ev.count,
        "eval_top5": ev.correct5 / ev.count,
        "eval_samples": ev.count,
        "eval_skipped_samples": ev.skipped,
    }
