"""Every signal counts, from the console script's first line: `sparknet train` (local mode) gets
SIGINT at moments drawn at random over its start-up (imports, Spark's start, the Python
workers' start), inside a round, and while a checkpoint is being written; each time it exits
130 with the one `error: interrupted` line, leaves no JVM or Python worker, and its run dir's
latest checkpoint is a complete one or none."""

from __future__ import annotations

import os
import random
import shlex
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from sparknet.data.store import open_store
from sparknet.processes import alive
from sparknet.training import checkpoint
from sparknet.training.state import StateLayout
from tests.cli.test_cli_end_to_end import Lines, descendants
from tests.conftest import REPO, SPARKNET

pytestmark = [pytest.mark.slow, pytest.mark.integration]

ROUNDS = 10


class _Run:
    """One `sparknet train` in its own session, its descendants noted as they come (a Python
    worker forked and gone by the end still had to be stopped)."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.t0 = time.monotonic()
        self.args = [
            "train", "--data", "digits", "--model", "mlp", "--workers", "2", "--tau", "4",
            "--rounds", str(ROUNDS), "--checkpoint-every", "1", "--out", str(out),
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            [str(SPARKNET), *self.args],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True,
        )  # fmt: skip
        self.err = Lines(self.proc.stderr)
        self.seen: dict[int, str] = {}
        self._watch = threading.Thread(target=self._note_children, daemon=True)
        self._watch.start()

    def _note_children(self) -> None:
        while self.proc.poll() is None:
            self.seen.update(descendants(self.proc.pid))
            time.sleep(0.05)

    def interrupt_and_wait(self, signum: int = signal.SIGINT) -> None:
        self.seen.update(descendants(self.proc.pid))
        os.kill(self.proc.pid, signum)  # the CLI alone: it must stop the JVM itself
        try:
            self.proc.wait(timeout=90)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.err.thread.join(timeout=10)

    def check(self, what: str, code: int = 130) -> None:
        """The run's end as every signal must leave it."""
        lines = self.err.lines
        assert self.proc.returncode == code, f"{what}: rc {self.proc.returncode}; {lines}"
        assert lines and lines[-1].startswith("error: interrupted"), f"{what}: {lines}"
        if "starting Spark" not in lines:  # nothing started: nothing said to be stopped
            assert "Spark stopped" not in lines[-1], f"{what}: {lines}"
        text = "\n".join(lines)
        assert "Traceback" not in text and "Exception" not in text, f"{what}: {lines}"
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(alive(p) for p in self.seen):
            time.sleep(0.2)
        left = [cmd for pid, cmd in self.seen.items() if alive(pid)]
        assert not left, f"{what}: left running: {left}"
        _assert_only_complete_checkpoints(self.out, what)
        if "Spark stopped" in lines[-1]:  # the round kept, and the command that continues it
            last = checkpoint.latest(open_store(str(self.out))) if self.out.exists() else None
            kept = "no checkpoint was complete yet" if last is None else f"round {last}'s"
            assert kept in lines[-1], f"{what}: {lines[-1]}"
            if last is None and not (self.out / "config.yaml").exists():  # the command given
                given = lines[-1].split("`")[1]  # the command line given (in the CLI's order)
                assert _options(given) == _options(shlex.join(["sparknet", *self.args])), given
            else:  # `--resume` continues it, or starts it over with its config.yaml
                assert f"`sparknet train --resume --out {self.out}`" in lines[-1], lines[-1]


def _options(command: str) -> tuple[list[str], set[tuple[str, str]]]:
    """A command line's words before its first option, and its (option, value) pairs in any
    order."""
    words = shlex.split(command)
    first = next(i for i, w in enumerate(words) if w.startswith("--"))
    return words[:first], set(zip(words[first::2], words[first + 1 :: 2], strict=True))


def _assert_only_complete_checkpoints(out: Path, what: str) -> None:
    """`checkpoint.latest` is None or loads whole, and nothing incomplete is left beside it."""
    if not out.exists():
        return  # interrupted before the run dir was made
    store = open_store(str(out))
    last = checkpoint.latest(store)
    if last is not None:
        from sparknet.models import build_model  # lazy: torch

        layout = StateLayout.of_model(build_model("mlp", (1, 8, 8), 10))
        assert checkpoint.load(store, last, layout).rounds == last, what
    ckpts = out / "checkpoints"
    entries = sorted(p.name for p in ckpts.iterdir()) if ckpts.exists() else []
    incomplete = [e for e in entries if not (ckpts / e / checkpoint.MANIFEST).exists()]
    assert not incomplete, f"{what}: incomplete checkpoints left: {incomplete}"


