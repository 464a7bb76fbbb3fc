"""What a run's model is, recorded beside its weights, so that a run dir is a model to load.

`model.safetensors` holds weights only; rebuilding the module needs the model's name, its number
of classes and the shape of its input, and using it needs what an input must be made into (an
image's eval resize, crop and normalisation) and what its outputs mean (the classes' names).
Before this file a user guessed them (`config.yaml` records `num_classes: null` where the data
decided it). `model.json` records all of it when a run starts; `load_model` rebuilds the module
from it and the final weights, from a local run dir or an `s3://` one.
"""

from __future__ import annotations

import io
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationError, model_validator
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from sparknet.config import TrainConfig
from sparknet.data.decode import IMAGENET_MEAN, IMAGENET_STD, eval_resize
from sparknet.data.manifest import ClassInfo
from sparknet.data.sources import Source
from sparknet.data.store import MissingObjectError, Store, open_store
from sparknet.errors import SparknetError, first_line
from sparknet.models import build_model
from sparknet.say import command_line
from sparknet.training.retention import BEST, read_best
from sparknet.training.rundir import (
    EXPORTED_PROGRAM,
    EXPORTED_TORCHSCRIPT,
    MODEL_FILE,
    MODEL_INFO,
)

FORMAT = 1


class ModelInput(BaseModel):
    """What the model takes: `shape` is one input's (C, H, W for images). An `image` input is
    an encoded image decoded to RGB, its shorter side resized to `resize`, centre-cropped to
    `image_size`, scaled to [0, 1] and normalised with `mean` and `std` (torchvision's
    ImageNet evaluation); a `tensor` (a Dataset's samples) or `features` (a DataFrame's
    numeric arrays, reshaped to `shape`) input goes in as it is."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["tensor", "features", "image"]
    shape: tuple[PositiveInt, ...] = Field(min_length=1)
    image_size: int | None = None
    resize: int | None = None
    mean: tuple[float, float, float] | None = None
    std: tuple[float, float, float] | None = None


class ModelInfo(BaseModel):
    """`model.json`: the model by name (as `--model` takes it), its outputs and its input."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: Literal[1] = FORMAT
    model: str
    num_classes: int = Field(ge=1)
    input: ModelInput
    #: what each output means, where the data names its classes: a shard dataset's manifest's
    #: (`wnid` is the class's id there, a WordNet id for ImageNet)
    classes: list[ClassInfo] | None = None

    @model_validator(mode="after")
    def _a_name_an_output(self) -> ModelInfo:
        if self.classes is not None and [c.index for c in self.classes] != list(
            range(self.num_classes)
        ):
            raise ValueError(f"classes must name outputs 0..{self.num_classes - 1}, in order")
        return self

    @classmethod
    def of(cls, cfg: TrainConfig, source: Source, num_classes: int) -> ModelInfo:
        shape = tuple(source.input_shape)
        kind = source.input_kind
        if kind == "image":
            size = shape[-1]
            spec = ModelInput(
                kind="image", shape=shape, image_size=size, resize=eval_resize(size),
                mean=IMAGENET_MEAN, std=IMAGENET_STD,
            )  # fmt: skip
        else:
            spec = ModelInput(kind=kind, shape=shape)
        manifest = getattr(source, "manifest", None)
        classes = list(manifest.classes) if manifest is not None else None
        return cls(model=cfg.model, num_classes=num_classes, input=spec, classes=classes)


def write_info(store: Store, info: ModelInfo) -> None:
    store.write_bytes(
        MODEL_INFO, (info.model_dump_json(indent=2, exclude_none=True) + "\n").encode()
    )


def read_info(run: str | Path, endpoint_url: str | None = None) -> ModelInfo:
    """A run dir's `model.json`; one line naming what to do where it cannot be read."""
    return _info(open_store(str(run), endpoint_url), run)


@dataclass(frozen=True)
class SavedModel:
    """A run's model as data: its `model.json` and its final weights' bytes, read once. What
    the driver ships to executors (Spark ML's transform) and what a saved pipeline stage holds,
    so neither needs the run dir again."""

    info: ModelInfo
    weights: bytes
    #: where it came from, for messages: the run dir, or a saved stage's path
    where: str

    @classmethod
    def read(
        cls, run: str | Path, endpoint_url: str | None = None, *, best: bool = False
    ) -> SavedModel:
        """A finished run's model (with `best`, the weights of its best checkpoint by eval
        accuracy, as `best.json` names it); one line naming what to do where the run dir has
        none."""
        store = open_store(str(run), endpoint_url)
        info = _info(store, run)
        if best:
            return cls(info, _best_weights(store, run), str(run))
        resume = command_line("sparknet train", resume=True, out=run, endpoint_url=endpoint_url)
        weights = _read(
            store, run, MODEL_FILE,
            f"its run has not finished; `{resume}` finishes it (a "
            f"DataFrame's run: sparknet.fit(df, out={str(run)!r}, resume=True))",
        )  # fmt: skip
        return cls(info, weights, str(run))

    @classmethod
    def of(cls, info_json: str | bytes, weights: bytes, where: str) -> SavedModel:
        return cls(_parsed(info_json, where), weights, where)

    def info_json(self) -> str:
        return self.info.model_dump_json(exclude_none=True)

    def build(self) -> torch.nn.Module:
        """The module with these weights, in eval mode on the CPU."""
        info = self.info
        model = build_model(info.model, info.input.shape, info.num_classes)
        try:
            model.load_state_dict(load_safetensors(self.weights), strict=True)
        except (RuntimeError, SafetensorError) as exc:
            raise SparknetError(
                f"{self.where}: its weights do not fit {info.model!r} as its {MODEL_INFO} "
                f"records it: {_state_dict_error(exc)}"
            ) from exc
        return model.eval()


