"""The job's supervisor on a cluster's master, which restarts a driver that dies.

What `sparknet-submit` starts there, detached from the SSH session (`nohup setsid`), in the job
dir (design.md, section 2).

It runs the driver, `sparknet train --config job.yaml`, as a child, and while the job runs it
stamps the autostop activity file of the job (so the timer does not end a cluster that works).
When the driver *dies* (killed by a signal, or an exit that is no deliberate end: a crash's
traceback exits 1) it restarts it, up to `--max-restarts` times, as `sparknet train --out PREFIX
--resume` from the run prefix's last complete checkpoint (with none yet: from the start, with
--config), and records each restart as an event row in the run prefix's metrics.jsonl and as a
line in driver.log. Deliberate ends are final: 0, 2 (`sparknet train`'s one-line `error:` for a
bad setting or a run error it diagnosed: a restart would only repeat it), 129/130/143 (SIGHUP,
Ctrl-C, SIGTERM: somebody stopped it). A cancel (SIGTERM or SIGINT to the supervisor or its
session) ends the driver and the supervisor, never a restart. A supervisor that dies itself (a
kill -9) takes the driver with it: the driver gets SIGTERM then (`dies_with`).

Files in the job dir: `train.pid` (the driver now running: `kill -9 $(cat train.pid)` kills
exactly the driver), `driver.rc` (the final exit code, as a shell reports it: 128 + the signal
of a killed driver; none after a cancel, as before there was a supervisor).

    python -m sparknet.jobs.supervisor JOBDIR --sparknet PATH --state DIR --activity NAME
        [--local-ip IP] [--max-restarts N]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from sparknet.cluster.aws import autostop
from sparknet.errors import as_flag
from sparknet.node import job as node_job

# `# lazy: X` below: `sparknet-submit attach` imports this module (`restart_line`); boto3 and
# torch only where the supervisor on the master reads a checkpoint or writes metrics

#: the files of the job dir that the supervisor reads or writes
JOB_CONFIG, RC, TRAIN_PID = "job.yaml", node_job.RC, "train.pid"
#: a driver's exits that are deliberate ends: success, its own `error:` line, an interrupt
FINAL_EXITS = frozenset({0, 2, 128 + signal.SIGHUP, 128 + signal.SIGINT, 128 + signal.SIGTERM})
#: signals that stop a driver on purpose (somebody's kill, Ctrl-C, a closed session): final
STOPS = frozenset({signal.SIGHUP, signal.SIGINT, signal.SIGTERM})
#: restarts when `--max-restarts` is not given
DEFAULT_MAX_RESTARTS = 2
#: the `event` of a restart's row in metrics.jsonl
RESTART = "restart"
#: how often the job's autostop activity file is touched: a third of ACTIVITY_EVERY_S, so that
#: a timer check just before the next touch finds the last one at most this old, well inside the
#: shortest deadline (1 minute: with a touch every minute such a check terminated a running job)
STAMP_EVERY_S = autostop.ACTIVITY_EVERY_S / 3


# --- decisions (pure) ----------------------------------------------------------------------------


def exit_code(returncode: int) -> int:
    """A child's exit as a shell reports it: 128 + the signal of one killed by a signal."""
    return 128 - returncode if returncode < 0 else returncode


def death(returncode: int) -> str | None:
    """Why a driver that ended with `returncode` (subprocess's: negative for a signal) died, or
    None when its end was deliberate (`FINAL_EXITS`, `STOPS`) and it must not be restarted."""
    if returncode < 0:
        if -returncode in STOPS:
            return None
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"killed by {name}"
    return None if returncode in FINAL_EXITS else f"exited {returncode}"


def restart_event(
    attempt: int, max_restarts: int, after_round: int, reason: str, now: float
) -> dict[str, Any]:
    """The metrics.jsonl row of one restart (a row with `event`, never a round's)."""
    return {
        "event": RESTART, "attempt": attempt, "max_restarts": max_restarts,
        "after_round": after_round, "reason": reason, "time": now,
    }  # fmt: skip


def restart_line(event: dict[str, Any]) -> str:
    """The line a restart shows in driver.log and at the submitter."""
    where = f"round {event['after_round']}" if event["after_round"] else "the start"
    return (
        f"driver died ({event['reason']}); restart {event['attempt']}/"
        f"{event['max_restarts']} from {where}"
    )


def used_up_line(reason: str, max_restarts: int) -> str:
    """The supervisor's last `error:` line (the submitter's failure line) once restarts ran out;
    the setting is spelt as `sparknet-submit`'s flag, the only front end that starts a job."""
    setting = as_flag("max_restarts", max_restarts)
    if max_restarts == 0:
        return f"the driver died ({reason}); {setting}: no restart"
    plural = "s" if max_restarts > 1 else ""
    return f"the driver died ({reason}) after {max_restarts} restart{plural}; {setting} used up"


