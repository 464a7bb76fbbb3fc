"""`sparknet bench convergence`: rounds and samples to a target accuracy.

Measured over K, tau and the outer optimizer.

Local SGD trades statistical efficiency for communication: each of K workers takes tau steps of
its own between synchronizations, so a round costs one sync whatever tau is, but the averaged
model may need more samples than plain SGD to reach the same accuracy (SparkNet, Moritz et al.,
ICLR 2016, section 4). DiLoCo (Douillard et al. 2023) replaces the plain average with an outer
Nesterov step on the averaged update, and claims fewer rounds at large tau. This benchmark
measures both on this machine, with the engine itself: every setting is one
`sparknet.training.driver.train` run on one shared local Spark session (K simulated workers are K
Spark partitions running the same worker code as on a cluster), evaluated on the test set after
every round and stopped at the first round whose test accuracy reaches the dataset's target.

Datasets (`RECIPES`): scikit-learn's bundled digits, and `imagenet_like`, a generated ImageNet-like
set of small RGB crops of scikit-learn's two bundled photos, made here without any download.
`imagenet-like-wide` (the same set, a 40 MB MLP) is `bench peers`' alone: its target takes
hundreds of steps, beyond this sweep's rounds.

Cost on 2 cores (measured while other jobs shared them): digits 4.2 min with `max_rounds` 30,
the generated set 4.6 min with the default 60; both at the defaults about 10 min. Most of it is
the settings that never reach the target (tau=1: one step a round, and `nesterov` there) and run
all `max_rounds` rounds, each a Spark job to train and one to evaluate.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import math
import shutil
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from sparknet.bench.common import BenchReport, pyplot, save_figure
from sparknet.config import NESTEROV_DEFAULT_LR, NESTEROV_DEFAULT_MOMENTUM, TrainConfig
from sparknet.training.spark_settings import embedded_master

if TYPE_CHECKING:
    from torch import nn

# `# lazy: X` below: `bench peers` imports this module for its recipes; torch, PIL, Spark and
# matplotlib only where data are made, a session runs or the plot is drawn

#: the names `--data` takes, in the order they are run
DATASETS = ("digits", "imagenet-like")
#: what `bench peers` takes besides: a recipe whose model the links bind
PEERS_DATASETS = (*DATASETS, "imagenet-like-wide")

COLUMNS = [
    "dataset", "workers", "tau", "outer", "target", "rounds", "samples", "seconds",
    "final_accuracy",
]  # fmt: skip

#: the issue's goal: DiLoCo (`nesterov`) reaches the digits target in at most this fraction of
#: the rounds `average` takes, at every tau >= GOAL_TAU
GOAL_RATIO = 0.7
GOAL_TAU = 20
GOAL_DATASET = "digits"

Status = Callable[[str], None]


@dataclass(frozen=True)
class Recipe:
    """How one dataset trains in the sweep, and the test accuracy that counts as reached.

    Each target is fixed (not relative to the best run) so that figures of different sweeps
    compare, and low enough that the reference setting, K=1 and tau=1 (plain minibatch SGD, one
    step a round), reaches it within the CLI's default 60 rounds: then every setting has a
    chance to, and "not reached" says something about the setting rather than the target.
    `bench peers`' own recipe is the exception: its target takes every contender tens of
    seconds of training, so that seconds to it tell them apart.
    """

    data: str
    model: str
    target: float
    why: str
    batch_size: int = 32
    lr: float = 0.05
    momentum: float = 0.9
    #: `bench peers`: steps between evaluations (sparknet's: the first round past them), as
    #: many as take a small part of the seconds to the target
    eval_steps: int = 10


RECIPES: dict[str, Recipe] = {
    # An MLP, since on these 8x8 images it learns faster per step than the small CNN (measured:
    # after 60 single steps the MLP is at ~0.82 test accuracy, the CNN at ~0.7). 0.80 is reached
    # by K=1 tau=1 in about 54 rounds; 0.90 would take it ~96, beyond any sensible max_rounds.
    "digits": Recipe(
        data="digits",
        model="mlp",
        target=0.80,
        why="K=1 tau=1 (one SGD step a round) reaches it in ~54 rounds",
    ),
    # The small CNN (BatchNorm, global pooling): the MLP does not learn this set beyond ~0.5
    # and collapses to ~0.15 at tau=20. The CNN's K=1 tau=1 reaches 0.55 in ~35 rounds (0.60
    # would take it ~53, too close to 60 for a model whose BatchNorm makes runs differ slightly
    # between machines); the best settings level off near 0.8.
    "imagenet-like": Recipe(
        data="sparknet.bench.convergence:imagenet_like",
        model="cnn",
        target=0.55,
        why="K=1 tau=1 reaches it in ~35 rounds; the best settings level off near 0.8",
    ),
    # `bench peers`' own: the generated set again, and a model whose parameters are large
    # against its compute (`wide_mlp`), so that 1 Gbit/s and 100 Mbit/s bind DDP. Measured on
    # the 2-core VM, 1 thread, batch 32, others' tests sharing it (2026-12-06): plain PyTorch
    # steps in ~36 ms, so DDP's all-reduce, 4 x params x 2(K-1)/K = 40 MB sent by each rank a
    # step at K=2, would need 8.9 Gbit/s; at 1 Gbit/s it takes 0.32 s (9x the step), at
    # 100 Mbit/s 3.2 s (90x). In `bench peers` (1gbit, 20 s each): DDP 170 samples/s against
    # plain's 871, 87% of its training waiting on the all-reduce, the link 95% full.
    # The target, from simulations in one process (K=2 DDP as batch-64 SGD; local SGD as two
    # models averaged every tau steps; the test set every 25 or 50 steps): at lr 0.05 the MLP
    # diverges after ~750 steps, at 0.01 and 0.003 it levels off near 0.80 within ~400 and
    # ~700 steps (a noisy plateau: 0.78-0.83); at 0.002 batch-64 SGD first reaches 0.80 at step
    # 775 (0.78 at 600), local SGD at tau=50 at 650 (each worker's steps; steady from 950),
    # and every curve levels off at 0.81-0.83 after ~1000. At the ~64 ms a step each of K=2
    # ranks takes in `bench peers` on 2 cores (plain: ~37 ms), that is >= 40 s of training
    # for sparknet and DDP, >= 13 exchanges at tau=50, and ~40 s for plain PyTorch.
    "imagenet-like-wide": Recipe(
        data="sparknet.bench.convergence:imagenet_like",
        model="sparknet.bench.convergence:wide_mlp",
        target=0.80,
        why="lr 0.002 on the 40 MB wide_mlp: simulated, K=2 synchronous SGD first reaches it at "
        "step 775 and local SGD (tau=50) at 650, both leveling off at 0.81-0.83 past ~1000; "
        "at bench peers' ~64 ms a step on 2 cores, >= 40 s of training and >= 13 exchanges "
        "for the best, timed to ~2 s (evaluated every 30 steps or 2 s, sparknet every round "
        "past 30 steps)",
        lr=0.002,
        eval_steps=30,
    ),
}


# ---- the generated ImageNet-like set ---------------------------------------------------------

#: side of the square images: Chrabaszcz et al.'s downsampled ImageNet comes at 16x16 too, and a
#: step of the CNN costs a quarter of one at 32x32 (K=8 tau=50 is 400 steps a round on 2 cores)
IMAGE_SIZE = 16
TRAIN_PER_CLASS = 500
TEST_PER_CLASS = 100
SEED = 0
#: the classes: (photo, (x0, y0, x1, y1)) of scikit-learn's china.jpg (0) and flower.jpg (1),
#: both 640x427; each a region of one texture or object, as an ImageNet class is
REGIONS: tuple[tuple[int, tuple[int, int, int, int]], ...] = (
    (0, (380, 0, 640, 110)),  # clear sky
    (0, (90, 40, 330, 330)),  # pagoda
    (0, (340, 230, 540, 300)),  # lake with boats
    (0, (330, 290, 560, 427)),  # trees, right
    (0, (0, 300, 120, 427)),  # trees, left
    (1, (180, 110, 440, 360)),  # dahlia petals
    (1, (0, 60, 150, 300)),  # leaves
    (1, (420, 0, 640, 200)),  # blurred background
    (1, (290, 370, 470, 427)),  # second flower
    (1, (0, 330, 250, 427)),  # dark foliage
)
PHOTOS = ("china.jpg", "flower.jpg")
#: crop sides in source pixels (before the resize to IMAGE_SIZE): scale varies as in real photos
CROP_SIDES = (24, 56)
BRIGHTNESS = 0.3
NOISE = 0.1


@functools.cache
def imagenet_like():
    """(train, test) TensorDatasets of 3xIMAGE_SIZExIMAGE_SIZE float images in 10 classes,
    TRAIN_PER_CLASS and TEST_PER_CLASS each, generated without any download.

    Each class is one region of scikit-learn's two bundled photos (`REGIONS`); a sample is a
    random square crop inside it (random side, so random scale), resized, flipped at random,
    with a random brightness and Gaussian noise. Texture and colour tell the classes apart, some
    pairs only barely (sky and lake, leaves and foliage): learnable, not trivial. Deterministic
    (fixed seeds; train and test drawn from separate streams) and cached: every Spark Python
    worker calls it through `load_data`.
    """
    photos = _photos()
    train = _generate(photos, TRAIN_PER_CLASS, np.random.default_rng([SEED, 0]))
    test = _generate(photos, TEST_PER_CLASS, np.random.default_rng([SEED, 1]))
    return train, test


#: `wide_mlp`'s hidden layers, on the 3 x IMAGE_SIZE x IMAGE_SIZE values of a flattened image
WIDE_LAYERS = (2048, 2048, 2048)


def wide_mlp(num_classes: int = 10) -> nn.Module:
    """`imagenet-like-wide`'s model: WIDE_LAYERS of ReLU units on a flattened image, 10.0M
    parameters (40 MB in float32) for ~36 ms of a step of 32 images on one core. Its parameters
    are large against its compute, so that DDP's all-reduce of them each step, not the step, is
    what a 1 Gbit/s link limits. A `module:factory` model, as a user's own would be
    (`sparknet.models.build_model`)."""
    from torch import nn  # lazy: torch

    layers: list[nn.Module] = [nn.Flatten()]
    width = 3 * IMAGE_SIZE * IMAGE_SIZE
    for units in WIDE_LAYERS:
        layers += [nn.Linear(width, units), nn.ReLU()]
        width = units
    return nn.Sequential(*layers, nn.Linear(width, num_classes))


def _photos() -> list[np.ndarray]:
    """The two photos `sklearn.datasets.load_sample_images` returns, read the way it reads them,
    without importing scikit-learn (~1.5 s of CPU in every Python worker)."""
    from PIL import Image  # lazy: PIL

    from sparknet.data.sources import _sklearn_file  # lazy: torch, boto3

    out = []
    for name in PHOTOS:
        with Image.open(_sklearn_file(f"datasets/images/{name}")) as img:
            out.append(np.asarray(img.convert("RGB")))
    return out


def _generate(photos: Sequence[np.ndarray], per_class: int, rng: np.random.Generator):
    import torch  # lazy: torch
    from torch.utils.data import TensorDataset  # lazy: torch

    images, labels = [], []
    for label, (photo, box) in enumerate(REGIONS):
        for _ in range(per_class):
            images.append(_sample(photos[photo], box, rng))
            labels.append(label)
    x = (np.stack(images) - 0.5) / 0.25  # roughly zero mean, unit variance
    return TensorDataset(torch.from_numpy(x.astype(np.float32)), torch.tensor(labels))


def _sample(photo: np.ndarray, box: tuple[int, int, int, int], rng: np.random.Generator):
    """One CHW float image: a random crop of `box`, resized, flipped, brightened, noised."""
    from PIL import Image  # lazy: PIL

    x0, y0, x1, y1 = box
    side = int(rng.integers(CROP_SIDES[0], min(CROP_SIDES[1], x1 - x0, y1 - y0) + 1))
    x = x0 + int(rng.integers(0, x1 - x0 - side + 1))
    y = y0 + int(rng.integers(0, y1 - y0 - side + 1))
    crop = Image.fromarray(photo[y : y + side, x : x + side])
    img = np.asarray(crop.resize((IMAGE_SIZE, IMAGE_SIZE), Image.BILINEAR), np.float32) / 255.0
    if rng.random() < 0.5:
        img = img[:, ::-1]
    img = img * rng.uniform(1 - BRIGHTNESS, 1 + BRIGHTNESS)
    img = img + rng.normal(0.0, NOISE, img.shape)
    return img.transpose(2, 0, 1)


# ---- the sweep ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    """One point of the sweep: one training run."""

    dataset: str
    workers: int
    tau: int
    outer: str

    @property
    def name(self) -> str:
        """Its run dir's name under `out/runs/`."""
        return f"{self.dataset}-K{self.workers}-tau{self.tau}-{self.outer}"

    @property
    def label(self) -> str:
        return f"{self.dataset} K={self.workers} tau={self.tau} {self.outer}"


