"""A training run on the driver, from its checks to its last round.

Check the settings and the run dir, resume or start, start Spark, choose the transport, and run
the rounds (`rounds`) on the problem (`problem`)."""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from sparknet.config import DatasetEntry, TrainConfig
from sparknet.data.frames import Frames
from sparknet.data.sources import check_frame_path, is_frame_spec, resolve_source
from sparknet.errors import Line, Placeholder, SettingError, SparknetError
from sparknet.training import allreduce, checkpoint, rundir, rundir_reach
from sparknet.training.outer import outer_at
from sparknet.training.probe import check_python_workers, user_modules
from sparknet.training.problem import FrameInput, Problem, frame_problem, prepare
from sparknet.training.progress_guard import Guard
from sparknet.training.report import EARLY, STOPPED, MetricsLog, plot_curves, read_metrics
from sparknet.training.retention import Retention
from sparknet.training.rounds import (
    RoundCallback,
    RunContext,
    RunEvents,
    StartPoint,
    WarningCallback,
    allreduce_rounds,
    spark_rounds,
    write_config,
)
from sparknet.training.rundir import MODEL_FILE, Lock, RunDir, read_run_config
from sparknet.training.saved_model import ModelInfo, SavedModel, write_info
from sparknet.training.session import start_session, stop_quietly, stopped_from_outside
from sparknet.training.spark_settings import is_local_master
from sparknet.training.state import StateLayout
from sparknet.training.sync import layers_of
from sparknet.training.tracking import Tracker, check_installed
from sparknet.training.transport import wait_for_executors
from sparknet.training.watchdog import ExecutorWatchdog

#: called once the run is validated and its dir opened: (rounds already done, rounds in all)
StartCallback = Callable[[int, int], None]
#: what the run is waiting for before its first round: "starting Spark", "starting Python workers"
StatusCallback = Callable[[str], None]


@dataclass(frozen=True)
class RunResult:
    #: a Path for a local run dir, the s3:// URI for one on S3
    run_dir: Path | str
    rounds: int
    metrics: list[dict[str, Any]]

    @property
    def final(self) -> dict[str, Any]:
        return self.metrics[-1]

    @property
    def stopped_at_target(self) -> float | None:
        """The `stop_at` target whose evaluation ended the run (before its last round, or at
        it: `stopped_early` says which), or None where no evaluation reached one."""
        return self.final.get(STOPPED)

    @property
    def stopped_early(self) -> bool:
        """Whether the run reached its target before its last round, and ended there."""
        return bool(self.final.get(EARLY))


def slug(text: str) -> str:
    """A name for a dir from a model's or a dataset's (`pkg.mod:factory` -> `factory`,
    `s3://b/imagenet` -> `b_imagenet`): letters and digits, the rest `_`."""
    return re.sub(r"[^A-Za-z0-9]+", "_", text.split(":")[-1]).strip("_") or "x"


def default_run_dir(cfg: TrainConfig) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{slug(cfg.model)}-{slug(cfg.data)}-{stamp}"


def _resume_changes(cfg: TrainConfig, run: RunDir) -> dict[str, tuple[Any, Any]]:
    """{setting: (stored, now)} for the settings that decide the weights and differ from the
    stored run's."""
    section = read_run_config(run.text, cfg.endpoint_url)
    try:
        stored = TrainConfig(**section)
    except (ValueError, TypeError) as exc:
        raise SparknetError(f"{section.where} is not a config sparknet can resume") from exc
    return cfg.trajectory_changes(stored)


def _changes_that_matter(changes: dict[str, tuple[Any, Any]], problem: Problem) -> dict[str, tuple]:
    """Leave out changes that change nothing for this problem: a `num_classes` that equals the
    one the dataset gives (the stored run left it to the dataset), an `image_size` of data that
    is not images."""
    out = dict(changes)
    stored, now = out.get("num_classes", (0, 0))
    if {stored, now} == {None, problem.num_classes}:
        del out["num_classes"]
    source = problem.source
    images = getattr(source, "image_size", None) is not None
    if "image_size" in out and not (images and getattr(source, "kind", "image") == "image"):
        del out["image_size"]
    return out


