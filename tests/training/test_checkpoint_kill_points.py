"""A checkpoint write killed with SIGKILL at every one of its steps, on a local run dir and on S3
(moto's server): the newest checkpoint is always the one before it, whole, until the new one is
complete; a resume loads exactly the previous weights, inner states and outer momentum; and
`discard_incomplete` leaves nothing of the killed write behind.

The kill moments come from the write itself, not from wall time: one write is counted first
(each file-system call or S3 request that changes the run dir is a step), then a process is
killed just before step k, for every k. The writer forks from a process that imported torch
once (tests/training/checkpoint_writer.py), so each kill point costs a fork, not an import."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator

import pytest
import torch

from sparknet.data.store import Store, open_store
from sparknet.training import checkpoint
from tests.conftest import REPO
from tests.training import checkpoint_writer as writer

pytestmark = pytest.mark.integration


class Writer:
    """The forking writer process: `write(uri, kill_at)` is its answer for one request."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.training.checkpoint_writer"], cwd=REPO,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip

    def write(self, uri: str, kill_at: int | None) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"uri": uri, "kill_at": kill_at}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"the writer died (exit {self.proc.wait()})"
        return json.loads(line)

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        assert self.proc.wait(timeout=30) == 0


@pytest.fixture(scope="module")
def checkpoint_writer(moto_endpoint) -> Iterator[Writer]:
    """Started once moto's server is up: it reaches it through AWS_ENDPOINT_URL."""
    w = Writer()
    yield w
    w.close()


def _files(store: Store) -> set[str]:
    """Every object of the run dir; locally every file, hidden temp files too."""
    return set(store.walk(""))


def _assert_holds(store: Store, rounds: int) -> None:
    """The checkpoint after `rounds` loads exactly what the writer wrote for it."""
    ckpt = checkpoint.load(store, rounds, writer.LAYOUT)
    assert ckpt.rounds == rounds and ckpt.elapsed_s == float(rounds)
    assert ckpt.theta.tobytes() == writer.theta(rounds).tobytes()
    assert ckpt.outer_momentum is not None
    assert ckpt.outer_momentum.tobytes() == writer.momentum(rounds).tobytes()
    assert {k: v.tolist() for k, v in ckpt.integers.items()} == {
        k: v.tolist() for k, v in writer.integers(rounds).items()
    }
    for partition in range(writer.WORKERS):
        got = checkpoint.read_inner(store.uri, rounds, partition)
        want = writer.inner(rounds, partition)
        assert got is not None and got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want), (rounds, partition)


def _kill_every_step(checkpoint_writer: Writer, new_uri) -> list[int]:
    """Kill the write of round 2's checkpoint before each of its steps (and once not at all),
    each in a fresh run dir that holds round 1's; returns the rounds `latest` gave, in order."""
    counted = checkpoint_writer.write(new_uri(), None)
    steps = counted["steps"]
    assert counted["signal"] is None and steps >= writer.WORKERS + 3, counted
    seen = []
    for kill_at in [*range(1, steps + 1), None]:
        uri = new_uri()
        answer = checkpoint_writer.write(uri, kill_at)
        store = open_store(uri)
        if kill_at is not None:
            assert answer == {"steps": None, "signal": 9}, (kill_at, answer)
        whole = {f for f in _files(store) if f.startswith(checkpoint.name(1) + "/")}
        latest = checkpoint.latest(store)
        seen.append(latest)
        _assert_holds(store, 1)
        removed = checkpoint.discard_incomplete(store)
        if latest == 2:  # published: whole, and nothing of it is taken for a leftover
            assert removed == [], (kill_at, removed)
            _assert_holds(store, 2)
        else:
            assert latest == 1, (kill_at, latest)
            # the killed write's files are gone, round 1's are all there, nothing else is
            assert _files(store) == whole, (kill_at, _files(store) - whole)
            assert len(whole) == 4 + writer.WORKERS  # config, weights, outer, manifest, inner
    # the old one until the new one is complete, the new one from then on
    assert seen == sorted(seen) and seen[0] == 1 and seen[-1] == 2, seen
    return seen


def test_a_local_checkpoint_killed_at_any_step_leaves_the_previous_one_whole(
    checkpoint_writer, tmp_path
):
    def new_uri() -> str:
        return str(tmp_path / uuid.uuid4().hex[:8])

    seen = _kill_every_step(checkpoint_writer, new_uri)
    # a temp file written and renamed a file, the dirs made: many more steps than files; the
    # manifest's rename publishes it, and only the temp name's clean-up comes after it
    assert len(seen) > 20 and seen.count(2) == 2, seen


def test_an_s3_checkpoint_killed_at_any_step_leaves_the_previous_one_whole(
    checkpoint_writer, moto_endpoint, bucket
):
    def new_uri() -> str:
        return f"s3://{bucket}/runs/{uuid.uuid4().hex[:8]}"

    seen = _kill_every_step(checkpoint_writer, new_uri)
    # one PUT a file, the manifest's last: killed before any of them, round 1 is the newest
    assert seen == [1] * (4 + writer.WORKERS) + [2], seen