@dataclass(frozen=True)
class Outcome:
    """What one setting measured. `rounds`, `samples` and `seconds` are those up to the first
    round at or above the target; `rounds` and `samples` are None when no round was."""

    setting: Setting
    target: float
    rounds: int | None
    samples: int | None
    seconds: float
    final_accuracy: float | None
    #: test accuracy after each round run
    curve: list[float] = field(default_factory=list)

    @property
    def reached(self) -> bool:
        return self.rounds is not None

    def row(self) -> dict[str, Any]:
        s = self.setting
        return {
            "dataset": s.dataset,
            "workers": s.workers,
            "tau": s.tau,
            "outer": s.outer,
            "target": self.target,
            "rounds": self.rounds,
            "samples": self.samples,
            "seconds": self.seconds,
            "final_accuracy": self.final_accuracy,
        }


def outcome_of(setting: Setting, target: float, rows: Sequence[dict[str, Any]]) -> Outcome:
    """The outcome of a run's metrics rows (one per round, each evaluated). `seconds` is the
    round loop's `elapsed_s` at the target (or at the last round): Spark's start, the Python
    workers' probe and the run's set-up are left out, as they are the same for every setting."""
    curve = [float(r["eval_accuracy"]) for r in rows if "eval_accuracy" in r]
    hit = next((i for i, r in enumerate(rows) if r.get("eval_accuracy", -1.0) >= target), None)
    upto = rows if hit is None else rows[: hit + 1]
    last = upto[-1] if upto else {}
    return Outcome(
        setting=setting,
        target=target,
        rounds=None if hit is None else int(rows[hit]["round"]),
        samples=None if hit is None else int(sum(r["samples"] for r in upto)),
        seconds=float(last.get("elapsed_s", 0.0)),
        final_accuracy=last.get("eval_accuracy"),
        curve=curve,
    )


