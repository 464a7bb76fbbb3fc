"""The job's driver on the master, worked from the submitter's machine: where the master is and
how to reach it, the job dir, the command that starts the driver under its supervisor, and the
shell commands that ask how the job stands or end it.

Separate from the flow because everything that asks a master about a job needs it and nothing
else of a submit: `follow` (the job's state while it runs), the job records (`attach`, `logs`,
`cancel`, `list`) and `sparknet cluster down` (the jobs still running)."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass

from sparknet.cluster import nodes, provider
from sparknet.cluster.aws import autostop
from sparknet.cluster.remote import CommandFailed, Conn, q, run, succeeds, upload
from sparknet.cluster.spark.plan import JOB_CANCELLED, JOB_PID, JOBS_DIR, Node
from sparknet.cluster.spec import ClusterSpec
from sparknet.config import TrainConfig
from sparknet.errors import SparknetError
from sparknet.jobs.supervisor import DEFAULT_MAX_RESTARTS, JOB_CONFIG, RC

#: how long a cancel waits for the job's session to end before it kills what is left of it
CANCEL_WAIT_S = 60.0
#: the driver's files in its job dir on the master (PID: the supervisor's, whose session is
#: the job's; the supervisor's `train.pid` names the `sparknet train` process running now)
LOG, PID = "driver.log", JOB_PID


@dataclass(frozen=True)
class Master:
    """The master node of a running cluster, how to reach it, and its Spark."""

    node: Node
    access: nodes.Access
    spark_url: str
    #: Spark worker nodes (the master runs one too)
    nodes: int
    #: each Spark worker node's GPUs, master first (empty: the master's count for every node)
    gpus: tuple[int, ...] = ()


def master_of(spec: ClusterSpec, endpoint_url: str | None) -> Master:
    """The running cluster's master as the bootstrap laid it out."""
    access, planned = provider.nodes_of(spec, endpoint_url)
    master = planned[0]
    url = f"spark://{master.rpc_host}:{spec.bootstrap.master_port}"
    return Master(master, access, url, len(planned), tuple(n.gpus for n in planned))


def job_dir(node: Node, run_id: str) -> str:
    return node.path(JOBS_DIR, run_id)


def activity_name(run_id: str) -> str:
    return f"job-{run_id}"


def driver_command(node: Node, run_id: str, max_restarts: int = DEFAULT_MAX_RESTARTS) -> str:
    """The shell command that starts the job's supervisor (`sparknet.jobs.supervisor`, run by the
    node's venv Python) in its own session (`setsid`, as daemons.py starts Spark without
    systemd), so it outlives the SSH session that started it. The supervisor stamps the
    autostop activity file while the job runs, runs `sparknet train` (restarting it from the
    last checkpoint when it dies, up to `max_restarts` times), and at the end writes the exit
    code (a file of its own: the submitter may be gone); its output and the driver's are the
    log. The pid file names the supervisor: its session is the job's."""
    jd = job_dir(node, run_id)
    supervisor = [
        node.path("venv", "bin", "python"), "-m", "sparknet.jobs.supervisor", jd,
        "--sparknet", node.path("venv", "bin", "sparknet"),
        "--state", autostop.state_dir(node.prefix), "--activity", activity_name(run_id),
        "--local-ip", node.rpc_host, "--max-restarts", str(max_restarts),
    ]  # fmt: skip
    # `cd || exit` and not `cd && ...&`: `a && b &` backgrounds a subshell that holds the SSH
    # channel's stdout until the driver ends (the command then returns only with the job)
    return (
        f"cd {q(jd)} || exit 1; nohup setsid {' '.join(q(a) for a in supervisor)}"
        f" > {q(jd + '/' + LOG)} 2>&1 < /dev/null & echo $! > {q(jd + '/' + PID)}"
    )


def start_driver(
    conn: Conn,
    node: Node,
    run_id: str,
    cfg: TrainConfig,
    max_restarts: int = DEFAULT_MAX_RESTARTS,
) -> None:
    """The job dir with the settings file, then the detached supervisor and driver."""
    jd = job_dir(node, run_id)
    try:
        run(conn, f"umask 077 && mkdir -p {q(jd)}")  # the job's settings and logs: its user's
        upload(conn, cfg.to_yaml().encode(), f"{jd}/{JOB_CONFIG}", 0o600)
        run(conn, driver_command(node, run_id, max_restarts))
    except CommandFailed as exc:
        raise SparknetError(f"starting the driver in {jd} on the master: {exc}") from exc


def driver_rc(conn: Conn, node: Node, run_id: str) -> int | None:
    """The job's exit code once it ended (its supervisor's: the driver's last, after any
    restarts); None while it runs. A job gone without one (cancelled, killed) counts as failed
    (-1)."""
    jd = job_dir(node, run_id)
    text = run(conn, f"cat {q(jd + '/' + RC)} 2>/dev/null || true").strip()
    if text:
        return parse_rc(text)
    pid = f"{jd}/{PID}"
    if succeeds(conn, f'kill -0 "$(cat {q(pid)})" 2>/dev/null'):
        return None
    text = run(conn, f"cat {q(jd + '/' + RC)} 2>/dev/null || true").strip()  # ended meanwhile
    return parse_rc(text) if text else -1