def _recorded_changes(
    changes: dict[str, tuple[Any, Any]], run: RunDir, allow_change: bool
) -> dict[str, Any]:
    """Changes are refused, or with --allow-change returned to be recorded in metrics.jsonl."""
    if changes and not allow_change:
        listed = ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changes.items())
        raise SparknetError(
            "resuming {run} would change {listed}, so it would no longer equal an uninterrupted "
            "run; drop the change, or pass {@allow_change=True} to continue anyway",
            run=run,
            listed=listed,
        )
    return {k: {"stored": a, "now": b} for k, (a, b) in changes.items()}


def train(
    cfg: TrainConfig,
    *,
    resume: bool = False,
    spark=None,
    on_start: StartCallback | None = None,
    on_round: RoundCallback | None = None,
    on_status: StatusCallback | None = None,
    on_warning: WarningCallback | None = None,
    datasets: dict[str, DatasetEntry] | None = None,
    frames: FrameInput | None = None,
    allow_change: bool = False,
) -> RunResult:
    """Run (or resume) a training job; writes the run dir of design.md section 4.

    Everything that can be checked without Spark (settings, the run dir, a shard dataset's
    manifest, the model) is checked before Spark starts; a DataFrame is checked right after.
    A resume may change `rounds` and what does not alter the weights; other changes are refused
    unless `allow_change`, and then recorded in the first resumed round's metrics row. A resume
    of a run that stopped before its first complete checkpoint starts it over, as `cfg` says.
    """
    if cfg.out is None:
        cfg = cfg.model_copy(update={"out": str(default_run_dir(cfg))})
    if frames is None:  # a parquet: path that is not there, before Spark starts
        check_frame_path(cfg.data, cfg.endpoint_url)
        check_frame_path(cfg.eval_data, cfg.endpoint_url)
    if frames is None and is_frame_spec(cfg.data):
        frames = FrameInput()
    run = RunDir.open(cfg.out, cfg.endpoint_url)
    rundir.check_out(run)
    check_installed(cfg)
    with rundir.locked(run) as lock:
        rundir.check(run, resume)
        checkpoint.discard_incomplete(run.store)  # an interrupted run's; never resumed from
        changes = _resume_changes(cfg, run) if resume else {}
        if resume and (last := _ended_at(cfg, run)) is not None:
            _recorded_changes(changes, run, allow_change)
            return _finished(cfg, run, last)
        return _start(
            cfg, run, lock, resume, (changes, allow_change), spark, on_start, on_round,
            on_status, on_warning, datasets, frames,
        )  # fmt: skip


def _ended_at(cfg: TrainConfig, run: RunDir) -> int | None:
    """The round a resumed run already ended at, or None where it has rounds to run: its
    newest checkpoint is after the last round, or after an evaluation that reached `stop_at`
    (the resume's own: a higher target, or none, goes on)."""
    last = checkpoint.latest(run.store)
    if last is None or last >= cfg.rounds:  # past it: refused where the rounds start
        return last if last == cfg.rounds else None
    row = next((r for r in read_metrics(run.store) if r["round"] == last), {})
    return last if checkpoint.reached(cfg, row) else None


def _finished(cfg: TrainConfig, run: RunDir, last: int) -> RunResult:
    """A resumed run whose last round (`last`: cfg.rounds, or where `stop_at` ended it) is
    already checkpointed needs no Spark: (re)write what an interrupt after that checkpoint may
    have left out (model.safetensors, curves.png, the pruning of older checkpoints)."""
    weights = checkpoint.read_weights(run.store, last)
    run.store.write_bytes(MODEL_FILE, weights)  # the same tensors, the model's own keys
    rows = MetricsLog(run.store, keep_rounds=last).rounds
    Retention(run.store, cfg.keep_checkpoints).prune(rows)
    plot_curves(rows, run.store)
    return RunResult(run.result, last, rows)


