"""What a run trains on what, checked on the driver before any Spark job.

The data source, its number of classes and the initial model.

Kept apart from `driver`: `sparknet-submit` runs `prepare` before it launches a job (no run dir,
no session), and the Python API hands its DataFrames in as a `FrameInput`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from sparknet.config import TrainConfig
from sparknet.data.frames import Frames, prepare_frames, read_frame
from sparknet.data.sources import Source
from sparknet.errors import SettingError
from sparknet.models import build_model, check_model_accepts
from sparknet.training.spark_settings import check_security_conf


@dataclass(frozen=True)
class Problem:
    """What the driver checks before any Spark job: data, model and their fit."""

    source: Source
    num_classes: int
    model: torch.nn.Module


def check_num_classes(cfg: TrainConfig, source: Source) -> None:
    """--num-classes against the classes the dataset says it has, before Spark starts: fewer
    would fail at the first batch with a high label, after every retry (minutes in); more gives
    a head whose extra outputs no label reaches, which is what a subset (ImageNet-100, indexed
    0..99) trained with ImageNet-1k's 1000 looks like, so a shard dataset (whose manifest lists
    its classes) needs `--extra-classes` for it."""
    have = source.num_classes
    want = cfg.num_classes
    if want is None or have is None or want == have:
        return
    labels = f"its labels run 0..{have - 1}"
    manifest = getattr(source, "manifest", None)
    if manifest is not None and manifest.subset_of:
        labels += f": a subset of {manifest.subset_of} classes, indexed in its own order"
    if want < have:
        raise SettingError(
            "{@num_classes=value} is fewer than the {have} classes of {data} ({labels}); pass "
            "{@num_classes=have} or leave it out",
            setting="num_classes", value=want, have=have, data=cfg.data, labels=labels,
        )  # fmt: skip
    # a dataset without a manifest only shows its highest label, not how many classes it has
    if manifest is not None and not cfg.extra_classes:
        raise SettingError(
            "{@num_classes=value}, but {data} has {have} classes ({labels}); leave it out, or "
            "add {@extra_classes=True} for a {value}-way head anyway",
            setting="num_classes", value=want, have=have, data=cfg.data, labels=labels,
        )  # fmt: skip


def prepare(cfg: TrainConfig, source: Source) -> Problem:
    """Check the data against the settings and build the initial model on the driver."""
    check_security_conf(cfg.master or "local", cfg.spark_conf)  # sparknet-submit: pre-launch
    source.check_workers(cfg.workers)
    check_num_classes(cfg, source)
    num_classes = cfg.num_classes or source.num_classes
    if num_classes is None:
        raise SettingError(
            "cannot tell how many classes {data!r} has; pass {@num_classes}",
            setting="num_classes", value=None, data=cfg.data,
        )  # fmt: skip
    local = (cfg.master or "local").startswith("local")  # its tasks use this machine's GPUs
    if cfg.device == "cuda" and local and not torch.cuda.is_available():
        raise SettingError(
            "{@device=value}, but torch {torch} sees no GPU on this machine: pass "
            "{@device=auto} or cpu, or install a CUDA build of torch",
            setting="device", value="cuda", torch=torch.__version__, auto="auto",
        )  # fmt: skip
    if cfg.fail_once_at and cfg.fail_once_at[1] >= cfg.workers:
        raise SettingError(
            "fail_once partition {partition} >= {@workers=workers}",
            setting="fail_once", value=cfg.fail_once, partition=cfg.fail_once_at[1],
            workers=cfg.workers,
        )  # fmt: skip
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, source.input_shape, num_classes)
    check_model_accepts(model, source.example(), num_classes, cfg.model)
    return Problem(source, num_classes, model)


def frame_problem(cfg: TrainConfig, spark, frames: FrameInput) -> tuple[Problem, Frames]:
    train_df = frames.train if frames.train is not None else read_frame(spark, cfg.data)
    eval_df = frames.eval
    if eval_df is None and cfg.eval_data:
        eval_df = read_frame(spark, cfg.eval_data)
    source, placed = prepare_frames(
        train_df, eval_df, workers=cfg.workers, label_col=cfg.label_col,
        input_col=cfg.input_col, num_classes=cfg.num_classes, image_size=cfg.image_size,
        loader_workers=cfg.loader_workers, feature_shape=frames.feature_shape,
        name=cfg.data if frames.train is None else "the DataFrame",
        eval_name=cfg.eval_data if frames.eval is None else "eval_df",
    )  # fmt: skip
    try:
        return prepare(cfg, source), placed
    except BaseException:
        placed.release()
        raise


@dataclass(frozen=True)
class FrameInput:
    """DataFrames handed in by the Python API (`sparknet.fit`); None: read `cfg.data`."""

    train: Any = None
    eval: Any = None
    feature_shape: tuple[int, ...] | None = None