@dataclass(frozen=True)
class Job:
    """What the supervisor needs of a job: its dir, and its run prefix and S3 endpoint (from the
    job's settings file, job.yaml)."""

    dir: Path
    #: None: the settings name no run dir (a submit always sets one): restarts start over
    out: str | None
    endpoint_url: str | None = None
    #: the driver's `sparknet` arguments where it is no training (job.yaml's `command:`:
    #: `sparknet evaluate ...` or `predict ...`, run again as it was on a restart)
    command: tuple[str, ...] = ()

    @classmethod
    def read(cls, job_dir: Path) -> Job:
        doc = yaml.safe_load((job_dir / JOB_CONFIG).read_text())
        train = doc["train"]
        command = tuple(str(a) for a in doc.get("command") or ())
        return cls(job_dir, train.get("out"), train.get("endpoint_url"), command)

    def train_args(self, resume: bool) -> list[str]:
        """The driver's `sparknet` arguments: the job's `command`, else `train` on the job's
        settings, or on the run prefix to resume (its own config.yaml then holds the settings;
        the endpoint is needed to read it)."""
        if self.command:
            return list(self.command)
        if not resume or self.out is None:
            return ["train", "--config", str(self.dir / JOB_CONFIG)]
        endpoint = ["--endpoint-url", self.endpoint_url] if self.endpoint_url else []
        return ["train", "--out", self.out, "--resume", *endpoint]


def last_checkpoint(job: Job) -> int | None:
    """The rounds of the run prefix's last complete checkpoint (None: none yet)."""
    from sparknet.data.store import open_store  # lazy: boto3
    from sparknet.training import checkpoint  # torch: only when a restart needs it

    if job.out is None:
        return None
    return checkpoint.latest(open_store(job.out, job.endpoint_url))


def record_restart(job: Job, event: dict[str, Any]) -> None:
    """Append the event row to metrics.jsonl, dropping the rows past the checkpoint the driver
    resumes from, as its resume does (so the file reads in order)."""
    from sparknet.data.store import open_store  # lazy: boto3
    from sparknet.training.report import MetricsLog  # lazy: boto3

    if job.out is None:
        return
    MetricsLog(open_store(job.out, job.endpoint_url), keep_rounds=event["after_round"]).append(
        event
    )


# --- the process ---------------------------------------------------------------------------------


class Supervisor:
    """Runs the driver, restarts it when it dies, and ends it on a cancel."""

    def __init__(self, job: Job, sparknet: str, env: dict[str, str], max_restarts: int) -> None:
        self.job, self.sparknet, self.env = job, sparknet, env
        self.max_restarts = max_restarts
        self.cancelled: int | None = None
        self.child: subprocess.Popen | None = None

    def cancel(self, signum: int, _frame: Any = None) -> None:
        """A cancel: pass it on to the driver (a signal to the whole session reached it too)."""
        self.cancelled = self.cancelled or signum
        if self.child is not None and self.child.poll() is None:
            with contextlib.suppress(OSError):
                self.child.send_signal(signum)

    def run(self) -> int | None:
        """The final exit code (as a shell reports it), or None after a cancel."""
        attempt, resume = 0, False
        while True:
            returncode = self._train(resume)
            if self.cancelled:
                return None
            reason = death(returncode)
            if reason is None:
                return exit_code(returncode)
            if attempt >= self.max_restarts:
                say(f"error: {used_up_line(reason, self.max_restarts)}")
                return exit_code(returncode)
            attempt += 1
            resume = self._restart(attempt, reason)

    def _train(self, resume: bool) -> int:
        """Run the driver once; its return code (negative: killed by that signal)."""
        cmd = [self.sparknet, *self.job.train_args(resume)]
        self.child = subprocess.Popen(
            cmd, cwd=self.job.dir, env=self.env, preexec_fn=dies_with(os.getpid())
        )
        _write_atomic(self.job.dir / TRAIN_PID, f"{self.child.pid}\n")
        if self.cancelled:  # came while it started: it may have missed the signal
            self.cancel(self.cancelled)
        return self.child.wait()

    def _restart(self, attempt: int, reason: str) -> bool:
        """Record restart `attempt`; whether the driver resumes (a checkpoint is there, or the
        checkpoints could not be listed: the resume then says what is wrong)."""
        try:
            after = last_checkpoint(self.job)
        except Exception as exc:  # one line in the log; the restart goes on
            say(f"warning: could not list the checkpoints in {self.job.out}: {_one_line(exc)}")
            say(f"driver died ({reason}); restart {attempt}/{self.max_restarts}")
            return True
        event = restart_event(attempt, self.max_restarts, after or 0, reason, time.time())
        try:
            record_restart(self.job, event)
        except Exception as exc:  # a missing row must not stop the restart
            say(f"warning: could not record the restart in metrics.jsonl: {_one_line(exc)}")
        say(restart_line(event))
        return after is not None


