"""A frozen worker (its Python process stopped with SIGSTOP mid-run, and left stopped) is named in
one warning once it has made no progress for `progress_timeout_s`, and its work is failed:
- `spark` transport on the standalone cluster: its executor is stopped, the round runs again on
  the other one, and the run ends with the weights of an undisturbed run;
- `spark` transport on a local master: its task attempt is killed (with its Python worker) and
  runs again, with the same result;
- `allreduce` on the standalone cluster: its executor is stopped and the stage fails; the one
  executor left cannot hold both ranks, so the run ends in one line naming the host;
- a run whose one executor froze: no executor can take the work, one line at the deadline.
Before the guard every one of these runs waited for the stopped worker without end. Also the
guard's decision and the task's reports on their own."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest
from safetensors.torch import load_file

from sparknet.config import TrainConfig
from sparknet.errors import SparknetError
from sparknet.training import progress, progress_guard
from sparknet.training.driver import train
from tests.conftest import REPO, SPARKNET
from tests.helpers import cli_config

pytestmark = [pytest.mark.slow, pytest.mark.integration]

#: the deadline these runs get: short, yet past a task's start on a busy machine
DEADLINE_S = 10
#: a local master's killed task runs again on a Python worker Spark starts for it, which took
#: more than 10 s to make its first step while the whole suite ran on two cores
LOCAL_DEADLINE_S = 20
#: momentum SGD restarted every round (`reset`): a round run again on another executor starts
#: from what it started from the first time
RUN = (
    "train", "--data", "digits", "--model", "mlp", "--workers", "2", "--rounds", "16",
    "--tau", "2", "--batch-size", "16", "--lr", "0.05", "--momentum", "0.9",
    "--inner-state", "reset", "--seed", "7", "--eval-every", "0", "--checkpoint-every", "0",
)  # fmt: skip
WARNING = re.compile(r"worker (\d+) on (\S+) made no progress in round (\d+) for (\d+) s")


def _rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _wait_for_rows(out: Path, count: int, alive, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while len(_rows(out)) < count:
        assert alive() and time.monotonic() < deadline, "the run ended or stalled before"
        time.sleep(0.1)


def _children() -> dict[int, list[int]]:
    """{pid: its children's pids}, from /proc."""
    out: dict[int, list[int]] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        out.setdefault(ppid, []).append(int(proc.name))
    return out


def _python_workers(jvm: int) -> list[int]:
    """The Python workers a JVM's pyspark daemon forked (not the daemon itself)."""
    tree = _children()
    daemons = [p for p in tree.get(jvm, []) if b"python" in _cmdline(p)]
    return [w for d in daemons for w in tree.get(d, [])]


def _cmdline(pid: int) -> bytes:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes()
    except OSError:
        return b""


def _executors(work_dirs: tuple[Path, ...]) -> dict[str, int]:
    """{executor id: pid} of the executor JVMs the standalone cluster's workers run."""
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cwd = Path(os.readlink(proc / "cwd"))
        except OSError:
            continue
        args = _cmdline(int(proc.name)).split(b"\0")
        if b"org.apache.spark.executor.CoarseGrainedExecutorBackend" in args and any(
            cwd.is_relative_to(w) for w in work_dirs
        ):
            found[args[args.index(b"--executor-id") + 1].decode()] = int(proc.name)
    return found


@contextmanager
def _frozen(pids: list[int]) -> Iterator[list[int]]:
    """The processes stopped (SIGSTOP) for the block; killed after it, whatever happened."""
    assert pids, "no Python worker to stop"
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield pids
    finally:
        for pid in pids:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _tensors(run_dir: Path) -> dict:
    return {k: v.numpy().tobytes() for k, v in load_file(run_dir / "model.safetensors").items()}


def _cli(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [str(SPARKNET), *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip


@pytest.fixture(scope="module")
def undisturbed(spark, tmp_path_factory) -> dict:
    """The run's weights without a fault, in this process's local session (one thread a task,
    as on the cluster's 1-core workers)."""
    out = tmp_path_factory.mktemp("undisturbed") / "run"
    train(cli_config(RUN[1:], transport="spark", out=out, progress_timeout_s=0), spark=spark)
    return _tensors(out)


def _freeze_a_worker(standalone, args: list[str], out: Path, executors: int = 2):
    """Run `args` with the short deadline, stop one executor's Python workers once two rounds
    are in, and wait for the end: (process, its stderr, seconds from the stop to the end).
    Where another executor is left, exactly one warning names the frozen worker, its host and
    its executor."""
    proc = _cli(*args, "--set", f"progress_timeout_s={DEADLINE_S}")
    try:
        _wait_for_rows(out, 2, lambda: proc.poll() is None)
        running = _executors(standalone.work_dirs)
        assert len(running) == executors, running
        victim = min(running)
        with _frozen(_python_workers(running[victim])):
            started = time.monotonic()
            _out, err = proc.communicate(timeout=DEADLINE_S + 180)
            took = time.monotonic() - started
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    named = [line for line in err.splitlines() if WARNING.search(line)]
    if executors == 1:
        assert len(named) == 1 and named[0].startswith("error: "), err[-3000:]
        return proc, err, took
    assert len(named) == 1, err[-3000:]
    assert named[0].startswith("warning: ") and " on 127.0.0.1 " in named[0], named
    assert f"its executor {victim} is stopped" in named[0], named
    return proc, err, took


def test_a_frozen_spark_worker_on_a_cluster_is_named_and_its_round_runs_again(
    standalone, undisturbed, tmp_path
):
    out = tmp_path / "frozen"
    args = [*RUN, "--master", standalone.master, "--transport", "spark", "--out", str(out)]
    proc, err, _took = _freeze_a_worker(standalone, args, out)
    assert proc.returncode == 0, err[-3000:]
    got = _rows(out)
    assert [r["round"] for r in got] == list(range(1, 17))
    assert any(r.get("executors_lost") for r in got)
    assert {r["slowest_worker"] for r in got} <= {0, 1}
    assert _tensors(out) == undisturbed


def test_a_frozen_worker_on_a_local_master_has_its_task_killed_and_run_again(
    spark, undisturbed, tmp_path
):
    """The local session's Python workers are this process's grandchildren: every one is
    stopped, so whichever takes the next task is frozen."""
    out = tmp_path / "local"
    said: list[str] = []
    failed: list[BaseException] = []
    cfg = cli_config(RUN[1:], transport="spark", out=out, progress_timeout_s=LOCAL_DEADLINE_S)

    def run() -> None:
        try:
            train(cfg, spark=spark, on_warning=said.append)
        except BaseException as exc:
            failed.append(exc)

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    _wait_for_rows(out, 2, runner.is_alive)
    jvm = spark.sparkContext._gateway.proc.pid
    with _frozen(_python_workers(jvm)):
        runner.join(120)
    assert not runner.is_alive() and not failed, failed
    assert said and all(WARNING.search(line) for line in said), said
    assert all("is killed and runs again" in line for line in said), said
    assert [r["round"] for r in _rows(out)] == list(range(1, 17))
    assert _tensors(out) == undisturbed


def test_a_frozen_allreduce_rank_is_named_and_the_run_ends_in_one_line(standalone, tmp_path):
    """The rank waiting in the exchange for the stopped one is alive, and not named. Its
    executor stopped for good (Spark starts none in its place, so nothing is waited for), the
    one left cannot hold both ranks: one `error:` line naming the host, exit 2, well within
    the deadline and a minute."""
    out = tmp_path / "allreduce"
    args = [*RUN, "--master", standalone.master, "--transport", "allreduce", "--out", str(out)]
    args[args.index("--rounds") + 1] = "400"
    args[args.index("--checkpoint-every") + 1] = "5"
    proc, err, took = _freeze_a_worker(standalone, args, out)
    assert proc.returncode == 2, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: ") and "127.0.0.1" in last, err[-3000:]
    assert "stopped (a worker there made no progress)" in last, last
    assert took < DEADLINE_S + 60, (took, err[-3000:])


def test_a_frozen_worker_no_other_executor_can_replace_ends_the_run_in_one_line(
    standalone, tmp_path
):
    """The run holds one executor (`spark.cores.max=1`), which runs both workers' tasks: once
    its worker is frozen nothing is left to take the work, so the run ends at the deadline with
    one `error:` line naming the worker and its host, exit 2, not after the wait for executors
    (`no_executor_timeout_s`, 300 s by default)."""
    out = tmp_path / "alone"
    args = [*RUN, "--master", standalone.master, "--transport", "spark", "--out", str(out)]
    args[args.index("--rounds") + 1] = "400"
    args += ["--conf", "spark.cores.max=1"]
    proc, err, took = _freeze_a_worker(standalone, args, out, executors=1)
    assert proc.returncode == 2, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert WARNING.search(last) and " on 127.0.0.1 " in last, last
    assert "no other executor can take its work" in last, last
    assert "Traceback" not in err, err[-3000:]
    assert took < DEADLINE_S + 60, (took, err[-3000:])


# ---- the parts on their own ---------------------------------------------------------------


def test_a_waiting_rank_that_reports_is_alive_and_a_silent_one_is_not():
    launched = 1000.0
    task = progress_guard.Running(7, 0, "1", "127.0.0.1", launched)
    assert progress_guard.idle_s(task, None, launched + 30) == 30  # never said a word
    seen = progress_guard.Seen(0, 3, 5, False, heard=launched + 20, moved=launched + 10)
    assert (
        progress_guard.idle_s(task, seen, launched + 30) == 20
    )  # talks, but its steps stand still
    seen.waiting = True
    assert progress_guard.idle_s(task, seen, launched + 30) == 10  # waits on the others, alive
    seen.hear({"round": 3, "steps": 5, "waiting": True}, launched + 29)
    assert progress_guard.idle_s(task, seen, launched + 30) == 1


def test_the_automatic_deadline_follows_the_slowest_round():
    assert progress_guard.auto_deadline(None) == progress_guard.STARTUP_S
    assert progress_guard.auto_deadline(2.0) == progress_guard.MIN_DEADLINE_S
    assert progress_guard.auto_deadline(30.0) == 150.0
    assert progress_guard.collective_timeout_s(150.0) > 150.0
    # a set deadline holds from the first measured round on; the first gets the start-up's
    guard = progress_guard.Guard(_Context(), DEADLINE_S, print)
    assert guard.deadline() == progress_guard.STARTUP_S
    guard.round_done({"round": 1, "seconds": {"total": 0.5}})
    assert guard.deadline() == DEADLINE_S


def test_a_task_reports_its_steps_and_a_dead_driver_costs_it_nothing(monkeypatch):
    """Real sockets: the reports reach a listener with the token; with no listener at all the
    steps go on (the reporter's thread alone meets the refused connection)."""
    import queue

    monkeypatch.setattr(progress, "REPORT_S", 0.05)
    inbox: queue.Queue = queue.Queue()
    listener = progress.Listener("127.0.0.1", "ab" * 16, inbox)
    try:
        beacon = progress.Beacon(listener.address, "ab" * 16)
        with progress.reporting(beacon, 3):
            progress.begin_round(4)
            progress.step()
            with progress.waiting():
                message = {}
                deadline = time.monotonic() + 5
                while not message.get("waiting") and time.monotonic() < deadline:
                    message = inbox.get(timeout=5)[1]
        assert message == {"task": -1, "partition": 3, "round": 4, "steps": 1, "waiting": True}
    finally:
        listener.close()
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        nowhere = progress.Beacon(unused.getsockname(), "ab" * 16)
    with progress.reporting(nowhere, 0):
        progress.begin_round(1)
        for _ in range(1000):
            progress.step()
        assert progress._current is not None and progress._current.steps == 1000
    assert progress._current is None


class _Context:
    """Stands in for a SparkContext (a mock: a worker that freezes on every try would cost a
    real deadline per try): records the task kills and job cancels the guard asks for."""

    def __init__(self) -> None:
        self.killed: list[int] = []
        self.cancelled = 0
        self._jsc = self

    def sc(self) -> _Context:
        return self

    def killTaskAttempt(self, task: int, interrupt: bool, reason: str) -> None:
        self.killed.append(task)

    def cancelAllJobs(self) -> None:
        self.cancelled += 1


def test_work_that_freezes_on_every_try_ends_the_run_after_three(monkeypatch):
    """A local master's task killed and run again three times; the fourth freeze of the same
    worker ends the run with one line instead of killing it for ever."""
    said: list[str] = []
    sc = _Context()
    guard = progress_guard.Guard(sc, DEADLINE_S, said.append)
    for attempt in range(1, 5):
        guard._fail(progress_guard.Running(attempt, 1, "driver", "localhost", 0), None, 12)
    assert sc.killed == [1, 2, 3] and sc.cancelled == 1
    assert len(said) == 3 and all("its task" in line for line in said), said
    with pytest.raises(SparknetError, match=r"^worker 1 on localhost .* for the 4th time: its"):
        guard.__exit__(RuntimeError, RuntimeError("cancelled"), None)


@pytest.mark.parametrize("value", ["0.001", "9.5", "-1"])
def test_a_deadline_no_healthy_task_could_meet_is_refused(value):
    with pytest.raises(ValueError, match="progress_timeout_s"):
        TrainConfig(progress_timeout_s=value)
    assert TrainConfig(progress_timeout_s="10").progress_timeout_s == 10
