"""`sparknet-submit`: one training job on a cluster, end to end (the flow is
`sparknet.jobs.submit`), and the jobs it started: `attach`, `logs`, `cancel`, `list`
(`sparknet.cli.jobs`, registered here on the same app).

The training flags are `sparknet train`'s own parameters, taken from its signature (one
definition, the same help); `--workers` here counts worker instances, as `cluster up`'s does.
The submit options belong to the group's callback, which runs the job when no subcommand is
given, so `sparknet-submit --s3 X ...` is the job itself."""

from __future__ import annotations

import inspect
import signal
from pathlib import Path
from typing import Any

import typer

from sparknet.cli import jobs
from sparknet.cli import train as train_command
from sparknet.cli.cluster.options import cluster_spec
from sparknet.cli.common import (
    Caught,
    caught_signal,
    console,
    fail,
    first_line,
    interrupts,
    results,
)
from sparknet.cli.jobs import Report, say
from sparknet.config import find_config_file, load_datasets, load_train_config, read_section
from sparknet.errors import SparknetError

# `# lazy: X` below: an import kept inside the command that needs it, X being slow to import
# (torch ~2 s; boto3, fabric, numpy ~0.2 s each; `+N ms`: what it adds, measured) while
# `sparknet-submit --help` and every other command import this module

submit_app = typer.Typer(
    add_completion=False,
    help="Run a training job on an EC2 GPU cluster; attach, logs, cancel, list: the jobs started.",
)

#: `sparknet train` parameters that submit sets itself or has its own of: the data is --s3, the
#: run dir the run prefix, the master the cluster's; --workers and --config are submit's own
NOT_SHARED = frozenset(
    {"config", "data", "workers", "out", "resume", "allow_change", "master", "endpoint_url"}
)


def submit(
    ctx: typer.Context,
    s3: str | None = typer.Option(
        None, "--s3", help="dataset name from sparknet.yaml or s3://bucket/prefix (required)"
    ),
    cluster: str | None = typer.Option(
        None, "--cluster", help="reuse this running cluster (it stays up after the job)"
    ),
    name: str | None = typer.Option(
        None, "--name", help="name of the cluster to make; default: the only `clusters:` entry"
    ),
    workers: int | None = typer.Option(
        None,
        help="worker instances of the cluster to make (EC2 machines, not Spark tasks: those are "
        "one per GPU, or --set workers=N)",
    ),
    instance_type: list[str] = typer.Option([], help="worker type, repeatable: fallback order"),
    spot: bool | None = typer.Option(None, "--spot/--on-demand", help="workers on spot"),
    provider: str | None = typer.Option(
        None, help="aws (default): EC2 instances; static: your own `hosts:` (sparknet.yaml)"
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
        "no job running and no submitter attached; 0 (off) only with --keep; default 30",
    ),
    max_restarts: int = typer.Option(
        2,
        "--max-restarts",
        min=0,
        help="restarts of a driver that dies (killed, crashed) from the run's last checkpoint; "
        "0: never",
    ),
    endpoint_url: str | None = typer.Option(None, help="AWS endpoint (moto) for EC2 and S3"),
    config: Path | None = typer.Option(
        None,
        "--config",
        help="settings YAML (train:, datasets:, clusters:); default ./sparknet.yaml",
    ),
    **training: Any,
) -> None:
    """Check the dataset and run prefix, bring a cluster up (or reuse --cluster), run the job on
    it, follow its rounds, fetch curves.png and metrics.jsonl into runs/RUN/, and take the
    cluster down (unless --keep, --detach or --cluster) after success, failure, Ctrl-C or
    SIGTERM. --detach returns once the job runs; the cluster's autostop timer ends it after."""
    from sparknet.cluster import repair  # lazy: boto3, fabric
    from sparknet.cluster.registry import LockUnavailable  # lazy: boto3
    from sparknet.jobs import records  # lazy: boto3, fabric
    from sparknet.jobs import submit as flow  # lazy: boto3, fabric
    from sparknet.jobs.follow import JobOutOfReach, summary_lines  # lazy: boto3, fabric
    from sparknet.jobs.preflight import Job, PreflightFailed, resolve_dataset  # lazy: boto3, fabric

    if ctx.invoked_subcommand is not None:
        return
    debug = training.pop("debug")
    sets, conf = training.pop("set_"), training.pop("conf")
    caught = Caught()
    started = False  # an error before the flow starts is in the command or settings: exit 2
    ending = flow.Ending()  # a signal during the checks below: "nothing was launched"
    try:
        _check_flags(s3, cluster, name, keep, autostop)
        path = find_config_file(config)
        cfg = load_train_config(config_file=path, sets=sets, flags=training, conf=conf)
        dataset = resolve_dataset(s3, load_datasets(path), endpoint_url)
        cluster_name = cluster or _named_cluster(name, path) or _only_cluster(path)
        flags = dict(
            workers=workers, instance_types=instance_type, spot=spot, provider=provider,
            autostop_minutes=autostop,
        )  # fmt: skip
        spec = _instances_spec(cluster_name, path, {} if cluster else flags)
        if spec.provider == "static":
            _check_static(spec, instance_type, spot, autostop, keep, detach, cluster is not None)
        _check_autostop(spec, cluster is not None, keep)
        repair.check_every_s()  # a bad setting fails now, not once the job runs
        job = Job(
            spec, cluster is not None, keep, dataset, cfg, endpoint_url, detach=detach,
            max_restarts=max_restarts,
        )  # fmt: skip
        report = Report(console.is_terminal, cfg.rounds)
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
    for line in summary_lines(
        result.run_id, result.prefix, result.outcome.rows, result.wall_s, result.cost
    ):
        results.print(line, markup=False, highlight=False, soft_wrap=True)
    for path in result.fetched:
        results.print(f"fetched {path}", markup=False, highlight=False, soft_wrap=True)
    if job.keep or job.reused:
        say(flow.stays_up_line(job))


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


