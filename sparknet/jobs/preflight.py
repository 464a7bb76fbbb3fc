"""A submit's job as given, and everything checked before anything is launched.

The job is the cluster, the data and the training settings; the checks are of the dataset (and
its bucket's region), the run prefix, the cluster's name and GPU counts, what `sparknet train`
itself checks, and the settings the driver will run with.

Separate from the flow because these checks cost nothing and launch nothing: the flow runs
them first and only then brings a cluster up, starts the driver and follows it."""

from __future__ import annotations

import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sparknet.cluster import nodes, provider
from sparknet.cluster.aws import preflight as aws_preflight
from sparknet.cluster.records import ClusterNotFound
from sparknet.cluster.spark import steps
from sparknet.cluster.spec import ClusterSpec
from sparknet.config import DatasetEntry, TrainConfig, read_section
from sparknet.data.integrity import DatasetMismatch
from sparknet.data.s3 import S3Uri
from sparknet.data.store import writable_store
from sparknet.errors import SparknetError
from sparknet.jobs.driver_control import Master, master_of
from sparknet.jobs.follow import reconnect_s
from sparknet.jobs.supervisor import DEFAULT_MAX_RESTARTS
from sparknet.say import command_line

if TYPE_CHECKING:
    from sparknet.data.sources import Source
    from sparknet.jobs.model_jobs import ModelTask


class PreflightFailed(SparknetError):
    """Something the job needs is missing before anything was launched (exit 2)."""


# --- what the job runs on (pure) ---------------------------------------------------------------


@dataclass(frozen=True)
class SparkWorkers:
    """What a job's settings are derived from (`job_config`): the cluster's Spark master URL and
    the GPUs of each Spark worker node, the master's first (it runs a Spark worker too). Known
    before launch (`planned_workers`) as well as from a running cluster (`workers_of`)."""

    spark_url: str
    gpus: tuple[int, ...]

    @property
    def nodes(self) -> int:
        return len(self.gpus)


def workers_of(master: Master) -> SparkWorkers:
    """A running cluster's Spark workers, as its master knows them."""
    return SparkWorkers(master.spark_url, master.gpus or (master.node.gpus,) * master.nodes)


@dataclass(frozen=True)
class Dataset:
    """Where the job's data is: an s3:// URI and the S3 endpoint to reach it (None: AWS)."""

    uri: str
    endpoint_url: str | None = None


def resolve_dataset(
    text: str, datasets: Mapping[str, DatasetEntry], endpoint_url: str | None = None
) -> Dataset:
    """`--s3`: a `datasets:` name or an s3:// URI; a cluster reads only S3, so a name whose
    entry is a local directory is refused, as is an unknown name (the line lists the known).
    A bare URI is reached through `endpoint_url` (`--endpoint-url`: EC2's and S3's); a name
    through its entry's own."""
    if text.startswith("s3://"):
        S3Uri.parse(text)
        return Dataset(text.rstrip("/"), endpoint_url)
    entry = datasets.get(text)
    if entry is None:
        known = ", ".join(sorted(datasets)) or "none"
        raise PreflightFailed(
            "{@s3=text}: no such dataset in datasets: (known: {known}); give a name from "
            "sparknet.yaml's datasets: or an s3://bucket/prefix",
            text=text,
            known=known,
        )
    if not entry.uri.startswith("s3://"):
        raise PreflightFailed(
            "{@s3=text}: datasets.{text} is {uri}, not on S3; a cluster reads its data from S3 "
            "(`sparknet data upload` puts it there)",
            text=text,
            uri=entry.uri,
        )
    return Dataset(entry.uri.rstrip("/"), entry.endpoint_url)


