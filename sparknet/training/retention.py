"""Which checkpoints a run dir keeps: the newest `keep_checkpoints`, and the best by eval accuracy.

After each checkpoint is published the run prunes: every complete checkpoint but the newest N
and the best one is deleted whole (`checkpoint.discard`: its manifest first, so none is ever half
there). Only complete checkpoints are candidates, so the one a resume needs (the newest
complete) always stays, and one being written (no manifest yet) is never touched.

The best is the checkpoint whose round's evaluation scored the highest accuracy (the first of
equals), from the run's metrics rows. `best.json` in the run dir names it and the file in it
that holds the weights that were evaluated; it is written before any checkpoint is deleted, so
it always names one that is there.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from sparknet.data.store import MissingObjectError, Store
from sparknet.training import checkpoint

#: the run dir's record of its best checkpoint
BEST = "best.json"


@dataclass(frozen=True)
class Best:
    """The best checkpoint so far: what `best.json` holds."""

    round: int
    eval_accuracy: float
    #: the checkpoint's dir, relative to the run dir
    checkpoint: str
    #: the file in it holding the weights that were evaluated (a state_dict in safetensors)
    weights: str


def best_round(rows: Iterable[dict[str, Any]], complete: Iterable[int]) -> tuple[int, float] | None:
    """(round, eval accuracy) of the checkpointed round whose evaluation scored highest (the
    earliest of equals); None where no round with a checkpoint in `complete` was evaluated."""
    have = set(complete)
    best: tuple[int, float] | None = None
    for row in sorted(rows, key=lambda r: r["round"]):
        acc = row.get("eval_accuracy")
        if acc is not None and row["round"] in have and (best is None or acc > best[1]):
            best = (row["round"], float(acc))
    return best


def read_best(store: Store) -> Best | None:
    """The run dir's `best.json`, or None where it has none (or one that does not parse)."""
    try:
        doc = json.loads(store.read_bytes(BEST))
        return Best(**doc)
    except MissingObjectError:
        return None
    except (ValueError, TypeError):
        return None


def _best(store: Store, rounds: int, accuracy: float) -> Best:
    where = checkpoint.name(rounds)
    final = store.size(f"{where}/{checkpoint.FINAL}") is not None
    file = checkpoint.FINAL if final else checkpoint.WEIGHTS
    return Best(rounds, accuracy, where, f"{where}/{file}")


class Retention:
    """A run's pruning of its checkpoints: the newest `keep` (0: all) and the best stay."""

    def __init__(self, store: Store, keep: int) -> None:
        self.store = store
        self.keep = keep
        self.best = read_best(store)

    def prune(self, rows: Iterable[dict[str, Any]]) -> list[int]:
        """Record the best complete checkpoint (`best.json`, where it changed), then delete the
        complete ones past the newest `keep` but the best; returns the rounds deleted."""
        complete = sorted(checkpoint.complete(self.store))
        found = best_round(rows, complete)
        if found is not None and (self.best is None or found != self._said()):
            best = _best(self.store, *found)
            self.store.write_bytes(BEST, (json.dumps(asdict(best), indent=2) + "\n").encode())
            self.best = best
        if self.keep == 0:
            return []
        kept = set(complete[-self.keep :])
        if self.best is not None:
            kept.add(self.best.round)
        gone = [r for r in complete if r not in kept]
        for rounds in gone:
            checkpoint.discard(self.store, rounds)
        return gone

    def _said(self) -> tuple[int, float] | None:
        return None if self.best is None else (self.best.round, self.best.eval_accuracy)
