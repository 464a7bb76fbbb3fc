"""`sparknet evaluate`: a finished run's model over a whole split, on Spark as training evaluates.

Each of K partitions runs the very evaluation a training round runs (`evaluate_partition`: the
run's device, precision, decoder and batches), so with the run's K the top-1 equals the run's
own final evaluation on the same split; each partition also counts its (label, prediction)
pairs, which give per-class accuracy and the confusion matrix. The data is a shard dataset (any
split its manifest has), a built-in or `module:factory` dataset (its test set), or a DataFrame
(`parquet:PATH`, `table:NAME`).
"""

from __future__ import annotations

import functools
import io
import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sparknet.config import DatasetEntry, TrainConfig, load_train_config
from sparknet.data.frames import prepare_frames, read_frame
from sparknet.data.manifest import ClassInfo
from sparknet.data.sources import (
    ShardSource,
    Source,
    check_frame_path,
    is_frame_spec,
    resolve_source,
    with_split,
)
from sparknet.data.store import Store
from sparknet.errors import SparknetError
from sparknet.models import check_model_accepts
from sparknet.training.probe import check_python_workers, user_modules
from sparknet.training.rounds import eval_work
from sparknet.training.rundir import read_run_config
from sparknet.training.saved_model import SavedModel
from sparknet.training.session import session_for
from sparknet.training.spark_settings import is_local_master
from sparknet.training.state import StateLayout
from sparknet.training.transport import SparkTransport, wait_for_executors
from sparknet.training.worker import EvalResult, RoundTask

StatusCallback = Callable[[str], None]


@dataclass(frozen=True)
class ClassScore:
    """One class's share of an evaluation: its samples and how many were predicted right."""

    index: int
    #: the manifest's id and name for it (a WordNet id and words for ImageNet), where it has them
    wnid: str | None
    name: str | None
    samples: int
    correct: int

    @property
    def accuracy(self) -> float | None:
        return self.correct / self.samples if self.samples else None


@dataclass(frozen=True)
class Evaluation:
    """A run's model over one split: loss, top-1, top-5 and the [label, prediction] counts."""

    run: str
    data: str
    #: the shard split read (None: a dataset's test set or a DataFrame's rows)
    split: str | None
    samples: int
    #: samples that could not be read or decoded (counted in no figure)
    skipped: int
    loss: float
    top1: float
    top5: float
    #: [label, top-1 prediction] counts, classes x classes
    confusion: np.ndarray
    classes: list[ClassInfo] | None

    def per_class(self) -> list[ClassScore]:
        known = {c.index: c for c in self.classes or []}
        rows, right = self.confusion.sum(1), np.diag(self.confusion)
        scores = []
        for i in range(len(rows)):
            c = known.get(i)
            wnid, name = (c.wnid, c.name) if c is not None else (None, None)
            scores.append(ClassScore(i, wnid, name, int(rows[i]), int(right[i])))
        return scores

    def as_json(self) -> dict[str, Any]:
        """What `evaluation.json` holds: the figures, each class's, and the confusion counts."""
        return {
            "run": self.run, "data": self.data, "split": self.split, "samples": self.samples,
            "skipped_samples": self.skipped, "loss": self.loss, "top1": self.top1,
            "top5": self.top5,
            "classes": [
                {"index": c.index, "wnid": c.wnid, "name": c.name, "samples": c.samples,
                 "correct": c.correct, "accuracy": c.accuracy}
                for c in self.per_class()
            ],
            "confusion": self.confusion.tolist(),
        }  # fmt: skip

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Evaluation:
        """An `evaluation.json` read back (`sparknet-submit evaluate` fetches one)."""
        classes = [
            ClassInfo(index=c["index"], wnid=c["wnid"], name=c["name"])
            for c in doc["classes"]
            if c.get("wnid") is not None
        ]
        return cls(
            doc["run"], doc["data"], doc["split"], doc["samples"], doc["skipped_samples"],
            doc["loss"], doc["top1"], doc["top5"], np.asarray(doc["confusion"], dtype=np.int64),
            classes or None,
        )  # fmt: skip


#: the most classes the confusion picture shows (a 1000-class matrix is a grey square)
PICTURE_CLASSES = 100
EVALUATION_JSON = "evaluation.json"
CONFUSION_PNG = "confusion.png"


def write_report(evaluation: Evaluation, store: Store) -> list[str]:
    """`evaluation.json` and, for up to `PICTURE_CLASSES` classes, `confusion.png` (each row
    a true class, as shares of its samples); the names written."""
    written = []
    if len(evaluation.confusion) <= PICTURE_CLASSES:
        store.write_bytes(CONFUSION_PNG, _confusion_png(evaluation))
        written.append(CONFUSION_PNG)
    # last: a report with its evaluation.json is whole
    store.write_bytes(EVALUATION_JSON, (json.dumps(evaluation.as_json(), indent=1) + "\n").encode())
    return [EVALUATION_JSON, *written]


def _confusion_png(evaluation: Evaluation) -> bytes:
    import matplotlib  # lazy: matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: matplotlib

    counts = evaluation.confusion.astype(float)
    shares = counts / np.maximum(counts.sum(1, keepdims=True), 1)
    classes = len(shares)
    side = min(4 + classes * 0.12, 16)
    fig, ax = plt.subplots(figsize=(side + 1.5, side), constrained_layout=True)
    image = ax.imshow(shares, cmap="Blues", vmin=0, vmax=1, interpolation="nearest")
    fig.colorbar(image, ax=ax, label="share of the true class's samples")
    ax.set_xlabel("predicted class")
    ax.set_ylabel("true class")
    ax.set_title(f"{evaluation.data}: top-1 {evaluation.top1:.4f} over {evaluation.samples}")
    if classes <= 30:
        names = [c.wnid or str(c.index) for c in evaluation.per_class()]
        ax.set_xticks(range(classes), names, rotation=90, fontsize=7)
        ax.set_yticks(range(classes), names, fontsize=7)
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=100)
    plt.close(fig)
    return png.getvalue()


