"""The job's driver on the master, worked from the submitter's machine.

Where the master is and how to reach it, the job dir, the command that starts the driver under
its supervisor, and the commands that ask how the job stands or end it (each one line that runs
a function of `sparknet.node.job` on the master).

Separate from the flow because everything that asks a master about a job needs it and nothing
else of a submit: `follow` (the job's state while it runs), the job records (`attach`, `logs`,
`cancel`, `list`) and `sparknet cluster down` (the jobs still running)."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import yaml

from sparknet.cluster import nodes, provider, registry
from sparknet.cluster.aws import autostop
from sparknet.cluster.remote import CommandFailed, Conn, q, run, upload
from sparknet.cluster.spark.bootstrap import running_jobs
from sparknet.cluster.spark.plan import JOB_PID, JOBS_DIR, Node
from sparknet.cluster.spec import ClusterSpec
from sparknet.config import TrainConfig
from sparknet.errors import SparknetError
from sparknet.jobs.supervisor import DEFAULT_MAX_RESTARTS, JOB_CONFIG
from sparknet.node import job
from sparknet.node.command import node_command

#: how long a cancel waits for the job's session to end before it kills what is left of it
CANCEL_WAIT_S = job.CANCEL_WAIT_S
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
    access, planned = provider.of(spec).nodes_of(spec, endpoint_url)
    master = planned[0]
    url = f"spark://{master.rpc_host}:{spec.bootstrap.master_port}"
    return Master(master, access, url, len(planned), tuple(n.gpus for n in planned))


#: seconds `cluster down` gives the master to answer which jobs run there before it goes on
#: without naming them (a master that is running but unreachable is taken down all the same)
JOBS_ASK_S = 10.0


def jobs_on(spec: ClusterSpec, endpoint_url: str | None, *, any_owner: bool = False) -> list[str]:
    """The run ids of the sparknet-submit jobs whose session is alive on the cluster's master
    (what `cluster down` cancels); none where it has no running master or it does not answer
    within `JOBS_ASK_S` (`down` ends what runs there all the same). Asked only of a cluster
    bootstrapped from here (its secret is here, as for any job submitted from here) and, unless
    `any_owner`, the caller's own: `down` refuses another principal's cluster, and logs in to
    nothing of theirs before it does."""
    if not registry.secret_file(spec.name).is_file():
        return []
    cluster = provider.of(spec)
    try:
        if not cluster.master_running(spec, endpoint_url):
            return []
        if not any_owner:
            cluster.check_owner(spec, endpoint_url)
        master = master_of(spec, endpoint_url)
        conn = nodes.connect(master.node.endpoint, master.access, timeout=JOBS_ASK_S)
        try:
            return running_jobs(conn, master.node)
        finally:
            conn.close()
    except SparknetError:
        return []


def job_dir(node: Node, run_id: str) -> str:
    return node.path(JOBS_DIR, run_id)


def activity_name(run_id: str) -> str:
    return f"job-{run_id}"


def driver_command(node: Node, run_id: str, max_restarts: int = DEFAULT_MAX_RESTARTS) -> str:
    """The command that starts the job's supervisor (`sparknet.jobs.supervisor`, run by the
    node's venv Python) in its own session (`node.daemon.start`, as daemons.py starts Spark
    without systemd), so it outlives the SSH session that started it. The supervisor stamps the
    autostop activity file while the job runs, runs `sparknet train` (restarting it from the
    last checkpoint when it dies, up to `max_restarts` times), and at the end writes the exit
    code (a file of its own: the submitter may be gone); its output and the driver's are the
    log. The pid file names the supervisor: its session is the job's."""
    jd = job_dir(node, run_id)
    supervisor = [
        node.python, "-m", "sparknet.jobs.supervisor", jd,
        "--sparknet", node.path("venv", "bin", "sparknet"),
        "--state", autostop.state_dir(node.prefix), "--activity", activity_name(run_id),
        "--local-ip", node.rpc_host, "--max-restarts", str(max_restarts),
    ]  # fmt: skip
    where = ["--pid-file", f"{jd}/{PID}", "--log", f"{jd}/{LOG}", "--cwd", jd]
    return on_master(node, "daemon-start", *where, "--", *supervisor)