def _check_flags(
    s3: str | None, cluster: str | None, name: str | None, keep: bool, autostop: int | None
) -> None:
    """The flags' combinations that are refused before anything is read or asked of AWS."""
    from sparknet.jobs.preflight import PreflightFailed  # lazy: boto3, fabric

    if s3 is None:
        raise PreflightFailed(
            "--s3 DATASET is required (a name from datasets: or s3://bucket/prefix); "
            "or a command: attach, logs, cancel, list"
        )
    if name is not None and cluster is not None:
        raise PreflightFailed(
            f"--name {name} names a cluster to make and --cluster {cluster} one to reuse; "
            "give one of them"
        )
    if autostop is not None and cluster is not None:
        raise PreflightFailed(
            f"--autostop applies to a cluster sparknet-submit makes; --cluster {cluster} keeps "
            f"its own (`sparknet cluster up {cluster} --autostop MINUTES` changes it)"
        )
    if autostop == 0 and not keep:
        raise PreflightFailed(
            "--autostop 0 turns the timer off only with --keep: a cluster left without it runs "
            "until `sparknet cluster down`"
        )


def _check_static(
    spec, instance_type: list[str], spot, autostop, keep: bool, detach: bool, reused: bool
) -> None:
    """EC2's flags are refused on a static cluster even where they say the default (they would
    be ignored), and so is --detach on one the submit makes without --keep: with no autostop
    timer, Spark would run on its hosts after the job until `sparknet cluster down`."""
    from sparknet.jobs.preflight import PreflightFailed  # lazy: boto3, fabric

    given = [
        flag for flag, value in
        (("--instance-type", instance_type), ("--spot/--on-demand", spot), ("--autostop", autostop))
        if value not in (None, [])
    ]  # fmt: skip
    if given:
        raise PreflightFailed(
            f"{', '.join(given)}: EC2 flags, not for static cluster {spec.name} (its machines "
            "are its `hosts:`)"
        )
    if detach and not keep and not reused:
        raise PreflightFailed(
            f"--detach on static cluster {spec.name}, which this submit brings up: it has no "
            "autostop timer, so Spark would run on its hosts after the job; add --keep to keep "
            f"it on purpose, or `sparknet cluster up {spec.name}` first and --cluster {spec.name}"
        )


