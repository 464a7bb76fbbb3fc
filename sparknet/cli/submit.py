"""`sparknet-submit`: one training job on a cluster, end to end, and the jobs it started.

The flow is `sparknet.jobs.submit`; `evaluate` and `predict` run a finished run's model through
the same flow (`sparknet.jobs.model_jobs`), with the same job options (`_job_options`, declared
once); `attach`, `logs`, `cancel`, `list` are `sparknet.cli.jobs`, registered here on the same
app.

The training flags are built as `sparknet train`'s are, from the settings' one declaration
(`sparknet.cli.settings`); `--workers` here counts worker instances, as `cluster up`'s does.
The submit options belong to the group's callback, which runs the job when no subcommand is
given, so `sparknet-submit --s3 X ...` is the job itself."""

from __future__ import annotations

import copy
import inspect
import signal
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any, TypeVar

import typer
from typer.models import OptionInfo

from sparknet.cli import jobs
from sparknet.cli.cluster.options import INSTANCE_TYPE_HELP, SPOT_HELP, cluster_spec
from sparknet.cli.common import (
    ENDPOINT_HELP,
    Caught,
    DebugOption,
    VersionOption,
    caught_signal,
    console,
    fail,
    interrupts,
    program,
    results,
    short_helps,
    sized,
    takes,
)
from sparknet.cli.jobs import Report, say
from sparknet.cli.settings import ConfOption, SetOption, known_sets, with_settings
from sparknet.config import TrainConfig, find_config_file, load_datasets, load_train_config
from sparknet.errors import NO_VALUE, SettingError, SparknetError, as_flag, first_line
from sparknet.say import command_line

# `# lazy: X` below: an import kept inside the command that needs it, X being slow to import
# (torch ~2 s; boto3, fabric, numpy ~0.2 s each; `+N ms`: what it adds, measured) while
# `sparknet-submit --help` and every other command import this module

submit_app = typer.Typer(
    add_completion=False,
    help="Run a training job on an EC2 GPU cluster; evaluate, predict: a finished run's model "
    "on one; attach, logs, cancel, list: the jobs started.",
)

F = TypeVar("F", bound=Callable[..., Any])

#: the training settings with an option in `sparknet train` that submit sets itself or has its own
#: option of: the data is --s3, the run dir the run prefix, the master the cluster's, a node's
#: GPUs its instance type's; --workers and --endpoint-url are submit's own (worker instances;
#: the AWS endpoint)
NOT_SHARED = frozenset({"data", "workers", "out", "master", "gpus_per_worker", "endpoint_url"})
#: the training settings a job's driver gets from submit, whatever `--set` says (`job_config`),
#: each with what sets it instead; `--set workers=N` (Spark tasks) is the job's to choose
SET_BY_SUBMIT = {
    "data": "the dataset is --s3",
    "out": "the run dir is the job's run prefix, under the cluster's runs_prefix: (sparknet.yaml)",
    "master": "the master is the cluster's",
    "gpus_per_worker": "a node's GPUs are its instance type's (the cluster's instance_types:, "
    "or --instance-type)",
    "endpoint_url": "use --endpoint-url",
}


def refuse_own_sets(items: list[str]) -> None:
    """A `--set` of a setting submit sets itself is refused (exit 2 at the caller), naming what
    sets it, not dropped: the launch would overwrite it without a word."""
    for item in items:
        key = item.partition("=")[0].strip().removeprefix("train.")
        if key in SET_BY_SUBMIT:
            raise SparknetError(
                "--set {key}: sparknet-submit sets it itself; {instead}",
                key=key, instead=SET_BY_SUBMIT[key],
            )  # fmt: skip


def spelt(setting: str, value: Any = NO_VALUE) -> str:
    """How sparknet-submit's errors name a setting: its own flag where it has one; else a
    cluster's setting as its key in sparknet.yaml (`region:`), a training setting as `--set`
    (never a flag only `sparknet train` or `sparknet cluster` has)."""
    from sparknet.cluster.spec import ClusterSpec  # lazy: only for an error's line

    flag = as_flag(setting, value)
    if not flag.startswith("--") or takes("sparknet-submit", flag.split()[0]):
        return flag
    if setting in ClusterSpec.model_fields:
        shown = "" if value is NO_VALUE else f" {value}"
        return f"the cluster's `{setting}:{shown}` in sparknet.yaml"
    if setting in TrainConfig.model_fields:
        return f"--set {setting}=" + ("..." if value is NO_VALUE else str(value))
    return flag


