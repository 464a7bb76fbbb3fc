"""`sparknet train` as a user runs it: a subprocess with its own embedded Spark."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from sparknet.data.sources import digits
from sparknet.models import build_model
from sparknet.processes import alive
from tests.conftest import REPO, SPARKNET
from tests.helpers import POISON

pytestmark = [pytest.mark.slow, pytest.mark.integration]


def sparknet(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(SPARKNET), *args], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


def descendants(pid: int) -> dict[int, str]:
    """Every process below `pid`, with its command line."""
    table = subprocess.run(["ps", "-eo", "pid=,ppid=,args="], capture_output=True, text=True)
    rows = [line.split(None, 2) for line in table.stdout.splitlines()]
    children: dict[int, list[tuple[int, str]]] = {}
    for cpid, ppid, *cmd in rows:
        children.setdefault(int(ppid), []).append((int(cpid), cmd[0] if cmd else ""))
    found, todo = {}, [pid]
    while todo:
        for child, cmd in children.get(todo.pop(), []):
            found[child] = cmd
            todo.append(child)
    return found


def _cmdline(pid: int) -> bytes:
    """The full command line (`ps` cuts long ones such as the JVM's)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def test_digits_reaches_95_percent_and_writes_the_run_dir(tmp_path):
    """The main job with its defaults, run as `sparknet train ... 2>&1 >summary | head -1`: the
    progress lines after the first meet a closed pipe; the run still ends with rc 0 and its
    files, and the summary is on stdout."""
    out, summary = tmp_path / "digits", tmp_path / "summary.txt"
    cmd = (
        f"'{SPARKNET}' train --data digits --workers 2 --out '{out}' 2>&1 >'{summary}'"
        " | head -1; exit ${PIPESTATUS[0]}"
    )
    t0 = time.monotonic()
    proc = subprocess.run(
        ["bash", "-c", cmd], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    wall = time.monotonic() - t0
    text = summary.read_text()
    assert proc.returncode == 0, proc.stdout + proc.stderr + text
    assert proc.stdout == "starting Spark\n"
    assert "sparknet run" in text and "test accuracy" in text
    assert str(out) in re.sub(r"[\s│]", "", text)  # folded over lines, never cut
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    cfg_text = (out / "config.yaml").read_text()
    rounds = len(rows)
    assert f"rounds: {rounds}" in cfg_text and "workers: 2" in cfg_text
    assert [r["round"] for r in rows] == list(range(1, rounds + 1))
    for key in ("samples", "loss", "seconds", "samples_per_s", "inner_state_misses"):
        assert key in rows[-1]
    assert set(rows[-1]["seconds"]) == {"broadcast", "compute", "aggregate", "total"}
    accuracy = rows[-1]["eval_accuracy"]
    print(f"digits: test accuracy {accuracy:.4f} in {wall:.1f} s wall")
    assert accuracy >= 0.95
    assert wall < 180

    # model.safetensors is plain PyTorch: the model's own keys, and it scores what was reported
    model = build_model("cnn", (1, 8, 8), 10)
    model.load_state_dict(load_file(out / "model.safetensors"), strict=True)
    model.eval()
    _, test = digits()
    with torch.no_grad():
        predicted = model(test.tensors[0]).argmax(1)
    assert (predicted == test.tensors[1]).float().mean().item() == pytest.approx(accuracy)

    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ckpts = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert ckpts[-1] == f"round-{rounds:05d}" and not any(n.startswith(".") for n in ckpts)


def test_divergence_stops_with_one_line_and_keeps_the_last_good_checkpoint(tmp_path):
    out = tmp_path / "poisoned"
    p = POISON
    proc = sparknet(
        "train", "--data", "tests.helpers:poisoned_digits", "--model", "mlp",
        "--workers", str(p["workers"]), "--tau", str(p["tau"]), "--batch-size",
        str(p["batch_size"]), "--seed", str(p["seed"]), "--rounds", "6",
        "--checkpoint-every", "1", "--out", str(out),
    )  # fmt: skip
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: training diverged at round {p['round']}, worker {p['partition']}: loss nan at "
        f"step 1; lower --lr or check the data; last good checkpoint: "
        f"{out / 'checkpoints' / 'round-00002'}"
    ]
    assert "Traceback" not in proc.stderr
    assert sorted(x.name for x in (out / "checkpoints").iterdir()) == ["round-00001", "round-00002"]
    assert not (out / "model.safetensors").exists()


ROUND_LINE = re.compile(
    r"^round (\d+)/500  loss \d+\.\d{4}(  acc \d\.\d{3})?  \d+ samples/s  \d+\.\d s$"
)


class Lines:
    """A pipe's lines as they arrive, read on a thread (a log file or CI sees the same)."""

    def __init__(self, stream) -> None:
        self.lines: list[str] = []
        self.thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self.thread.start()

    def _read(self, stream) -> None:
        for line in stream:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, prefix: str, proc: subprocess.Popen, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not any(ln.startswith(prefix) for ln in self.lines):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"no line {prefix!r} while running; stderr so far: {self.lines}")
            time.sleep(0.1)