class _TargetReached(Exception):
    """Raised from `on_round` to end a run at its target: `train` has no other early stop."""


def config_of(setting: Setting, rounds: int, master: str, run_dir: Path) -> TrainConfig:
    """The run of `setting`: evaluated after every round (the target is checked there), no
    checkpoint but the engine's last-round one, and the Spark transport, which runs any K on
    any number of cores (a barrier stage needs a core for each of the K tasks at once)."""
    recipe = RECIPES[setting.dataset]
    return TrainConfig(
        model=recipe.model, data=recipe.data, batch_size=recipe.batch_size, lr=recipe.lr,
        momentum=recipe.momentum, workers=setting.workers, tau=setting.tau, outer=setting.outer,
        rounds=rounds, eval_every=1, checkpoint_every=0, transport="spark", master=master,
        out=str(run_dir),
    )  # fmt: skip


def warm_up(spark, dataset: str, workers: int, master: str, runs_dir: Path) -> None:
    """One round of `dataset` on `workers` partitions, not measured: it starts Spark's Python
    workers (torch imported, the data loaded into each), ~10 s that would otherwise land in the
    first setting's seconds, or in the first setting whose K needs a second Python worker."""
    from sparknet.training.driver import train  # lazy: torch, pyspark, boto3

    run_dir = runs_dir / f"warm-up-{dataset}"
    shutil.rmtree(run_dir, ignore_errors=True)
    train(config_of(Setting(dataset, workers, 1, "average"), 1, master, run_dir), spark=spark)


