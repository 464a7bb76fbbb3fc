"""User-facing configuration: pydantic models, merged from a YAML file, the environment and flags.

Precedence, lowest first: model defaults, the run dir's own `config.yaml` (on `--resume`), the
`--config` file's `train:` section, `SPARKNET_TRAIN_<FIELD>` environment variables, `--set
key=value`, then explicit flags. Values from text (env, `--set`) are parsed as YAML scalars, so
`--set lr=0.1` is a float and `--set master=local[4]` a string.
"""

from __future__ import annotations

import itertools
import os
import re
import urllib.parse
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from sparknet.errors import NO_VALUE, Line, SettingError, SparknetError

# `# lazy: boto3`: every command imports this module; the S3 parser only where a URI is checked

ENV_PREFIX = "SPARKNET_TRAIN_"

#: the steps of the first rounds under tau auto, before a choice is made from measured rounds
#: (a run's `tau_max` where that is lower): the default bound itself, so that the probe's rounds
#: cost the fewest exchanges for their steps. On a slow link an exchange is most of a round
#: (`bench peers` at 100 Mbit/s: five probe rounds of 10 steps took 20 s of a 55 s run to the
#: target, of 50 steps 26 s), and it is the tau such a link is then given; on a fast one the
#: first choice brings it down after five rounds
TAU_PROBE = 100

#: DiLoCo's outer optimizer settings (Douillard et al. 2023), used when `outer: nesterov` is
#: chosen without an explicit `outer_lr` / `outer_momentum`.
NESTEROV_DEFAULT_LR = 0.7
NESTEROV_DEFAULT_MOMENTUM = 0.9
#: the shortest progress deadline a run takes (0 aside: no guard)
MIN_PROGRESS_TIMEOUT_S = 10.0


def _whole_number(value: Any) -> int:
    """A milestone as a whole number (an int, or the text of one); else one line saying so."""
    if isinstance(value, bool):
        raise ValueError(f"whole numbers, not {str(value).lower()}")
    if isinstance(value, int):
        return value
    if isinstance(value, str) and re.fullmatch(r"[+-]?[0-9]+", value.strip()):
        return int(value)
    raise ValueError("whole numbers")


@dataclass(frozen=True)
class Flag:
    """Marks a training setting that the command line takes as an option of its own, named as
    the setting with dashes (`--batch-size`); the others go through `--set`, the settings file
    or the environment. `help` is the option's line in `--help` where the setting's description
    does not fit there (a `Line` where it names another setting, which the front end spells);
    `negatable` gives a switch its `--no-` form too."""

    help: str | None = None
    negatable: bool = True