def _job_options(
    s3: str | None = typer.Option(
        None, "--s3", help="dataset name from sparknet.yaml or s3://bucket/prefix (required)"
    ),
    cluster: str | None = typer.Option(
        None, "--cluster", help="reuse this running cluster (it stays up after the job)"
    ),
    name: str | None = typer.Option(
        None, "--name", help="name of the cluster to make (default: the only `clusters:` entry)"
    ),
    workers: int | None = typer.Option(
        None,
        help="worker instances of the cluster to make (EC2 machines, not Spark tasks: those are "
        "one per GPU, or --set workers=N) (default: the cluster's workers:, else 2)",
    ),
    instance_type: list[str] = typer.Option([], help=INSTANCE_TYPE_HELP),
    spot: bool | None = typer.Option(None, "--spot/--on-demand", help=SPOT_HELP),
    provider: str | None = typer.Option(
        None,
        help="aws: EC2 instances; static: your own `hosts:` (default: the cluster's provider:, "
        "else aws)",
    ),
    keep: bool = typer.Option(False, "--keep", help="leave the cluster up after the job"),
    detach: bool = typer.Option(
        False, "--detach", help="return once the job runs (`sparknet-submit attach RUN` follows it)"
    ),
    autostop: int | None = typer.Option(
        None,
        "--autostop",
        metavar="MINUTES",
        help="the master of the cluster made here terminates it after this many minutes with "
        "no job running and no submitter attached; 0 (off) only with --keep (default: 30)",
    ),
    max_restarts: int = typer.Option(
        2,
        "--max-restarts",
        min=0,
        help="restarts of a driver that dies (killed, crashed): training's from the run's last "
        "checkpoint, evaluate's and predict's from the start; 0: never",
    ),
    endpoint_url: str | None = typer.Option(None, help=ENDPOINT_HELP),
    dry_run: bool = typer.Option(
        False,
        "--dry-run",
        help="run every check a launch runs first and print the plan (machines and their "
        "price, the data, the settings); nothing is made",
    ),
    config: Path | None = typer.Option(
        None,
        "--config",
        help="settings YAML (train:, datasets:, clusters:) (default: ./sparknet.yaml)",
    ),
) -> None:
    """The options of every job a submit runs (training, evaluate, predict): its data and the
    cluster it runs on. Declared once here; `with_job_options` adds them to each command."""


def with_job_options(func: F) -> F:
    """`func`'s leading parameters (the context, arguments), then `_job_options`'s, then the
    rest of its own but its `**kwargs`, in which typer passes the job options (`JOB_OPTIONS`
    names them; and `with_settings`'s training options, where it adds them)."""
    own = list(inspect.signature(func, eval_str=True).parameters.values())
    lead = 0
    while (
        lead < len(own)
        and not isinstance(own[lead].default, OptionInfo)
        and (own[lead].kind is not inspect.Parameter.VAR_KEYWORD)
    ):
        lead += 1
    job = [
        p.replace(kind=inspect.Parameter.KEYWORD_ONLY, default=_in_job_panel(p.default))
        for p in inspect.signature(_job_options, eval_str=True).parameters.values()
    ]
    rest = [p.replace(kind=p.KEYWORD_ONLY) for p in own[lead:] if p.kind is not p.VAR_KEYWORD]
    func.__signature__ = inspect.Signature([*own[:lead], *job, *rest])  # type: ignore[attr-defined]
    return func


def _in_job_panel(option: OptionInfo) -> OptionInfo:
    """A job option as `--help` shows it: in the panel of the job and its cluster, apart from
    the training settings (a copy: one option serves every command)."""
    option = copy.copy(option)
    option.rich_help_panel = "Job and cluster"
    return option


#: the parameters `with_job_options` adds
JOB_OPTIONS = tuple(inspect.signature(_job_options).parameters)


@with_settings(leave_out=NOT_SHARED, after={"conf": "spark_conf"}, last=("debug",))
@with_job_options
def submit(
    ctx: typer.Context,
    set_: list[str] = SetOption,
    conf: list[str] = ConfOption,
    debug: bool = DebugOption,
    version: bool = VersionOption,
    **training: Any,
) -> None:
    """Check the dataset and run prefix, bring a cluster up (or reuse --cluster), run the job on
    it, follow its rounds, fetch curves.png and metrics.jsonl into runs/RUN/, and take the
    cluster down (unless --keep, --detach or --cluster) after success, failure, Ctrl-C or
    SIGTERM. --detach returns once the job runs; the cluster's autostop timer ends it after."""
    if ctx.invoked_subcommand is not None:
        _refuse_options_before(ctx, debug)
        return
    try:
        known_sets(set_)  # a misspelt key is named before anything is checked or launched
        refuse_own_sets(set_)
    except SparknetError as exc:
        fail(exc, debug)
    job = {k: training.pop(k) for k in JOB_OPTIONS}
    _run_job(
        job, debug,
        settings=lambda path: load_train_config(
            config_file=path, sets=set_, flags=training, conf=conf
        ),
    )  # fmt: skip