def run_setting(
    spark, setting: Setting, max_rounds: int, master: str, run_dir: Path, on_status: Status
) -> Outcome:
    """Train `setting` on the shared session until the target or `max_rounds`. A run stopped at
    its target leaves a run dir without model.safetensors or curves.png (its metrics.jsonl and
    config.yaml are whole): enough to look at, and this benchmark resumes nothing."""
    from sparknet.training.driver import train  # lazy: torch, pyspark, boto3

    recipe = RECIPES[setting.dataset]
    cfg = config_of(setting, max_rounds, master, run_dir)
    rows: list[dict[str, Any]] = []

    def on_round(row: dict[str, Any]) -> None:
        rows.append(row)
        if row.get("eval_accuracy", -1.0) >= recipe.target:
            raise _TargetReached

    shutil.rmtree(run_dir, ignore_errors=True)  # an earlier sweep's: train refuses a used dir
    with contextlib.suppress(_TargetReached):
        train(
            cfg,
            spark=spark,
            on_round=on_round,
            on_warning=lambda text: on_status(f"warning: {setting.label}: {text}"),
        )
    return outcome_of(setting, recipe.target, rows)


def settings_of(
    datasets: Iterable[str], workers: Iterable[int], taus: Iterable[int], outers: Iterable[str]
) -> list[Setting]:
    """Every combination, each once, in a stable order: dataset, K, tau, outer."""
    combos = itertools.product(
        _unique(datasets), sorted(set(workers)), sorted(set(taus)), _unique(outers)
    )
    return [Setting(*c) for c in combos]


