"""`sparknet-submit`: one training job on a cluster, end to end (the flow is `sparknet.submit`).

The training flags are `sparknet train`'s own parameters, taken from its signature (one
definition, the same help); `--workers` here counts worker instances, as `cluster up`'s does."""

from __future__ import annotations

import inspect
import signal
from pathlib import Path
from typing import Any

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from sparknet.cli import train as train_command
from sparknet.cli.common import Caught, console, fail, interrupts, results
from sparknet.config import find_config_file, load_datasets, load_train_config
from sparknet.errors import SparknetError

submit_app = typer.Typer(add_completion=False, help="Run a training job on an EC2 GPU cluster.")

#: `sparknet train` parameters that submit sets itself or has its own of: the data is --s3, the
#: run dir the run prefix, the master the cluster's; --workers and --config are submit's own
NOT_SHARED = frozenset(
    {"config", "data", "workers", "out", "resume", "allow_change", "master", "endpoint_url"}
)


def _say(line: str) -> None:
    console.print(line, markup=False, highlight=False, soft_wrap=True)


def submit(
    s3: str = typer.Option(
        ..., "--s3", help="dataset name from sparknet.yaml or s3://bucket/prefix"
    ),
    cluster: str | None = typer.Option(
        None, "--cluster", help="reuse this running cluster (it stays up after the job)"
    ),
    name: str | None = typer.Option(
        None, "--name", help="name of the cluster to make; default: the only `clusters:` entry"
    ),
    workers: int | None = typer.Option(None, help="worker instances of the cluster to make"),
    instance_type: list[str] = typer.Option([], help="worker type, repeatable: fallback order"),
    spot: bool | None = typer.Option(None, "--spot/--on-demand", help="workers on spot"),
    provider: str | None = typer.Option(None, help="aws (default); static is not supported yet"),
    keep: bool = typer.Option(False, "--keep", help="leave the cluster up after the job"),
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
    cluster down (unless --keep or --cluster) after success, failure, Ctrl-C or SIGTERM."""
    from sparknet import submit as flow
    from sparknet.cli.cluster import _cluster_spec

    debug = training.pop("debug")
    sets, conf = training.pop("set_"), training.pop("conf")
    caught = Caught()
    started = False  # an error before the flow starts is in the command or settings: exit 2
    try:
        path = find_config_file(config)
        cfg = load_train_config(config_file=path, sets=sets, flags=training, conf=conf)
        dataset = flow.resolve_dataset(s3, load_datasets(path))
        cluster_name = cluster or name or _only_cluster(path)
        flags = dict(workers=workers, instance_types=instance_type, spot=spot, provider=provider)
        spec = _cluster_spec(cluster_name, path, {} if cluster else flags)
        if spec.provider != "aws":
            raise flow.PreflightFailed(
                "sparknet-submit runs on EC2 clusters only (provider: aws) so far"
            )
        job = flow.Job(spec, cluster is not None, keep, dataset, cfg, endpoint_url)
        report = _Report(console.is_terminal, cfg.rounds)
        with interrupts(caught, note="still taking the cluster down; it ends by itself"):
            started = True
            try:
                result = flow.submit(job, say=_say, on_rows=report.rows)
            finally:
                report.stop()
    except (KeyboardInterrupt, Exception) as exc:
        if isinstance(exc, KeyboardInterrupt) or caught.signum is not None:
            signum = caught.signum or signal.SIGINT
            how = "" if signum == signal.SIGINT else f" ({signal.Signals(signum).name})"
            fail(SparknetError(f"interrupted{how}; teardown done"), debug, 128 + signum)
        if isinstance(exc, flow.JobFailed):
            fail(exc, debug, 1)
        if isinstance(exc, SparknetError):
            bad_input = not started or isinstance(exc, flow.PreflightFailed)
            fail(exc, debug, 2 if bad_input else 1)
        raise
    for line in flow.summary_lines(
        result.run_id, result.prefix, result.outcome.rows, result.wall_s, result.cost
    ):
        results.print(line, markup=False, highlight=False, soft_wrap=True)
    for path in result.fetched:
        results.print(f"fetched {path}", markup=False, highlight=False, soft_wrap=True)


def _only_cluster(path: Path | None) -> str:
    """The cluster to make when neither --cluster nor --name says: the settings file's only
    `clusters:` entry."""
    from sparknet.config import read_section

    names = sorted(read_section(path, "clusters")) if path is not None else []
    if len(names) != 1:
        from sparknet.submit import PreflightFailed

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


submit_app.command()(_with_training_flags(submit))


class _Report:
    """Round progress: a bar on a terminal, else one plain line per round."""

    def __init__(self, live: bool, total: int) -> None:
        self.live, self.total = live, total
        self.progress = Progress(
            TextColumn("[bold]round"), MofNCompleteColumn(), BarColumn(),
            TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=console,
        )  # fmt: skip
        self.bar = self.progress.add_task("job", total=total, info="starting")
        if live:
            self.progress.start()

    def rows(self, rows: list[dict[str, Any]], cost: float | None) -> None:
        from sparknet.submit import progress_line

        for row in rows:
            line = progress_line(row, self.total, cost)
            if self.live:
                self.progress.update(self.bar, completed=row["round"], info=line)
            else:
                train_command._line(line)

    def stop(self) -> None:
        if self.live:
            self.progress.stop()
