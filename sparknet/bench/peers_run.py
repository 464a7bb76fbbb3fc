"""The driver side of `sparknet bench peers` for one link.

Every contender, one after another, on one Spark session, each run's figures appended to a
JSON-lines file as it ends.

It runs as a process of its own (`python -m sparknet.bench.peers_run SPEC RESULTS`), started by
`peers` inside the lab's first namespace, so that the driver reaches the executors over a shaped
link as a cluster's driver would; without namespaces it runs on this machine's loopback.

The lab's namespaces share this machine's disk, so a run dir here is one every node sees.
Every contender trains the same model on the same data with the same K, batch,
threads, inner optimizer and seed (`PeersSpec`), for the same seconds of training (`budget_s`,
evaluations excluded), evaluated on the whole test set as it goes:
- sparknet: `sparknet.training.driver.train`, evaluated after the first round past every
  recipe's `eval_steps` steps (every round at tau >= those, and under tau auto): its averaged
  model exists only at a round's end;
- TorchDistributor and plain PyTorch: `sparknet.bench.distributor`, every `eval_steps` steps, or
  sooner where those take more than EVAL_S seconds of training (a large model on a slow link:
  seconds a step), so that a time to the target is known to within EVAL_S.
Bytes on the wire are the lab's link counters (or loopback's) read before and after each run:
its start, its evaluations and its end included, as a user's network would carry them.

Seconds waiting on the network, per run (`Outcome.wait_s`; the notes of `peers` say the same):
- sparknet `allreduce`: the rows' `seconds.exchange`, rank 0's wait for the mean of the updates
  (under overlap only what compute did not hide); `spark`: `seconds.broadcast` + `aggregate`,
  the weights sent out and the updates summed through Spark (its scheduling included, and the
  round's first batch, which the rows count with the weights' load: an over-estimate);
- TorchDistributor: DDP's own runtime statistics of rank 0, per step the all-reduce's end less
  the end of the backward's compute: the all-reduce time the backward did not hide;
- plain PyTorch: none.
`busy_s` is how long the exchange had the link: sparknet's blocking exchange its wait, under
overlap its whole training time (the exchange runs behind compute: an upper bound), both from
round 2 on, with `busy_bytes` the bytes the links carried meanwhile (round 1 carries the run's
start: the weights sent out, Spark's tasks); DDP's the all-reduces from the first bucket's
launch to the last one's end, each step (with the run's `wire_bytes`: the start is one
all-reduce's worth).
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from sparknet.bench.convergence import RECIPES
from sparknet.bench.links import link_bytes
from sparknet.config import TrainConfig

# `# lazy: X` below: the runner starts in each namespace without torch or Spark; each is
# imported by the contender that uses it

#: what `--contenders` takes: sparknet's two transports, TorchDistributor's two modes, plain
KINDS = ("allreduce", "spark", "distributor", "distributor-local", "plain")
#: what a variant's `compress` may be: the allreduce transport's formats but `none`
COMPRESS = ("bf16", "fp16", "int8", "int4")
#: TorchDistributor's and plain's evaluations: at most this many seconds of training apart
EVAL_S = 2.0
#: rounds a sparknet run is given at most; the budget ends it long before
MAX_ROUNDS = 100_000


@dataclass(frozen=True)
class Variant:
    """The allreduce transport's slow-link settings a contender runs with (all off: `none`),
    written as `bench peers` takes them: `int8+overlap+frag4`."""

    compress: str = "none"
    overlap: bool = False
    fragments: int = 1

    def __post_init__(self) -> None:
        if self.compress != "none" and self.compress not in COMPRESS:
            raise ValueError(f"compress is none or one of {', '.join(COMPRESS)}: {self.compress}")
        if self.fragments < 1:
            raise ValueError(f"fragments must be at least 1, got {self.fragments}")

    @property
    def words(self) -> list[str]:
        """What a label shows: nothing for `none`."""
        words = [] if self.compress == "none" else [self.compress]
        words += ["overlap"] if self.overlap else []
        return words + ([f"frag{self.fragments}"] if self.fragments > 1 else [])

    @property
    def name(self) -> str:
        return "+".join(self.words) or "none"

    @staticmethod
    def parse(text: str) -> Variant:
        """`none`, or `+`-joined terms, each once: a format of COMPRESS, `overlap`, `fragN`
        (N >= 2). ValueError, saying what is wrong, for anything else."""
        terms = [t.strip() for t in text.split("+")]
        if terms == ["none"]:
            return Variant()
        fields: dict[str, Any] = {}
        for term in terms:
            frag = re.fullmatch(r"frag(\d+)", term)
            key: str
            value: Any
            if term in COMPRESS:
                key, value = "compress", term
            elif term == "overlap":
                key, value = "overlap", True
            elif frag and int(frag.group(1)) >= 2:
                key, value = "fragments", int(frag.group(1))
            else:
                raise ValueError(
                    f"{term!r} is none of {', '.join(COMPRESS)}, overlap, fragN (N >= 2)"
                )
            if key in fields:
                raise ValueError(f"{text!r} sets {key} twice")
            fields[key] = value
        return Variant(**fields)


@dataclass(frozen=True)
class Contender:
    """One way to train: `kind` in KINDS; sparknet's kinds with their tau (a number of steps,
    or `auto`) and outer optimizer, `allreduce` with its slow-link settings (`Variant`)."""

    kind: str
    tau: int | str = 0
    outer: str = ""
    compress: str = "none"
    overlap: bool = False
    fragments: int = 1

    def __post_init__(self) -> None:
        if self.kind != "allreduce" and self.variant != Variant():
            raise ValueError(f"{self.variant.name} is the allreduce transport's, not {self.kind}'s")

    @property
    def variant(self) -> Variant:
        return Variant(self.compress, self.overlap, self.fragments)

    @property
    def label(self) -> str:
        if self.sparknet:
            return " ".join(
                ["sparknet", self.kind, f"tau={self.tau}", self.outer, *self.variant.words]
            )
        return {"distributor": "TorchDistributor", "distributor-local": "TorchDistributor local",
                "plain": "plain PyTorch"}[self.kind]  # fmt: skip

    @property
    def slug(self) -> str:
        """Its run dir's name (with the dataset's and repetition's around it)."""
        return "-".join(
            str(p) for p in (self.kind, self.tau, self.outer, *self.variant.words) if p != ""
        )

    @property
    def sparknet(self) -> bool:
        return self.kind in ("allreduce", "spark")