def _start(
    cfg: TrainConfig,
    run: RunDir,
    lock: Lock,
    resume: bool,
    changes: tuple[dict[str, tuple[Any, Any]], bool],
    spark,
    on_start: StartCallback | None,
    on_round: RoundCallback | None,
    on_status: StatusCallback | None,
    on_warning: WarningCallback | None,
    datasets: dict[str, DatasetEntry] | None,
    frames: FrameInput | None,
) -> RunResult:
    """Check the problem, start Spark (unless given a session) and run the rounds."""
    status = on_status or (lambda _text: None)
    own_session = spark is None
    placed: Frames | None = None
    if frames is None:  # a dataset is checked before Spark starts, a DataFrame once it runs
        problem = prepare(cfg, resolve_source(cfg, datasets))
        begin = _begin(cfg, problem, run, resume, changes)
        if on_start is not None:
            on_start(begin.rounds, cfg.rounds)
    result: RunResult | None = None
    if frames is not None and on_start is not None:  # before Spark: the bar says which round
        last = checkpoint.latest(run.store) if resume else None
        on_start(last or 0, cfg.rounds)
    try:
        if own_session:
            status("starting Spark")
            spark = start_session(cfg.master, cfg.workers, cfg.spark_conf, cfg.gpus_per_worker)
        if not is_local_master(spark.sparkContext.master):  # a cluster's executors register
            status("waiting for Spark's executors")
            if cores := wait_for_executors(spark.sparkContext, cfg.workers):
                status(f"{len(cores)} executors registered ({sum(cores.values())} cores)")
        ran = rundir.ran_transport(run.store) if resume and cfg.transport == "auto" else None
        cfg = _resolve_transport(cfg, spark, ran)  # refusals first
        status("starting Python workers")
        data = None if frames is not None or cfg.data in (datasets or {}) else cfg.data
        check_python_workers(spark, cfg.workers, user_modules(cfg.model, data))
        _reach_run_dir(run, spark, cfg.workers, status)
        if frames is not None:
            problem, placed = frame_problem(cfg, spark, frames)
            if cfg.stop_at is not None and placed.eval is None:
                raise SettingError(
                    "{@stop_at=value} needs an evaluation as the run goes; give {@eval_data} "
                    "or drop {@stop_at}",
                    setting="stop_at", value=cfg.stop_at,
                )  # fmt: skip
            begin = _begin(cfg, problem, run, resume, changes)
        warn = _warner(on_warning)
        guard = Guard(spark.sparkContext, cfg.progress_timeout_s, warn)
        on_row = guard.following(_with_warnings(on_round, warn, begin, cfg))
        with ExecutorWatchdog(spark.sparkContext, cfg.no_executor_timeout_s), guard:
            result = _run(
                cfg, problem, begin, run, lock, spark, own_session, placed, on_row, warn, guard
            )  # fmt: skip
        return result
    except Exception as exc:  # the application ended under the run: one line, not a traceback
        if spark is not None and (stopped := stopped_from_outside(spark.sparkContext, exc)):
            raise stopped from exc
        raise
    finally:
        if placed is not None:
            placed.release()
        if own_session and spark is not None:
            try:
                stop_quietly(spark)
            except KeyboardInterrupt:
                if result is None:
                    raise  # once every file is written, a signal while Spark stops is no failure