def _state_dict_error(exc: BaseException) -> str:
    """torch's load_state_dict error in one line: its first line says only that there were
    errors, the next ones which (missing and unexpected keys, shapes)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return "; ".join(lines[1:3]) if len(lines) > 1 else first_line(exc)


def load_model(
    run: str | Path, endpoint_url: str | None = None, *, best: bool = False
) -> torch.nn.Module:
    """The model a finished run trained, with its final weights, in eval mode on the CPU.

    Args:
        run: the run dir, a local path or an `s3://` URI.
        endpoint_url: an S3-compatible endpoint (else `AWS_ENDPOINT_URL` or AWS).
        best: the weights of the run's best checkpoint by eval accuracy instead (`best.json`
            names it; a run still going has one too).

    `read_info(run)` says what an input must be made into and what each output means.
    """
    return SavedModel.read(run, endpoint_url, best=best).build()


def _best_weights(store: Store, run: str | Path) -> bytes:
    """The weights `best.json` names; one line where there is none."""
    best = read_best(store)
    if best is None:
        raise SparknetError(
            f"{run} has no {BEST}: none of its checkpoints was evaluated yet (or its run "
            "started before run dirs recorded their best)"
        )
    return _read(
        store, run, best.weights,
        f"its {BEST} names it (round {best.round}), but that checkpoint was deleted",
    )  # fmt: skip


def _info(store: Store, run: str | Path) -> ModelInfo:
    data = _read(
        store, run, MODEL_INFO,
        "it is not a sparknet run dir, or its run started before run dirs recorded their "
        "model (build it with sparknet.models.build_model and load model.safetensors into it)",
    )  # fmt: skip
    return _parsed(data, str(run))


def _parsed(data: str | bytes, where: str) -> ModelInfo:
    try:
        return ModelInfo.model_validate_json(data)
    except ValidationError as exc:
        try:
            made = json.loads(data).get("format")
        except (ValueError, AttributeError):
            made = None
        if isinstance(made, int) and made > FORMAT:
            raise SparknetError(
                f"{where}: its {MODEL_INFO} is format {made}, from a newer sparknet than this "
                f"one (format {FORMAT}): upgrade sparknet to load it"
            ) from exc
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or "the file"
        raise SparknetError(f"{where}: its {MODEL_INFO} is damaged: {field}: {err['msg']}") from exc


def _read(store: Store, run: str | Path, name: str, missing: str) -> bytes:
    """A run dir's file `name`; where it is not there, one line: `RUN has no NAME: {missing}`."""
    try:
        return store.read_bytes(name)
    except MissingObjectError:
        raise SparknetError(f"{run} has no {name}: {missing}") from None


#: the formats `sparknet export` writes, and the file name each gets in a run dir
EXPORT_FORMATS = {"torchscript": EXPORTED_TORCHSCRIPT, "torch-export": EXPORTED_PROGRAM}


def exported(saved: SavedModel, format: str) -> bytes:
    """The model as a file that torch alone loads (no sparknet, no model code), with
    `model.json` inside it: what its input must be made into and what its outputs mean.

    - `torchscript`: `torch.jit.load(f, _extra_files={"model.json": ""})`. Scripted where
      the model's code allows (its control flow kept), else traced.
    - `torch-export`: `torch.export.load(f, extra_files={"model.json": ""}).module()`, the
      format torch now prefers (TorchScript is deprecated), any batch size.
    """
    model = saved.build()
    example = torch.zeros((2, *saved.info.input.shape))
    extra = {MODEL_INFO: saved.info_json()}
    buf = io.BytesIO()
    with warnings.catch_warnings():  # torch.jit's deprecation: the user asked for the format
        warnings.simplefilter("ignore", FutureWarning)
        if format == "torchscript":
            try:
                module = torch.jit.script(model)
            except Exception:  # TorchScript refuses much of Python: a trace records the ops
                with torch.no_grad():
                    module = torch.jit.trace(model, example, check_trace=False)
            torch.jit.save(module, buf, _extra_files=extra)
        elif format == "torch-export":
            batch = torch.export.Dim("batch")
            try:
                program = torch.export.export(model, (example,), dynamic_shapes=({0: batch},))
            except Exception as exc:  # what torch.export cannot trace, said in its words
                raise SparknetError(
                    f"torch.export cannot export {saved.info.model!r}: {first_line(exc)}; try "
                    "the torchscript format"
                ) from exc
            torch.export.save(program, buf, extra_files=extra)
        else:
            raise SparknetError(f"sparknet exports {', '.join(EXPORT_FORMATS)}, not {format!r}")
    return buf.getvalue()
