"""The allreduce transport on a real local Spark (local[2,2]): what it adds to the contract of
test_algorithm (which runs for both transports): a rank that dies mid-stage, compression, where
`auto` picks it, and the runs it refuses."""

from __future__ import annotations

import filecmp
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from sparknet.config import TrainConfig
from sparknet.errors import SparknetError
from sparknet.training import driver
from sparknet.training.driver import train
from sparknet.training.report import read_metrics
from tests.helpers import assert_state_close, assert_state_equal, load_run_model
from tests.sockets import Listener, descendants, listeners

pytestmark = pytest.mark.integration

SETTINGS = dict(model="cnn", workers=2, tau=3, batch_size=16, momentum=0.9, seed=5, eval_every=2)


def _transport(run_dir: Path) -> str:
    return yaml.safe_load((run_dir / "config.yaml").read_text())["train"]["transport"]


def test_a_rank_that_dies_mid_stage_restarts_from_the_checkpoint(spark, tmp_path):
    """The drill kills worker 1's Python process in round 3; the stage runs again from the
    checkpoint after round 2 and the run ends with the very model of a run without the death."""
    clean = TrainConfig(
        out=tmp_path / "clean", transport="allreduce", rounds=5, checkpoint_every=2, **SETTINGS
    )
    train(clean, spark=spark)
    warned: list[str] = []
    drill = clean.model_copy(update={"out": str(tmp_path / "drill"), "fail_once": "2:1"})
    result = train(drill, spark=spark, on_warning=warned.append)
    assert [r["round"] for r in result.metrics] == [1, 2, 3, 4, 5]
    assert [r["round"] for r in read_metrics(tmp_path / "drill")] == [1, 2, 3, 4, 5]
    assert len(warned) == 1 and "running it again from round 2 (restart 1 of 3)" in warned[0]
    assert warned[0].startswith("the allreduce stage failed (a worker"), warned[0]  # in words
    assert_state_equal(load_run_model(tmp_path / "drill"), load_run_model(tmp_path / "clean"))
    assert filecmp.cmp(
        tmp_path / "clean/model.safetensors", tmp_path / "drill/model.safetensors", shallow=False
    )
    assert sorted(p.name for p in (tmp_path / "drill/checkpoints").iterdir()) == [
        "round-00002",
        "round-00004",
        "round-00005",
    ]
    assert all(r["inner_state_misses"] == 0 for r in result.metrics)


def test_both_transports_end_with_allclose_weights(spark, tmp_path):
    for transport in ("spark", "allreduce"):
        cfg = TrainConfig(out=tmp_path / transport, transport=transport, rounds=3, **SETTINGS)
        result = train(cfg, spark=spark)
        assert _transport(tmp_path / transport) == transport
        assert "eval_accuracy" in result.metrics[1]
    assert_state_close(
        load_run_model(tmp_path / "allreduce"), load_run_model(tmp_path / "spark"), rtol=1e-5
    )


def test_a_compressed_update_trains_close_to_the_full_one(spark, tmp_path):
    full = TrainConfig(out=tmp_path / "full", transport="allreduce", rounds=3, **SETTINGS)
    train(full, spark=spark)
    want = load_run_model(tmp_path / "full")
    for compress in ("bf16", "fp16"):
        small = full.model_copy(update={"out": str(tmp_path / compress), "compress": compress})
        train(small, spark=spark)
        got = load_run_model(tmp_path / compress)
        assert any(not (got[k] == want[k]).all() for k in want)  # it did travel compressed
        assert_state_close(got, want, rtol=0.05, atol=2e-3)


def test_a_buffer_that_forward_reassigns_is_averaged_too(spark, tmp_path):
    """Plain averaging all-reduces the weights in the buffer the model's tensors view; a
    forward() that reassigns a float buffer (`self.center = 0.9 * self.center + ...`) leaves
    that buffer with a new tensor, which must come back in: both transports agree."""
    for transport in ("spark", "allreduce"):
        settings = {**SETTINGS, "model": "tests.helpers:ema_net"}
        cfg = TrainConfig(out=tmp_path / transport, transport=transport, rounds=3, **settings)
        train(cfg, spark=spark)
    want = load_run_model(tmp_path / "spark")
    assert want["center"].abs().sum() > 0.5
    assert_state_close(load_run_model(tmp_path / "allreduce"), want)


def test_auto_is_spark_on_a_local_master(spark, tmp_path):
    cfg = TrainConfig(out=tmp_path / "auto", rounds=1, **SETTINGS)
    assert cfg.transport == "auto"
    train(cfg, spark=spark)
    assert _transport(tmp_path / "auto") == "spark"


@pytest.mark.parametrize(
    ("master", "ran", "fits", "chosen"),
    [
        ("local[2]", None, True, "spark"),
        ("local[2]", "spark", True, "spark"),
        ("local[2]", "allreduce", True, "allreduce"),  # a resume goes on bit for bit
        ("local[2]", "allreduce", False, "spark"),  # where it cannot run: the one that can
        ("spark://m:7077", None, True, "allreduce"),
        ("spark://m:7077", "spark", True, "allreduce"),  # moved to a cluster: the faster one
        ("spark://m:7077", "allreduce", False, "spark"),
    ],
)
def test_auto_chooses_from_the_master_and_the_transport_a_resume_ran_on(
    monkeypatch, master, ran, fits, chosen
):
    """The decision alone, on a stand-in session (a cluster master cannot run here): whether
    the stage fits is `_allreduce_refusal`'s, tested on real Spark beside this."""
    refusal = None if fits else SparknetError("2 task slot(s) for 3 workers")
    monkeypatch.setattr(driver, "_allreduce_refusal", lambda sc, cfg: refusal)
    session = SimpleNamespace(sparkContext=SimpleNamespace(master=master))
    cfg = driver._resolve_transport(TrainConfig(**SETTINGS), session, ran)
    assert cfg.transport == chosen
    given = TrainConfig(**{**SETTINGS, "transport": "spark"})
    assert driver._resolve_transport(given, session, "allreduce").transport == "spark"