#: what a second Ctrl-C prints while the first one's clean-up runs
STILL_STOPPING = "still stopping Spark; the last complete checkpoint is kept"


@pytest.mark.parametrize(
    ("signum", "group", "code", "said"),
    [
        (signal.SIGINT, True, 130, "interrupted;"),  # Ctrl-C: the terminal signals the group
        (signal.SIGTERM, False, 143, "interrupted (SIGTERM);"),  # `kill PID`, a CI timeout
    ],
    ids=["ctrl-c", "sigterm"],
)
def test_rounds_stream_without_a_tty_and_a_signal_prints_one_line(
    tmp_path, signum, group, code, said
):
    """Ctrl-C comes twice, 0.15 s apart, as an impatient user presses it: the second only says
    what is still being cleaned up, so no half-written checkpoint (`.round-N.partial`) is left
    behind."""
    out = tmp_path / "interrupted"
    proc = subprocess.Popen(
        [str(SPARKNET), "train", "--rounds", "500", "--tau", "2", "--eval-every", "2",
         "--checkpoint-every", "1", "--out", str(out)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    err = Lines(proc.stderr)
    try:
        err.wait_for("round 2/500", proc, timeout=180)  # printed as it happens, not at the end
        spawned = descendants(proc.pid)
        assert any("java" in cmd for cmd in spawned.values())
        assert any("pyspark.daemon" in cmd for cmd in spawned.values())
        os.killpg(proc.pid, signum) if group else os.kill(proc.pid, signum)
        if signum == signal.SIGINT:
            time.sleep(0.15)
            with contextlib.suppress(ProcessLookupError):  # done already: nothing to cut
                os.killpg(proc.pid, signum)
        proc.wait(timeout=60)
        err.thread.join(timeout=10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    lines = err.lines
    assert proc.returncode == code, "\n".join(lines[-80:])
    assert lines.index("starting Spark") < lines.index("round 1 (starting Python workers)")
    rounds = [m for ln in lines if (m := ROUND_LINE.match(ln))]
    assert [int(m.group(1)) for m in rounds] == list(range(1, len(rounds) + 1))
    assert all(bool(m.group(2)) == (int(m.group(1)) % 2 == 0) for m in rounds), lines
    # after the last round: the one line, no py4j, Python or Java traces
    after = lines[lines.index(rounds[-1].group(0)) + 1 :]
    if signum == signal.SIGINT:
        after = [ln for ln in after if ln != STILL_STOPPING]
    done = [c.name for c in (out / "checkpoints").iterdir() if c.name.startswith("round-")]
    kept = max(int(name.removeprefix("round-")) for name in done)
    assert after == [
        f"error: {said} Spark stopped, round {kept}'s checkpoint is kept; "
        f"`sparknet train --resume --out {out}` continues the run"
    ]
    text = "\n".join(lines)
    assert "Traceback" not in text and "py4j" not in text and "Exception" not in text
    # only sparknet's lines: not the JVM's module warning nor Spark's shell log-level note
    assert lines[: lines.index("round 1 (starting Python workers)")] == ["starting Spark"], lines
    # the JVM and Spark's Python workers must not outlive the CLI
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(alive(pid) for pid in spawned):
        time.sleep(0.2)
    assert not [cmd for pid, cmd in spawned.items() if alive(pid)]
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize(
    ("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["ctrl-c", "sigterm"]
)
def test_a_signal_while_spark_starts_stops_with_one_line_and_no_jvm_left(tmp_path, signum, code):
    proc = subprocess.Popen(
        [str(SPARKNET), "train", "--rounds", "2", "--tau", "1", "--out", str(tmp_path / "r")],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    err = Lines(proc.stderr)
    try:
        err.wait_for("starting Spark", proc, timeout=60)
        deadline, jvm = time.monotonic() + 60, []
        while not jvm and time.monotonic() < deadline:  # the gateway JVM is starting
            jvm = [p for p in descendants(proc.pid) if b"SparkSubmit" in _cmdline(p)]
            time.sleep(0.05)
        assert jvm, err.lines
        os.kill(proc.pid, signum)  # the CLI alone: the JVM never sees it
        proc.wait(timeout=60)
        err.thread.join(timeout=10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    lines = err.lines
    assert proc.returncode == code, lines
    assert lines[-1].startswith("error: interrupted") and "Exception" not in "\n".join(lines)
    assert lines[lines.index("starting Spark") + 1 :] == [lines[-1]], lines
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and alive(jvm[0]):
        time.sleep(0.2)
    assert not alive(jvm[0]), "the Spark JVM outlived the CLI"