#: prctl(2)'s option that gives a process a signal for its parent's death
PR_SET_PDEATHSIG = 1


def dies_with(parent: int) -> Callable[[], None] | None:
    """What the driver runs between fork and exec (`preexec_fn`): SIGTERM to it when the
    supervisor (`parent`) dies, by whatever means (a kill -9, the OOM killer), so no driver
    trains on, holding the GPUs and the cluster, with nobody to record its end or to restart
    it; SIGTERM, not SIGKILL: it stops its Spark and keeps its last checkpoint, as on a cancel.
    A supervisor already gone by then sends nothing: the child ends at once. None where prctl
    is missing (not Linux): the submitter then ends what a killed supervisor left
    (`submit.follow`).

    prctl is looked up here, before the fork: the child only calls it (no import, no lookup
    under locks another thread of the supervisor may hold)."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    option, signum = ctypes.c_int(PR_SET_PDEATHSIG), ctypes.c_ulong(signal.SIGTERM)

    def set_death_signal() -> None:
        prctl(option, signum)
        if os.getppid() != parent:  # died before the line above: no signal will come
            os._exit(128 + signal.SIGTERM)

    return set_death_signal


def _end_leftovers() -> None:
    """SIGTERM to what is left of the job's process group once its driver ended (a child that
    outlived it), the supervisor's own ignored: after the job nothing of it runs on, and a
    cancel, which signals the supervisor alone, finds no straggler to wait for. Only as the
    leader of its own group (`setsid` started it): never the group of whoever ran it else."""
    if os.getpgrp() != os.getpid():
        return
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with contextlib.suppress(OSError):
        os.killpg(0, signal.SIGTERM)


def say(line: str) -> None:
    """One line of driver.log (the supervisor's stdout), at once."""
    print(line, flush=True)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


class _Stamps:
    """The job's autostop activity file, touched every STAMP_EVERY_S while the job runs and
    removed at its end (its last touch, and the dir's change, stay the last activity)."""

    def __init__(self, state: Path, name: str) -> None:
        self.state, self.name = state, name
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="autostop-stamp", daemon=True)

    def __enter__(self) -> _Stamps:
        autostop.record_activity(self.state, self.name)
        self.thread.start()
        return self

    def _loop(self) -> None:
        while not self.stop.wait(STAMP_EVERY_S):
            with contextlib.suppress(OSError):
                autostop.record_activity(self.state, self.name)

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()
        with contextlib.suppress(OSError):
            autostop.record_activity(self.state, self.name)
        with contextlib.suppress(OSError):
            (self.state / autostop.ACTIVITY / self.name).unlink()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sparknet.jobs.supervisor")
    parser.add_argument("job_dir", type=Path, help="the job dir (holds job.yaml)")
    parser.add_argument("--sparknet", required=True, help="the node's `sparknet` executable")
    parser.add_argument("--state", type=Path, required=True, help="the autostop state dir")
    parser.add_argument("--activity", required=True, help="the job's activity file name")
    parser.add_argument(
        "--local-ip", default=None,
        help="the node's cluster address: the driver's RPC and block manager bind it (its UI "
        "stays on 127.0.0.1)",
    )  # fmt: skip
    parser.add_argument("--max-restarts", type=int, default=DEFAULT_MAX_RESTARTS)
    args = parser.parse_args(argv)
    job_dir = args.job_dir.resolve()
    env = dict(os.environ)
    if args.local_ip:
        env["SPARK_LOCAL_IP"] = args.local_ip
    supervisor = Supervisor(Job.read(job_dir), args.sparknet, env, max(0, args.max_restarts))
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, supervisor.cancel)
    rc: int | None = 1
    try:
        with _Stamps(args.state, args.activity):
            rc = supervisor.run()
    except Exception as exc:  # the submitter reads the line and the rc file
        say(f"error: the job's supervisor failed: {_one_line(exc)}")
        rc = 1
    finally:
        with contextlib.suppress(OSError):
            (job_dir / TRAIN_PID).unlink()
        if rc is not None:
            _write_atomic(job_dir / RC, f"{rc}\n")
        _end_leftovers()
    return rc if rc is not None else 128 + (supervisor.cancelled or signal.SIGTERM)


if __name__ == "__main__":
    sys.exit(main())