def _resolve_transport(cfg: TrainConfig, spark, ran: str | None) -> TrainConfig:
    """The transport that runs, recorded in the run's config.yaml: `auto` is `allreduce`
    wherever it can run when an option of its own (`compress`, `overlap`, `fragments`) asks
    for it, or when a resumed run's checkpoint was made on it (`ran`), so that it goes on bit
    for bit; else `allreduce` on a cluster master whose executors give every worker a task
    slot at once (DataFrames too), `spark` otherwise. A run that ran on `spark` is not kept
    there: moved to a cluster, it gets the faster transport (the same weights up to float
    rounding). An `allreduce` that cannot run is an error saying why."""
    if cfg.transport == "spark":
        return cfg
    sc = spark.sparkContext
    why = _allreduce_refusal(sc, cfg)
    wanted = cfg.transport == "allreduce" or bool(cfg.allreduce_options)
    if why is not None and wanted:
        raise why
    if why is None and (wanted or ran == "allreduce" or not is_local_master(sc.master)):
        return cfg.model_copy(update={"transport": "allreduce"})
    return cfg.model_copy(update={"transport": "spark"})


def _reach_run_dir(run: RunDir, spark, workers: int, status: StatusCallback) -> None:
    """On a cluster, a local run dir must be one every executor sees: tasks write files of the
    run into it (both transports: each worker its inner optimizer state into a checkpoint; under
    allreduce rank 0 the checkpoints and the weights). Refused in one line where some do not."""
    if run.on_s3 or is_local_master(spark.sparkContext.master):
        return
    status(Line("checking that the executors see {@out}"))
    if hosts := rundir_reach.unseen_hosts(spark.sparkContext, run, workers):
        raise rundir_reach.refusal(run, hosts)


def _allreduce_refusal(sc, cfg: TrainConfig) -> SparknetError | None:
    why = allreduce.why_not(sc, cfg.workers)
    if why is None:
        return None
    options = cfg.allreduce_options
    asked = "{@transport=allreduce}" if cfg.transport == "allreduce" else _settings(options)
    without = " without " + _settings(options) if options else ""
    return SparknetError(
        "the allreduce transport (" + asked + ") cannot run here: {why}; use the spark "
        "transport" + without,
        allreduce="allreduce", why=why,
    )  # fmt: skip


#: the allreduce transport's own settings, as an error's template names them
_TEMPLATE = {"compress": "{@compress}", "overlap": "{@overlap}", "fragments": "{@fragments}"}


def _settings(names: list[str]) -> str:
    """Settings named in an error's template (each front end spells them): `a`, `a and b`."""
    return " and ".join(_TEMPLATE[name] for name in names)


def _warner(on_warning: WarningCallback | None) -> WarningCallback:
    """`on_warning`, or a Python warning for a caller without one (the benchmarks)."""
    return on_warning or (lambda text: warnings.warn(text, RuntimeWarning, stacklevel=3))


def _with_warnings(
    on_round: RoundCallback | None,
    warn: WarningCallback,
    begin: StartPoint,
    cfg: TrainConfig,
) -> RoundCallback:
    """`on_round`, after the round's warnings (Python warnings without a callback):
    - once a run, the partitions that found no usable inner optimizer state in the checkpoint
      their round started from (a lost executor's misses are replayed, never recorded; these
      cannot be: the checkpoint lacks them): their optimizers started fresh, so the run no
      longer equals one that went on from that checkpoint. Not for the first resumed round of
      a run that changed the inner optimizer, `inner_state` or the number of workers (no usable
      states are stored for them: expected).
    - an fp16 round whose loss scaler skipped at least half of its steps, all workers' (gradients
      overflowed): the round learnt little or nothing, and only metrics.jsonl would say so."""
    expected = {"optimizer", "inner_state", "workers"} & set(begin.changes)
    inexact = False  # said once: the run stays inexact

    def on_row(row: dict[str, Any]) -> None:
        nonlocal inexact
        missed = row.get("inner_state_missed")
        if missed and not inexact and not (row["round"] == begin.rounds + 1 and expected):
            inexact = True
            which = ", ".join(map(str, missed))
            warn(
                f"round {row['round']}: partition{'s' if len(missed) > 1 else ''} {which} found "
                "no usable inner optimizer state in the checkpoint the round starts from and "
                "started a fresh optimizer, so the run is no longer exact; counted in "
                "metrics.jsonl"
            )
        skipped = row.get("skipped_steps", 0)
        steps = cfg.workers * row.get("tau", cfg.first_tau)  # a row names its tau under auto
        if skipped and 2 * skipped >= steps:
            warn(
                Line(
                    "round {round}: the fp16 loss scaler skipped {skipped} of {steps} steps "
                    "(gradients overflowed); if this goes on, lower {@lr} or use "
                    "{@precision=bf16}",
                    round=row["round"],
                    skipped=skipped,
                    steps=steps,
                    bf16="bf16",
                )
            )
        if on_round is not None:
            on_round(row)

    return on_row