class TrainConfig(BaseModel):
    """Everything that decides what a training run computes; saved as the run's `config.yaml`.

    Each field declares one setting once: its name is the YAML key, the `--set` key, the
    `SPARKNET_TRAIN_` variable's suffix and the `sparknet.fit` keyword; its type, default and
    range are checked here for every source; a `Flag` makes it a `sparknet train` option too.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: Annotated[str, Flag("mlp, cnn, a torchvision name, or module:factory")] = Field(
        "cnn", description="mlp, cnn, a torchvision model name, or module:factory"
    )
    num_classes: Annotated[
        int | None, Flag("classes the model tells apart; default: the dataset's")
    ] = Field(None, ge=2, description="default: taken from the dataset")
    extra_classes: Annotated[
        bool, Flag(Line("allow {@num_classes} above the dataset's classes"), negatable=False)
    ] = Field(
        False,
        description="allow num_classes above the dataset's class count (outputs no label uses)",
    )
    data: Annotated[
        str,
        Flag(
            "digits, module:factory, a name from sparknet.yaml's datasets:, s3://bucket/prefix, "
            "a local dataset dir, parquet:PATH or table:NAME"
        ),
    ] = Field(
        "digits",
        description="digits, module:factory, a dataset name from `datasets:`, s3://..., a local "
        "dataset dir, parquet:PATH or table:NAME",
    )
    eval_data: Annotated[str | None, Flag("parquet:PATH or table:NAME to evaluate on")] = Field(
        None, description="parquet:PATH or table:NAME to evaluate on (DataFrame training)"
    )
    label_col: Annotated[str, Flag("DataFrame label column (default label)")] = Field(
        "label", description="DataFrame column of class indices"
    )
    input_col: Annotated[str | None, Flag("DataFrame image/features column")] = Field(
        None,
        description="DataFrame column of encoded images or feature arrays; default: "
        "'image' or 'features', whichever the frame has",
    )
    image_size: Annotated[int, Flag("train/eval crop size for images")] = Field(
        64, ge=8, description="side of the square crops images train at"
    )
    loader_workers: Annotated[int | None, Flag("decoding processes per Spark task")] = Field(
        None,
        ge=0,
        description="decoding processes per Spark task; default: from the task's cores "
        "(none up to 2 cores, one per core beyond the first above that, at most 8)",
    )
    cache_dir: Annotated[Path | None, Flag("executor-local shard cache dir")] = Field(
        None, description="executor-local shard cache; default ~/.cache/sparknet/shards"
    )
    cache_gb: Annotated[float, Flag("shard cache cap (GiB); 0: stream only")] = Field(
        20.0, ge=0, description="shard cache cap per executor; 0: stream only"
    )
    endpoint_url: Annotated[str | None, Flag("S3-compatible endpoint (MinIO, moto)")] = Field(
        None, description="S3-compatible endpoint (MinIO, moto); default AWS_ENDPOINT_URL or AWS"
    )
    workers: Annotated[int, Flag("K: Spark partitions, one worker each")] = Field(
        2, ge=1, description="Spark partitions, one worker each"
    )
    tau: Annotated[
        Annotated[int, Field(ge=1)] | Literal["auto"],
        Flag(
            "local steps per round; auto: chosen as the run goes, the fewest that keep the "
            "exchange within tau_share of a round, at most tau_max"
        ),
    ] = Field(10, description="local steps per round; auto: chosen from the measured rounds")
    tau_share: float = Field(
        0.10,
        gt=0,
        lt=1,
        description="tau auto: the share of a round the exchange may take (the paper's model, "
        "round = tau x step + exchange, from the rounds measured); every choice is in "
        "metrics.jsonl",
    )
    tau_max: int = Field(
        100,
        ge=1,
        description="tau auto: the most steps a round may take, whatever the exchange costs. "
        "The share rule knows the exchange's cost, not what drift between averages costs: at "
        "100 Mbit/s it asked for ~700 steps where 100 reached the target sooner (bench peers)",
    )
    rounds: Annotated[int, Flag("synchronization rounds: tau local steps, then an exchange")] = (
        Field(30, ge=1)
    )
    batch_size: Annotated[int, Flag()] = Field(32, ge=1, description="per worker")
    optimizer: Annotated[Literal["sgd", "adamw"], Flag("inner optimizer: sgd or adamw")] = "sgd"
    lr: Annotated[float, Flag("inner learning rate")] = Field(0.05, gt=0)
    momentum: Annotated[float, Flag("inner momentum (sgd)")] = Field(
        0.9, ge=0, lt=1, description="sgd only"
    )
    weight_decay: Annotated[float, Flag("inner optimizer's weight decay")] = Field(0.0, ge=0)
    label_smoothing: Annotated[
        float, Flag("train loss's label smoothing, as torch's cross_entropy takes it; default 0")
    ] = Field(
        0.0,
        ge=0,
        lt=1,
        description="label smoothing of the train loss (torch's cross_entropy label_smoothing); "
        "the test loss is the plain one",
    )
    warmup_steps: Annotated[
        int, Flag("inner lr's linear warmup, in global inner steps; default 0: none")
    ] = Field(
        0,
        ge=0,
        description="the first N inner steps of the run (counted along its trajectory, whatever "
        "the workers and tau) take lr x (step + 1) / N",
    )
    lr_schedule: Annotated[
        Literal["constant", "cosine", "step", "multistep"],
        Flag(
            Line(
                "inner lr after warmup: constant (default), cosine (to {@min_lr} over "
                "{@lr_decay_length}), step (x {@lr_gamma} every {@lr_step_size}) or multistep "
                "(x {@lr_gamma} at each of {@lr_milestones})"
            )
        ),
    ] = Field("constant", description="how the inner lr changes as the run goes")
    lr_unit: Annotated[
        Literal["rounds", "steps", "epochs"] | None,
        Flag(
            Line(
                "what {@lr_milestones}, {@lr_step_size} and {@lr_decay_length} count: rounds "
                "(default), steps or epochs"
            )
        ),
    ] = Field(
        None,
        description="what an inner cosine, step or multistep schedule counts: rounds (default), "
        "global inner steps, or epochs (samples all workers took over the training set's size)",
    )
    lr_milestones: Annotated[
        list[int],
        Flag(Line("multistep: where lr is multiplied by {@lr_gamma}, repeatable; default none")),
    ] = Field(
        default_factory=list,
        description="multistep: the lr_unit positions (increasing) from which lr is multiplied "
        "by lr_gamma once more; 30,60,80 in text",
    )
    lr_step_size: Annotated[
        int | None,
        Flag(Line("step: lr is multiplied by {@lr_gamma} every N {@lr_unit}; default none")),
    ] = Field(None, ge=1, description="step: every this many lr_unit, lr x lr_gamma")
    lr_gamma: Annotated[float | None, Flag("step and multistep: the factor; default 0.1")] = Field(
        None,
        gt=0,
        le=1,
        description="step and multistep: what each milestone multiplies lr by; default 0.1",
    )
    lr_decay_length: Annotated[
        int | None,
        Flag(Line("cosine: the {@lr_unit} it decays over; default (in rounds) the run's rounds")),
    ] = Field(
        None,
        ge=1,
        description="inner cosine: how many lr_unit the decay lasts; default, with lr_unit "
        "rounds, the run's rounds (recorded, so a resume with more rounds keeps it)",
    )
    min_lr: Annotated[float, Flag("cosine: the lr it decays to; default 0")] = Field(
        0.0, ge=0, description="cosine: the inner lr at the end of the decay and after it"
    )
    outer: Annotated[
        Literal["average", "nesterov"], Flag("average (SparkNet) or nesterov (DiLoCo)")
    ] = "average"
    outer_lr: Annotated[float | None, Flag("nesterov only; default 0.7")] = Field(None, gt=0)
    outer_momentum: Annotated[float | None, Flag("nesterov only; default 0.9")] = Field(
        None, ge=0, lt=1
    )
    outer_lr_schedule: Annotated[
        Literal["constant", "cosine"],
        Flag(
            "nesterov only: constant (default) or cosine (over the run's rounds, never 0 in them)"
        ),
    ] = Field("constant", description="nesterov only: how the outer lr changes as the run goes")
    outer_lr_decay_rounds: int | None = Field(
        None,
        ge=1,
        description="outer_lr_schedule cosine: the rounds the outer lr decays over (to 0 at its "
        "end), at least the run's rounds; default the run's rounds (recorded, so a resume with "
        "more rounds needs a new one, with allow_change)",
    )
    inner_state: Annotated[
        Literal["keep", "reset"], Flag("keep or reset the inner optimizer state")
    ] = "keep"
    seed: Annotated[int, Flag("random seed: initial weights, data order, augmentation")] = 0
    eval_every: Annotated[int, Flag("rounds; 0: only at the end")] = Field(
        5, ge=0, description="0: only at the end"
    )
    checkpoint_every: Annotated[int, Flag("rounds; 0: only at the end")] = Field(
        5, ge=0, description="0: only at the end"
    )
    keep_checkpoints: Annotated[
        int, Flag("checkpoints kept: the last N and the best by eval accuracy; 0: all")
    ] = Field(
        3,
        ge=0,
        description="how many checkpoints the run dir keeps: the newest N, and the one with the "
        "best eval accuracy (best.json names it); older ones are deleted as new ones are "
        "published; 0: keep all",
    )
    stop_at: Annotated[
        float | None, Flag("end the run at the first evaluation whose accuracy reaches this")
    ] = Field(
        None,
        gt=0,
        le=1,
        description="an eval accuracy in (0, 1]: the run ends after the first evaluation that "
        "reaches it, with a checkpoint there (every evaluated round then ends with one); "
        "default: run every round",
    )
    out: Annotated[str | None, Flag()] = Field(
        None,
        description="run dir, a local path or s3://bucket/prefix; default "
        "runs/<model>-<data>-<time>",
    )
    mlflow: Annotated[
        str | None,
        Flag("MLflow tracking URI (default MLFLOW_TRACKING_URI): settings, rounds, the model"),
    ] = Field(
        None,
        description="an MLflow tracking URI (http://host:5000, file:///dir, databricks, ...) to "
        "log the run to: settings as params, a step a round, the run dir's files and the "
        "model; default MLFLOW_TRACKING_URI; needs pip install 'sparknet[mlflow]'",
    )
    master: Annotated[str | None, Flag("Spark master; default local[<cores>,4]")] = Field(
        None, description="Spark master; default embedded local[cores,4]"
    )
    device: Annotated[
        Literal["auto", "cpu", "cuda"], Flag("auto (a GPU when the task has one), cpu, cuda")
    ] = Field("auto", description="auto: the GPU Spark assigned the task, else the CPU")
    precision: Annotated[Literal["fp32", "bf16", "fp16"], Flag("fp32, bf16 or fp16 (autocast)")] = (
        Field("fp32", description="autocast precision of the inner steps; fp16 scales the loss")
    )
    deterministic: Annotated[
        bool, Flag("deterministic kernels only; a resume on GPUs is bit-exact only with this")
    ] = Field(
        False,
        description="deterministic kernels only (slower); what a resume on GPUs is bit-exact under",
    )
    gpus_per_worker: Annotated[
        int, Flag("GPUs of each Spark worker machine (cluster master); every task takes one")
    ] = Field(
        0,
        ge=0,
        description="GPUs of each Spark worker machine (executor) on a cluster master; every "
        "task takes one",
    )
    spark_conf: dict[str, str] = Field(
        default_factory=dict,
        description="Spark settings passed through: the settings file's spark: section, --conf",
    )
    transport: Annotated[
        Literal["auto", "spark", "allreduce"],
        Flag(
            "auto (default: allreduce on a cluster master with a task slot per worker, or "
            "for a resumed allreduce run; else spark), spark, or allreduce"
        ),
    ] = Field(
        "auto",
        description="how updates travel: spark (broadcast + tree sum, one job per round), "
        "allreduce (one barrier stage for all rounds, torch.distributed); auto: allreduce on a "
        "cluster master whose executors hold a task slot per worker, else spark (a resume of an "
        "allreduce run stays on allreduce where it can run). A run's config.yaml records the "
        "one that ran",
    )
    compress: Annotated[
        Literal["none", "bf16", "fp16", "int8", "int4"],
        Flag(
            "allreduce only: none, bf16, fp16, int8 or int4 (blocks with a scale each), what "
            "updates travel as"
        ),
    ] = Field("none", description="allreduce only: what the averaged update travels as")
    overlap: Annotated[
        bool,
        Flag(
            "allreduce only: each round's exchange crosses while the next round computes (the "
            "outer step lands a round late)"
        ),
    ] = Field(
        False,
        description="allreduce only: a round's exchange runs while the next round computes; "
        "its outer step lands one round late, each worker's own progress kept on top",
    )
    fragments: Annotated[
        int,
        Flag(
            "allreduce only: the model's layers in N fragments, one synced after each round "
            "(each every N rounds; Streaming DiLoCo)"
        ),
    ] = Field(
        1,
        ge=1,
        description="allreduce only: the layers in this many fragments, one synced after each "
        "round in turn, so a round moves 1/N of the bytes (Streaming DiLoCo)",
    )
    no_executor_timeout_s: float = Field(
        300.0,
        ge=0,
        le=7 * 24 * 3600,
        description="on a cluster master: a run whose Spark job has waited this many seconds "
        "with no executor, or whose allreduce stage has waited as long for executors lost "
        "from under it (the ones left cannot run it), stops with one line saying so (Spark "
        "itself would wait forever); 0: never",
    )
    pack_workers: bool = Field(
        True,
        description="allreduce: after executors are lost, run the stage again on those left "
        "when they still hold a task slot per worker (more workers on each, each with fewer "
        "threads); false: only on as many executors as the run began with, waiting "
        "no_executor_timeout_s for the lost ones to come back or be replaced",
    )
    progress_timeout_s: float | None = Field(
        None,
        ge=0,
        le=7 * 24 * 3600,
        description="a worker whose steps have not moved (or that has said nothing) for this "
        "many seconds while its task runs is named in one warning and its task failed (on a "
        "cluster master its executor stopped), so its work runs again; default: 300 until a "
        "round is measured, then 5x the slowest round so far, at least 60; 0: never; a "
        "number (at least 10) holds once a round is measured",
    )
    #: a test drill, not a user setting: never written to config.yaml (nor carried by --resume)
    fail_once: str | None = Field(
        None,
        pattern=r"^\d+:\d+$",
        exclude=True,
        description="fault drill 'ROUND:PARTITION': that task's first attempt raises mid-round",
    )

    @field_validator("spark_conf", mode="before")
    @classmethod
    def _conf_as_text(cls, conf: Any) -> Any:
        """YAML reads `spark.task.cpus: 2` as an int; Spark takes every setting as text."""
        if isinstance(conf, Mapping):
            bad = [k for k in conf if not isinstance(k, str) or not k.strip()]
            if bad:
                raise ValueError(f"Spark setting names are text, got {bad[0]!r}")
            return {
                str(k): str(v).lower() if isinstance(v, bool) else str(v) for k, v in conf.items()
            }
        return conf

    @field_validator("mlflow")
    @classmethod
    def _a_tracking_uri(cls, value: str | None) -> str | None:
        """A URI MLflow takes (its scheme says which store), caught here rather than as a
        warning minutes later: `--mlflow runs` is a path, which MLflow 3 refuses."""
        if value is None or value == "databricks" or re.match(r"^[a-z][a-z0-9+.-]*://", value):
            return value
        raise ValueError(
            "a tracking URI: http(s)://HOST:PORT, sqlite:///FILE.db, postgresql://..., "
            "file:///DIR or databricks"
        )

    @field_validator(
        "fragments", "tau_max", "keep_checkpoints", "warmup_steps", "lr_step_size",
        "lr_decay_length", "outer_lr_decay_rounds", mode="before",
    )  # fmt: skip
    @classmethod
    def _count_not_a_bool(cls, value: Any, info: ValidationInfo) -> Any:
        """YAML's `true` (`yes`, `on`) is not a count (it read as 1)."""
        if isinstance(value, bool):
            what = {
                "fragments": " of fragments (1: none)",
                "tau_max": " of steps",
                "keep_checkpoints": " of checkpoints (0: all)",
            }.get(info.field_name or "", "")
            raise ValueError(f"a whole number{what}, not {str(value).lower()}")
        return value

    @field_validator("stop_at", mode="before")
    @classmethod
    def _accuracy_not_a_bool(cls, value: Any) -> Any:
        """YAML's `true` is not an accuracy (it read as 1.0: a stop only at 100 %)."""
        if isinstance(value, bool):
            raise ValueError(f"an accuracy in (0, 1], not {str(value).lower()}")
        return value

    @field_validator("no_executor_timeout_s", "progress_timeout_s", mode="before")
    @classmethod
    def _seconds_not_a_bool(cls, value: Any) -> Any:
        """YAML's `on`/`yes`/`true` is not a number of seconds (it read as 1: a run stopped
        after a second of waiting for its executors)."""
        if isinstance(value, bool):
            raise ValueError(f"a number of seconds (0: never), not {str(value).lower()}")
        return value

    @field_validator("progress_timeout_s")
    @classmethod
    def _a_deadline_a_task_can_meet(cls, value: float | None) -> float | None:
        """A few seconds is less than a healthy task takes to start (its Python worker, its
        imports, its first batch): every task would be failed again and again."""
        if value is not None and 0 < value < MIN_PROGRESS_TIMEOUT_S:
            raise ValueError(
                f"0 (never) or at least {MIN_PROGRESS_TIMEOUT_S:g} seconds (a healthy task "
                f"takes seconds to start), not {value:g}"
            )
        return value

    @field_validator("tau", mode="before")
    @classmethod
    def _steps_or_auto(cls, value: Any) -> Any:
        """One line for a bad tau, rather than one per member of its union."""
        if value == "auto":
            return value
        try:
            steps = int(value) if not isinstance(value, bool | float) else None
        except (TypeError, ValueError):
            steps = None
        if steps is None or steps < 1:
            raise ValueError("a whole number of steps (at least 1) or auto")
        return steps

    @field_validator("out", mode="before")
    @classmethod
    def _out_as_text(cls, out: Any) -> Any:
        return str(out) if isinstance(out, os.PathLike) else out

    @field_validator("lr_milestones", mode="before")
    @classmethod
    def _milestones_from_text(cls, value: Any) -> Any:
        """`--set lr_milestones=30,60,80` (or `[30, 60, 80]`, or one number) as a list."""
        if isinstance(value, str):
            text = value.strip().removeprefix("[").removesuffix("]")
            value = [part.strip() for part in text.split(",") if part.strip()]
        elif not isinstance(value, list | tuple):
            value = [value]
        return [_whole_number(m) for m in value]

    @field_validator("lr_milestones")
    @classmethod
    def _milestones_increase(cls, value: list[int]) -> list[int]:
        if any(m < 1 for m in value) or any(b <= a for a, b in itertools.pairwise(value)):
            raise ValueError(f"increasing whole numbers of at least 1, not {value}")
        return value

    @model_validator(mode="after")
    def _resolve_schedule(self) -> TrainConfig:
        """Each schedule setting given only where it applies; what a schedule left out is filled
        in (lr_gamma 0.1, lr_unit rounds, a cosine's length in rounds as the run's rounds) so
        that the saved config says what ran."""
        schedule, unit = self.lr_schedule, self.lr_unit or "rounds"
        if schedule == "multistep" and not self.lr_milestones:
            raise ValueError(f"lr_schedule multistep needs lr_milestones (in {unit})")
        if schedule == "step" and self.lr_step_size is None:
            raise ValueError(f"lr_schedule step needs lr_step_size (in {unit})")
        given = {
            "lr_milestones": (bool(self.lr_milestones), ("multistep",)),
            "lr_step_size": (self.lr_step_size is not None, ("step",)),
            "lr_gamma": (self.lr_gamma is not None, ("step", "multistep")),
            "min_lr": (self.min_lr > 0, ("cosine",)),
            "lr_decay_length": (self.lr_decay_length is not None, ("cosine",)),
            "lr_unit": (self.lr_unit is not None, ("cosine", "step", "multistep")),
        }
        for name, (set_, kinds) in given.items():
            if set_ and schedule not in kinds:
                which = " or ".join(kinds) if len(kinds) < 3 else "cosine, step or multistep"
                raise ValueError(
                    f"{name} applies to lr_schedule {which} only (lr_schedule is {schedule}); "
                    f"drop it or choose {which}"
                )
        if self.min_lr >= self.lr and schedule == "cosine":
            raise ValueError(f"min_lr {self.min_lr:g} must be below lr {self.lr:g}")
        if schedule == "cosine" and self.lr_decay_length is None:
            if unit != "rounds":
                raise ValueError(
                    f"a cosine schedule in {unit} needs lr_decay_length (the {unit} it decays "
                    "over); only in rounds is it the run's rounds by default"
                )
            object.__setattr__(self, "lr_decay_length", self.rounds)
        if schedule in ("step", "multistep") and self.lr_gamma is None:
            object.__setattr__(self, "lr_gamma", 0.1)
        if schedule != "constant":
            object.__setattr__(self, "lr_unit", unit)
        self._resolve_outer_schedule()
        return self

    def _resolve_outer_schedule(self) -> None:
        """The outer cosine decays over rounds of its own (the run's by default, recorded), never
        fewer than the run's: its lr would be 0 from there on, and those rounds move nothing."""
        if self.outer_lr_schedule != "constant" and self.outer != "nesterov":
            raise ValueError(
                "outer_lr_schedule applies to outer 'nesterov' only ('average' has no lr of "
                "its own)"
            )
        length = self.outer_lr_decay_rounds
        if self.outer_lr_schedule != "cosine":
            if length is not None:
                raise ValueError(
                    "outer_lr_decay_rounds applies to outer_lr_schedule cosine only "
                    f"(outer_lr_schedule is {self.outer_lr_schedule}); drop it or choose cosine"
                )
            return
        if length is None:
            object.__setattr__(self, "outer_lr_decay_rounds", self.rounds)
        elif length < self.rounds:
            raise ValueError(
                f"outer_lr_decay_rounds {length} is below rounds {self.rounds}: the outer lr "
                f"would be 0 from round {length + 1} on, and those rounds would not move the "
                f"weights; set outer_lr_decay_rounds to at least {self.rounds} (on a resume "
                "that adds rounds, with allow_change)"
            )

    @model_validator(mode="after")
    def _resolve_outer(self) -> TrainConfig:
        """Fill the outer optimizer's defaults so the saved config says exactly what ran."""
        if self.outer == "average":
            if self.outer_lr not in (None, 1.0) or self.outer_momentum not in (None, 0.0):
                raise ValueError(
                    "outer 'average' has no lr or momentum of its own; use outer 'nesterov' "
                    "to set outer_lr / outer_momentum"
                )
            lr, momentum = 1.0, 0.0
        else:
            lr = NESTEROV_DEFAULT_LR if self.outer_lr is None else self.outer_lr
            momentum = (
                NESTEROV_DEFAULT_MOMENTUM if self.outer_momentum is None else self.outer_momentum
            )
            if momentum == 0:
                raise ValueError("outer 'nesterov' needs outer_momentum > 0")
        object.__setattr__(self, "outer_lr", lr)
        object.__setattr__(self, "outer_momentum", momentum)
        return self

    @model_validator(mode="after")
    def _stop_at_needs_evaluations(self) -> TrainConfig:
        """With eval_every 0 the only evaluation is after the last round: nothing to stop."""
        if self.stop_at is not None and self.eval_every == 0:
            raise ValueError(
                "stop_at needs evaluations as the run goes (eval_every 0 evaluates only after "
                "the last round); set eval_every to 1 or more, or drop stop_at"
            )
        return self

    @model_validator(mode="after")
    def _slow_link_options_need_allreduce(self) -> TrainConfig:
        if self.transport == "spark" and (asked := self.allreduce_options):
            raise ValueError(
                f"{' and '.join(asked)} {'applies' if len(asked) == 1 else 'apply'} to the "
                "allreduce transport only; use transport allreduce (or auto), or drop "
                f"{'it' if len(asked) == 1 else 'them'}"
            )
        return self

    @property
    def allreduce_options(self) -> list[str]:
        """The names of the settings given that only the `allreduce` transport has (`auto`
        then picks it)."""
        given = {"compress": self.compress != "none", "overlap": self.overlap}
        given["fragments"] = self.fragments > 1
        return [name for name, on in given.items() if on]

    @property
    def first_tau(self) -> int:
        """The steps of the run's first round: tau, or under tau auto the probe it starts at."""
        return min(TAU_PROBE, self.tau_max) if self.tau == "auto" else self.tau

    @property
    def fail_once_at(self) -> tuple[int, int] | None:
        """(round, partition) of the fault drill, if one is set."""
        if self.fail_once is None:
            return None
        rnd, part = self.fail_once.split(":")
        return int(rnd), int(part)

    def to_yaml(self) -> str:
        return yaml.safe_dump({"train": self.model_dump(mode="json")}, sort_keys=False)

    def trajectory_changes(self, before: TrainConfig) -> dict[str, tuple[Any, Any]]:
        """{setting: (before, now)} for the settings whose change alters what a resumed run
        computes; `rounds`, evaluation, checkpoints and where it runs may change freely."""
        old, new = before.model_dump(mode="json"), self.model_dump(mode="json")
        names = TRAJECTORY_SETTINGS
        if "auto" not in (old["tau"], new["tau"]):  # the chooser's settings: nothing to choose
            names = tuple(k for k in names if k not in TAU_AUTO_SETTINGS)
        return {k: (old[k], new[k]) for k in names if old[k] != new[k]}