def new_run_id(now: float | None = None) -> str:
    """A run id unique per submit and sortable by time: UTC time plus 16 random bits."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(time.time() if now is None else now))
    return f"{stamp}-{secrets.token_hex(2)}"


def run_prefix(bucket: str, cluster: str, run_id: str, runs_prefix: str = "runs/") -> str:
    """`s3://BUCKET/RUNS_PREFIX/CLUSTER/RUN/` (the cluster's `cluster_runs_prefix` plus the run):
    where the driver writes everything of the run, the only prefix its nodes may write."""
    return f"s3://{bucket}/{runs_prefix}{cluster}/{run_id}/"


def runs_bucket(spec: ClusterSpec, dataset: Dataset, reused: bool = False) -> str:
    """The cluster's `bucket:`, where the node role reads `data_prefix` and writes the cluster's
    runs prefix (without one the role has no S3 access at all, so a cluster made for the job
    would fail only once up and paid for); the dataset must be under its data prefix. A reused
    cluster without one: the dataset's bucket (what it was given when it was made); so for a
    static cluster, whose hosts reach S3 with their own credentials, not a role of sparknet's."""
    if spec.bucket is None:
        if reused or not provider.of(spec).LAUNCHES:
            return S3Uri.parse(dataset.uri).bucket
        raise PreflightFailed(
            f"cluster {spec.name} has no `bucket:` in its settings: its nodes could read no data "
            f"and write no run; set clusters.{spec.name}.bucket (the dataset's bucket)"
        )
    data = f"s3://{spec.bucket}/{spec.data_prefix}"
    if not f"{dataset.uri}/".startswith(data):
        raise PreflightFailed(
            f"dataset {dataset.uri} is outside {data}, the only data cluster {spec.name}'s nodes "
            f"may read; upload it there (`sparknet data upload`) or set clusters.{spec.name}'s "
            "bucket and data_prefix"
        )
    return spec.bucket


# --- preflight: nothing is launched before these pass ------------------------------------------


def check_dataset(dataset: Dataset, cfg: TrainConfig | None = None) -> Source:
    """`sparknet train`'s own checks of a shard dataset before Spark starts (`shard_source`):
    the manifest reads, every shard it lists is there with the manifest's size (a HEAD each,
    in parallel), the train split has samples. The source, for `check_training`."""
    # sources imports torch: only once a submit checks its data, not for `--help`
    from sparknet.data.sources import shard_source

    try:
        return shard_source(dataset.uri, cfg or TrainConfig(), dataset.endpoint_url)
    except SparknetError as exc:
        named = isinstance(exc, DatasetMismatch)  # names the dataset itself
        template = "{cause:line}" if named else "dataset {uri}: {cause:line}"
        raise PreflightFailed(template, uri=dataset.uri, cause=exc) from exc


def planned_workers(job: Job) -> SparkWorkers:
    """The cluster's Spark as the job will find it, known before anything is launched: a
    reused cluster's own; a cluster to make: its master and `workers` instances (a static
    one: its hosts), each with its type's GPUs (`bootstrap.gpus_per_node` when set). A static
    host's GPUs are known only once it is reached: counted as none here, so its task count is
    the least the job can get (one per host)."""
    spec = job.spec
    if job.reused:
        return workers_of(master_of(spec, job.endpoint_url))
    check_gpu_counts(spec, job.endpoint_url)  # one count for every type, or refused
    count, gpus = provider.of(spec).planned_nodes(spec, job.endpoint_url)
    return SparkWorkers(f"spark://planned:{spec.bootstrap.master_port}", (gpus or 0,) * count)


def check_training(job: Job, source: Source, prefix: str) -> None:
    """What `sparknet train` checks before Spark starts (`problem.prepare`: the model by name
    and on a sample of the data, the Spark tasks against the train shards and samples), on
    the job's settings as the cluster will run them (`job_config` on `planned_workers`)."""
    from sparknet.training.problem import prepare  # torch: only here

    cfg = job_config(job.cfg, job.dataset, prefix, planned_workers(job), job.spec.name)
    try:
        prepare(cfg, source)
    except SparknetError as exc:
        raise PreflightFailed("{cause:line}", cause=exc) from exc


def check_writable(prefix: str, endpoint_url: str | None) -> None:
    """Write, then delete, a probe object under the run prefix."""
    try:
        writable_store(prefix, endpoint_url)
    except SparknetError as exc:
        raise PreflightFailed(
            "run prefix {prefix} is not writable: {cause:line}", prefix=prefix, cause=exc
        ) from exc


def check_data_region(job: Job) -> None:
    """The dataset's bucket is in the cluster's region, or the cluster's settings accept the
    cross-region transfer (`cross_region_data`): one line naming both regions otherwise."""
    bucket = S3Uri.parse(job.dataset.uri).bucket
    try:
        aws_preflight.check_bucket_region(job.spec, job.dataset.endpoint_url, bucket)
    except SparknetError as exc:
        raise PreflightFailed("{cause:line}", cause=exc) from exc


# --- what the submit asks for: refused before anything is read or asked of AWS -----------------


def check_request(
    s3: str | None,
    cluster: str | None,
    name: str | None,
    keep: bool,
    autostop: int | None,
    command: str | None = None,
) -> None:
    """The combinations of a submit's options that cannot work together; `command`: the
    model's job (evaluate, predict) they are given to, None for training."""
    if s3 is None and command is not None:
        raise PreflightFailed(
            "{@s3=dataset} is required: the dataset to {command} on (a name from datasets: or "
            "s3://bucket/prefix)",
            dataset="DATASET", command=command,
        )  # fmt: skip
    if s3 is None:
        raise PreflightFailed(
            "{@s3=dataset} is required (a name from datasets: or s3://bucket/prefix); "
            "or a command: evaluate, predict, attach, logs, cancel, list",
            dataset="DATASET",
        )
    if name is not None and cluster is not None:
        raise PreflightFailed(
            "{@name=name} names a cluster to make and {@cluster=cluster} one to reuse; "
            "give one of them",
            name=name,
            cluster=cluster,
        )
    if autostop is not None and cluster is not None:
        raise PreflightFailed(
            "{@autostop} applies to a cluster sparknet-submit makes; {@cluster=cluster} keeps "
            "its own (`{up}` changes it)",
            cluster=cluster,
            up=command_line("sparknet cluster up", cluster, autostop="MINUTES"),
        )
    if autostop == 0 and not keep:
        raise PreflightFailed(
            "{@autostop=zero} turns the timer off only with {@keep}: a cluster left without it "
            "runs until `sparknet cluster down`",
            zero=0,
        )


def cluster_to_use(cluster: str | None, name: str | None, path: Path | None) -> str:
    """The cluster a submit runs on: the one to reuse (`cluster`), else the one to make:
    `name`, which must be a `clusters:` entry of the settings file at `path` (a cluster is
    made from its entry: a typo would make one of the defaults), else the file's only entry."""
    if cluster is not None:
        return cluster
    names = sorted(read_section(path, "clusters")) if path is not None else []
    if name is None:
        if len(names) != 1:
            raise PreflightFailed(
                "which cluster? give {@cluster=what} (running) or {@name=what} (to make); "
                "clusters: in the settings has {have}",
                what="NAME",
                have=", ".join(names) or "none",
            )
        return names[0]
    if name not in names:
        if path is None:
            raise PreflightFailed(
                "{@name=name}: no settings file (./sparknet.yaml or {@config}) to make it from "
                "(a cluster is made from its `clusters:` entry)",
                name=name,
            )
        raise PreflightFailed(
            "{@name=name}: no such entry in {path}'s clusters: (known: {known}); a cluster is "
            "made from its entry",
            name=name,
            path=path,
            known=", ".join(names) or "none",
        )
    return name


def check_cluster_options(
    spec: ClusterSpec,
    *,
    instance_types: list[str],
    spot: bool | None,
    autostop: int | None,
    keep: bool,
    detach: bool,
    reused: bool,
) -> None:
    """What the cluster's provider cannot do is refused even where an option says the default
    (it would be ignored): instance types and a market where sparknet launches no machine, an
    autostop timer where there is none, and `detach` of a cluster this submit makes without
    `keep` and with no timer (Spark would run on after the job until `sparknet cluster down`).
    A cluster this submit makes with its timer off (`autostop_minutes: 0`) needs `keep`: a
    detached job, a job out of reach or a failed teardown would leave it running."""
    cluster = provider.of(spec)
    given = [
        option
        for option, value, allowed in (
            ("{@instance_type}", instance_types, cluster.LAUNCHES),
            ("{@spot}/{@on_demand}", spot, cluster.LAUNCHES),
            ("{@autostop}", autostop, cluster.AUTOSTOP),
        )
        if not allowed and value not in (None, [])
    ]
    if given:
        raise PreflightFailed(
            ", ".join(given) + ": EC2 flags, not for static cluster {name} (its machines are its "
            "`hosts:`); leave " + ("it" if len(given) == 1 else "them") + " out",
            name=spec.name,
        )
    if not cluster.AUTOSTOP and detach and not keep and not reused:
        raise PreflightFailed(
            "{@detach} on static cluster {name}, which this submit brings up: it has no "
            "autostop timer, so Spark would run on its hosts after the job; add {@keep} to keep "
            "it on purpose, or `{up}` first and {@cluster=name}",
            name=spec.name,
            up=command_line("sparknet cluster up", spec.name),
        )
    if not reused and not keep and spec.autostop_minutes == 0:
        raise PreflightFailed(
            "cluster {name}'s autostop is off (autostop_minutes: 0), which is allowed only with "
            "{@keep}: give {@autostop=minutes}, or {@keep} to keep it on purpose",
            name=spec.name,
            minutes="MINUTES",
        )


# --- the cluster --------------------------------------------------------------------------------


def reuse(spec: ClusterSpec, endpoint_url: str | None) -> None:
    """`--cluster NAME`: it must exist and its master run (a static one: be up here), else one
    line and nothing launched."""
    try:
        provider.of(spec).check_running(spec, endpoint_url)
    except ClusterNotFound as exc:
        raise PreflightFailed(
            "{@cluster=name}: {cause:line}, or leave out {@cluster} to make a new cluster",
            name=spec.name,
            cause=exc,
        ) from exc


def check_name_free(spec: ClusterSpec, endpoint_url: str | None) -> None:
    """A submit that makes its cluster (no --cluster) must not find one of that name already
    there: `up` would take it over and the teardown after the job would end it, and the jobs
    on it with it."""
    if provider.of(spec).in_use(spec, endpoint_url):
        raise PreflightFailed(
            "cluster {name} already runs; pass {@cluster=name} to reuse it, or {@name=new} to "
            "make another",
            name=spec.name,
            new="NEW",
        )


def check_gpu_counts(spec: ClusterSpec, endpoint_url: str | None) -> None:
    """A cluster to make whose master type and worker types have different GPU counts is
    refused before launch (see `node_gpus`); `bootstrap.gpus_per_node` sets one for all. A
    static cluster's hosts are counted once they are reached (`master_of`)."""
    if spec.bootstrap.gpus_per_node is not None:
        return
    counts = provider.of(spec).gpus_by_type(spec, endpoint_url)
    if len(set(counts.values())) > 1:
        raise PreflightFailed(_mixed(spec.name, counts))


def node_gpus(name: str, workers: SparkWorkers) -> int:
    """The GPUs of every Spark worker node (the master's included: it runs one too), which
    must be one count: a job runs `gpus_per_worker` tasks on each, so a node with fewer would
    place none and one with more would leave GPUs idle."""
    counts = set(workers.gpus)
    if len(counts) > 1:
        raise PreflightFailed(_mixed(name, {f"node {k}": g for k, g in enumerate(workers.gpus)}))
    return counts.pop()


def _mixed(name: str, counts: Mapping[str, int]) -> str:
    listed = ", ".join(f"{k}: {v}" for k, v in counts.items())
    return (
        f"cluster {name}'s nodes have different GPU counts ({listed}); every node runs a Spark "
        "worker with the same number of tasks: give master_type and instance_types the same "
        "GPU count, or set bootstrap.gpus_per_node"
    )


# --- the job and its settings on the cluster ---------------------------------------------------


def job_config(
    cfg: TrainConfig, dataset: Dataset, prefix: str, workers: SparkWorkers, name: str = "cluster"
) -> TrainConfig:
    """The job's settings as the driver runs them: the data, the run prefix, the cluster's Spark
    master and GPUs (its Spark worker nodes', one count: `node_gpus`), and one Spark task per
    worker GPU (per worker node without GPUs) unless the user chose `workers`."""
    gpus = node_gpus(name, workers)
    update: dict[str, Any] = {
        "data": dataset.uri, "out": prefix.rstrip("/"), "master": workers.spark_url,
        "gpus_per_worker": gpus,
    }  # fmt: skip
    if dataset.endpoint_url:
        update["endpoint_url"] = dataset.endpoint_url
    if "workers" not in cfg.model_fields_set:
        update["workers"] = workers.nodes * max(1, gpus)
    return TrainConfig(**{**cfg.model_dump(), **update})


@dataclass(frozen=True)
class Job:
    """One submit: the cluster (reused or to make), the data, the training settings."""

    spec: ClusterSpec
    reused: bool
    keep: bool
    dataset: Dataset
    cfg: TrainConfig
    endpoint_url: str | None = None
    runs_dir: Path = Path("runs")
    #: restarts of a driver that dies (`sparknet.jobs.supervisor`); 0: never
    max_restarts: int = DEFAULT_MAX_RESTARTS
    #: return once the driver runs (no follow, no teardown: the master's autostop ends a
    #: cluster this submit made once the job is over and no submitter is attached)
    detach: bool = False
    #: a finished run's model to evaluate or predict with (None: training); `cfg` is then the
    #: run's settings (`model_jobs.run_settings`)
    task: ModelTask | None = None


@dataclass(frozen=True)
class Checked:
    """What the preflight found: the run's id and prefix, and the dataset's source (its
    manifest read)."""

    run_id: str
    prefix: str
    source: Source


def preflight(job: Job) -> Checked:
    """Everything that costs nothing, in order."""
    try:  # a bad setting of the SSH deadlines fails now, not once the job runs
        reconnect_s(), nodes.silence_s(), steps.reboot_wait_s()
    except SparknetError as exc:
        raise PreflightFailed("{cause}", cause=exc) from exc
    if job.cfg.mlflow is not None:  # the node's sparknet is installed without the extra
        raise PreflightFailed(
            "{@mlflow} is for runs on this machine or a Spark cluster you already have: a "
            "cluster's nodes have no MLflow; leave it out (the run dir keeps every metric)"
        )
    source = check_dataset(job.dataset, job.cfg)
    if provider.of(job.spec).REGIONAL:  # a static cluster's hosts are wherever they are
        check_data_region(job)
    if job.reused:
        reuse(job.spec, job.endpoint_url)
    run_id = new_run_id()
    bucket = runs_bucket(job.spec, job.dataset, job.reused)
    prefix = run_prefix(bucket, job.spec.name, run_id, job.spec.runs_prefix)
    check_writable(prefix, job.dataset.endpoint_url)
    if not job.reused:
        try:
            provider.of(job.spec).check_launch(job.spec, job.endpoint_url)
        except SparknetError as exc:
            raise PreflightFailed("{cause}", cause=exc) from exc
    if job.task is None:
        check_training(job, source, prefix)
    else:
        check_model_job(job, job.task, source, bucket)
    return Checked(run_id, prefix, source)


def check_model_job(job: Job, task: ModelTask, source: Source, bucket: str) -> None:
    """A model's job (`model_jobs`): the run's model fits the data, predict's `--out` is
    where the cluster may write and free."""
    from sparknet.jobs import model_jobs  # lazy: torch, for a model's job only

    try:
        model_jobs.check_model(task, source, job.dataset.uri)
        model_jobs.check_output(task, job.spec, bucket, job.dataset.endpoint_url)
    except SparknetError as exc:
        raise PreflightFailed("{cause:line}", cause=exc) from exc