def test_a_stage_that_does_not_fit_is_refused_before_training(spark, tmp_path):
    cfg = TrainConfig(
        out=tmp_path / "big", transport="allreduce", rounds=1, **{**SETTINGS, "workers": 3}
    )
    said: list[str] = []
    with pytest.raises(SparknetError, match=r"2 task slot\(s\) for 3 workers"):
        train(cfg, spark=spark, on_status=said.append)
    assert "starting Python workers" not in said  # refused before any job runs
    assert not (tmp_path / "big/model.safetensors").exists()
    assert not (tmp_path / "big/checkpoints").exists() or not any(
        (tmp_path / "big/checkpoints").iterdir()
    )


def test_rows_reach_the_driver_while_the_stage_runs_and_nothing_listens_everywhere(spark, tmp_path):
    """Progress is live: every round's row is handed to the driver's callback while the one
    barrier stage that runs all rounds is still a running Spark job. And while it runs, no
    socket of the job (the driver's JVM, its Python workers with rank 0's TCPStore and gloo,
    which have no authentication) listens on every interface."""
    tracker = spark.sparkContext.statusTracker()
    seen: list[tuple[int, bool]] = []
    jvm = spark.sparkContext._gateway.proc.pid
    during: list[Listener] = []

    def on_round(row: dict) -> None:
        seen.append((row["round"], bool(tracker.getActiveJobsIds())))
        if row["round"] == 2:
            during.extend(listeners(descendants(jvm)))

    cfg = TrainConfig(out=tmp_path / "live", transport="allreduce", rounds=4, **SETTINGS)
    train(cfg, spark=spark, on_round=on_round)
    assert seen == [(1, True), (2, True), (3, True), (4, True)]
    workers = {w.pid for w in during if w.pid != jvm}
    assert len(workers) >= 2, [str(w) for w in during]  # the ranks' store and gloo, seen
    assert not [str(w) for w in during if w.wildcard]
    rows = read_metrics(tmp_path / "live")
    assert all(r["seconds"]["exchange"] > 0 for r in rows)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ("tests.helpers:unhealable_digits", "differs from the manifest"),
        ("tests.helpers:refused_digits", "access denied"),
    ],
)
def test_a_fault_no_restart_can_heal_ends_the_run_at_once(spark, tmp_path, data, message):
    warned: list[str] = []
    cfg = TrainConfig(
        out=tmp_path / "bad", transport="allreduce", data=data, num_classes=10, rounds=3,
        **{**SETTINGS, "model": "mlp"},
    )  # fmt: skip
    with pytest.raises(SparknetError, match=message):
        train(cfg, spark=spark, on_warning=warned.append)
    assert warned == []  # not run again
    assert not (tmp_path / "bad/model.safetensors").exists()


def test_divergence_names_the_round_the_worker_and_the_last_good_checkpoint(spark, tmp_path):
    from tests.helpers import POISON

    warned: list[str] = []
    cfg = TrainConfig(
        out=tmp_path / "nan", transport="allreduce", data="tests.helpers:poisoned_digits",
        model="mlp", num_classes=10, rounds=5, checkpoint_every=2, eval_every=0,
        **{k: POISON[k] for k in ("seed", "workers", "batch_size", "tau")},
    )  # fmt: skip
    with pytest.raises(SparknetError) as caught:
        train(cfg, spark=spark, on_warning=warned.append)
    text = str(caught.value)
    assert text.startswith(f"training diverged at round {POISON['round']}, worker 1: loss nan")
    assert text.endswith(f"last good checkpoint: {tmp_path / 'nan'}/checkpoints/round-00002")
    assert warned == []


def _mean_rank(rank: int, port: int, got) -> None:
    """One rank of the test below: 2 plain gloo processes, pieces of at least 2 floats."""
    import torch
    import torch.distributed as dist

    from sparknet.training import compress

    compress._PIECE_MIN = 2
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        flat = torch.arange(10, dtype=torch.float32) * (rank + 1)
        out = compress.exchange_mean(flat, 2, "none", torch.device("cpu"))
        assert out is flat  # in place
        got.put((rank, flat.tolist()))
    finally:
        dist.destroy_process_group()


def test_the_mean_in_pieces_is_the_mean_of_the_whole_buffer():
    """10 floats in pieces of 3, 3, 3 and 1, each all-reduced on gloo's threads and divided as
    it arrives: every element is the exact mean, on both ranks."""
    import torch.multiprocessing as mp

    from sparknet.bench.gloo import _free_port

    got = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_mean_rank, args=(_free_port(), got), nprocs=2, start_method="spawn")
    means = dict(got.get() for _ in range(2))
    assert means[0] == means[1] == [1.5 * i for i in range(10)]