def _first_round_line(run: _Run, timeout: float = 120) -> float:
    """Seconds from launch to the first round's line."""
    deadline = time.monotonic() + timeout
    while not any(ln.startswith("round 1/") for ln in run.err.lines):
        if run.proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"no round 1 line: {run.err.lines}")
        time.sleep(0.01)
    return time.monotonic() - run.t0


def _checkpoint_being_written(run: _Run, timeout: float = 120) -> str:
    """Wait for a checkpoint after round 1 caught in its writing: a worker's inner state is in
    it and its manifest is not (the workers write their states into the dir the driver made,
    then the driver the weights and, last, the manifest); returns its name."""
    ckpts = run.out / "checkpoints"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and run.proc.poll() is None:
        try:
            names = [e for e in os.listdir(ckpts) if e > "round-00001"]
            for entry in names:
                inner = os.listdir(ckpts / entry / "inner")
                if inner and not (ckpts / entry / checkpoint.MANIFEST).exists():
                    return f"{entry} ({len(inner)} inner file(s) in)"
        except FileNotFoundError:
            pass
        time.sleep(0.001)
    pytest.fail(f"no checkpoint caught being written: {run.err.lines}")


def _torch_loading(run: _Run, timeout: float = 60) -> None:
    """Wait until the CLI maps libtorch: it is importing the training code (seconds of it),
    long before Spark starts."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and run.proc.poll() is None:
        try:
            if "libtorch" in Path(f"/proc/{run.proc.pid}/maps").read_text():
                return
        except OSError:
            pass
        time.sleep(0.005)
    pytest.fail(f"torch never loaded: {run.err.lines}")


def _in_threads(*calls) -> None:
    """Run the cases side by side (each one waits on its own run), raising the first failure."""
    errors: list[BaseException] = []

    def guarded(call) -> None:
        try:
            call()
        except BaseException as exc:  # an assertion: reported by the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(c,)) for c in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def test_a_signal_anywhere_in_a_run_exits_128_plus_it_and_leaves_nothing(tmp_path):
    """SIGINT inside a round and while a checkpoint is being written (the first run also
    measures the start-up), then at three moments drawn over the start-up, and SIGTERM while
    the training code is imported: there, before the command's own handler, SIGTERM killed the
    CLI with no line, and a SIGINT a library swallowed was lost (the run trained on)."""
    measured: list[float] = []

    def inside_a_round() -> None:
        run = _Run(tmp_path / "round")
        try:
            measured.append(_first_round_line(run))  # the line comes as round 2 begins
        finally:
            run.interrupt_and_wait()
        run.check("inside a round")

    def while_a_checkpoint_is_written() -> None:
        run = _Run(tmp_path / "checkpoint")
        try:
            caught = _checkpoint_being_written(run)
        finally:
            run.interrupt_and_wait()
        run.check(f"while {caught} was being written")

    _in_threads(inside_a_round, while_a_checkpoint_is_written)
    startup_s = measured[0]
    seed = random.randrange(1 << 30)
    moments = sorted(random.Random(seed).uniform(0, startup_s) for _ in range(3))

    def at(i: int, moment: float) -> None:
        run = _Run(tmp_path / f"start-{i}")
        try:
            time.sleep(max(0.0, moment - (time.monotonic() - run.t0)))
        finally:
            run.interrupt_and_wait()
        run.check(f"at {moment:.2f} s of a {startup_s:.1f} s start-up (seed {seed})")

    def sigterm_in_the_imports() -> None:
        run = _Run(tmp_path / "imports")
        try:
            _torch_loading(run)
        finally:
            run.interrupt_and_wait(signal.SIGTERM)
        run.check("SIGTERM while torch is imported", code=128 + signal.SIGTERM)

    _in_threads(*(lambda i=i, m=m: at(i, m) for i, m in enumerate(moments)), sigterm_in_the_imports)