#: the settings that decide the weights a run computes, round by round; resuming with any of them
#: changed would break the promise that a resumed run equals an uninterrupted one
TRAJECTORY_SETTINGS = (
    "model", "num_classes", "data", "label_col", "input_col", "image_size", "workers", "tau",
    "batch_size", "optimizer", "lr", "momentum", "weight_decay", "outer", "outer_lr",
    "outer_momentum", "inner_state", "seed", "precision", "compress", "overlap", "fragments",
    "tau_share", "tau_max", "label_smoothing", "warmup_steps", "lr_schedule", "lr_unit",
    "lr_milestones", "lr_step_size", "lr_gamma", "lr_decay_length", "min_lr",
    "outer_lr_schedule", "outer_lr_decay_rounds",
)  # fmt: skip
#: what shapes the inner schedule beyond its kind: a changed kind on resume takes them anew
SCHEDULE_SHAPE = ("lr_milestones", "lr_step_size", "lr_gamma", "lr_decay_length", "min_lr")
#: the settings of tau auto alone: with a fixed tau on both sides of a resume, nothing
TAU_AUTO_SETTINGS = ("tau_share", "tau_max")


class DatasetEntry(BaseModel):
    """One entry of the `datasets:` map: a name for a dataset dir on S3 or on local disk."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    uri: str = Field(description="s3://bucket/prefix or a local directory")
    endpoint_url: str | None = None

    @field_validator("uri")
    @classmethod
    def _s3_uri_parses(cls, uri: str) -> str:
        """An s3:// URI is checked here by the one parser, so the error names the settings file."""
        if uri.startswith("s3://"):
            from sparknet.data.s3 import S3Uri  # lazy: boto3

            try:
                S3Uri.parse(uri)
            except SparknetError as exc:
                raise ValueError(str(exc)) from exc
        return uri

    @field_validator("endpoint_url")
    @classmethod
    def _endpoint_is_a_url(cls, url: str | None) -> str | None:
        """Checked here, so the error names the settings file (see `aws.check_endpoint_url`)."""
        parts = urllib.parse.urlsplit(url or "http://x")
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError("not a URL: write it as http://HOST:PORT (or https://...)")
        return url


