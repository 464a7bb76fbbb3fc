"""The job's supervisor on the master (`sparknet.jobs.supervisor`), started by `start_driver`
exactly as on a node, and the readers of metrics.jsonl's event rows. No Spark: a local shell
stands in for the node's SSH session (the same command, the same pipes), and a fake
`venv/bin/sparknet` for the driver (a mock: the real one needs Spark; the end-to-end test in
tests/jobs/test_submit.py kills a real one). The node's `venv/bin/python` is this
venv's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from invoke import Context

from sparknet.cluster.address import Endpoint
from sparknet.cluster.spark.plan import Node
from sparknet.config import TrainConfig
from sparknet.data.store import open_store
from sparknet.jobs import driver_control, follow, preflight
from sparknet.jobs import submit as flow
from sparknet.jobs.supervisor import restart_line
from sparknet.training.report import MetricsLog, plot_curves, read_metrics, round_rows

#: a fake driver in Python (this venv's): rounds 1..3, each row then its checkpoint's manifest,
#: resuming (`--resume`) from the last manifest as the real driver does; its first run is
#: killed by SIGKILL after round 2's row, before round 2's checkpoint
RESUMING_TRAIN = """#!{python}
import os, signal, sys
from pathlib import Path
from sparknet.data.store import open_store
from sparknet.training.report import MetricsLog
calls = Path({calls!r})
with calls.open("a") as f:
    f.write(" ".join(sys.argv[1:]) + "\\n")
first = len(calls.read_text().splitlines()) == 1
out = Path({out!r})
done = sorted(int(p.parent.name[6:]) for p in out.glob("checkpoints/round-*/state.json"))
start = done[-1] if "--resume" in sys.argv else 0
log = MetricsLog(open_store(str(out)), keep_rounds=start)
for r in range(start + 1, 4):
    log.append({{"round": r, "loss": 1.0 / r, "samples": 4, "samples_per_s": 10.0,
                "seconds": {{"total": 1.0}}, "elapsed_s": float(r)}})
    if first and r == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    (out / f"checkpoints/round-{{r:05d}}").mkdir(parents=True)
    (out / f"checkpoints/round-{{r:05d}}/state.json").write_text("{{}}")