def start_driver(
    conn: Conn,
    node: Node,
    run_id: str,
    cfg: TrainConfig,
    max_restarts: int = DEFAULT_MAX_RESTARTS,
    command: Sequence[str] = (),
) -> None:
    """The job dir with the settings file, then the detached supervisor and driver. A
    `command` (`sparknet` arguments: a model's evaluate or predict) is the driver instead of
    `sparknet train` on the settings; it goes into the settings file as `command:`."""
    jd = job_dir(node, run_id)
    text = cfg.to_yaml() + (yaml.safe_dump({"command": list(command)}) if command else "")
    try:
        run(conn, f"umask 077 && mkdir -p {q(jd)}")  # the job's settings and logs: its user's
        upload(conn, text.encode(), f"{jd}/{JOB_CONFIG}", 0o600)
        run(conn, driver_command(node, run_id, max_restarts))
    except CommandFailed as exc:
        raise SparknetError(
            "starting the driver in {jd} on the master: {cause}", jd=jd, cause=exc
        ) from exc


def on_master(node: Node, command: str, *args: object) -> str:
    """The command line that runs `sparknet.node`'s `command` in the master's venv."""
    return node_command(node.python, command, *args)


def driver_rc(conn: Conn, node: Node, run_id: str) -> int | None:
    """The job's exit code once it ended (`node.job.rc`: its supervisor's, the driver's last
    after any restarts); None while it runs. A job gone without one (cancelled, killed) counts
    as failed (-1)."""
    text = run(conn, on_master(node, "job-rc", job_dir(node, run_id))).strip()
    return parse_rc(text) if text else None


#: the exit code in a `driver.rc` (a failure, -1, where it does not read as a number)
parse_rc = job.parse_rc


def driver_log(conn: Conn, node: Node, run_id: str, lines: int = 200) -> str:
    return run(conn, f"tail -n {lines} {q(job_dir(node, run_id) + '/' + LOG)} 2>/dev/null || true")


def cancel_driver(conn: Conn, node: Node, run_id: str) -> None:
    """Ask the job to end, best effort, without waiting: SIGTERM to its supervisor, which
    passes it on to the driver (one signal: the driver stops its Spark in order; a signal to
    the whole group would also reach its JVM, which then stops under it); to the whole
    process group when the supervisor is gone (its driver left running)."""
    run(conn, on_master(node, "job-signal", job_dir(node, run_id)))


def stop_session(
    conn: Conn, node: Node, run_id: str, wait_s: float | None = None, poll_s: float = 0.2
) -> None:
    """`cancel_driver`, then wait until no process of the job's session is left: SIGKILL to
    the whole group once `wait_s` (default CANCEL_WAIT_S) has passed. One command on the node,
    so a cancel costs one SSH round trip, not one per look."""
    wait = CANCEL_WAIT_S if wait_s is None else wait_s
    jd = job_dir(node, run_id)
    run(conn, on_master(node, "job-stop", jd, "--wait", wait, "--poll", poll_s), timeout=wait + 60)


def cancel_job(conn: Conn, node: Node, run_id: str, wait_s: float | None = None) -> bool:
    """End the job as `sparknet-submit cancel` does: when any process of its session is alive
    (whatever its state says: a driver whose supervisor was killed runs on, holding the
    GPUs), mark it cancelled (the marker its state reads) and stop it as `stop_session`
    does (`node.job.cancel`: one command on the master); whether there was any. A job none of
    whose processes is left is left as it ended."""
    wait = CANCEL_WAIT_S if wait_s is None else wait_s
    jd = job_dir(node, run_id)
    out = run(conn, on_master(node, "job-cancel", jd, "--wait", wait), timeout=wait + 60)
    return out.strip() == job.CANCELLED


#: the state of a job whose supervisor left its driver (or a child) running
ORPHANED = job.ORPHANED


def how_it_ended(conn: Conn, node: Node, run_id: str) -> str:
    """Of a job whose supervisor is gone (`node.job.how_it_ended`): `rc` (it wrote its exit
    code), ORPHANED (no code, but its process group still has a member), `cancelled` (the
    marker) or "" (its supervisor was killed, and nothing of it is left)."""
    return run(conn, on_master(node, "job-ended", job_dir(node, run_id))).strip()


def stamp_submitter(conn: Conn, node: Node) -> None:
    """The attached submitter's autostop activity stamp."""
    run(conn, autostop.activity_command(node.prefix, f"submitter-{_host_pid()}"))


def _host_pid() -> str:
    """This submitter's name among the activity files: host and process id."""
    return f"{socket.gethostname()}-{os.getpid()}".replace("/", "_")


def quietly(action: Callable[[], None]) -> None:
    """Best effort while something else is raised: its failure must not replace that."""
    with contextlib.suppress(Exception):  # what is being raised says what went wrong
        action()