#: where settings are read from when no --config is given: $SPARKNET_CONFIG, then ./sparknet.yaml
CONFIG_ENV = "SPARKNET_CONFIG"
DEFAULT_CONFIG = Path("sparknet.yaml")


def find_config_file(
    explicit: Path | None, environ: Mapping[str, str] | None = None
) -> Path | None:
    """The settings file in use: --config, else $SPARKNET_CONFIG, else ./sparknet.yaml if any."""
    if explicit is not None:
        return explicit
    env = (os.environ if environ is None else environ).get(CONFIG_ENV)
    if env:
        return Path(env)
    return DEFAULT_CONFIG if DEFAULT_CONFIG.is_file() else None


def load_datasets(config_file: Path | None) -> dict[str, DatasetEntry]:
    """The `datasets:` map of the settings file (empty without one)."""
    if config_file is None:
        return {}
    out = {}
    for name, entry in _read_yaml_section(config_file, "datasets").items():
        if isinstance(entry, str):
            entry = {"uri": entry}
        try:
            out[str(name)] = DatasetEntry.model_validate(entry)
        except ValidationError as exc:
            where = f"{config_file}: datasets.{name}: "
            raise validation_error(exc, DatasetEntry, where=where) from exc
    return out


#: YAML 1.1 reads `5:1` as the base-60 integer 301; `--set fail_once=5:1` means the text
_SEXAGESIMAL = re.compile(r"[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?")


