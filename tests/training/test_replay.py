"""The `spark` transport replays the rounds since the last checkpoint when a partition found no
inner optimizer state (its executor lost), so the run ends with the weights of a run without the
loss. Real local Spark (local[2,2]): a lost executor is stood in for by deleting partition 1's
executor-local state files between rounds, what a lost executor takes with it (the standalone
cluster's real SIGKILL is test_standalone.py's)."""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from pyspark import SparkFiles
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from sparknet.config import TrainConfig, load_train_config
from sparknet.errors import SparknetError
from sparknet.training.driver import train
from sparknet.training.report import START_UP, read_metrics
from sparknet.training.rundir import read_run_config
from tests.helpers import weights_hash

pytestmark = pytest.mark.integration

#: momentum SGD: a fresh inner optimizer changes the weights
SMALL = {
    "model": "mlp", "workers": 2, "tau": 1, "batch_size": 8, "eval_every": 0, "momentum": 0.9,
    "transport": "spark", "inner_state": "keep",
}  # fmt: skip


def lose_partition_1(after: int, times: int = 1) -> Callable[[dict], None]:
    """An on_round that deletes partition 1's executor-local inner states after round `after`,
    the first `times` times that round ends."""
    left = [times]

    def on_round(row: dict) -> None:
        if row["round"] == after and left[0] > 0:
            left[0] -= 1
            files = list(Path(SparkFiles.getRootDirectory()).rglob("sparknet-inner/*/p00001-*"))
            assert files
            for path in files:
                path.unlink()

    return on_round


def scalars(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    """A tag's (step, value) pairs as TensorBoard reads the run dir's event files."""
    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


@pytest.fixture(scope="module")
def undisturbed(spark, tmp_path_factory) -> str:
    """The weights hash of 5 rounds without a loss (checkpoints do not change the weights)."""
    out = tmp_path_factory.mktemp("replay") / "undisturbed"
    train(TrainConfig(rounds=5, checkpoint_every=0, out=out, **SMALL), spark=spark)
    return weights_hash(out)


@pytest.mark.parametrize(
    ("checkpoint_every", "after", "replayed"),
    [
        (0, 2, "rounds 1-3 again from the start (no checkpoint yet)"),
        (2, 3, "rounds 3-4 again from checkpoint checkpoints/round-00002"),
    ],
)
def test_a_lost_inner_state_is_replayed_and_the_run_ends_exact(
    spark, tmp_path, undisturbed, checkpoint_every, after, replayed
):
    """Partition 1's state is lost after round `after`: round `after` + 1 misses and is not
    stepped with; the rounds since the last checkpoint run again. One warning; every round's
    row once in metrics.jsonl and once in TensorBoard's curves; the undisturbed run's bits."""
    out = tmp_path / "run"
    cfg = TrainConfig(rounds=5, checkpoint_every=checkpoint_every, out=out, **SMALL)
    warned: list[str] = []
    result = train(cfg, spark=spark, on_round=lose_partition_1(after), on_warning=warned.append)
    assert warned == [
        f"round {after + 1}: partition 1 found no inner optimizer state (an executor was lost "
        f"or the partition moved); running {replayed}, so that the run ends as without the "
        "loss (replay 1 of at most 3)"
    ]
    rows = read_metrics(out)
    assert [r["round"] for r in rows] == [1, 2, 3, 4, 5] == [r["round"] for r in result.metrics]
    assert [r["inner_state_misses"] for r in rows] == [0] * 5
    # the run's first round and the replay's first hold a start-up (new Python workers)
    first_replayed = int(re.search(r"rounds (\d+)-", replayed).group(1))
    assert [r["round"] for r in rows if r.get(START_UP)] == sorted({1, first_replayed})
    assert scalars(out, "train/loss") == [(r["round"], pytest.approx(r["loss"])) for r in rows]
    assert weights_hash(out) == undisturbed


def test_a_miss_no_replay_can_mend_is_counted_and_said_once(spark, tmp_path):
    """A resume whose checkpoint lacks partition 1's state: its first round misses there, and
    replaying would miss again (counted, one warning that the run is no longer exact). A loss
    after it replays from that same checkpoint: the first round misses again, unwarned, and the
    run ends as the same resume without the loss."""
    out = tmp_path / "run"
    train(TrainConfig(rounds=2, checkpoint_every=2, out=out, **SMALL), spark=spark)
    (out / "checkpoints" / "round-00002" / "inner" / "partition-00001.pt").unlink()
    shutil.copytree(out, tmp_path / "undisturbed")
    resumed = load_train_config(base=read_run_config(out), flags={"rounds": 4}, environ={})

    warned: list[str] = []
    train(resumed, resume=True, spark=spark, on_round=lose_partition_1(3),
          on_warning=warned.append)  # fmt: skip
    assert warned == [
        "round 3: partition 1 found no usable inner optimizer state in the checkpoint the round "
        "starts from and started a fresh optimizer, so the run is no longer exact; counted in "
        "metrics.jsonl",
        "round 4: partition 1 found no inner optimizer state (an executor was lost or the "
        "partition moved); running rounds 3-4 again from checkpoint checkpoints/round-00002, so "
        "that the run ends as without the loss (replay 1 of at most 3)",
    ]
    rows = read_metrics(out)
    assert [(r["round"], r["inner_state_misses"]) for r in rows] == [(1, 0), (2, 0), (3, 1), (4, 0)]
    reference = resumed.model_copy(update={"out": str(tmp_path / "undisturbed")})
    train(reference, resume=True, spark=spark, on_warning=lambda _line: None)
    assert weights_hash(out) == weights_hash(tmp_path / "undisturbed")


def test_replays_are_bounded_and_then_the_run_fails_in_one_line(spark, tmp_path):
    out = tmp_path / "run"
    cfg = TrainConfig(rounds=4, checkpoint_every=0, out=out, **SMALL)
    warned: list[str] = []
    with pytest.raises(SparknetError) as exc:
        train(cfg, spark=spark, on_round=lose_partition_1(2, times=10), on_warning=warned.append)
    assert str(exc.value) == (
        "round 3: partitions still found no inner optimizer state after 3 replays from the "
        "start (no checkpoint yet): executors keep being lost; run it again once the cluster "
        "keeps its executors, or train with --inner-state reset"
    )
    assert [w.split(";")[0] for w in warned] == [
        "round 3: partition 1 found no inner optimizer state (an executor was lost or the "
        "partition moved)"
    ] * 3
    assert [r["round"] for r in read_metrics(out)] == [1, 2]
    ckpts = out / "checkpoints"
    assert not ckpts.exists() or not any(ckpts.iterdir())  # none half-written left