print("round 3/3")
"""


def _node(tmp_path: Path, train: str, *, shell: bool = True) -> Node:
    """A node whose prefix is tmp_path/node: `venv/bin/python` runs this venv's Python,
    `venv/bin/sparknet` is `train` (a shell script body, or a whole script)."""
    bin_dir = tmp_path / "node" / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    python = bin_dir / "python"
    python.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    sparknet = bin_dir / "sparknet"
    calls = tmp_path / "calls"
    sparknet.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n{train}\n' if shell else train)
    for f in (python, sparknet):
        f.chmod(0o755)
    return Node(Endpoint("master", "127.0.0.1", 22, "me"), "127.0.0.1", str(tmp_path / "node"), 0)


def _start(node: Node, tmp_path: Path, max_restarts: int) -> Path:
    """The detached supervisor of job R with run prefix tmp_path/run; the job dir."""
    cfg = TrainConfig(out=str(tmp_path / "run"))
    driver_control.start_driver(Context(), node, "R", cfg, max_restarts=max_restarts)
    return Path(node.path("jobs", "R"))


def _wait_for(predicate, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _calls(tmp_path: Path) -> list[str]:
    return (tmp_path / "calls").read_text().splitlines()


def _events(out: Path) -> list[dict]:
    return [r for r in read_metrics(out, events=True) if "event" in r]


def _gone(pid: int) -> bool:
    return subprocess.run(["kill", "-0", str(pid)], capture_output=True).returncode != 0


def test_a_killed_driver_resumes_from_its_checkpoint_and_the_submitter_sees_one_restart(
    tmp_path,
) -> None:
    out = tmp_path / "run"
    out.mkdir()
    train = RESUMING_TRAIN.format(
        python=sys.executable, calls=str(tmp_path / "calls"), out=str(out)
    )
    node = _node(tmp_path, train, shell=False)
    job = _start(node, tmp_path, max_restarts=2)
    master = driver_control.Master(node, None, "spark://x:7077", 1)  # type: ignore[arg-type]
    shown: list[int] = []
    events: list[dict] = []
    outcome = follow.follow(
        Context(), master, "R", str(out), None,
        lambda rows: shown.extend(r["round"] for r in rows), poll_s=0.05, on_event=events.append,
    )  # fmt: skip
    assert outcome.rc == 0 and (job / "driver.rc").read_text() == "0\n"
    assert _calls(tmp_path) == [f"train --config {job}/job.yaml", f"train --out {out} --resume"]
    # metrics.jsonl: round 1, the restart (round 2's row went with the resume), rounds 2 and 3
    rows = read_metrics(out, events=True)
    assert [r.get("round", r.get("event")) for r in rows] == [1, "restart", 2, 3]
    assert {k: rows[1][k] for k in ("attempt", "max_restarts", "after_round", "reason")} == {
        "attempt": 1, "max_restarts": 2, "after_round": 1, "reason": "killed by SIGKILL",
    }  # fmt: skip
    assert (
        [r["round"] for r in read_metrics(out)] == [1, 2, 3] == [r["round"] for r in outcome.rows]
    )
    # the submitter: each round once, the restart once, as one line
    assert sorted(shown) == [1, 2, 3] and len(shown) == 3
    assert [restart_line(e) for e in events] == [
        "driver died (killed by SIGKILL); restart 1/2 from round 1"
    ]
    log = (job / "driver.log").read_text()
    assert "driver died (killed by SIGKILL); restart 1/2 from round 1\n" in log
    assert not (job / "train.pid").exists()
    assert not (tmp_path / "node" / "autostop" / "activity" / "job-R").exists()


def test_a_driver_that_dies_every_time_is_restarted_max_restarts_times(tmp_path) -> None:
    node = _node(tmp_path, "kill -9 $$")
    job = _start(node, tmp_path, max_restarts=2)
    _wait_for(lambda: driver_control.driver_rc(Context(), node, "R") is not None)
    assert driver_control.driver_rc(Context(), node, "R") == 137  # 128 + SIGKILL, as a shell says
    # no checkpoint: every restart starts over with the job's settings
    assert _calls(tmp_path) == [f"train --config {job}/job.yaml"] * 3
    assert [(e["attempt"], e["after_round"]) for e in _events(tmp_path / "run")] == [(1, 0), (2, 0)]
    log = driver_control.driver_log(Context(), node, "R")
    assert "driver died (killed by SIGKILL); restart 2/2 from the start" in log
    assert follow.last_error(log) == (
        "the driver died (killed by SIGKILL) after 2 restarts; --max-restarts 2 used up"
    )


@pytest.mark.parametrize(
    ("body", "max_restarts", "calls", "rc"),
    [
        ("echo 'error: no such model'; exit 2", 2, 1, 2),  # its own error: a restart repeats it
        ("exit 130", 2, 1, 130),  # interrupted
        ("exit 0", 2, 1, 0),
        ("kill -9 $$", 0, 1, 137),  # --max-restarts 0: never
        ("exit 1", 1, 2, 1),  # a crash (a traceback exits 1): restarted
    ],
)
def test_which_ends_are_restarted(tmp_path, body, max_restarts, calls, rc) -> None:
    node = _node(tmp_path, body)
    _start(node, tmp_path, max_restarts=max_restarts)
    _wait_for(lambda: driver_control.driver_rc(Context(), node, "R") is not None)
    assert driver_control.driver_rc(Context(), node, "R") == rc
    assert len(_calls(tmp_path)) == calls
    assert len(_events(tmp_path / "run")) == calls - 1


def test_a_cancel_ends_the_supervisor_and_the_driver_without_a_restart(tmp_path) -> None:
    node = _node(tmp_path, "sleep 60")
    job = _start(node, tmp_path, max_restarts=2)
    _wait_for(lambda: (job / "train.pid").exists())
    supervisor, train = int((job / "driver.pid").read_text()), int((job / "train.pid").read_text())
    assert os.getsid(supervisor) == supervisor and os.getsid(train) == supervisor
    driver_control.cancel_driver(Context(), node, "R")
    _wait_for(lambda: _gone(supervisor) and _gone(train))
    # the signal went to the supervisor alone; what the driver left (its `sleep`) went with the
    # supervisor's end
    _wait_for(lambda: _group(supervisor) == [])
    rc = driver_control.driver_rc(Context(), node, "R")
    assert rc == -1  # cancelled: no exit code, as before
    assert len(_calls(tmp_path)) == 1 and _events(tmp_path / "run") == []
    assert "restart" not in (job / "driver.log").read_text()
    assert not (tmp_path / "node" / "autostop" / "activity" / "job-R").exists()


def test_metrics_readers_skip_event_rows(tmp_path) -> None:
    """A resume keeps event rows (and drops round rows past its checkpoint); `read_metrics`
    gives rounds only unless asked; curves and the progress line never see an event."""
    store = open_store(str(tmp_path))
    event = {"event": "restart", "attempt": 1, "max_restarts": 2, "after_round": 1}
    row = {"round": 1, "loss": 0.5, "samples_per_s": 3.0, "elapsed_s": 1.0, "eval_loss": 0.4,
           "eval_accuracy": 0.5}  # fmt: skip
    lines = [row, event, {**row, "round": 2}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    log = MetricsLog(store, keep_rounds=1)
    assert log.rows == [row, event] and log.rounds == [row]
    assert read_metrics(tmp_path) == [row]
    assert read_metrics(tmp_path, events=True) == [row, event]
    plot_curves([row, event], store)
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"
    assert round_rows([row, event]) == [row]


def test_the_jobs_stamps_keep_a_one_minute_autostop_from_ending_a_running_job(
    tmp_path, monkeypatch
) -> None:
    """The timer's worst case: a check just before the supervisor's next touch, even one touch
    late, still finds the deadline of `autostop_minutes: 1` ahead (a touch every minute let such
    a check terminate a running job); and the stamping thread does touch at that period."""
    from sparknet.cluster.aws import autostop
    from sparknet.jobs import supervisor

    state = tmp_path / "autostop"
    state.mkdir()
    (state / autostop.SETTINGS).write_text(autostop.Settings("c", "us-east-1", 1).to_json())
    autostop.record_activity(state, "job-R")
    last = autostop.last_activity(state)
    assert last is not None
    late_check = last + 2 * supervisor.STAMP_EVERY_S
    assert autostop.decide(state, late_check).action == "wait"
    assert autostop.decide(state, last + 60).action == "terminate"  # the deadline itself holds
    monkeypatch.setattr(supervisor, "STAMP_EVERY_S", 0.05)
    stamp = state / autostop.ACTIVITY / "job-S"
    with supervisor._Stamps(state, "job-S"):
        first = stamp.stat().st_mtime_ns
        _wait_for(lambda: stamp.stat().st_mtime_ns > first, timeout=10.0)
    assert not stamp.exists()


@pytest.mark.parametrize(("body", "state"), [("exit 0", "succeeded"), ("exit 3", "failed 3")])
def test_a_job_that_ends_as_a_cancel_comes_in_keeps_its_exit_code(tmp_path, body, state) -> None:
    """`cancel` writes its marker before its kill: a job that ended on its own at that moment
    wrote its exit code, and that code (not the marker) says how it ended."""
    from sparknet.jobs import records

    node = _node(tmp_path, body)
    job = _start(node, tmp_path, max_restarts=0)
    supervisor = int((job / "driver.pid").read_text())
    _wait_for(lambda: (job / "driver.rc").exists() and _gone(supervisor))
    (job / records.CANCELLED).touch()
    assert records.state_of(Context(), node, "R") == state
    assert records.cancel(Context(), node, "R") == state  # nothing left to end


def test_a_killed_supervisor_takes_its_driver_with_it_and_the_job_reads_killed(tmp_path) -> None:
    """SIGKILL to the supervisor alone: its driver gets SIGTERM (its death signal) and ends,
    rather than training on with nobody to restart it or record its end; the job reads
    `killed`, in `list` and at the submitter (whose error line says why) alike."""
    from sparknet.jobs import records

    node = _node(tmp_path, "exec sleep 60")
    job = _start(node, tmp_path, max_restarts=0)
    _wait_for(lambda: (job / "train.pid").exists())
    supervisor, train = int((job / "driver.pid").read_text()), int((job / "train.pid").read_text())
    os.kill(supervisor, 9)
    _wait_for(lambda: _gone(supervisor) and _gone(train), timeout=10)
    assert records.state_of(Context(), node, "R") == records.KILLED
    outcome = _follow(node, tmp_path)
    assert outcome.rc == -1
    assert follow.last_error(outcome.log) == (
        "the job was killed on the master: its supervisor ended without an exit code (a kill "
        "-9, the out-of-memory killer, the node restarted)"
    )
    assert records.cancel(Context(), node, "R") == records.KILLED  # nothing left to end


def test_the_submitter_stops_a_driver_that_outlives_its_killed_supervisor(
    tmp_path, monkeypatch
) -> None:
    """A driver that does not end on its death signal (here: it ignores SIGTERM) runs on,
    `orphaned`: the attached submitter finds the supervisor gone without an exit code, ends
    what is left (SIGKILL once the cancel's wait is over) and fails the job saying so; then
    `list` reads `killed`, as the submitter said."""
    from sparknet.jobs import records

    trapped = tmp_path / "trapped"  # the driver ignores SIGTERM from here on
    node = _node(tmp_path, f"trap '' TERM; : > {trapped}; exec sleep 60")
    job = _start(node, tmp_path, max_restarts=0)
    _wait_for(lambda: (job / "train.pid").exists() and trapped.exists())
    supervisor, train = int((job / "driver.pid").read_text()), int((job / "train.pid").read_text())
    os.kill(supervisor, 9)
    _wait_for(lambda: _gone(supervisor))
    assert records.state_of(Context(), node, "R") == records.ORPHANED and not _gone(train)
    monkeypatch.setattr(driver_control, "CANCEL_WAIT_S", 0.0)  # SIGKILL right after the SIGTERM
    outcome = _follow(node, tmp_path)
    assert _gone(train) and _group(supervisor) == []
    assert outcome.rc == -1
    assert follow.last_error(outcome.log).endswith("; the driver it left running was stopped")
    assert records.state_of(Context(), node, "R") == records.KILLED


def test_an_interrupted_submit_cancels_its_job_and_waits_until_it_is_gone(
    tmp_path, monkeypatch
) -> None:
    """Ctrl-C or SIGTERM on a submit whose cluster stays up (--cluster, --keep): the job is
    marked `cancelled` (not `failed -1`), and when the submitter goes on nothing of it runs:
    the driver, which takes a while to stop (its Spark), got one SIGTERM (through its
    supervisor; not a second one, sent to the whole group, that also reaches its JVM)."""
    from sparknet.cluster import nodes
    from sparknet.cluster.spec import ClusterSpec
    from sparknet.jobs import records

    class Local(Context):
        def close(self) -> None:
            pass

    signals = tmp_path / "signals"
    stopping = f"trap 'echo TERM >> {signals}; sleep 1; exit 143' TERM"  # 1 s to stop
    node = _node(tmp_path, f"{stopping}; sleep 60 & wait")
    master = driver_control.Master(node, None, "spark://x:7077", 1)  # type: ignore[arg-type]
    monkeypatch.setattr(nodes, "connect", lambda endpoint, access: Local())
    job = preflight.Job(
        ClusterSpec(name="c1"), True, False, preflight.Dataset("s3://b-b/x"), TrainConfig(),
        max_restarts=0,
    )  # fmt: skip
    said: list[str] = []

    def say(line: str) -> None:
        said.append(line)
        if line.startswith("job K1 started"):
            _wait_for(lambda: (tmp_path / "node" / "jobs" / "K1" / "train.pid").exists())
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        flow._run_driver(job, master, "K1", "p/", TrainConfig(), say, lambda rows, cost: None)
    leader = int((tmp_path / "node" / "jobs" / "K1" / "driver.pid").read_text())
    assert _group(leader) == []  # gone before the submitter went on: no wait here
    assert records.state_of(Context(), node, "K1") == records.CANCELLED
    assert signals.read_text() == "TERM\n"
    assert said[1:] == ["cancelling job K1: waiting for its driver to stop", "job K1 cancelled"]
    assert "Traceback" not in (tmp_path / "node" / "jobs" / "K1" / "driver.log").read_text()


def _follow(node: Node, tmp_path: Path):
    """`follow.follow` of job R, with the local shell as the master's SSH session."""
    (tmp_path / "run").mkdir(exist_ok=True)
    master = driver_control.Master(node, None, "spark://x:7077", 1)  # type: ignore[arg-type]
    return follow.follow(
        Context(), master, "R", str(tmp_path / "run"), None, lambda rows: None, poll_s=0.05
    )


def _group(leader: int) -> list[int]:
    """The live processes of the process group `leader` led (zombies are no one's)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == leader and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found