def _parse_scalar(text: str) -> Any:
    if _SEXAGESIMAL.fullmatch(text.strip()):
        return text
    value = yaml.safe_load(text)
    return text if isinstance(value, (dict, list)) else value


def read_section(path: Path, section: str) -> dict[str, Any]:
    """A top-level section of the settings file (e.g. `clusters:`), {} when absent."""
    return _read_yaml_section(path, section)


#: the top-level sections a settings file may hold; anything else is a typo that would otherwise
#: leave a whole section silently at its defaults
SECTIONS = ("train", "datasets", "clusters", "spark")


def _read_yaml_section(path: Path, section: str) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise SparknetError(f"cannot read config file {path}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise SparknetError(
            f"config file {path} is not UTF-8 text (byte {exc.start}); save it as UTF-8"
        ) from exc
    return yaml_section(text, path, section)


def yaml_section(text: str, path: Path | str, section: str) -> dict[str, Any]:
    """A section of settings-file text read from `path` (named in the errors)."""
    try:
        doc = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise SparknetError(f"config file {path} is not valid YAML: {exc}".splitlines()[0]) from exc
    if not isinstance(doc, dict) or not isinstance(doc.get(section) or {}, dict):
        raise SparknetError(f"config file {path}: expected a mapping with a '{section}:' section")
    unknown = [str(key) for key in doc if key not in SECTIONS]
    if unknown:
        raise SparknetError(
            f"config file {path}: unknown section '{unknown[0]}:'; the sections are "
            f"{', '.join(s + ':' for s in SECTIONS)}"
        )
    return dict(doc.get(section) or {})