def _check_autostop(spec, reused: bool, keep: bool) -> None:
    """A cluster this submit makes, with its autostop timer off (the flag or the settings'
    `autostop_minutes: 0`) and no --keep: a detached job, a job out of reach or a failed
    teardown would leave it running until `sparknet cluster down`."""
    from sparknet.jobs.preflight import PreflightFailed  # lazy: boto3, fabric

    if not reused and not keep and spec.autostop_minutes == 0:
        raise PreflightFailed(
            f"cluster {spec.name}'s autostop is off (autostop_minutes: 0), which is allowed "
            "only with --keep: give --autostop MINUTES, or --keep to keep it on purpose"
        )


def _print_detached(job, run_id: str, prefix: str) -> None:
    """What a detached submit prints: the run id (stdout), how to reach the job, and what
    ends the cluster."""
    for line in (f"run id: {run_id}", f"run prefix: {prefix}"):
        results.print(line, markup=False, highlight=False, soft_wrap=True)
    say(
        f"job {run_id} runs detached: `sparknet-submit attach {run_id}` follows it, "
        f"`sparknet-submit logs {run_id}` shows its log, `sparknet-submit cancel {run_id}` ends it"
    )
    from sparknet.jobs.submit import stays_up_line  # lazy: boto3, fabric

    say(stays_up_line(job))


def _named_cluster(name: str | None, path: Path | None) -> str | None:
    """`--name NAME`, which must be a `clusters:` entry of the settings file: a cluster is made
    from its entry (a typo would make one of the defaults)."""
    if name is None:
        return None
    names = sorted(read_section(path, "clusters")) if path is not None else []
    if name not in names:
        from sparknet.jobs.preflight import PreflightFailed  # lazy: boto3, fabric

        if path is None:
            raise PreflightFailed(
                f"--name {name}: no settings file (./sparknet.yaml or --config) to make it from "
                "(a cluster is made from its `clusters:` entry)"
            )
        raise PreflightFailed(
            f"--name {name}: no such entry in {path}'s clusters: (known: "
            f"{', '.join(names) or 'none'}); a cluster is made from its entry"
        )
    return name


def _instances_spec(name: str, path: Path | None, flags: dict[str, Any]):
    """The cluster's spec (`sparknet cluster`'s `cluster_spec`); a bad `--workers` is named
    as the flag and what it counts, worker instances (not the Spark tasks of `--set workers`)."""
    try:
        return cluster_spec(name, path, flags)
    except SparknetError as exc:
        said = "invalid setting workers:"
        if flags.get("workers") is None or said not in str(exc):
            raise
        raise SparknetError(
            str(exc).replace(said, f"--workers {flags['workers']} (worker instances):", 1)
        ) from exc


def _only_cluster(path: Path | None) -> str:
    """The cluster to make when neither --cluster nor --name says: the settings file's only
    `clusters:` entry."""
    names = sorted(read_section(path, "clusters")) if path is not None else []
    if len(names) != 1:
        from sparknet.jobs.preflight import PreflightFailed  # lazy: boto3, fabric

        have = ", ".join(names) or "none"
        raise PreflightFailed(
            f"which cluster? give --cluster NAME (running) or --name NAME (to make); "
            f"clusters: in the settings has {have}"
        )
    return names[0]


def _shared_parameters() -> list[inspect.Parameter]:
    """`sparknet train`'s training flags as keyword parameters (annotations resolved)."""
    params = inspect.signature(train_command.train, eval_str=True).parameters.values()
    return [
        p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in params if p.name not in NOT_SHARED
    ]


def _with_training_flags(func):
    """`func`'s own parameters, then train's: typer reads `__signature__`."""
    own = [
        p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
        for p in inspect.signature(func, eval_str=True).parameters.values()
        if p.kind is not inspect.Parameter.VAR_KEYWORD
    ]
    func.__signature__ = inspect.Signature([*own, *_shared_parameters()])
    return func


submit_app.callback(invoke_without_command=True)(_with_training_flags(submit))

for _name, _command in (
    ("attach", jobs.attach),
    ("logs", jobs.logs),
    ("cancel", jobs.cancel),
    ("list", jobs.list_jobs),
):
    submit_app.command(_name)(_command)
