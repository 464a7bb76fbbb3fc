"""`python -m sparknet.node COMMAND ...`: the command line the submitter sends a node over SSH.

Each command is one function of a module of this package (`daemon`, `job`, `dependencies`,
`spark_master`, `torch_build`); a wait that ends without what it waited for exits 1 with one line
on stderr (the submitter adds the daemon's log)."""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Sequence

from sparknet.node import daemon, dependencies, job, spark_master, torch_build

#: the commands on one job dir
JOB_COMMANDS = {
    "job-rc": "print the job's exit code (nothing while it runs)",
    "job-state": "print the job's state",
    "job-ended": "print how a job whose supervisor is gone ended",
    "job-signal": "SIGTERM to the job's supervisor (or its group)",
}
#: the commands that end a job, waiting for its session
JOB_ENDINGS = {
    "job-stop": "signal the job, wait for its session, then KILL it",
    "job-cancel": "mark the job cancelled and stop it, if it runs",
}


def _daemon_args(p: argparse.ArgumentParser, *, stamp: bool = False) -> None:
    p.add_argument("--pid-file", required=True)
    p.add_argument("--klass", required=True, help="a word of the daemon's command line")
    p.add_argument("--own", required=True, help="a path only this prefix's daemon has")
    if stamp:
        p.add_argument("--stamp-file", required=True)
        p.add_argument("--stamp", required=True)


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="python -m sparknet.node", description=__doc__)
    sub = top.add_subparsers(dest="command", required=True)

    p = sub.add_parser("daemon-running", help="exit 0 if the daemon runs (with --stamp: as today)")
    _daemon_args(p)
    p.add_argument("--stamp-file")
    p.add_argument("--stamp")
    p = sub.add_parser("daemon-start", help="start ARGV as a daemon in its own session")
    p.add_argument("--pid-file", required=True)
    p.add_argument("--stamp-file")
    p.add_argument("--stamp", default="")
    p.add_argument("--log", required=True)
    p.add_argument("--cwd", required=True)
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE")
    p.add_argument("argv", nargs=argparse.REMAINDER)
    p = sub.add_parser("daemon-stop", help="TERM, then KILL, the daemon's process group")
    _daemon_args(p, stamp=False)
    p.add_argument("--stamp-file", required=True)
    p = sub.add_parser("daemon-wait", help="until the daemon is alive")
    _daemon_args(p)
    p.add_argument("--within", type=float, required=True)
    p = sub.add_parser("wait-port", help="until HOST:PORT takes a connection")
    p.add_argument("host")
    p.add_argument("port", type=int)
    p.add_argument("--within", type=float, required=True)
    p = sub.add_parser("wait-file", help="until PATH has content")
    p.add_argument("path")
    p.add_argument("--within", type=float, required=True)
    sub.add_parser("spark-home", help="print the venv's pyspark dir")
    p = sub.add_parser("master-json", help="print the Spark master's state (its UI's /json/)")
    p.add_argument("host")
    p.add_argument("port", type=int)
    sub.add_parser("dependencies", help="exit 1 naming sparknet's requirements not installed")
    sub.add_parser("torch-build", help="print torch's version and the CUDA it was built for")

    for name, what in JOB_COMMANDS.items():
        sub.add_parser(name, help=what).add_argument("job_dir")
    for name, what in JOB_ENDINGS.items():
        p = sub.add_parser(name, help=what)
        p.add_argument("job_dir")
        p.add_argument("--wait", type=float, default=job.CANCEL_WAIT_S)
        p.add_argument("--poll", type=float, default=0.2)
    for name, what in (("jobs-live", "print the run ids of the live jobs under JOBS_DIR"),
                       ("jobs-end", "mark every live job cancelled and SIGTERM it")):  # fmt: skip
        sub.add_parser(name, help=what).add_argument("jobs_dir")
    p = sub.add_parser("log-since", help="print LOG's size, then its bytes from OFFSET")
    p.add_argument("log")
    p.add_argument("offset", type=int)
    p.add_argument("--lines", type=int, help="only the last LINES lines of them")
    return top


def _env(pairs: Sequence[str]) -> dict[str, str]:
    return dict(pair.split("=", 1) for pair in pairs)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; its exit status."""
    a = parser().parse_args(argv)
    c = a.command
    if c == "daemon-running":
        if a.stamp is not None:
            return 0 if daemon.running(a.pid_file, a.klass, a.own, a.stamp_file, a.stamp) else 1
        return 0 if daemon.alive(a.pid_file, a.klass, a.own) else 1
    if c == "daemon-start":
        argv_ = a.argv[1:] if a.argv[:1] == ["--"] else a.argv
        daemon.start(argv_, _env(a.env), a.cwd, a.log, a.pid_file, a.stamp_file, a.stamp)
    elif c == "daemon-stop":
        daemon.stop(a.pid_file, a.stamp_file, a.klass, a.own)
    elif c == "daemon-wait":
        if not daemon.wait_started(a.pid_file, a.klass, a.own, a.within):
            return _failed(f"{a.klass} did not start within {a.within:g} s")
    elif c == "wait-port":
        if not daemon.wait_listening(a.host, a.port, a.within):
            return _failed(f"nothing listens on {a.host}:{a.port} within {a.within:g} s")
    elif c == "wait-file":
        if not daemon.wait_file(a.path, a.within):
            return _failed(f"{a.path} is not written within {a.within:g} s")
    elif c == "spark-home":
        print(daemon.spark_home())
    elif c == "master-json":
        try:
            print(spark_master.master_json(a.host, a.port))
        except OSError as exc:  # the line a traceback would end with: what the status shows
            return _failed(traceback.format_exception_only(exc)[-1].strip())
    elif c == "torch-build":
        print(*torch_build.torch_build())
    elif c == "dependencies":
        absent = dependencies.missing()
        if absent:
            return _failed(f"missing: {' '.join(absent)}")
    elif c == "job-rc":
        code = job.rc(a.job_dir)
        print("" if code is None else code)
    elif c == "job-state":
        print(job.state(a.job_dir))
    elif c == "job-ended":
        print(job.how_it_ended(a.job_dir))
    elif c == "job-signal":
        job.signal_job(a.job_dir)
    elif c == "job-stop":
        job.stop_session(a.job_dir, a.wait, a.poll)
    elif c == "job-cancel":
        print(job.CANCELLED if job.cancel(a.job_dir, a.wait) else "")
    elif c == "jobs-live":
        print("\n".join(job.live_jobs(a.jobs_dir)))
    elif c == "jobs-end":
        job.end_jobs(a.jobs_dir)
    elif c == "log-since":
        sys.stdout.buffer.write(job.log_since(a.log, a.offset, a.lines))
    return 0


def _failed(line: str) -> int:
    print(line, file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
