"""`sparknet-submit --dry-run`: every check a launch runs first, and what the launch would make.

The checks are the flow's own (`preflight`, and for a cluster to make `check_name_free` and
`check_gpu_counts`), so a dry run that passes is a launch that gets past them; nothing is made
(the run prefix's writability probe is deleted again) and no job is recorded. The plan says
what a user decides on before paying: the machines and their price per hour, the data, where
the run goes, and the settings as the driver would run them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sparknet.cluster import provider
from sparknet.cluster.aws.prices import Hourly
from sparknet.cluster.records import Planned
from sparknet.config import TrainConfig
from sparknet.jobs.preflight import (
    Job,
    check_gpu_counts,
    check_name_free,
    job_config,
    planned_workers,
    preflight,
)

if TYPE_CHECKING:
    from sparknet.jobs.model_jobs import ModelTask

#: settings a plan always shows, whatever their value (the rest: those not at their default)
HEADLINE = ("model", "rounds", "tau", "workers", "batch_size", "optimizer", "lr", "outer")
#: settings a plan leaves out: shown on lines of their own (the data, the run prefix), or the
#: cluster's to say (its Spark master, known once it runs)
OWN_LINES = frozenset({"data", "out", "endpoint_url", "master"})


@dataclass(frozen=True)
class SplitSize:
    """One split of the dataset, from its manifest."""

    shards: int
    samples: int
    bytes: int


@dataclass(frozen=True)
class Plan:
    """What a launch would make and run."""

    #: train, evaluate or predict
    command: str
    cluster: str
    reused: bool
    #: a cluster to make: its machines by role; a reused one: as it runs
    machines: list[Planned]
    #: per hour, every machine together; None where unknown or not sparknet's to pay
    cost: Hourly | None
    dataset: str
    splits: dict[str, SplitSize]
    #: the run prefix, RUN standing for the run id the launch gets
    prefix: str
    #: the settings as the driver would run them, and those of them a plan lists (a model's
    #: job: its own, None for a default it leaves to `sparknet evaluate|predict`)
    cfg: TrainConfig
    settings: dict[str, Any]
    #: predict's output (RUN for the run id where it is under the run prefix); None otherwise
    output: str | None = None
    #: what the plan cannot know or leaves out, a line each
    notes: tuple[str, ...] = ()


def plan(job: Job) -> Plan:
    """Every check of a launch, then the plan; a `PreflightFailed` as a launch would raise."""
    checked = preflight(job)
    spec = job.spec
    notes: list[str] = []
    if job.reused:
        machines, cost, stopped = _running(job)
        if stopped:
            notes.append(f"{stopped} of its instances are not running: not counted")
    else:
        check_name_free(spec, job.endpoint_url)
        check_gpu_counts(spec, job.endpoint_url)
        machines = provider.of(spec).planned(spec, job.endpoint_url)
        notes += dict.fromkeys(m.why for m in machines if m.why)
        costs = [m.cost for m in machines]
        cost = None if None in costs else sum((c for c in costs if c), Hourly())
    workers = planned_workers(job)
    cfg = job_config(job.cfg, job.dataset, checked.prefix, workers, spec.name)
    if not job.reused and not provider.of(spec).LAUNCHES and spec.bootstrap.gpus_per_node is None:
        notes.append(
            "a host's GPUs are counted once the job reaches it: the Spark tasks shown are the "
            "fewest it gets (one per host)"
        )
    prefix = checked.prefix.replace(checked.run_id, "RUN")
    manifest = getattr(checked.source, "manifest", None)
    splits = {
        name: SplitSize(len(shards), sum(s.samples for s in shards), sum(s.bytes for s in shards))
        for name, shards in (manifest.splits.items() if manifest is not None else ())
    }
    task = job.task
    output = None
    if task is not None and task.command == "predict":
        output = task.target(checked.prefix).replace(checked.run_id, "RUN")
    shown = shown_settings(cfg) if task is None else task_settings(task, cfg)
    return Plan(
        "train" if task is None else task.command, spec.name, job.reused, machines, cost,
        job.dataset.uri, splits, prefix, cfg, shown, output, tuple(notes),
    )  # fmt: skip


def task_settings(task: ModelTask, cfg: TrainConfig) -> dict[str, Any]:
    """What a model's job is run with: the run and its model, the split, the Spark tasks and,
    for predict, its own options (None: `sparknet predict`'s default). The run's training
    settings (rounds, lr, ...) play no part in it."""
    shown: dict[str, Any] = {
        "run": task.run, "model": cfg.model, "split": task.split or "val",
        "workers": cfg.workers, "device": cfg.device,
    }  # fmt: skip
    if task.command == "predict":
        shown |= {"top_k": task.top_k, "batch_size": task.batch_size}
    return shown


def shown_settings(cfg: TrainConfig) -> dict[str, Any]:
    """The settings a plan lists: the headline ones, then every other not at its default."""
    values = cfg.model_dump(mode="json")
    defaults = TrainConfig().model_dump(mode="json")
    shown = {k: values[k] for k in HEADLINE if k in values}
    for key, value in values.items():
        if key not in shown and key not in OWN_LINES and value != defaults.get(key):
            shown[key] = value
    return shown


def _running(job: Job) -> tuple[list[Planned], Hourly | None, int]:
    """A reused cluster's running machines, what they cost per hour now (a stopped one bills
    its volumes), and how many of its instances are not running."""
    info = provider.of(job.spec).status(job.spec, endpoint_url=job.endpoint_url)
    if info.hosts:
        return [Planned("hosts", len(info.hosts), [], False, None)], None, 0
    rows = []
    master = [info.master] if info.master else []
    for role, found in (("master", master), ("workers", info.workers)):
        running = [i for i in found if i.state == "running"]
        for kind in sorted({i.type for i in running}):
            same = [i for i in running if i.type == kind]
            rows.append(Planned(role, len(same), [kind], all(i.spot for i in same), None))
    stopped = sum(i.state != "running" for i in info.instances)
    return rows, info.cost, stopped