def _spark_section(path: Path) -> dict[str, Any]:
    """The settings file's `spark:` section: every Spark setting is one value (text, a number,
    true/false); a list or mapping would reach Spark as its Python text."""
    section = _read_yaml_section(path, "spark")
    for key, value in section.items():
        if isinstance(value, dict | list):
            raise SparknetError(
                f"config file {path}: spark setting '{key}' is a "
                f"{'mapping' if isinstance(value, dict) else 'list'}; give it one value "
                "(text, a number, true/false), as Spark takes it"
            )
    return section


def _key_values(items: Iterable[str], refusal: str) -> Iterator[tuple[str, str]]:
    """(key, value) of each `key=value` item; a missing `=` or key is one line, `refusal` with
    the item as `item`."""
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise SparknetError(refusal, item=item)
        yield key.strip(), value


def _parse_sets(items: Iterable[str]) -> dict[str, Any]:
    return {
        key.removeprefix("train."): _parse_scalar(value)
        for key, value in _key_values(items, "{@set} expects key=value, got {item!r}")
    }


def _parse_conf(items: Iterable[str]) -> dict[str, str]:
    return dict(_key_values(items, "{@conf} expects a Spark setting key=value, got {item!r}"))


def _from_env(environ: Mapping[str, str]) -> dict[str, Any]:
    return {
        key[len(ENV_PREFIX) :].lower(): _parse_scalar(value)
        for key, value in environ.items()
        if key.startswith(ENV_PREFIX)
    }