def parse_rc(text: str) -> int:
    """The exit code in a `driver.rc`; one that does not read as a number (a disk full while
    it was written, a hand edit) counts as a failure (-1), not a traceback."""
    try:
        return int(text.strip())
    except ValueError:
        return -1


def driver_log(conn: Conn, node: Node, run_id: str, lines: int = 200) -> str:
    return run(conn, f"tail -n {lines} {q(job_dir(node, run_id) + '/' + LOG)} 2>/dev/null || true")


def cancel_driver(conn: Conn, node: Node, run_id: str) -> None:
    """Ask the job to end, best effort, without waiting: SIGTERM to its supervisor, which
    passes it on to the driver (one signal: the driver stops its Spark in order; a signal to
    the whole group would also reach its JVM, which then stops under it); to the whole
    process group when the supervisor is gone (its driver left running)."""
    run(conn, _signal_command(job_dir(node, run_id)))


def stop_session(
    conn: Conn, node: Node, run_id: str, wait_s: float | None = None, poll_s: float = 0.2
) -> None:
    """`cancel_driver`, then wait until no process of the job's session is left: SIGKILL to
    the whole group once `wait_s` (default CANCEL_WAIT_S) has passed. One command on the node,
    so a cancel costs one SSH round trip, not one per look."""
    wait = CANCEL_WAIT_S if wait_s is None else wait_s
    group = '"-$p"'
    command = (
        f"{_signal_command(job_dir(node, run_id))}; p=$(cat {q(job_dir(node, run_id) + '/' + PID)}"
        f" 2>/dev/null) || exit 0; end=$(( $(date +%s) + {int(wait)} )); "
        f"while kill -0 -- {group} 2>/dev/null; do "
        f"[ $(date +%s) -ge $end ] && kill -KILL -- {group} 2>/dev/null; sleep {poll_s:g}; "
        "done; true"
    )
    run(conn, command, timeout=wait + 60)


def cancel_job(conn: Conn, node: Node, run_id: str, wait_s: float | None = None) -> bool:
    """End the job as `sparknet-submit cancel` does: when any process of its session is alive
    (whatever its state says: a driver whose supervisor was killed runs on, holding the
    GPUs), mark it cancelled (the marker its state reads) and `stop_session`; whether there
    was any. A job none of whose processes is left is left as it ended."""
    jd = job_dir(node, run_id)
    if not succeeds(conn, group_alive(jd)):
        return False
    run(conn, f"touch {q(jd + '/' + JOB_CANCELLED)}")
    stop_session(conn, node, run_id, wait_s)
    return True


def _signal_command(jd: str) -> str:
    """SIGTERM to the supervisor while it leads its process group (a pid only alive is not
    proof: the number may be another process's by now), else to the group."""
    pid = q(f"{jd}/{PID}")
    return (
        f'p=$(cat {pid} 2>/dev/null) && case "$p" in ""|*[!0-9]*) false;; esac && '
        f'if kill -0 "$p" 2>/dev/null && [ "$(ps -o pgid= -p "$p" | tr -d " ")" = "$p" ]; '
        f'then kill -TERM "$p"; else kill -TERM -- "-$p"; fi 2>/dev/null; true'
    )


def group_alive(jd: str) -> str:
    """The shell test that succeeds while any process of the job's session (its supervisor's
    process group: the supervisor, the driver, their children) is alive."""
    return f'kill -0 -- "-$(cat {q(jd + "/" + PID)} 2>/dev/null)" 2>/dev/null'


#: what `how_it_ended` says of a job whose supervisor left its driver (or a child) running
ORPHANED = "orphaned"


def how_it_ended(jd: str) -> str:
    """The shell command that says, of a job whose supervisor is gone, `rc` (it wrote its exit
    code), `orphaned` (no code, but its process group still has a member), `cancelled` (the
    marker) or nothing (its supervisor was killed, and nothing of it is left)."""
    rc, marker = q(f"{jd}/{RC}"), q(f"{jd}/{JOB_CANCELLED}")
    return (
        f"if test -s {rc}; then echo rc; elif {group_alive(jd)}; then echo {ORPHANED}; "
        f"elif test -e {marker}; then echo {JOB_CANCELLED}; fi; true"
    )


def stamp_submitter(conn: Conn, node: Node) -> None:
    """The attached submitter's autostop activity stamp."""
    run(conn, autostop.activity_command(node.prefix, f"submitter-{_host_pid()}"))


def _host_pid() -> str:
    """This submitter's name among the activity files: host and process id."""
    return f"{socket.gethostname()}-{os.getpid()}".replace("/", "_")


def quietly(action: Callable[[], None]) -> None:
    """Best effort while something else is raised: its failure must not replace that."""
    with contextlib.suppress(Exception):
        action()