@dataclass(frozen=True)
class Settings:
    """What every link runs: the datasets, the contenders and what they all share."""

    datasets: list[str]
    contenders: list[Contender]
    workers: int
    threads: int
    batch_size: int
    budget_s: float
    reps: int
    seed: int

    def settings(self) -> dict[str, Any]:
        """These fields alone (of a subclass too), to make another subclass from."""
        return {f.name: getattr(self, f.name) for f in fields(Settings)}


@dataclass(frozen=True)
class PeersSpec(Settings):
    """What the child process runs: the settings, on one link's master."""

    link: str
    master: str
    runs_dir: str
    #: (pid of a root-namespace process, host-side veths) for the lab's counters; None: loopback
    counters: tuple[int, list[str]] | None = None

    def dump(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self)))

    @staticmethod
    def load(path: Path) -> PeersSpec:
        doc = json.loads(path.read_text())
        doc["contenders"] = [Contender(**c) for c in doc["contenders"]]
        if doc["counters"] is not None:
            doc["counters"] = (doc["counters"][0], doc["counters"][1])
        return PeersSpec(**doc)


@dataclass
class Outcome:
    """One contender's run on one dataset: what `peers` tabulates and plots."""

    link: str
    dataset: str
    contender: str
    kind: str
    rep: int
    samples: int
    train_s: float
    setup_s: float
    wall_s: float
    wire_bytes: int
    #: (train seconds, samples, test accuracy) at every evaluation
    curve: list[tuple[float, int, float]] = field(default_factory=list)
    #: seconds of training spent waiting on the network (what, per kind: the module's docstring);
    #: None where it could not be measured
    wait_s: float | None = None
    #: seconds the exchange had the link (the module's docstring); None where unknown
    busy_s: float | None = None
    #: sparknet: bytes the links carried from round 2 on (None: `wire_bytes` stands for them)
    busy_bytes: int | None = None
    #: what `busy_s` is: the exchange's time, or under overlap the training's
    busy_what: str = "exchange"
    #: sparknet under tau auto: the tau of its last round
    tau_last: int | None = None