def _unique(values: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(values))


def check_workers(datasets: Iterable[str], workers: Iterable[int]) -> None:
    """The engine's own check that every dataset has a sample for each of max(K) workers, before
    Spark starts rather than after the settings before the failing one have run."""
    from sparknet.data.sources import TensorSource  # lazy: torch, boto3

    for name in datasets:
        TensorSource.load(RECIPES[name].data).check_workers(max(workers))


def _status_line(index: int, total: int, o: Outcome, max_rounds: int) -> str:
    head = f"[{index}/{total}] {o.setting.label}"
    acc = "-" if o.final_accuracy is None else f"{o.final_accuracy:.3f}"
    if o.reached:
        return f"{head}: {o.rounds} rounds (accuracy {acc} >= {o.target}, {o.seconds:.1f} s)"
    return f"{head}: not reached in {max_rounds} rounds (accuracy {acc} < {o.target})"


def run(
    datasets: Sequence[str],
    workers: Sequence[int],
    taus: Sequence[int],
    outers: Sequence[str],
    max_rounds: int,
    out: Path,
    on_status: Status = lambda _text: None,
    master: str | None = None,
) -> BenchReport:
    """Run every setting on one local Spark session (runs under `out/runs/`), then write
    `convergence.json`, `convergence.csv` and `convergence.png` into `out`."""
    from sparknet.training.session import start_session, stop_quietly  # lazy: pyspark

    settings = settings_of(datasets, workers, taus, outers)
    check_workers({s.dataset for s in settings}, workers)
    master = master or embedded_master()
    on_status("starting Spark")
    spark = start_session(master, max(workers))
    outcomes = []
    runs_dir = out / "runs"
    try:
        for dataset in _unique(s.dataset for s in settings):
            on_status(f"warming up Spark's Python workers on {dataset}")
            warm_up(spark, dataset, max(workers), master, runs_dir)
        for i, setting in enumerate(settings, 1):
            o = run_setting(spark, setting, max_rounds, master, runs_dir / setting.name, on_status)
            outcomes.append(o)
            on_status(_status_line(i, len(settings), o, max_rounds))
    finally:
        stop_quietly(spark)
    return _report(outcomes, max_rounds, out)


# ---- the report ----------------------------------------------------------------------------