@with_job_options
def evaluate(
    run: str = typer.Argument(
        ...,
        metavar="RUN",
        help="a finished run: its run id (`sparknet-submit list`), or its run dir (local or "
        "s3://bucket/prefix)",
    ),
    split: str | None = typer.Option(None, help="the dataset's split to read (default: val)"),
    debug: bool = DebugOption,
    **job: Any,
) -> None:
    """Evaluate a finished run's model on a cluster: loss, top-1, top-5, per-class accuracy and
    the confusion matrix of the --s3 dataset's split, into the job's run prefix and runs/RUN/.
    The cluster is made and taken down as for training (or reuse one with --cluster)."""
    from sparknet.jobs.model_jobs import ModelTask  # lazy: boto3

    _run_job(job, debug, run=run, command="evaluate", task=lambda where, endpoint, job_id: (
        ModelTask("evaluate", where, endpoint, split=split, job=job_id)
    ))  # fmt: skip


@with_job_options
def predict(
    run: str = typer.Argument(
        ...,
        metavar="RUN",
        help="a finished run: its run id (`sparknet-submit list`), or its run dir (local or "
        "s3://bucket/prefix)",
    ),
    out: str | None = typer.Option(
        None,
        help="parquet:s3://bucket/prefix, which must not exist, under the cluster's own runs "
        "where sparknet made its nodes (default: the job's run prefix's predictions/)",
    ),
    split: str | None = typer.Option(None, help="the dataset's split to read (default: val)"),
    top_k: int | None = typer.Option(
        None, min=1, help="likeliest classes a row lists (default: 5, or the classes if fewer)"
    ),
    batch_size: int | None = typer.Option(
        None, min=1, help="rows a forward pass takes at once (default: 64)"
    ),
    debug: bool = DebugOption,
    **job: Any,
) -> None:
    """Predict with a finished run's model on a cluster: a Parquet row per sample of the --s3
    dataset's split (its key, label, prediction, top-k, probabilities), written to S3."""
    from sparknet.jobs.model_jobs import ModelTask  # lazy: boto3

    _run_job(job, debug, run=run, command="predict", task=lambda where, endpoint, job_id: (
        ModelTask("predict", where, endpoint, split=split, out=out, top_k=top_k,
                  batch_size=batch_size, job=job_id)
    ))  # fmt: skip


def _refuse_options_before(ctx: typer.Context, debug: bool) -> None:
    """An option given before a command (`sparknet-submit --s3 D evaluate RUN`) is the group's,
    a training job's, which the command would never see: refused in one line (exit 2) that
    says where it goes, rather than dropped."""
    command = ctx.invoked_subcommand
    for param in ctx.command.params:
        if param.name in (None, "debug"):
            continue
        source = ctx.get_parameter_source(param.name)  # typer's own click's enum: by name
        if source is None or source.name != "COMMANDLINE":
            continue
        flag = param.opts[0]
        if command in ("evaluate", "predict") and param.name in JOB_OPTIONS:
            where = f"goes after the command: `sparknet-submit {command} RUN {flag} ...`"
        elif command in ("evaluate", "predict"):
            where = f"is a training option; `sparknet-submit {command}` scores the run's model"
        else:
            where = f"is for a new job; `sparknet-submit {command}` takes its options after it"
        fail(SparknetError(f"{flag} {where}"), debug, 2)


