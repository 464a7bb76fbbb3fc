"""A process that writes checkpoints as a run does and is killed at a chosen step of a write:
what tests/training/test_checkpoint_kill_points.py drives.

Run as `python -m tests.training.checkpoint_writer`: it imports torch once, then for each JSON
line on stdin ({"uri": run dir, "kill_at": k or null}) forks a child that writes a complete
checkpoint after round 1, then the checkpoint after round 2 as the round loops do (`begin`, each
worker's inner state, `write`), counting the write's steps from its first: with `kill_at` k the
child SIGKILLs itself just before step k (nothing of Python's clean-up runs). It answers one
JSON line per request: {"steps": the steps the write took, or null when killed, "signal": the
signal that ended the child, or null}.

A step is one store operation, counted below the product's code: on a local run dir every
file-system call that changes something under it (an open for writing, a rename, a mkdir, a
removal), seen through a Python audit hook; on S3 every request the S3 client sends (botocore's
`before-send` event). The product has no hook of its own for this.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import traceback

import numpy as np
import torch

from sparknet.data import s3
from sparknet.data.store import open_store
from sparknet.training import checkpoint
from sparknet.training.state import StateLayout

WORKERS = 2
#: a small model's state: parameters, a float buffer, an integer buffer
_STATE = {
    "fc.weight": torch.zeros(4, 3),
    "fc.bias": torch.zeros(4),
    "bn.running_mean": torch.zeros(4),
    "bn.num_batches_tracked": torch.zeros((), dtype=torch.int64),
}
LAYOUT = StateLayout.of(_STATE, {"fc.weight", "fc.bias"})
CONFIG = "model: mlp\n"


def theta(rounds: int) -> np.ndarray:
    """The global weights after `rounds` rounds."""
    return np.random.default_rng(rounds).standard_normal(LAYOUT.size).astype(np.float32)


def integers(rounds: int) -> dict[str, np.ndarray]:
    return {"bn.num_batches_tracked": np.array(rounds, dtype=np.int64)}


def momentum(rounds: int) -> np.ndarray:
    return np.full(LAYOUT.size, rounds / 10, dtype=np.float32)


def inner(rounds: int, partition: int) -> dict:
    """Worker `partition`'s inner optimizer state after `rounds` rounds."""
    return {"step": torch.tensor(rounds), "buf": torch.arange(6.0) * rounds + partition}


def write(uri: str, rounds: int) -> None:
    """The checkpoint after `rounds`, written as a round loop and its workers write it."""
    store = open_store(uri)
    stage = checkpoint.begin(store, rounds)
    for partition in range(WORKERS):
        checkpoint.write_inner(stage, partition, inner(rounds, partition))
    checkpoint.write(
        store, rounds, LAYOUT, theta(rounds), integers(rounds), momentum(rounds),
        float(rounds), CONFIG,
    )  # fmt: skip


class Steps:
    """Counts the write's steps; SIGKILLs the process just before step `kill_at`."""

    def __init__(self, kill_at: int | None) -> None:
        self.kill_at = kill_at
        self.count = 0

    def step(self) -> None:
        self.count += 1
        if self.count == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)


#: audit events of a call that changes the file system (os.replace raises "os.rename")
_CHANGES = {"os.rename", "os.mkdir", "os.remove", "os.rmdir", "shutil.rmtree"}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def _writes(event: str, args: tuple) -> str | None:
    """The path a file-system call changes, or None when it changes nothing."""
    if event == "open":
        path, mode, flags = args
        if mode is not None and not set(mode) & set("wax+"):
            return None
        if mode is None and not (flags or 0) & _WRITE_FLAGS:
            return None
    elif event not in _CHANGES:
        return None
    path = args[0]
    return os.fsdecode(path) if isinstance(path, str | bytes | os.PathLike) else None


def count_local(steps: Steps, root: str) -> None:
    def hook(event: str, args: tuple) -> None:
        path = _writes(event, args)
        if path is not None and os.path.abspath(path).startswith(root + os.sep):
            steps.step()

    sys.addaudithook(hook)


def count_s3(steps: Steps) -> None:
    s3.client(None).meta.events.register("before-send.s3", lambda **_: steps.step())


def child(uri: str, kill_at: int | None, report: int) -> None:
    """In the forked child: round 1's checkpoint whole, then round 2's counted (and killed)."""
    write(uri, 1)
    steps = Steps(kill_at)
    if uri.startswith("s3://"):
        count_s3(steps)
    else:
        count_local(steps, os.path.abspath(uri))
    write(uri, 2)
    os.write(report, str(steps.count).encode())


def serve() -> None:
    for line in sys.stdin:
        request = json.loads(line)
        read, report = os.pipe()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                os.close(read)
                child(request["uri"], request["kill_at"], report)
            except BaseException:
                traceback.print_exc()
                code = 1
            finally:
                os._exit(code)
        os.close(report)
        with os.fdopen(read, "rb") as said:
            steps = said.read()
        _, status = os.waitpid(pid, 0)
        if os.WIFEXITED(status) and os.WEXITSTATUS(status):
            raise SystemExit(f"the writer failed (exit {os.WEXITSTATUS(status)})")
        answer = {
            "steps": int(steps) if steps else None,
            "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
        }
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    serve()