def wire_bytes(counters: tuple[int, list[str]] | None) -> int:
    """Bytes sent between the nodes so far: every frame enters the bridge once and leaves it
    once, so half of the host-side veths' rx + tx; on loopback, what `lo` sent."""
    if counters is not None:
        return link_bytes(*counters) // 2
    for line in Path("/proc/net/dev").read_text().splitlines()[2:]:
        name, _, numbers = line.partition(":")
        if name.strip() == "lo":
            return int(numbers.split()[8])  # transmit bytes
    return 0


class _Spent(Exception):
    """Raised from `on_round` once a sparknet run has trained its budget."""


def eval_rounds(tau: int | str, steps: int) -> int:
    """Rounds between a sparknet run's evaluations: the first round past every `steps` steps;
    every round under tau auto (its rounds are as long as it makes them)."""
    return 1 if tau == "auto" else -(-steps // int(tau))


def run_sparknet(spark, spec: PeersSpec, dataset: str, c: Contender, run_dir: Path) -> dict:
    """One sparknet run: `budget_s` seconds of rounds (each round's `seconds.total`, its
    evaluation not included), evaluated every `eval_rounds`."""
    from sparknet.training.driver import train  # lazy: torch, pyspark, boto3

    recipe = RECIPES[dataset]
    cfg = TrainConfig(
        model=recipe.model, data=recipe.data, batch_size=spec.batch_size, lr=recipe.lr,
        momentum=recipe.momentum, workers=spec.workers, tau=c.tau, outer=c.outer,
        rounds=MAX_ROUNDS, eval_every=eval_rounds(c.tau, recipe.eval_steps), checkpoint_every=0,
        transport=c.kind, compress=c.compress, overlap=c.overlap, fragments=c.fragments,
        master=spec.master, seed=spec.seed, out=str(run_dir),
    )  # fmt: skip
    curve: list[tuple[float, int, float]] = []
    spent: dict[str, Any] = {"train_s": 0.0, "samples": 0, "wait_s": 0.0, "first": 0.0}
    mark: dict[str, Any] = {}  # the links' bytes, the wait and training seconds after round 1
    started = time.perf_counter()

    def on_round(row: dict[str, Any]) -> None:
        if row["round"] == 1:  # the loop's start: the first row's arrival less its elapsed time
            spent["first"] = time.perf_counter() - started - row["elapsed_s"]
        seconds = row["seconds"]
        spent["train_s"] += seconds["total"]
        spent["samples"] += row["samples"]
        spent["wait_s"] += seconds.get("exchange", seconds["broadcast"] + seconds["aggregate"])
        spent["tau"] = row.get("tau")
        spent["bytes"] = wire_bytes(spec.counters)
        if row["round"] == 1:
            mark.update(spent)
        if "eval_accuracy" in row:
            curve.append((spent["train_s"], spent["samples"], row["eval_accuracy"]))
        if spent["train_s"] >= spec.budget_s:
            raise _Spent

    shutil.rmtree(run_dir, ignore_errors=True)
    with contextlib.suppress(_Spent):
        train(cfg, spark=spark, on_round=on_round)
    busy = "train_s" if c.overlap else "wait_s"
    return {
        "samples": spent["samples"], "train_s": spent["train_s"], "setup_s": spent["first"],
        "curve": curve, "wait_s": spent["wait_s"],
        "busy_s": spent[busy] - mark[busy] if mark else None,
        "busy_bytes": spent["bytes"] - mark["bytes"] if mark else None,
        "busy_what": "training" if c.overlap else "exchange",
        "tau_last": spent.get("tau") if c.tau == "auto" else None,
    }  # fmt: skip


def run_peer(spark, spec: PeersSpec, dataset: str, c: Contender) -> dict:
    """One TorchDistributor or plain PyTorch run of `budget_s` seconds of training."""
    # lazy: torch, boto3
    from sparknet.bench.distributor import PeerSpec, run_distributor, run_plain

    recipe = RECIPES[dataset]
    peer = PeerSpec(
        data=recipe.data, model=recipe.model, workers=1 if c.kind == "plain" else spec.workers,
        batch_size=spec.batch_size, lr=recipe.lr, momentum=recipe.momentum,
        threads=spec.threads, seed=spec.seed, target=math.inf, max_steps=10**9,
        max_seconds=spec.budget_s, eval_every=recipe.eval_steps, eval_s=EVAL_S,
    )  # fmt: skip
    if c.kind == "plain":
        run = run_plain(peer)
    else:
        run = run_distributor(spark, peer, local_mode=c.kind == "distributor-local")
    return {
        "samples": run.samples, "train_s": run.train_s, "setup_s": run.setup_s,
        "curve": [tuple(p) for p in run.curve],
        "wait_s": 0.0 if c.kind == "plain" else run.wait_s,
        "busy_s": None if c.kind == "plain" else run.busy_s,
    }  # fmt: skip


def order(contenders: list[Contender], rep: int) -> list[Contender]:
    """Repetition `rep`'s order: rotated by one each time, so no contender always runs first
    (on a machine whose speed drifts, the first and last runs of a sweep see different ones)."""
    k = rep % len(contenders)
    return contenders[k:] + contenders[:k]


def warm_up(spark, spec: PeersSpec, dataset: str) -> None:
    """One sparknet round on `dataset`, not measured, before each sparknet run: it starts
    Spark's Python workers (torch imported, the data loaded into each) where none is idle, which
    would otherwise land in the run's first round: after the first run, and after a barrier
    stage ended by its budget (its cancelled tasks' Python workers are not reused): ~10-25 s
    measured. About a second when they are up."""
    from sparknet.training.driver import train  # lazy: torch, pyspark, boto3

    recipe = RECIPES[dataset]
    run_dir = Path(spec.runs_dir) / f"warm-up-{dataset}"
    shutil.rmtree(run_dir, ignore_errors=True)
    cfg = TrainConfig(
        model=recipe.model, data=recipe.data, batch_size=spec.batch_size, workers=spec.workers,
        tau=1, rounds=1, eval_every=1, checkpoint_every=0, transport="spark",
        master=spec.master, out=str(run_dir),
    )  # fmt: skip
    train(cfg, spark=spark)


def main(spec_path: str, results_path: str) -> None:
    from sparknet.training.session import start_session, stop_quietly  # lazy: pyspark

    spec = PeersSpec.load(Path(spec_path))
    results = Path(results_path)
    # a task takes a worker's every core: one rank per worker, as on a cluster of K machines
    spark = start_session(spec.master, spec.workers, {"spark.task.cpus": str(spec.threads)})
    try:
        for dataset in spec.datasets:
            for rep in range(spec.reps):
                for c in order(spec.contenders, rep):
                    run_dir = Path(spec.runs_dir) / f"{dataset}-{c.slug}-{rep}"
                    if c.sparknet:
                        warm_up(spark, spec, dataset)
                    before, t0 = wire_bytes(spec.counters), time.perf_counter()
                    if c.sparknet:
                        got = run_sparknet(spark, spec, dataset, c, run_dir)
                    else:
                        got = run_peer(spark, spec, dataset, c)
                    wall_s = time.perf_counter() - t0
                    outcome = Outcome(
                        link=spec.link, dataset=dataset, contender=c.label, kind=c.kind, rep=rep,
                        wall_s=wall_s, wire_bytes=wire_bytes(spec.counters) - before, **got,
                    )  # fmt: skip
                    with results.open("a") as fh:
                        fh.write(json.dumps(asdict(outcome)) + "\n")
    finally:
        stop_quietly(spark)


if __name__ == "__main__":
    main(*sys.argv[1:3])
