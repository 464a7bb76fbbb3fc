"""A round as a line of text, worded once for every front end that prints it.

The CLI's bar and its plain lines, and `sparknet.fit`'s logger, all show a round this way.

A module of its own, importing nothing: the CLI imports it at start, before torch or boto3.
"""

from __future__ import annotations

from typing import Any


def round_text(row: dict[str, Any]) -> str:
    """A round row's figures in a few words (loss, test accuracy where evaluated, rate): what a
    progress bar shows beside its count."""
    acc = f"  acc {row['eval_accuracy']:.3f}" if "eval_accuracy" in row else ""
    return f"loss {row['loss']:.4f}{acc}  {row['samples_per_s']:.0f} samples/s"


def round_line(row: dict[str, Any], rounds: int) -> str:
    """A round row as one line of a log: `round 3/10  loss ...  2.1 s`. The one wording of a
    round for every front end that prints lines (the CLI without a terminal, `sparknet.fit`'s
    logger)."""
    return f"round {row['round']}/{rounds}  {round_text(row)}  {row['seconds']['total']:.1f} s"