def evaluate(
    run: str | Path,
    data: str,
    *,
    split: str | None = None,
    workers: int | None = None,
    master: str | None = None,
    endpoint_url: str | None = None,
    label_col: str | None = None,
    input_col: str | None = None,
    device: str | None = None,
    spark=None,
    datasets: dict[str, DatasetEntry] | None = None,
    on_status: StatusCallback | None = None,
) -> Evaluation:
    """Evaluate the final model of `run` on `data`, with the run's settings but for the data
    (and `workers`, `master`, the columns, where given). Checked before Spark starts: the run
    has a model, the data's classes are the model's; a DataFrame's right after it starts."""
    status = on_status or (lambda _text: None)
    saved = SavedModel.read(run, endpoint_url)
    flags = {
        "data": data, "eval_data": None, "out": str(run), "transport": "spark",
        "workers": workers, "master": master, "endpoint_url": endpoint_url,
        "label_col": label_col, "input_col": input_col, "device": device,
    }  # fmt: skip
    cfg = load_train_config(flags=flags, environ={}, base=read_run_config(run, endpoint_url))
    frames = is_frame_spec(data)
    check_frame_path(data, cfg.endpoint_url)  # a parquet: path not there: now, not in Spark
    source = with_split(None if frames else resolve_source(cfg, datasets), data, split)
    if source is not None:
        check_fit(saved, source, data)
    placed = None
    with session_for(spark, cfg, status) as spark:
        try:
            sc = spark.sparkContext
            if not is_local_master(sc.master):
                status("waiting for Spark's executors")
                wait_for_executors(sc, cfg.workers)
            status("starting Python workers")
            named = frames or data in (datasets or {})  # no module of the user's to import
            modules = user_modules(cfg.model, None if named else data)
            check_python_workers(spark, cfg.workers, modules)
            if frames:
                numbers = saved.info.input.kind != "image"  # reshaped as the model takes them
                source, placed = prepare_frames(
                    read_frame(spark, data), None, workers=cfg.workers,
                    label_col=cfg.label_col, input_col=cfg.input_col, num_classes=None,
                    image_size=cfg.image_size, loader_workers=cfg.loader_workers, name=data,
                    feature_shape=tuple(saved.info.input.shape) if numbers else None,
                )  # fmt: skip
                check_fit(saved, source, data)
            status(f"evaluating on {cfg.workers} partitions")
            frame = placed.train if placed is not None else None
            ev = _evaluate(cfg, saved, source, spark, frame)
        finally:
            if placed is not None:
                placed.release()
    if ev.count == 0:
        raise SparknetError(f"{data} gave no sample to evaluate on" + _skipped(ev.skipped))
    assert ev.confusion is not None
    return Evaluation(
        str(run), data, _split_of(source), ev.count, ev.skipped, ev.loss_sum / ev.count,
        ev.correct / ev.count, ev.correct5 / ev.count, ev.confusion, saved.info.classes,
    )  # fmt: skip


def check_fit(saved: SavedModel, source: Source, data: str) -> None:
    """The data's classes and input are the model's, or one line saying how they differ."""
    info = saved.info
    have = source.num_classes
    if have is not None and have > info.num_classes:
        raise SparknetError(
            f"{data} has labels up to {have - 1}, but the model of {saved.where} has "
            f"{info.num_classes} classes: use data of its own classes"
        )
    manifest = getattr(source, "manifest", None)
    if manifest is not None and info.classes is not None:
        ours = [c.wnid for c in info.classes]
        theirs = [c.wnid for c in manifest.classes]
        if ours != theirs:
            differ = next(
                (i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b),
                min(len(ours), len(theirs)),
            )
            raise SparknetError(
                f"the classes of {data} are not the model's: class {differ} is "
                f"{_at(theirs, differ)} there and {_at(ours, differ)} in {saved.where}; "
                "use a dataset sharded with the same classes"
            )
    if tuple(source.input_shape) != tuple(info.input.shape):
        raise SparknetError(
            f"{data} gives inputs of shape {tuple(source.input_shape)}, but the model of "
            f"{saved.where} takes {tuple(info.input.shape)}"
        )


def _at(wnids: list[str], i: int) -> str:
    return repr(wnids[i]) if i < len(wnids) else "missing"


def _evaluate(cfg: TrainConfig, saved: SavedModel, source: Source, spark, frame) -> EvalResult:
    model = saved.build()
    check_model_accepts(model, source.example(), saved.info.num_classes, cfg.model)
    layout = StateLayout.of_model(model)
    state = model.state_dict()
    task = RoundTask(
        cfg, source, uuid.uuid4().hex, 0, layout, layout.integers(state), saved.info.num_classes,
        tuple(saved.info.input.shape), str(cfg.out), tau=1, confusion=True,
    )  # fmt: skip
    transport = SparkTransport(spark.sparkContext, cfg.workers)
    try:
        ev, _ = transport.map_reduce(
            layout.flatten(state), functools.partial(eval_work, task), EvalResult.combine, frame
        )
    finally:
        transport.close()
    return ev


def _split_of(source: Source | None) -> str | None:
    return source.eval_split if isinstance(source, ShardSource) else None


def _skipped(skipped: int) -> str:
    return f" ({skipped} could not be read or decoded)" if skipped else ""