def _report(outcomes: Sequence[Outcome], max_rounds: int, out: Path) -> BenchReport:
    report = BenchReport(
        name="convergence",
        title=f"rounds and samples to the target test accuracy (at most {max_rounds} rounds)",
        columns=COLUMNS,
        rows=[o.row() for o in outcomes],
        notes=[*method_notes(outcomes, max_rounds), *goal_notes(outcomes, max_rounds)],
        extra={
            "max_rounds": max_rounds,
            "recipes": {
                name: dataclasses.asdict(r)
                for name, r in RECIPES.items()
                if any(o.setting.dataset == name for o in outcomes)
            },
            "goal": {"dataset": GOAL_DATASET, "ratio": GOAL_RATIO, "tau_at_least": GOAL_TAU},
            "curves": {o.setting.name: o.curve for o in outcomes},
        },
    )
    report.write(out)
    report.files.append(plot(outcomes, out / "convergence.png"))
    return report


def method_notes(outcomes: Sequence[Outcome], max_rounds: int) -> list[str]:
    """What was trained how, what the columns mean, and which settings never got there."""
    lines = []
    for name in _unique(o.setting.dataset for o in outcomes):
        r = RECIPES[name]
        lines.append(
            f"{name}: target {r.target:.2f} ({r.why}); {r.model}, sgd lr {r.lr} momentum "
            f"{r.momentum}, batch {r.batch_size} per worker; nesterov: outer lr "
            f"{NESTEROV_DEFAULT_LR}, momentum {NESTEROV_DEFAULT_MOMENTUM} (the defaults)"
        )
    lines.append(
        "rounds: the first round whose test accuracy (evaluated after every round) reaches the "
        "target; samples: training samples of all workers up to it (K x tau x batch a round); "
        "seconds: the round loop's elapsed time to it, evaluations included (Spark's start "
        "and the run's set-up left out; every worker gets an even share of this machine's "
        "cores, so K above the cores take turns)"
    )
    missed = [o.setting.label for o in outcomes if not o.reached]
    if missed:
        lines.append(
            f"not reached within {max_rounds} rounds ({len(missed)} of {len(outcomes)}): "
            + ", ".join(missed)
        )
    return lines


@dataclass(frozen=True)
class Pair:
    """`nesterov` against `average` at one (K, tau): the ratio of their rounds to the target."""

    workers: int
    tau: int
    nesterov: int | None
    average: int | None
    max_rounds: int

    @property
    def ratio(self) -> float | None:
        """nesterov / average; with one side short of the target, the bound the cap gives
        (an unreached side took more than `max_rounds`); None when neither reached it."""
        if self.nesterov is None and self.average is None:
            return None
        nesterov = self.nesterov if self.nesterov is not None else self.max_rounds + 1
        average = self.average if self.average is not None else self.max_rounds + 1
        return nesterov / average

    @property
    def met(self) -> bool:
        """Only a ratio that is surely within the goal counts: an unreached nesterov is not."""
        ratio = self.ratio
        return self.nesterov is not None and ratio is not None and ratio <= GOAL_RATIO

    def describe(self) -> str:
        def rounds(n: int | None) -> str:
            return str(n) if n is not None else f">{self.max_rounds}"

        ratio = self.ratio
        bound = "<=" if self.average is None else ">=" if self.nesterov is None else ""
        text = "n/a (neither reached it)" if ratio is None else f"{bound}{ratio:.2f}"
        return f"tau={self.tau}: {rounds(self.nesterov)}/{rounds(self.average)} = {text}"


def goal_pairs(outcomes: Sequence[Outcome], max_rounds: int) -> list[Pair]:
    """The (K, tau >= GOAL_TAU) settings of the goal's dataset that ran with both outers."""
    by_key = {
        (o.setting.dataset, o.setting.workers, o.setting.tau, o.setting.outer): o for o in outcomes
    }
    pairs = []
    for o in outcomes:
        s = o.setting
        if s.dataset != GOAL_DATASET or s.tau < GOAL_TAU or s.outer != "nesterov":
            continue
        avg = by_key.get((GOAL_DATASET, s.workers, s.tau, "average"))
        if avg is not None:
            pairs.append(Pair(s.workers, s.tau, o.rounds, avg.rounds, max_rounds))
    return pairs


