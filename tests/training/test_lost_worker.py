"""A worker host lost for good mid-run, on the shared standalone cluster (two 1-core workers):
its Worker daemon and executor killed with SIGKILL, nothing started in their place.
`allreduce` with K=2: the executor left holds one task slot, so the restarted stage cannot run;
the run waits the set time for the lost executor to come back (here 3 s), then ends with one
line naming it, exit 2, not a barrier stage Spark waits on without end. The killed worker is
started again afterwards: the tests after this need both. (`spark` goes on with the executors
left: an executor stopped for good under it is test_frozen_worker.py's, which also checks the
weights.)"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.training.test_standalone import RUN, _executor_pids, rows, sparknet

pytestmark = [pytest.mark.slow, pytest.mark.integration]

#: how long a run may take to end once the host is gone: the set wait (3 s) plus a failed
#: stage's cancellation, with a wide margin; the old code waited without end
ENDS_WITHIN_S = 120


def _worker_daemon(work_dir: Path) -> int:
    """The pid of the Worker daemon whose work dir is `work_dir`."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"org.apache.spark.deploy.worker.Worker" in cmdline and os.fsencode(work_dir) in cmdline:
            return int(proc.name)
    raise AssertionError(f"no Worker daemon with work dir {work_dir}")


def _kill_host_once_it_runs(standalone, proc: subprocess.Popen, out: Path) -> None:
    """After the run's second round, SIGKILL worker 0's daemon and its executor: the host is
    gone, and no replacement comes (the other worker's one core is the run's already)."""
    deadline = time.monotonic() + 120
    while not (out / "metrics.jsonl").exists() or len(rows(out)) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    executors = _executor_pids(standalone.work_dirs[:1])
    assert len(executors) == 1, executors
    for pid in (_worker_daemon(standalone.work_dirs[0]), *executors):
        os.kill(pid, signal.SIGKILL)


def _run_losing_a_host(standalone, tmp_path: Path, transport: str, rounds: int, *extra: str):
    """The run's (exit code, stderr, run dir), worker 0 lost for good after its second round."""
    out = tmp_path / transport
    args = [*RUN, "--master", standalone.master, "--out", str(out), "--transport", transport]
    args[args.index("--checkpoint-every") + 1] = "5"
    args[args.index("--rounds") + 1] = str(rounds)
    proc = sparknet(*args, *extra)
    try:
        _kill_host_once_it_runs(standalone, proc, out)
        _out, err = proc.communicate(timeout=ENDS_WITHIN_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        standalone.restart_worker(0)
    return proc.returncode, err, out


def test_allreduce_without_a_slot_per_worker_left_ends_in_one_line_naming_the_lost_host(
    standalone, tmp_path
):
    code, err, out = _run_losing_a_host(
        standalone, tmp_path, "allreduce", 5000, "--set", "no_executor_timeout_s=3"
    )
    assert code == 2, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: ") and "@127.0.0.1" in last, err[-3000:]
    assert "no_executor_timeout_s" in last and "--resume" in last, last
    assert "Traceback" not in err and "\tat " not in err, err[-3000:]
    # nothing half-written: only complete checkpoints, each with its row
    done = {r["round"] for r in rows(out)}
    checkpoints = out / "checkpoints"  # none where the host was lost before the first one
    for ckpt in checkpoints.iterdir() if checkpoints.exists() else ():
        assert (ckpt / "state.json").exists(), ckpt
        assert int(ckpt.name.split("-")[1]) in done