def _run_job(
    options: dict[str, Any],
    debug: bool,
    *,
    settings: Callable[[Path | None], Any] | None = None,
    run: str | None = None,
    task: Callable[[str, str | None, str | None], Any] | None = None,
    command: str | None = None,
) -> None:
    """One job, end to end, as the flow (`sparknet.jobs.submit`) runs it: training on the
    `settings` read from the file at the path given, or the model's job `task` makes of `run`
    (where it is, its S3 endpoint, the run id it was given as); exits as design.md says (2:
    refused before anything was launched)."""
    from sparknet.cluster import repair  # lazy: boto3, fabric
    from sparknet.cluster.registry import LockUnavailable  # lazy: boto3
    from sparknet.jobs import model_jobs, preflight, records  # lazy: boto3, fabric
    from sparknet.jobs import submit as flow  # lazy: boto3, fabric
    from sparknet.jobs.follow import JobOutOfReach  # lazy: boto3, fabric
    from sparknet.jobs.preflight import Job, PreflightFailed, resolve_dataset  # lazy: boto3, fabric

    o = SimpleNamespace(**options)
    caught = Caught()
    started = False  # an error before the flow starts is in the command or settings: exit 2
    ending = flow.ClusterOutcome()  # a signal during the checks below: "nothing was launched"
    try:
        preflight.check_request(o.s3, o.cluster, o.name, o.keep, o.autostop, command)
        path = find_config_file(o.config)
        dataset = resolve_dataset(o.s3, load_datasets(path), o.endpoint_url)
        model_task = None
        if task is not None:
            assert run is not None
            model_task = task(*records.run_dir_of(run, o.endpoint_url))
            cfg = model_jobs.run_settings(model_task)
        else:
            assert settings is not None
            cfg = settings(path)
        cluster_name = preflight.cluster_to_use(o.cluster, o.name, path)
        flags = dict(
            workers=o.workers, instance_types=o.instance_type, spot=o.spot, provider=o.provider,
            autostop_minutes=o.autostop,
        )  # fmt: skip
        spec = _instances_spec(cluster_name, path, {} if o.cluster else flags)
        preflight.check_cluster_options(
            spec, instance_types=o.instance_type, spot=o.spot, autostop=o.autostop, keep=o.keep,
            detach=o.detach, reused=o.cluster is not None,
        )  # fmt: skip
        repair.check_every_s()  # a bad setting fails now, not once the job runs
        job = Job(
            spec, o.cluster is not None, o.keep, dataset, cfg, o.endpoint_url, detach=o.detach,
            max_restarts=o.max_restarts, task=model_task,
        )  # fmt: skip
        if o.dry_run:
            from sparknet.jobs.plan import plan  # lazy: boto3, fabric

            _print_plan(plan(job))
            return
        report = Report(console.is_terminal and model_task is None, cfg.rounds)
        with interrupts(caught, note=_second_signal_note(job)):
            started = True
            try:
                result = flow.submit(
                    job, say=say, on_rows=report.rows,
                    on_job=lambda *a: records.save(records.record_of(job, *a)), ending=ending,
                )  # fmt: skip
            finally:
                report.stop()
    except (KeyboardInterrupt, Exception) as exc:
        after = getattr(exc, "after", None)  # a TeardownFailed's: what ended the job
        for error in (exc, after):
            if isinstance(error, SparknetError):
                error.respell(spelt)  # in words sparknet-submit has (no --region)
        interrupted = any(isinstance(e, KeyboardInterrupt) for e in (exc, after))
        if interrupted or caught_signal(caught) is not None:
            signum = caught_signal(caught) or signal.SIGINT
            how = "" if signum == signal.SIGINT else f" ({signal.Signals(signum).name})"
            fail(SparknetError(f"interrupted{how}{_ended(exc, ending)}"), debug, 128 + signum)
        if isinstance(after, SparknetError):
            fail(SparknetError(f"{first_line(after)}; then {exc}"), debug, 1)
        if isinstance(exc, flow.JobFailed | flow.TeardownFailed | JobOutOfReach):
            fail(exc, debug, 1)
        if isinstance(exc, SparknetError):
            bad_input = not started or isinstance(exc, PreflightFailed | LockUnavailable)
            fail(exc, debug, 2 if bad_input else 1)
        raise
    if result.outcome is None:
        _print_detached(job, result.run_id, result.prefix)
        return
    for line in _summary(job, result):
        results.print(line, markup=False, highlight=False, soft_wrap=True)
    for fetched in result.fetched:
        results.print(f"fetched {fetched}", markup=False, highlight=False, soft_wrap=True)
    if job.keep or job.reused:
        say(flow.stays_up_line(job))


def _summary(job, result) -> list[Any]:
    """What a finished job prints (`jobs.finished_lines`, as `attach` prints it)."""
    task = job.task
    return jobs.finished_lines(
        "train" if task is None else task.command,
        task.target(result.prefix) if task is not None and task.command == "predict" else None,
        result.run_id, result.prefix, job.dataset.endpoint_url, result.outcome.rows,
        result.wall_s, result.cost, result.fetched,
    )  # fmt: skip


