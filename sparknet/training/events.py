"""TensorBoard event files for a run, so `tensorboard --logdir runs/` shows every run's curves.

One `EventLog` per driver process writes one event file into a local dir; the driver copies that
file to an S3 run dir after each round (the writer itself only knows local paths).
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

#: a metrics.jsonl key and the TensorBoard tag it is written under, as PyTorch users name them
SCALARS: tuple[tuple[str, str], ...] = (
    ("loss", "train/loss"),
    ("inner_state_misses", "train/inner_state_misses"),
    ("skipped_samples", "train/skipped_samples"),
    ("eval_loss", "eval/loss"),
    ("eval_accuracy", "eval/accuracy"),
    ("eval_top5", "eval/top5"),
    ("samples_per_s", "throughput/samples_per_s"),
)
#: learning rates: the row's key (also the constructor's stand-in for it) and the tag
RATES: tuple[tuple[str, str], ...] = (("lr", "lr/inner"), ("outer_lr", "lr/outer"))
#: an event file's name carries its creation time in whole seconds; TensorBoard reads a dir's
#: files in name order
_STAMP = re.compile(r"^events\.out\.tfevents\.(\d+)\.")


class EventLog:
    """Writes each round's metrics row as TensorBoard scalars, at step = the row's round.

    `purge_step` is the first round about to run: on a resume that rolled back to the round-N
    checkpoint it is N + 1, and TensorBoard drops the events of rounds >= N + 1 that earlier
    event files in the dir hold (the rolled-back rounds), so the curves show each round once.

    Learning rates: a row's `lr` / `outer_lr` when it has them (a schedule may put them there),
    else the constant `inner_lr` / `outer_lr` given here; with neither, no `lr/` tag is written.
    """

    def __init__(
        self,
        log_dir: Path,
        purge_step: int = 0,
        *,
        inner_lr: float | None = None,
        outer_lr: float | None = None,
    ) -> None:
        from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only here

        log_dir = Path(log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        _wait_past_newest(log_dir)
        before = set(_event_files(log_dir))
        self._rates = {"lr": inner_lr, "outer_lr": outer_lr}
        # every round flushes; the writer's own timer would only add a thread's wake-ups
        self._writer = SummaryWriter(str(log_dir), purge_step=purge_step, flush_secs=3600)
        self._writer.flush()  # the purge marker is on disk before any round runs
        #: the event file this log writes (the one the driver copies to an S3 run dir)
        self.path = next(p for p in _event_files(log_dir) if p not in before)

    def round(self, row: dict[str, Any]) -> None:
        """Write one metrics.jsonl row and flush it to disk."""
        step = int(row["round"])
        for key, tag in SCALARS:
            if isinstance(row.get(key), int | float):
                self._writer.add_scalar(tag, float(row[key]), step)
        for phase, seconds in row.get("seconds", {}).items():
            self._writer.add_scalar(f"time/{phase}_s", float(seconds), step)
        for key, tag in RATES:
            value = row.get(key, self._rates[key])
            if value is not None:
                self._writer.add_scalar(tag, float(value), step)
        self._writer.flush()

    def purge(self, step: int) -> None:
        """Drop, for TensorBoard, the rounds >= `step` written so far: they run again (a
        replay from a checkpoint) and are written anew. The same marker a resume's
        `purge_step` writes, here in the open file: the curves show each round once."""
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog  # lazy: tensorboard

        start = SessionLog(status=SessionLog.START)
        self._writer._get_file_writer().add_event(Event(step=step, session_log=start))
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _wait_past_newest(log_dir: Path) -> None:
    """Waits (at most a second) until the clock's whole second is past every event file's in
    `log_dir`: files of one second sort by pid and counter, so a resume in the same second as
    the run it continues could sort first and its purge marker would be read before the events
    it drops."""
    stamps = [int(_STAMP.match(p.name)[1]) for p in _event_files(log_dir)]
    if stamps:  # a file stamped further ahead (clock skew, a stray file) is not waited for
        time.sleep(min(1.0, max(0.0, max(stamps) + 1 - time.time())))


def _event_files(log_dir: Path) -> list[Path]:
    return [p for p in log_dir.iterdir() if _STAMP.match(p.name)]
