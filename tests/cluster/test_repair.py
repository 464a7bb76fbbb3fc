"""The repair watch's decisions, with its checks replaced (the real checks and repairs run
against moto and loopback nodes in test_cluster_bootstrap.py and test_submit_detach.py): what
it says, and that an interrupt during a repair is an interrupt, not a failed repair."""

from __future__ import annotations

import pytest

from sparknet.cluster import records, registry, repair
from sparknet.cluster.spec import ClusterSpec
from sparknet.errors import SparknetError

SPEC = ClusterSpec(name="w1")


@pytest.fixture
def said(monkeypatch, tmp_path) -> list[str]:
    monkeypatch.setenv(registry.HOME_ENV, str(tmp_path))  # no registered clusters
    return []


def _watch(monkeypatch, said: list[str], found: repair.Losses, repair_fn=None) -> repair.Watch:
    monkeypatch.setattr(repair, "losses", lambda spec, endpoint_url=None: found)
    monkeypatch.setattr(repair, "repair", repair_fn or (lambda *a, **k: said.append("REPAIR")))
    return repair.Watch(SPEC, say=said.append, every_s=0)


def test_a_loss_is_repaired_and_said(monkeypatch, said) -> None:
    watch = _watch(monkeypatch, said, repair.Losses(False, ("worker i-1 is terminated",)))
    watch()
    assert said == [
        "cluster w1 lost worker i-1 is terminated: repairing", "REPAIR",
        "cluster w1 repaired; the job goes on",
    ]  # fmt: skip


def test_an_interrupt_during_the_repair_is_an_interrupt(monkeypatch, said) -> None:
    def interrupted(*_a, **_k):
        raise records.Interrupted("interrupted during the bootstrap; ...")

    watch = _watch(monkeypatch, said, repair.Losses(False, ("x",)), interrupted)
    with pytest.raises(KeyboardInterrupt):
        watch()

    def failed(*_a, **_k):
        raise SparknetError("worker-1: spark-worker failed\nmore")

    _watch(monkeypatch, said, repair.Losses(False, ("x",)), failed)()
    assert said[-1] == (
        "cluster w1: check or repair failed (worker-1: spark-worker failed); the job goes on"
    )


def test_a_lost_master_and_unreadable_notices_are_said_once(monkeypatch, said) -> None:
    found = repair.Losses(True, ("the master does not answer (refused)",))
    watch = _watch(monkeypatch, said, found)
    watch()
    watch()
    assert said == ["cluster w1: the master does not answer (refused); nothing to repair"]
    said.clear()
    found = repair.Losses(False, (), unchecked=("worker-2 (SSH failed)",))
    watch = _watch(monkeypatch, said, found)
    watch()
    watch()
    assert said == ["cluster w1: no spot notice can be read of worker-2 (SSH failed)"]


def test_the_check_waits_its_interval(monkeypatch, said) -> None:
    monkeypatch.setattr(repair, "losses", lambda spec, endpoint_url=None: said.append("CHECK"))
    repair.Watch(SPEC, say=said.append, every_s=3600)()
    assert said == []