def _begin(
    cfg: TrainConfig,
    problem: Problem,
    run: RunDir,
    resume: bool,
    changes: tuple[dict[str, tuple[Any, Any]], bool],
) -> StartPoint:
    """Where the rounds start on `problem`, with the changes a resume makes to the settings
    accepted (recorded in the first resumed row) or refused."""
    accepted = _recorded_changes(_changes_that_matter(changes[0], problem), run, changes[1])
    begin = _initial_state(cfg, problem, run, resume)
    begin.changes = accepted
    return begin


def _initial_state(cfg: TrainConfig, problem: Problem, run: RunDir, resume: bool) -> StartPoint:
    layout = StateLayout.of_model(problem.model)
    if cfg.fragments > (layers := len(layers_of(layout))):
        raise SettingError(
            "{@fragments=value} is more than the {layers} layers with weights of {model}; "
            "lower {@fragments}",
            setting="fragments", value=cfg.fragments, layers=layers, model=cfg.model,
        )  # fmt: skip
    last = checkpoint.latest(run.store) if resume else None
    if last is None:  # a new run, or one that stopped before its first checkpoint: round 0
        state = problem.model.state_dict()
        outer = outer_at(cfg, layout, layout.flatten(state), None)
        return StartPoint(layout, outer, layout.integers(state), 0, 0.0)
    resumed = StartPoint.from_checkpoint(cfg, run, last, layout)
    if resumed.rounds >= cfg.rounds:
        raise SettingError(
            "{run} already ran {done} rounds; pass {@rounds=n} with N > {done}",
            setting="rounds",
            value=cfg.rounds,
            run=run,
            done=resumed.rounds,
            n=Placeholder("N"),
        )
    return resumed


def _run(
    cfg: TrainConfig,
    problem: Problem,
    begin: StartPoint,
    run: RunDir,
    lock: Lock,
    spark,
    own_session: bool,
    placed: Frames | None,
    on_round: RoundCallback | None,
    warn: WarningCallback,
    guard: Guard | None = None,
) -> RunResult:
    events = RunEvents(run, cfg, begin.rounds)
    tracker: Tracker | None = None
    try:
        info = ModelInfo.of(cfg, problem.source, problem.num_classes)
        if not begin.changes:  # changed settings are the run's only once a checkpoint has them
            write_config(run, cfg)
            write_info(run.store, info)  # and a changed model only with the weights it fits
        metrics = MetricsLog(run.store, keep_rounds=begin.rounds)
        tracker = Tracker.start(cfg, run.store, run.text, warn)
        loop = RunContext(
            cfg, problem, run, lock, spark, own_session, metrics, events,
            tracker.following(on_round), warn, guard,
            Retention(run.store, cfg.keep_checkpoints),
        )  # fmt: skip
        if cfg.transport == "allreduce":
            model_bytes = allreduce_rounds(loop, begin, placed)
        else:
            model_bytes = spark_rounds(loop, begin, placed)
        write_info(run.store, info)
        run.store.write_bytes(MODEL_FILE, model_bytes)
        plot_curves(metrics.rounds, run.store)
    except BaseException as exc:
        if tracker is not None:
            tracker.stop(interrupted=isinstance(exc, KeyboardInterrupt))
        raise
    finally:
        events.close()
    tracker.finish(SavedModel(info, model_bytes, run.text))
    return RunResult(run.result, metrics.rounds[-1]["round"], metrics.rounds)
