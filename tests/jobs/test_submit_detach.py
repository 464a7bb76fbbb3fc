"""`sparknet-submit` on one kept cluster, as a user runs it (subprocesses): --keep, reuse with
--cluster, --detach, then `logs`, `list`, `attach` and `cancel` of the detached jobs (a worker
node's Spark daemons killed while one is attached: the attach repairs the cluster, the job
finishes), and the cluster taken down by hand at the end. The cloud, the loopback nodes and the
dataset are test_submit.py's (its fixtures and helpers, imported): moto's server, loopback sshd
nodes that the bootstrap starts a real Spark standalone cluster on, a tiny sharded dataset in
moto's S3. One cluster up for the whole test (about 70 s): every job after the first reuses it."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import SPARKNET
from tests.jobs.test_submit import (  # noqa: F401 (fixtures)
    ADDRESSES,
    JOB,
    SUBMIT,
    _client,
    _layout,
    _live,
    _torn_down,
    dataset,
    settings,
    shards,
    submit,
)
from tests.sshd import daemon_pids

pytestmark = pytest.mark.integration

#: the rounds of the job a worker node is lost in
ROUNDS = 8


def _rounds(text: str) -> list[str]:
    """The `round N/T` of each progress line (the submitter's and the driver's log alike)."""
    found = [ln.split()[1] for ln in text.splitlines() if ln.startswith("round ")]
    return [word for word in found if re.fullmatch(r"\d+/\d+", word)]


def _states(cwd: Path) -> dict[str, str]:
    """`sparknet-submit list`: run id -> state."""
    listed = submit("list", cwd=cwd, timeout=120)
    assert listed.returncode == 0, listed.stderr
    rows = [ln.split("\t") for ln in listed.stdout.splitlines()]
    assert all(len(row) == 5 and row[4] == "train" for row in rows), listed.stdout
    return {row[0]: row[2] for row in rows}


def _run_id(done: subprocess.CompletedProcess) -> str:
    out = dict(ln.split(": ", 1) for ln in done.stdout.splitlines() if ": " in ln)
    return out["run id"]


def _session_alive(leader: int) -> bool:
    """A process of the session (and group) whose leader was `leader` is still running."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == leader or int(fields[3]) == leader:  # pgrp, session
            return True
    return False


@pytest.mark.slow
def test_keep_reuse_detach_attach_logs_list_cancel(
    settings,  # noqa: F811 (the imported fixture)
    moto_nodes,
    bucket,
    tmp_path,
):
    name = settings
    group = moto_nodes(name, 1)
    _layout(group, name, tmp_path)
    try:
        _jobs_on_a_kept_cluster(name, group, bucket, tmp_path)
    finally:
        if _live(name):  # a failed check left the kept cluster up: nothing may outlive the test
            _down(name, tmp_path)


def _down(name: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(SPARKNET), "cluster", "down", name], cwd=cwd, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip


def _jobs_on_a_kept_cluster(name: str, group, bucket: str, tmp_path: Path) -> None:
    with group.watch(_client("ec2")):
        kept = submit("--s3", "tiny", "--keep", "--autostop", "7", *JOB, cwd=tmp_path)
    assert kept.returncode == 0, kept.stderr[-3000:]
    first = _run_id(kept)
    assert len(_live(name)) == 2  # master and worker still running

    # the same name without --cluster: refused before anything is launched (a made cluster's
    # teardown would end this kept one), and the kept cluster is untouched
    plain = submit("--s3", "tiny", *JOB, cwd=tmp_path)
    assert (plain.returncode, plain.stderr) == (
        2, f"error: cluster {name} already runs; pass --cluster {name} to reuse it, or --name NEW "
        "to make another\n",
    ), plain.stderr[-3000:]  # fmt: skip
    assert len(_live(name)) == 2
    settings_file = tmp_path / "master" / "autostop" / "settings.json"
    assert json.loads(settings_file.read_text())["minutes"] == 7

    # a failed job on the reused cluster (a Spark setting its driver refuses; an unknown model
    # is refused before anything): its error line, exit 1, and the cluster stays
    bad = submit(
        "--s3", "tiny", "--cluster", name, *JOB, "--conf", "spark.speculation=true", cwd=tmp_path
    )
    assert bad.returncode == 1, bad.stderr[-3000:]
    error = [ln for ln in bad.stderr.splitlines() if ln.startswith("error: ")]
    assert len(error) == 1 and "failed:" in error[0], bad.stderr[-3000:]
    assert "spark.speculation=true" in error[0], error
    assert "Traceback" not in bad.stderr
    assert len(_live(name)) == 2

    # detached: back while the job runs; its log and the list see it
    detached = submit(
        "--s3", "tiny", "--cluster", name, "--detach", *JOB, "--rounds", str(ROUNDS), cwd=tmp_path
    )
    assert detached.returncode == 0, detached.stderr[-3000:]
    run = _run_id(detached)
    assert f"sparknet-submit attach {run}" in detached.stderr
    assert _rounds(detached.stderr) == []
    job = tmp_path / "master" / "jobs" / run
    # the driver held still once round 1 is on S3 (SIGSTOP: a round that takes long), so the
    # job surely runs on while a worker node is lost and repaired below
    driver = _held_after_round_1(bucket, name, run, job)
    assert not (job / "driver.rc").exists()  # still running
    states = _states(tmp_path)
    assert states[run] == "running"
    assert states[first] == "succeeded" and states[_failed_run(states, first, run)].startswith(
        "failed "
    )

    assert submit("logs", run, cwd=tmp_path, timeout=120).returncode == 0

    # attach, and a worker node's Spark daemons killed while it follows the job: its loss check
    # (every 2 s here) restarts them and the job goes on to its end; every round, the summary
    # and the fetched files, as an attached submit; the rounds' rows record the executor lost
    # and the one that joined
    attached, victim = _attach_through_a_lost_worker(name, run, driver, tmp_path)
    assert attached.returncode == 0, attached.stderr[-3000:]
    lost = f"worker-1's worker ({ADDRESSES['worker-1']}) is not registered with the master"
    assert f"cluster {name} lost {lost}: repairing\n" in attached.stderr, attached.stderr[-3000:]
    assert f"cluster {name} repaired; the job goes on\n" in attached.stderr
    assert daemon_pids(tmp_path, ADDRESSES)["worker-1/worker"] != victim
    assert _rounds(attached.stderr) == [f"{r}/{ROUNDS}" for r in range(1, ROUNDS + 1)]
    rows = [
        json.loads(r) for r in (tmp_path / "runs" / run / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["round"] for r in rows] == list(range(1, ROUNDS + 1))
    (gone,) = [r for r in rows if "executors_lost" in r]
    (back,) = [r for r in rows if "executors_joined" in r]
    assert gone["round"] <= back["round"] and back["executors"] == 2, rows
    assert gone["executors_lost"][0].endswith(f"@{ADDRESSES['worker-1']}")
    assert back["executors_joined"][0].endswith(f"@{ADDRESSES['worker-1']}")
    assert _run_id(attached) == run and "final accuracy: " in attached.stdout
    assert (tmp_path / "runs" / run / "curves.png").read_bytes()[:4] == b"\x89PNG"
    # the log, by --cluster without the local record (as from another machine): the same
    # rounds, and the record written again from the job dir on the master
    record = tmp_path / "home" / "jobs" / f"{run}.json"
    before = json.loads(record.read_text())
    record.unlink()
    logs = submit(
        "logs", run, "--cluster", name, "--lines", "1000", "--follow", cwd=tmp_path, timeout=120
    )
    assert logs.returncode == 0, logs.stderr
    # the same rounds; under the allreduce transport the lost worker failed the stage, which
    # ran again from its last checkpoint: the rounds after it are in the log twice, after the
    # warning that says so
    logged = _rounds(logs.stdout)
    assert list(dict.fromkeys(logged)) == _rounds(attached.stderr)
    assert len(set(logged)) == len(logged) or "running it again from round" in logs.stdout
    after = json.loads(record.read_text())
    assert {k: after[k] for k in ("prefix", "job_dir", "rounds")} == {
        k: before[k] for k in ("prefix", "job_dir", "rounds")
    }
    assert _states(tmp_path)[run] == "succeeded"

    # a second detached job, cancelled while it runs: its whole session ends
    # (200 rounds: it still runs whatever the machine's load; the last --rounds counts)
    second = submit(
        "--s3", "tiny", "--cluster", name, "--detach", *JOB, "--rounds", "200", cwd=tmp_path
    )
    assert second.returncode == 0, second.stderr[-3000:]
    other = _run_id(second)
    leader = int((tmp_path / "master" / "jobs" / other / "driver.pid").read_text())
    # SIGTERM to an attach only detaches it: exit 143, the job goes on
    watcher = subprocess.Popen(
        [str(SUBMIT), "attach", other], cwd=tmp_path, env=os.environ.copy(),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    for line in watcher.stderr:
        if line.startswith(f"attached to job {other}"):
            watcher.send_signal(signal.SIGTERM)
            break
    _out, err = watcher.communicate(timeout=120)
    assert watcher.returncode == 143, err
    assert f"detached from job {other}: it goes on" in err
    assert _session_alive(leader)
    cancelled = submit("cancel", other, cwd=tmp_path, timeout=180)
    assert cancelled.returncode == 0, cancelled.stderr
    assert f"job {other} cancelled" in cancelled.stderr
    assert not _session_alive(leader)
    assert _states(tmp_path)[other] == "cancelled"

    down = _down(name, tmp_path)
    assert down.returncode == 0, down.stderr[-3000:]
    _torn_down(name, tmp_path)
    assert set(_states(tmp_path).values()) == {"cluster gone"}
    gone = submit("attach", run, cwd=tmp_path, timeout=120)
    assert gone.returncode == 2 and gone.stderr.startswith(f"error: job {run}: cluster {name}")
    assert len(gone.stderr.splitlines()) == 1


def _held_after_round_1(bucket: str, name: str, run: str, job: Path) -> int:
    """Once round 1 of `run` is in its metrics.jsonl on moto, SIGSTOP its driver (the train
    process on the loopback master); its pid."""
    key = f"runs/{name}/{run}/metrics.jsonl"
    s3 = _client("s3")
    deadline = time.monotonic() + 300
    while True:
        assert time.monotonic() < deadline and not (job / "driver.rc").exists(), "no round 1"
        with contextlib.suppress(s3.exceptions.NoSuchKey):
            if '"round"' in s3.get_object(Bucket=bucket, Key=key)["Body"].read().decode():
                break
        time.sleep(0.2)
    driver = int((job / "train.pid").read_text())
    os.kill(driver, signal.SIGSTOP)
    return driver


def _attach_through_a_lost_worker(
    name: str, run: str, driver: int, cwd: Path
) -> tuple[subprocess.CompletedProcess, int]:
    """`attach` to the job `run`, whose `driver` is held still: once attached, kill -9 the
    worker node's Spark worker (its executor exits with it); once the attach's loss check has
    repaired the cluster (or said that it could not), let the driver go on, and follow the
    attach to its end. The attach's run, and the pid killed."""
    from sparknet.cluster.repair import CHECK_EVERY_ENV

    watcher = subprocess.Popen(
        [str(SUBMIT), "attach", run], cwd=cwd, env={**os.environ, CHECK_EVERY_ENV: "2"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    timer = threading.Timer(300, watcher.kill)  # an attach that hangs fails the test
    timer.start()
    seen, victim = [], 0
    try:
        for line in watcher.stderr:  # to the end (communicate() would skip what was buffered)
            seen.append(line)
            if line.startswith(f"attached to job {run}"):
                victim = daemon_pids(cwd, ADDRESSES)["worker-1/worker"]
                before = set(_executor_logs(cwd))
                os.kill(victim, signal.SIGKILL)
            elif line.startswith(f"cluster {name} repaired"):
                _new_executor_registered(cwd, before)  # else the last rounds could outrun it
                os.kill(driver, signal.SIGCONT)
            elif "check or repair failed" in line:
                os.kill(driver, signal.SIGCONT)
        stdout = watcher.stdout.read()
        watcher.wait(timeout=60)
    finally:
        timer.cancel()
        with contextlib.suppress(ProcessLookupError):
            os.kill(driver, signal.SIGCONT)
    return subprocess.CompletedProcess(
        watcher.args, watcher.returncode, stdout, "".join(seen)
    ), victim


def _executor_logs(root: Path) -> list[Path]:
    """The stderr of every executor the worker node's Spark worker ever started."""
    return sorted((root / "worker-1" / "work").glob("app-*/*/stderr"))


def _new_executor_registered(root: Path, before: set[Path], timeout: float = 120) -> None:
    """Until an executor started on the worker node since `before` has registered its block
    manager with the driver (its log says so): the driver then counts it at the next round."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for log in set(_executor_logs(root)) - before:
            if "Registered BlockManager" in log.read_text(errors="replace"):
                return
        time.sleep(0.2)


def _failed_run(states: dict[str, str], *others: str) -> str:
    """The one run of `states` that is none of `others` and not running."""
    (found,) = [r for r, s in states.items() if r not in others and s != "running"]
    return found
