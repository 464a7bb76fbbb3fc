"""What every benchmark hands back and writes: a table, its notes, and its files."""

from __future__ import annotations

import csv
import json
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class BenchReport:
    """One benchmark's outcome: `rows` share the keys of `columns`; `notes` are the lines a
    reader needs to judge the figures (goals met or missed, what was measured how)."""

    name: str
    title: str
    columns: list[str]
    rows: list[dict[str, Any]]
    notes: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    files: list[Path] = field(default_factory=list)

    def write(self, out: Path) -> None:
        """`<name>.json` (every figure, with the machine it ran on) and `<name>.csv` (the
        table) into `out`, each written whole under a temp name first."""
        out.mkdir(parents=True, exist_ok=True)
        doc = {
            "name": self.name,
            "title": self.title,
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "machine": machine(),
            "columns": self.columns,
            "rows": self.rows,
            "notes": self.notes,
            **self.extra,
        }
        _write_text(out / f"{self.name}.json", json.dumps(doc, indent=2) + "\n")
        csv_path = out / f"{self.name}.csv"
        tmp = csv_path.with_name(f".{csv_path.name}.tmp")
        with tmp.open("w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=self.columns, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(self.rows)
        os.replace(tmp, csv_path)
        self.files[:0] = [out / f"{self.name}.json", csv_path]


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def machine() -> dict[str, Any]:
    """Where the figures were measured: they mean little without it."""
    import torch

    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.is_available(),
    }


def pyplot():
    """matplotlib's pyplot on the file-only backend (no display here, nor on a cluster)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path) -> Path:
    """A matplotlib figure to `path` (written whole under a temp name first), then closed."""
    plt = pyplot()

    tmp = path.with_name(f".{path.stem}.tmp{path.suffix}")
    fig.savefig(tmp, dpi=120, bbox_inches="tight")
    plt.close(fig)
    os.replace(tmp, path)
    return path