def validation_error(
    exc: ValidationError, model: type | None = None, *, where: str = ""
) -> SparknetError:
    """The first problem of a pydantic error as a one-line error, `where` (`cluster c1: `) before
    it: a setting's bad value is a `SettingError` (`invalid setting tau: ... (got 0)`) that a
    front end may word its own way. An unknown setting of `model` (a cluster's, a dataset's)
    lists the known ones; without one (the training settings) it points to their help."""
    err = exc.errors()[0]
    loc = ".".join(str(p) for p in err["loc"])
    msg = err["msg"].removeprefix("Value error, ")
    if not loc:  # a check across settings (e.g. outer and outer_lr)
        return SparknetError("{where}invalid settings: {reason}", where=where, reason=msg)
    if err["type"] == "extra_forbidden":
        known = _known_settings(model, err["loc"][:-1]) if model is not None else None
        if known is not None:
            return SparknetError(
                "{where}unknown setting '{name}' (known: {known})",
                where=where, name=loc, known=", ".join(known),
            )  # fmt: skip
        return SparknetError(
            "{where}unknown setting '{name}'; see {@help} for the settings", where=where, name=loc
        )
    value = NO_VALUE if err["type"] == "missing" else err.get("input")
    got = "" if value is NO_VALUE else f" (got {value!r})"
    return SettingError(
        "{where}invalid setting {name}: {reason}",
        setting=loc, value=value, where=where, name=loc, reason=msg + got,
    )  # fmt: skip


