"""TensorBoard event files: the scalars a run writes read back as TensorBoard reads them."""

from __future__ import annotations

from pathlib import Path

from pytest import approx
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from sparknet.training.events import EventLog


def row(n: int, loss: float, *, evaluated: bool = False) -> dict:
    """A metrics.jsonl row as the driver writes it (driver.py `_round_row` and `_eval_row`)."""
    out = {
        "round": n,
        "samples": 640,
        "loss": loss,
        "seconds": {"broadcast": 0.25 * n, "compute": 1.5, "aggregate": 0.125, "total": 2.0},
        "samples_per_s": 320.0 + n,
        "inner_state_misses": 0,
        "skipped_samples": 0,
        "elapsed_s": 2.0 * n,
    }
    if evaluated:
        out.update(eval_loss=loss / 2, eval_accuracy=0.5 + n / 100, eval_top5=0.9, eval_samples=360)
    return out


def read(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag in the dir, as (step, value) pairs in step order."""
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_rows_read_back_as_tensorboard_scalars(tmp_path):
    with EventLog(tmp_path / "tb", inner_lr=0.05, outer_lr=0.7) as log:
        log.round(row(1, 2.25))
        log.round(row(2, 1.5, evaluated=True))
        log.round({**row(3, 1.0), "lr": 0.025})  # a row's own lr wins over the constructor's
    assert log.path.parent == tmp_path / "tb" and log.path.stat().st_size > 0

    s = read(tmp_path / "tb")
    assert s["train/loss"] == [(1, 2.25), (2, 1.5), (3, 1.0)]
    assert s["eval/loss"] == [(2, 0.75)]
    assert s["eval/accuracy"] == [(2, approx(0.52))]
    assert s["eval/top5"] == [(2, approx(0.9))]
    assert s["throughput/samples_per_s"] == [(1, 321.0), (2, 322.0), (3, 323.0)]
    assert s["time/broadcast_s"] == [(1, 0.25), (2, 0.5), (3, 0.75)]
    for phase, value in (("compute", 1.5), ("aggregate", 0.125), ("total", 2.0)):
        assert s[f"time/{phase}_s"] == [(1, value), (2, value), (3, value)]
    assert s["lr/inner"] == [(1, approx(0.05)), (2, approx(0.05)), (3, approx(0.025))]
    assert s["lr/outer"] == [(n, approx(0.7)) for n in (1, 2, 3)]
    assert s["train/inner_state_misses"] == [(1, 0.0), (2, 0.0), (3, 0.0)]


def test_each_round_is_on_disk_before_close(tmp_path):
    """The driver copies the file to an S3 run dir after every round, while the log is open."""
    log = EventLog(tmp_path, purge_step=1)
    try:
        log.round(row(1, 2.0))
        assert read(tmp_path)["train/loss"] == [(1, 2.0)]
        log.round(row(2, 1.0))
        assert read(tmp_path)["train/loss"] == [(1, 2.0), (2, 1.0)]
    finally:
        log.close()


def test_without_learning_rates_no_lr_tags(tmp_path):
    with EventLog(tmp_path) as log:
        log.round(row(1, 2.0))
    assert not [tag for tag in read(tmp_path) if tag.startswith("lr/")]


def test_a_resume_drops_the_rolled_back_rounds(tmp_path):
    """A run wrote rounds 1-5, was killed, and resumes from its round-3 checkpoint: rounds 4-5
    run again with other numbers, and TensorBoard shows each round once, the resumed value."""
    with EventLog(tmp_path, purge_step=1) as first:
        for n in range(1, 6):
            first.round(row(n, 10.0 + n, evaluated=n % 2 == 0))
    with EventLog(tmp_path, purge_step=4) as resumed:
        for n in range(4, 8):
            resumed.round(row(n, 20.0 + n, evaluated=n % 2 == 0))

    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 2
    s = read(tmp_path)
    assert s["train/loss"] == [(1, 11.0), (2, 12.0), (3, 13.0), (4, 24.0), (5, 25.0), (6, 26.0),
                               (7, 27.0)]  # fmt: skip
    assert s["eval/loss"] == [(2, 6.0), (4, 12.0), (6, 13.0)]


def test_a_replay_drops_the_rounds_it_runs_again_in_the_same_file(tmp_path):
    """A replay from the round-2 checkpoint within one run: rounds 3-4 are written again into
    the open file, and TensorBoard shows each round once, the replayed value."""
    with EventLog(tmp_path, purge_step=1) as log:
        for n in range(1, 5):
            log.round(row(n, 10.0 + n))
        log.purge(3)
        for n in range(3, 6):
            log.round(row(n, 20.0 + n))

    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 1
    assert read(tmp_path)["train/loss"] == [(1, 11.0), (2, 12.0), (3, 23.0), (4, 24.0), (5, 25.0)]


def test_a_future_stamped_event_file_delays_a_new_log_at_most_a_second(tmp_path):
    """A stray file stamped an hour ahead (clock skew) must not stall the run for that hour."""
    import time

    import torch.utils.tensorboard  # noqa: F401  (imported before the clock starts)

    (tmp_path / f"events.out.tfevents.{int(time.time()) + 3600}.host.1.0").touch()
    t0 = time.monotonic()
    EventLog(tmp_path).close()
    assert time.monotonic() - t0 < 3.0