def goal_notes(outcomes: Sequence[Outcome], max_rounds: int) -> list[str]:
    """The nesterov/average rounds ratio per K at tau >= GOAL_TAU on digits, and the verdict.
    A miss is said, never raised."""
    goal = (
        f"goal (nesterov reaches the {GOAL_DATASET} target in <= {GOAL_RATIO}x the rounds of "
        f"average at tau >= {GOAL_TAU})"
    )
    pairs = goal_pairs(outcomes, max_rounds)
    if not pairs:
        return [
            f"{goal}: not checked: this sweep has no {GOAL_DATASET} setting with tau >= "
            f"{GOAL_TAU} run with both outers"
        ]
    lines = []
    for k in sorted({p.workers for p in pairs}):
        mine = [p for p in pairs if p.workers == k]
        lines.append(
            f"{GOAL_DATASET} K={k}, rounds nesterov/average: "
            + "; ".join(p.describe() for p in mine)
        )
    met = [p for p in pairs if p.met]
    missed = [f"K={p.workers} tau={p.tau}" for p in pairs if not p.met]
    verdict = "MET" if not missed else "MISSED"
    lines.append(
        f"{goal}: {verdict}, met at {len(met)} of {len(pairs)} (K, tau) pairs"
        + (f"; not met at {', '.join(missed)}" if missed else "")
    )
    return lines


def plot(outcomes: Sequence[Outcome], path: Path) -> Path:
    """For each dataset, rounds and samples to the target against tau (log scale), one line
    per (K, outer): colour for K, solid `average` with dots, dashed `nesterov` with hollow
    squares. A setting that did not reach the target has no point: its line breaks there."""
    plt = pyplot()
    names = _unique(o.setting.dataset for o in outcomes)
    fig, axes = plt.subplots(
        len(names), 2, figsize=(11, 4 * len(names)), squeeze=False, constrained_layout=True
    )
    ks = sorted({o.setting.workers for o in outcomes})
    colours = plt.get_cmap("viridis")(np.linspace(0, 0.9, max(len(ks), 1)))
    for row, name in zip(axes, names, strict=True):
        mine = [o for o in outcomes if o.setting.dataset == name]
        for k, colour in zip(ks, colours, strict=True):
            for outer in _unique(o.setting.outer for o in mine):
                line = sorted(
                    (o for o in mine if o.setting.workers == k and o.setting.outer == outer),
                    key=lambda o: o.setting.tau,
                )
                if line:
                    _draw(row, line, colour, outer, f"K={k} {outer}")
        _axes(row, name, mine)
    fig.suptitle("convergence to the target (missing points: not reached)")
    return save_figure(fig, path)


def _axes(row, name: str, mine: Sequence[Outcome]) -> None:
    """Labels, tau's ticks, and log scales; a panel without a single reached setting says so
    (a log scale of no data cannot be drawn)."""
    from matplotlib import ticker  # lazy: matplotlib

    target = RECIPES[name].target
    taus = sorted({o.setting.tau for o in mine})
    reached = any(o.reached for o in mine)
    for ax, what in zip(row, ("rounds", "samples"), strict=True):
        ax.set(xscale="log", xlabel="tau (local steps per round)", title=f"{name}: {what}")
        ax.set_ylabel(f"{what} to {target:.2f} test accuracy")
        ax.set_xticks(taus, [str(t) for t in taus])
        ax.xaxis.set_minor_locator(ticker.NullLocator())
        if reached:
            ax.set_yscale("log")  # plain numbers at 1, 2, 5, 10, ...: rounds are counts
            ax.yaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
            ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _pos: f"{v:g}"))
            ax.yaxis.set_minor_locator(ticker.NullLocator())
        else:
            ax.text(0.5, 0.5, "no setting reached the target", transform=ax.transAxes,
                    ha="center", va="center")  # fmt: skip
    if reached:
        row[0].legend(fontsize="small", ncol=2)


def _draw(row, line: Sequence[Outcome], colour, outer: str, label: str) -> None:
    taus = [o.setting.tau for o in line]
    average = outer == "average"  # both outers often coincide: the hollow marks show through
    style = {
        "color": colour,
        "linestyle": "-" if average else "--",
        "marker": "o" if average else "s",
        "markerfacecolor": colour if average else "none",
        "markersize": 7 if average else 10,
    }
    rounds = [o.rounds if o.reached else math.nan for o in line]
    samples = [o.samples if o.reached else math.nan for o in line]
    row[0].plot(taus, rounds, label=label, **style)
    row[1].plot(taus, samples, label=label, **style)