def _known_settings(model: type, parents: tuple[Any, ...]) -> list[str] | None:
    """The field names of `model`'s part at `parents` (`bootstrap`: its settings'); None
    where a part is not a settings model of its own."""
    for part in parents:
        field = getattr(model, "model_fields", {}).get(part)
        model = getattr(field, "annotation", None)
    fields = getattr(model, "model_fields", None)
    return sorted(fields) if isinstance(fields, dict) else None


def load_train_config(
    *,
    config_file: Path | None = None,
    sets: Iterable[str] = (),
    flags: Mapping[str, Any] | None = None,
    base: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    conf: Iterable[str] = (),
) -> TrainConfig:
    """Merge every source of settings into one validated `TrainConfig` (see module docstring).

    Spark settings (`spark_conf`) merge key by key: the resumed run's, then the settings file's
    `spark:` section, then `--conf key=value`."""
    merged: dict[str, Any] = dict(base or {})
    spark_conf = dict(merged.get("spark_conf") or {})
    #: the settings given now, whatever their values (a stored one given again is given)
    given: set[str] = set()
    if config_file is not None:
        section = _read_yaml_section(config_file, "train")
        merged.update(section)
        given.update(section)
        spark_conf.update(_spark_section(config_file))
    spark_conf.update(_parse_conf(conf))
    if spark_conf:
        merged["spark_conf"] = spark_conf
    for values in (
        _from_env(os.environ if environ is None else environ),
        _parse_sets(sets),
        {k: v for k, v in (flags or {}).items() if v is not None},
    ):
        merged.update(values)
        given.update(values)
    if base:
        _take_anew(merged, base, given)
    try:
        return TrainConfig(**merged)
    except ValidationError as exc:
        raise validation_error(exc, where=_stored_where(exc, merged, base)) from exc


def _take_anew(merged: dict[str, Any], base: Mapping[str, Any], given: set[str]) -> None:
    """On a resume, drop from `merged` the stored settings that belonged to a choice the user
    changed, unless `given` holds them: a changed `outer` chooses its own lr and momentum (the
    stored ones were filled in from defaults), a changed inner `lr_schedule` its own shape
    (milestones, step size, gamma, a cosine's length and floor; and no unit where it counts
    none), a changed `outer_lr_schedule` its own length. Only the kind a user changed decides."""
    changed = {k for k in given if k not in base or merged[k] != base[k]}
    dropped: list[str] = []
    if "outer" in changed:
        dropped += ["outer_lr", "outer_momentum"]
    if "lr_schedule" in changed:
        dropped += SCHEDULE_SHAPE
        if merged["lr_schedule"] == "constant":
            dropped.append("lr_unit")
    if "outer_lr_schedule" in changed:
        dropped.append("outer_lr_decay_rounds")
    for key in dropped:
        if key not in given:
            merged.pop(key, None)


def _stored_where(exc: ValidationError, merged: Mapping[str, Any], base: Mapping | None) -> str:
    """`{file}: ` where the first bad value is a resumed run's own, unchanged (a `base` that
    says where it was read from: `rundir.StoredSettings`), so the error names the file to fix;
    else nothing."""
    where = getattr(base, "where", None)
    loc = exc.errors()[0]["loc"]
    if where is None or not loc or loc[0] not in base or merged.get(loc[0]) != base[loc[0]]:
        return ""
    return f"{where}: "
