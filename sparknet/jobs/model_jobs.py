"""A finished run's model put to work on a cluster: `sparknet-submit evaluate` and `predict`.

Such a job is a submit like training's (`sparknet.jobs.submit`: the same preflight, cluster,
supervisor, follow and teardown); its driver is the node's own `sparknet evaluate` or `sparknet
predict`. Its run prefix is a run dir of its own: a copy of the model (`model.json`,
`model.safetensors`) and a `config.yaml` with the run's settings on the cluster's Spark (master,
GPUs, one task per GPU). A copy, because a cluster's nodes read only the data prefix and their
own cluster's runs (infra/policies/instance-role.json.tftpl): so a model trained anywhere (a
local run dir, another cluster's prefix) is scored the same way. The report (`evaluation.json`,
`confusion.png`) and, unless `--out` says otherwise, the predictions (`predictions/`) are
written there too, and the report is fetched into `runs/RUN/`.

Separate from the flow: it adds to it what a model's job needs and training's does not, and
nothing of it is imported for `sparknet-submit --help`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from sparknet.cluster import provider
from sparknet.cluster.spec import ClusterSpec
from sparknet.config import TrainConfig, load_train_config
from sparknet.data.s3 import S3Uri
from sparknet.data.store import SUCCESS, open_store
from sparknet.errors import SparknetError
from sparknet.say import command_line

if TYPE_CHECKING:
    from sparknet.data.sources import Source
    from sparknet.training.evaluation import Evaluation

# `# lazy: X` below: `ModelTask` is part of every submit's `Job`, and X (torch, Spark) is
# needed only by a model's job

#: where a predict job writes its rows when `--out` is not given: under its run prefix
PREDICTIONS = "predictions"
#: the settings of the run that do not carry over to a job that scores its model: the
#: cluster's task count is the job's own (`job_config`), and a node has no MLflow
NOT_CARRIED = frozenset({"workers", "mlflow"})


@dataclass(frozen=True)
class ModelTask:
    """What a model's job does: evaluate or predict with the run dir `run` (local or s3://,
    read from this machine through `endpoint_url`) on the job's dataset."""

    command: Literal["evaluate", "predict"]
    run: str
    endpoint_url: str | None = None
    split: str | None = None
    #: predict's `parquet:s3://...` (None: the run prefix's `predictions/`)
    out: str | None = None
    top_k: int | None = None
    batch_size: int | None = None
    #: the run id of a training job RUN was given as (`records.run_dir_of`), for what to say
    #: where it has no model yet
    job: str | None = None

    def target(self, prefix: str) -> str:
        """Where predict writes: `--out`'s path, or `PREFIX/predictions`."""
        if self.out is not None:
            return self.out.removeprefix("parquet:")
        return f"{prefix.rstrip('/')}/{PREDICTIONS}"

    def args(self, prefix: str, data: str, endpoint_url: str | None) -> list[str]:
        """The node's `sparknet evaluate|predict` arguments: the model copy in `prefix` on the
        dataset `data`; its settings (master, workers, GPUs) are in the prefix's config.yaml."""
        run = prefix.rstrip("/")
        common = ["--data", data, *(["--split", self.split] if self.split else [])]
        common += ["--endpoint-url", endpoint_url] if endpoint_url else []
        if self.command == "evaluate":
            return ["evaluate", run, *common, "--report", run]
        extra = ["--top-k", str(self.top_k)] if self.top_k is not None else []
        extra += ["--batch-size", str(self.batch_size)] if self.batch_size is not None else []
        # a restart (the supervisor's, after the driver died) meets its own unfinished write,
        # its parts named by the job's run id; another write's parts are never replaced
        job_id = run.rsplit("/", 1)[-1]
        out = ["--out", f"parquet:{self.target(prefix)}", "--replace-unfinished"]
        out += ["--write-id", job_id]
        return ["predict", run, *common, *out, *extra]


def run_settings(task: ModelTask) -> TrainConfig:
    """The run's own settings, as the job's base (`job_config` puts them on the cluster), less
    `NOT_CARRIED`; one line where the run dir has none."""
    from sparknet.training.rundir import read_run_config  # lazy: torch

    base = read_run_config(task.run, task.endpoint_url)
    cfg = load_train_config(flags={}, environ={}, base=base)
    kept = {k: v for k, v in cfg.model_dump().items() if k not in NOT_CARRIED}
    return TrainConfig(**kept)


