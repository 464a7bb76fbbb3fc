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
- sparknet: `sparknet.training.driver.train`, evaluated after every round (every tau steps);
- TorchDistributor and plain PyTorch: `sparknet.bench.distributor`, every `eval_every` steps.
Bytes on the wire are the lab's link counters (or loopback's) read before and after each run:
its start, its evaluations and its end included, as a user's network would carry them.
"""

from __future__ import annotations

import contextlib
import json
import math
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
#: steps between evaluations (sparknet's: rounds of tau steps, at least one)
EVAL_EVERY = 10
#: rounds a sparknet run is given at most; the budget ends it long before
MAX_ROUNDS = 100_000


@dataclass(frozen=True)
class Contender:
    """One way to train: `kind` in KINDS; sparknet's kinds with their tau and outer optimizer."""

    kind: str
    tau: int = 0
    outer: str = ""

    @property
    def label(self) -> str:
        if self.kind in ("allreduce", "spark"):
            return f"sparknet {self.kind} tau={self.tau} {self.outer}"
        return {"distributor": "TorchDistributor", "distributor-local": "TorchDistributor local",
                "plain": "plain PyTorch"}[self.kind]  # fmt: skip

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
    #: sparknet only: seconds of the round's exchange (allreduce) or broadcast and sum (spark)
    exchange_s: float | None = None


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


def run_sparknet(spark, spec: PeersSpec, dataset: str, c: Contender, run_dir: Path) -> dict:
    """One sparknet run: `budget_s` seconds of rounds (each round's `seconds.total`, its
    evaluation not included), evaluated after the first round past every EVAL_EVERY steps
    (every round at tau >= EVAL_EVERY), as often as the other contenders."""
    from sparknet.training.driver import train  # lazy: torch, pyspark, boto3

    recipe = RECIPES[dataset]
    cfg = TrainConfig(
        model=recipe.model, data=recipe.data, batch_size=spec.batch_size, lr=recipe.lr,
        momentum=recipe.momentum, workers=spec.workers, tau=c.tau, outer=c.outer,
        rounds=MAX_ROUNDS, eval_every=-(-EVAL_EVERY // c.tau), checkpoint_every=0,
        transport=c.kind,
        master=spec.master, seed=spec.seed, out=str(run_dir),
    )  # fmt: skip
    curve: list[tuple[float, int, float]] = []
    spent = {"train_s": 0.0, "samples": 0, "exchange_s": 0.0, "first": 0.0}
    started = time.perf_counter()

    def on_round(row: dict[str, Any]) -> None:
        if row["round"] == 1:  # the loop's start: the first row's arrival less its elapsed time
            spent["first"] = time.perf_counter() - started - row["elapsed_s"]
        seconds = row["seconds"]
        spent["train_s"] += seconds["total"]
        spent["samples"] += row["samples"]
        spent["exchange_s"] += seconds.get("exchange", seconds["broadcast"] + seconds["aggregate"])
        if "eval_accuracy" in row:
            curve.append((spent["train_s"], spent["samples"], row["eval_accuracy"]))
        if spent["train_s"] >= spec.budget_s:
            raise _Spent

    shutil.rmtree(run_dir, ignore_errors=True)
    with contextlib.suppress(_Spent):
        train(cfg, spark=spark, on_round=on_round)
    return {
        "samples": spent["samples"], "train_s": spent["train_s"], "setup_s": spent["first"],
        "curve": curve, "exchange_s": spent["exchange_s"],
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
        max_seconds=spec.budget_s, eval_every=EVAL_EVERY,
    )  # fmt: skip
    if c.kind == "plain":
        run = run_plain(peer)
    else:
        run = run_distributor(spark, peer, local_mode=c.kind == "distributor-local")
    return {
        "samples": run.samples, "train_s": run.train_s, "setup_s": run.setup_s,
        "curve": [tuple(p) for p in run.curve],
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
                    run_dir = Path(spec.runs_dir) / f"{dataset}-{c.kind}-{c.tau}-{c.outer}-{rep}"
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