def _print_plan(plan) -> None:
    """A dry run's plan (`sparknet.jobs.plan`), on stdout: the cluster and its machines, what
    they cost per hour, the data, where the run goes, the settings."""
    use = "reused, as it runs" if plan.reused else "to make"
    lines = [f"dry run: every check passed; nothing was launched. {plan.command} on cluster "
             f"{plan.cluster} ({use}):"]  # fmt: skip
    for m in plan.machines:
        if not m.instance_types:
            lines.append(f"  {m.role}: {m.count} of your own (no price of sparknet's)")
            continue
        market = "spot" if m.spot else "on-demand"
        then = f"; fallback {', '.join(m.instance_types[1:])}" if len(m.instance_types) > 1 else ""
        price = "" if m.cost is None else f", {m.cost.describe()}"
        lines.append(f"  {m.role}: {m.count} x {m.instance_types[0]} ({market}{then}){price}")
    if plan.cost is not None:
        lines.append(f"  per hour in all: {plan.cost.describe()}")
    sizes = "; ".join(
        f"{name} {size.samples:,} samples in {size.shards} "
        f"{'shard' if size.shards == 1 else 'shards'} ({sized(size.bytes)})"
        for name, size in plan.splits.items()
    )
    lines.append(f"dataset: {plan.dataset}" + (f": {sizes}" if sizes else ""))
    lines.append(f"run prefix: {plan.prefix} (RUN: the run id a launch gets)")
    if plan.output is not None:
        lines.append(f"predictions: {plan.output}")
    lines.append("settings:")
    lines += [
        f"  {key}: {'default' if value is None else value}" for key, value in plan.settings.items()
    ]
    lines += [f"note: {note}" for note in plan.notes]
    for line in lines:
        results.print(line, markup=False, highlight=False, soft_wrap=True)


def _second_signal_note(job) -> str:
    """What a second Ctrl-C or SIGTERM prints while the first one's clean-up runs: the job's
    cancel (waited for until its driver is gone) and, unless the cluster stays up (--cluster,
    --keep), the teardown; it cannot cut them short."""
    from sparknet.jobs import submit as flow  # lazy: boto3, fabric

    if flow.teardown_due(job):
        return "still cancelling the job and taking the cluster down; it ends by itself"
    return (
        f"still cancelling the job (waiting for its driver to stop); cluster {job.spec.name} "
        "stays up; it ends by itself"
    )


def _ended(exc: BaseException, ending) -> str:
    """What an interrupted submit says became of the cluster: down only when it is."""
    from sparknet.jobs import submit as flow  # lazy: boto3, fabric

    if isinstance(exc, flow.TeardownFailed):
        return f"; {exc}"
    return {"down": "; teardown done", "up": "; the cluster stays up (see above)"}.get(
        ending.cluster, "; nothing was launched"
    )


#: what a detached job's hint names: the commands that follow it, show its log, end it
_FOLLOW_UP = ("attach", "logs", "cancel")


def _print_detached(job, run_id: str, prefix: str) -> None:
    """What a detached submit prints: the run id (stdout), how to reach the job, and what
    ends the cluster."""
    for line in (f"run id: {run_id}", f"run prefix: {prefix}"):
        results.print(line, markup=False, highlight=False, soft_wrap=True)
    attach, logs, cancel = (command_line(f"sparknet-submit {c}", run_id) for c in _FOLLOW_UP)
    say(
        f"job {run_id} runs detached: `{attach}` follows it, `{logs}` shows its log, "
        f"`{cancel}` ends it"
    )
    from sparknet.jobs.submit import stays_up_line  # lazy: boto3, fabric

    say(stays_up_line(job))


def _instances_spec(name: str, path: Path | None, flags: dict[str, Any]):
    """The cluster's spec (`sparknet cluster`'s `cluster_spec`); a bad `--workers` is named
    as the flag and what it counts, worker instances (not the Spark tasks of `--set workers`)."""
    try:
        return cluster_spec(name, path, flags)
    except SettingError as exc:
        if flags.get("workers") is None or exc.setting != "workers":
            raise
        raise SettingError(
            "{where}{@workers=value} (worker instances): {reason}",
            setting="workers", value=flags["workers"],
            where=exc.values["where"], reason=exc.values["reason"],
        ) from exc  # fmt: skip


submit_app.callback(invoke_without_command=True)(submit)

for _name, _command in (
    ("evaluate", evaluate),
    ("predict", predict),
    ("attach", jobs.attach),
    ("logs", jobs.logs),
    ("cancel", jobs.cancel),
    ("list", jobs.list_jobs),
):
    submit_app.command(_name)(_command)
short_helps(submit_app)
program("sparknet-submit", submit_app)
