"""`sparknet train`: the main job on one machine (embedded local Spark, or `--master`)."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from sparknet import interrupts as signals
from sparknet.cli.common import (
    Caught,
    DebugOption,
    caught_signal,
    command_given,
    console,
    fail,
    interrupts,
    quiet_py4j,
    results,
    titled_table,
)
from sparknet.cli.settings import ConfOption, SetOption, known_sets, with_settings
from sparknet.config import find_config_file, load_datasets, load_train_config
from sparknet.errors import SparknetError, WriteRefused, is_permanent
from sparknet.say import command_line
from sparknet.training.round_line import round_line, round_text

# `# lazy: X` below: an import kept inside the command that needs it, X being slow to import
# (torch ~2 s; boto3, fabric, numpy ~0.2 s each; `+N ms`: what it adds, measured) while
# `sparknet --help` and every other command import this module


def _summary(result, classes: int | None = None, started_at: int = 0) -> Table:
    """The table a run ends with; `classes`: the model's (top-5 is left out for 5 or fewer,
    where it is always 1); `started_at`: the round this process resumed after (0: none)."""
    from sparknet.training.report import START_UP, target_words  # lazy: numpy

    rows = result.metrics
    last_eval = next((r for r in reversed(rows) if "eval_accuracy" in r), {})
    table = titled_table("sparknet run", show_header=False)
    table.add_column()
    table.add_column(overflow="fold")  # a log file's 80 columns must not cut the run dir's path
    table.add_row("rounds", str(result.rounds))
    if (target := target_words(result.final)) is not None:
        table.add_row(*target)
    table.add_row("train loss (last round)", f"{result.final['loss']:.4f}")
    if last_eval:
        table.add_row("test loss", f"{last_eval['eval_loss']:.4f}")
        table.add_row("test accuracy", f"{last_eval['eval_accuracy']:.4f}")
        if classes is None or classes > 5:
            table.add_row("test top-5", f"{last_eval['eval_top5']:.4f}")
    skipped = sum(r.get("skipped_samples", 0) for r in rows)
    if skipped:
        table.add_row("skipped bad samples", str(skipped))
    # a process's first round holds the Python workers' start-up (torch's import, the data's
    # open): the run's first, each resume's, a replay's (marked `START_UP` in the rows; a run
    # written before that key: its first and this process's first)
    starts = sorted(
        {rows[0]["round"], started_at + 1} | {r["round"] for r in rows if r.get(START_UP)}
    )
    first = next((r for r in rows if r["round"] == started_at + 1), rows[0])
    steady = [r for r in rows if r["round"] not in starts]
    if steady:
        rate = sum(r["samples"] for r in steady) / sum(r["seconds"]["total"] for r in steady)
        left_out = [n for n in starts if any(r["round"] == n for r in rows)]
        after = (
            f"after round {left_out[0]}"
            if len(left_out) == 1
            else f"without start-up rounds {', '.join(map(str, left_out))}"
        )
        table.add_row(f"samples/s ({after})", f"{rate:.0f}")
    table.add_row(
        f"samples/s (round {first['round']}, with start-up)",
        f"{first['samples'] / first['seconds']['total']:.0f}",
    )
    # the rounds only (resumed runs add up theirs): Spark's start-up is not in it
    table.add_row("training time", f"{result.final['elapsed_s']:.1f} s")
    table.add_row("run dir", str(result.run_dir))
    return table


@with_settings(
    after={"resume": "out", "allow_change": "out", "conf": "spark_conf"}, last=("debug",)
)
def train(
    config: Path | None = typer.Option(
        None, "--config", help="settings YAML (train:, datasets:) (default: ./sparknet.yaml)"
    ),
    set_: list[str] = SetOption,
    resume: bool = typer.Option(False, help="continue the run in --out from its last checkpoint"),
    allow_change: bool = typer.Option(
        False,
        help="with --resume: accept settings that change the weights (--workers, --lr, ...); "
        "recorded in metrics.jsonl",
    ),
    conf: list[str] = ConfOption,
    debug: bool = DebugOption,
    **settings: Any,
) -> None:
    """Train a model with synchronized local SGD on Spark and write a run dir."""
    out, endpoint_url = settings.get("out"), settings.get("endpoint_url")
    caught = Caught()
    report: _Report | None = None
    try:
        base = None
        if resume:
            if out is None:
                raise SparknetError("--resume needs --out, the run dir to continue")
            from sparknet.training.rundir import read_run_config  # torch: only for a resume

            base = read_run_config(out, endpoint_url)
        config = find_config_file(config)
        sets = known_sets(set_)
        cfg = load_train_config(config_file=config, sets=sets, flags=settings, base=base, conf=conf)
        datasets = load_datasets(config)
        from sparknet.training.driver import default_run_dir  # lazy: torch, pyspark, boto3
        from sparknet.training.driver import train as run_training  # lazy: as above

        if cfg.out is None:  # named here, so that an interrupt's line can name it
            cfg = cfg.model_copy(update={"out": str(default_run_dir(cfg))})

        signals.check()  # one that came during those seconds of imports, if a library ate it
        report = _Report(live=console.is_terminal, caught=caught)
        if not debug:
            quiet_py4j()
        with interrupts(caught, note="still stopping Spark; the last complete checkpoint is kept"):
            try:
                result = run_training(
                    cfg, resume=resume, on_start=report.start, on_round=report.round,
                    on_status=report.status, on_warning=report.warning, datasets=datasets,
                    allow_change=allow_change,
                )  # fmt: skip
            finally:
                report.stop()
        try:
            classes = _classes(result.run_dir, cfg.endpoint_url)
            results.print(_summary(result, classes, report.started_at))
        except BrokenPipeError:
            _to_devnull(sys.stdout)
    except (KeyboardInterrupt, Exception) as exc:
        # An interrupt can cut a JVM call short in a way that surfaces as a py4j error from the
        # clean-up that follows (a call made while unwinding): once a signal came, it is the cause.
        if isinstance(exc, KeyboardInterrupt) or caught_signal(caught) is not None:
            signum = caught_signal(caught) or signal.SIGINT
            how = "" if signum == signal.SIGINT else f" ({signal.Signals(signum).name})"
            # before Spark starts nothing is there to stop, and no checkpoint to speak of
            spark = report is not None and report.spark_started
            after = f"; Spark stopped, {_kept(cfg)}" if spark else ""
            fail(SparknetError(f"interrupted{how}{after}"), debug, code=128 + signum)
        if isinstance(exc, SparknetError):
            fail(exc, debug)
        if isinstance(exc, OSError) and is_permanent(exc):  # a write not through the run's store
            where = str(exc.filename or out or "the run dir")
            fail(WriteRefused(where, "a file of the run", exc), debug)
        raise


def _classes(run_dir, endpoint_url: str | None) -> int | None:
    """The run's model's classes (its model.json), None where it cannot be read."""
    from sparknet.training.saved_model import read_info  # lazy: torch

    try:
        return read_info(run_dir, endpoint_url).num_classes
    except (OSError, SparknetError):
        return None


def _kept(cfg, again: str | None = None) -> str:
    """What an interrupted run keeps and the command that continues it: `round 12's checkpoint
    is kept; `sparknet train --resume --out runs/x` continues the run`. Before its first
    checkpoint, `--resume` starts it over with the settings its config.yaml keeps; before that
    is written, the command line given (`again`, by default `command_given()`) does."""
    from sparknet.data.store import open_store  # lazy: boto3
    from sparknet.training import checkpoint  # lazy: torch
    from sparknet.training.rundir import CONFIG_FILE  # lazy: torch

    resume = command_line("sparknet train", resume=True, out=cfg.out, endpoint_url=cfg.endpoint_url)
    try:
        store = open_store(cfg.out, cfg.endpoint_url)
        last = checkpoint.latest(store)
        configured = last is not None or store.size(CONFIG_FILE) is not None
    except (OSError, SparknetError):  # the store does not answer: what is kept is unknown
        return f"the last complete checkpoint is kept; `{resume}` continues the run"
    if not configured:
        again = again or command_given()
        return f"no checkpoint was complete yet; `{again}` starts the run again"
    if last is None:
        return f"no checkpoint was complete yet; `{resume}` starts the run again, as it was set"
    return f"round {last}'s checkpoint is kept; `{resume}` continues the run"


class _Report:
    """Round progress on stderr: a live bar on a terminal; otherwise (a log file, CI, a pipe)
    one plain line per event as it happens, since a bar there shows nothing until the end."""

    def __init__(self, live: bool, caught: Caught | None = None) -> None:
        self.live = live
        self.caught = caught or Caught()
        self.done, self.total = 0, 0
        #: the rounds done before this process's first (a resume's checkpoint)
        self.started_at = 0
        self.progress = Progress(
            TextColumn("[bold]round"),
            MofNCompleteColumn(),
            BarColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            console=console,
        )
        self.bar = self.progress.add_task("train", start=False, info="starting Spark")
        self.shown = False
        #: the run got as far as starting Spark (so the interrupt line says Spark stopped)
        self.spark_started = False

    def _show(self) -> None:
        if self.live and not self.shown:
            self.progress.start()
            self.shown = True

    def _interrupted(self) -> None:
        """Raise the interrupt a signal asked for if it was lost: a KeyboardInterrupt raised
        inside a finalizer or a JVM callback while Spark starts is printed as "Exception
        ignored" and dropped, and the run would go on to the end. Every event checks, for
        this command's handler and the one from before it (`signals.received`)."""
        if caught_signal(self.caught) is not None:
            raise KeyboardInterrupt

    def start(self, done: int, total: int) -> None:
        self._interrupted()
        self.done, self.total, self.started_at = done, total, done
        self.progress.update(self.bar, completed=done, total=total)
        self.progress.start_task(self.bar)
        self._show()

    def status(self, text: str) -> None:
        self._interrupted()
        if text != "starting Spark":
            text = f"round {self.done + 1} ({text})"
        if not self.live:
            _line(text)
        else:
            self.progress.update(self.bar, info=text)
            self._show()
        self.spark_started = True  # every status comes as Spark starts, or after it

    def round(self, row: dict[str, Any]) -> None:
        self._interrupted()
        self.done = row["round"]
        if self.live:
            self.progress.update(self.bar, completed=row["round"], info=round_text(row))
        else:
            _line(round_line(row, self.total))

    def warning(self, text: str) -> None:
        """A line above the bar (or among the plain lines) that the run goes on after."""
        if self.live:
            self.progress.console.print(f"warning: {text}", markup=False, highlight=False)
        else:
            _line(f"warning: {text}")

    def stop(self) -> None:
        """Close the bar; one never shown prints nothing (not even an empty line)."""
        if self.shown:
            self.progress.stop()


def _line(text: str) -> None:
    """One progress line, written whole (`signals.write_line`: an `error:` line after it never
    shares its line); a reader that went away (`| head`) must not kill the run: from then on
    stderr goes to /dev/null."""
    try:
        signals.write_line(sys.stderr, text)
    except BrokenPipeError:
        _to_devnull(sys.stderr)


def _to_devnull(stream) -> None:
    """Point a stream whose reader is gone at /dev/null, so later writes (and the flush at exit)
    succeed silently instead of raising BrokenPipeError (the Python docs' advice for SIGPIPE)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, stream.fileno())
    os.close(devnull)