def check_model(task: ModelTask, source: Source, data: str) -> None:
    """The run has a model (its `model.json` reads, its weights are there), and the dataset's
    split (default val) fits it: its classes and input shape are the model's. Before anything
    is launched; the weights are read once, by `stage`."""
    from sparknet.data.sources import with_split  # lazy: torch
    from sparknet.training.evaluation import check_fit  # lazy: torch
    from sparknet.training.rundir import MODEL_FILE  # lazy: torch
    from sparknet.training.saved_model import SavedModel, read_info  # lazy: torch

    try:
        info = read_info(task.run, task.endpoint_url)
        if open_store(task.run, task.endpoint_url).size(MODEL_FILE) is None:
            SavedModel.read(task.run, task.endpoint_url)  # its line: the run has not finished
    except SparknetError as exc:
        if task.job is None:
            raise
        raise SparknetError(
            "job {job} has no final model in {run} yet: it still runs, or it failed or was "
            "cancelled; `{listed}` says which, `{attach}` follows it to its end",
            job=task.job, run=task.run, listed=command_line("sparknet-submit list"),
            attach=command_line("sparknet-submit attach", task.job),
        ) from exc  # fmt: skip
    if task.top_k is not None and task.top_k > info.num_classes:
        raise SparknetError(
            "{@top_k=k}: the model has {classes} classes; pass 1 to {classes}",
            k=task.top_k, classes=info.num_classes,
        )  # fmt: skip
    chosen = with_split(source, data, task.split)
    assert chosen is not None
    check_fit(SavedModel(info, b"", task.run), chosen, data)


def check_output(task: ModelTask, spec: ClusterSpec, bucket: str, endpoint_url: str | None) -> None:
    """Predict's `--out`: Parquet on S3 (a cluster has no shared disk), under the cluster's own
    runs (what its nodes may write) where sparknet made its nodes' role, and not there yet
    (asked through `endpoint_url`, the job's S3 endpoint: the run's may be another)."""
    if task.out is None:
        return
    target = task.target("")
    if not task.out.startswith("parquet:s3://"):
        raise SparknetError(
            "{@out=out}: a cluster writes predictions to S3; give parquet:s3://bucket/prefix "
            "(or leave it out: the job's run prefix)",
            out=task.out,
        )
    S3Uri.parse(target)
    if provider.of(spec).LAUNCHES:  # a static cluster's hosts write with their own rights
        own = f"s3://{bucket}/{spec.runs_prefix}{spec.name}/"
        if not f"{target.rstrip('/')}/".startswith(own):
            raise SparknetError(
                "{@out=out}: cluster {name}'s nodes may write only under {own}; give a "
                "parquet:{own}... path, or leave {@out} out (the job's run prefix)",
                out=task.out, name=spec.name, own=own,
            )  # fmt: skip
    if open_store(target, endpoint_url).walk():
        raise SparknetError("{target} exists: choose another {@out}, or remove it", target=target)


def stage(task: ModelTask, prefix: str, endpoint_url: str | None) -> None:
    """The model's copy in the job's run prefix: the weights first, `model.json` last."""
    from sparknet.training.rundir import MODEL_FILE, MODEL_INFO  # lazy: torch

    source = open_store(task.run, task.endpoint_url)
    store = open_store(prefix, endpoint_url)
    store.write_bytes(MODEL_FILE, source.read_bytes(MODEL_FILE))
    store.write_bytes(MODEL_INFO, source.read_bytes(MODEL_INFO))


#: an evaluate job's report (`training.evaluation`'s EVALUATION_JSON and CONFUSION_PNG, named
#: here without importing torch), which the submitter fetches
REPORT = ("evaluation.json", "confusion.png")


def fetch_report(prefix: str, endpoint_url: str | None, dest: Path) -> list[Path]:
    """evaluation.json and confusion.png of an evaluate job into `dest` (runs/RUN/)."""
    from sparknet.jobs.follow import fetch_results  # lazy: fabric

    return fetch_results(prefix, endpoint_url, dest, REPORT)


def read_evaluation(path: Path) -> Evaluation:
    """The fetched `evaluation.json`, for the summary."""
    from sparknet.training.evaluation import Evaluation  # lazy: torch

    return Evaluation.from_json(json.loads(path.read_text()))


def predicted_rows(target: str, endpoint_url: str | None) -> int | None:
    """The rows predict wrote to `target` (its `_SUCCESS` says), None where it does not."""
    try:
        return int(json.loads(open_store(target, endpoint_url).read_bytes(SUCCESS))["rows"])
    except (SparknetError, ValueError, KeyError, TypeError):
        return None
