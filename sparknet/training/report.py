"""What a run reports: `metrics.jsonl` (one object per round) and `curves.png`."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

METRICS = "metrics.jsonl"
CURVES = "curves.png"


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / METRICS
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class MetricsLog:
    """Appends one JSON line per round; on resume, drops rows past the checkpoint first."""

    def __init__(self, run_dir: Path, keep_rounds: int) -> None:
        self.path = run_dir / METRICS
        self.rows = [r for r in read_metrics(run_dir) if r["round"] <= keep_rounds]
        self.path.write_text("".join(json.dumps(r) + "\n" for r in self.rows))

    def append(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")


def plot_curves(rows: Iterable[dict[str, Any]], path: Path) -> None:
    """Loss and accuracy against round and against wall time, one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(rows)
    evals = [r for r in rows if "eval_accuracy" in r]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7), constrained_layout=True)
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
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(path)
