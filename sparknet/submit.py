"""`sparknet-submit`: one training job on a cluster, from the submitter's machine (design.md,
section 2). Checks everything that costs nothing first (dataset, run prefix, instance types),
ensures the cluster through `cluster.lifecycle` (the same functions `sparknet cluster up` and
`down` use), starts the driver on the master detached from the SSH session, follows its
metrics in the run prefix, fetches the curves, and leaves teardown to the caller's `finally`.

It sits between the CLI and cluster/training: no typer here, and the driver itself is the
node's own `sparknet train`, started with the job's resolved settings."""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import socket
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sparknet.cluster import autostop, instances, lifecycle, nodes, provider, repair, steps
from sparknet.cluster.plan import JOB_CANCELLED, JOB_PID, JOBS_DIR, Node
from sparknet.cluster.remote import CommandFailed, Conn, ConnectionLost, q, run, succeeds, upload
from sparknet.cluster.spec import ClusterSpec
from sparknet.config import DatasetEntry, TrainConfig
from sparknet.data.s3 import S3Uri
from sparknet.data.store import open_store
from sparknet.errors import SparknetError
from sparknet.supervisor import DEFAULT_MAX_RESTARTS, JOB_CONFIG, RC, restart_line
from sparknet.training.report import CURVES, METRICS, is_event, read_metrics, round_rows

if TYPE_CHECKING:
    from sparknet.data.sources import Source

Say = Callable[[str], None]

#: seconds between two looks at the run prefix and the driver while the job runs
POLL_S = 3.0
#: how long `follow` tries to reach the master again after its SSH connection broke or went
#: silent (a laptop asleep, a Wi-Fi change, a master that stopped answering) before it gives the
#: job up as out of reach; `RECONNECT_ENV` sets other seconds
GRACE_S = 300.0
RECONNECT_ENV = "SPARKNET_RECONNECT_S"
#: how long a cancel waits for the job's session to end before it kills what is left of it
CANCEL_WAIT_S = 60.0
#: the driver's files in its job dir on the master (PID: the supervisor's, whose session is
#: the job's; the supervisor's `train.pid` names the `sparknet train` process running now)
LOG, PID = "driver.log", JOB_PID


class PreflightFailed(SparknetError):
    """Something the job needs is missing before anything was launched (exit 2)."""


class JobFailed(SparknetError):
    """The driver on the master ended with a non-zero exit code."""


class JobOutOfReach(SparknetError):
    """The master did not answer over SSH for `reconnect_s()`: the job may go on there (it
    outlives the SSH session), so it is neither cancelled nor its cluster taken down."""


class SubmitBusy(PreflightFailed):
    """Another `sparknet-submit` of this machine holds the cluster's name (exit 2)."""


class TeardownFailed(SparknetError):
    """Taking the cluster down after the job did not finish: its instances may still run.
    `after` is what ended the job (None: it succeeded), for the caller to name both."""

    after: BaseException | None = None


# --- what the job runs on (pure) ---------------------------------------------------------------


@dataclass(frozen=True)
class Dataset:
    """Where the job's data is: an s3:// URI and the S3 endpoint to reach it (None: AWS)."""

    uri: str
    endpoint_url: str | None = None


def resolve_dataset(
    text: str, datasets: Mapping[str, DatasetEntry], endpoint_url: str | None = None
) -> Dataset:
    """`--s3`: a `datasets:` name or an s3:// URI; a cluster reads only S3, so a name whose
    entry is a local directory is refused, as is an unknown name (the line lists the known).
    A bare URI is reached through `endpoint_url` (`--endpoint-url`: EC2's and S3's); a name
    through its entry's own."""
    if text.startswith("s3://"):
        S3Uri.parse(text)
        return Dataset(text.rstrip("/"), endpoint_url)
    entry = datasets.get(text)
    if entry is None:
        known = ", ".join(sorted(datasets)) or "none"
        raise PreflightFailed(
            f"--s3 {text}: no such dataset in datasets: (known: {known}); give a name from "
            "sparknet.yaml's datasets: or an s3://bucket/prefix"
        )
    if not entry.uri.startswith("s3://"):
        raise PreflightFailed(
            f"--s3 {text}: datasets.{text} is {entry.uri}, not on S3; a cluster reads its data "
            "from S3 (`sparknet data upload` puts it there)"
        )
    return Dataset(entry.uri.rstrip("/"), entry.endpoint_url)


def new_run_id(now: float | None = None) -> str:
    """A run id unique per submit and sortable by time: UTC time plus 16 random bits."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(time.time() if now is None else now))
    return f"{stamp}-{secrets.token_hex(2)}"


def run_prefix(bucket: str, cluster: str, run_id: str, runs_prefix: str = "runs/") -> str:
    """`s3://BUCKET/RUNS_PREFIX/CLUSTER/RUN/` (the cluster's `cluster_runs_prefix` plus the run):
    where the driver writes everything of the run, the only prefix its nodes may write."""
    return f"s3://{bucket}/{runs_prefix}{cluster}/{run_id}/"


def runs_bucket(spec: ClusterSpec, dataset: Dataset, reused: bool = False) -> str:
    """The cluster's `bucket:`, where the node role reads `data_prefix` and writes the cluster's
    runs prefix (without one the role has no S3 access at all, so a cluster made for the job
    would fail only once up and paid for); the dataset must be under its data prefix. A reused
    cluster without one: the dataset's bucket (what it was given when it was made); so for a
    static cluster, whose hosts reach S3 with their own credentials, not a role of sparknet's."""
    if spec.bucket is None:
        if reused or provider.is_static(spec):
            return S3Uri.parse(dataset.uri).bucket
        raise PreflightFailed(
            f"cluster {spec.name} has no `bucket:` in its settings: its nodes could read no data "
            f"and write no run; set clusters.{spec.name}.bucket (the dataset's bucket)"
        )
    data = f"s3://{spec.bucket}/{spec.data_prefix}"
    if not f"{dataset.uri}/".startswith(data):
        raise PreflightFailed(
            f"dataset {dataset.uri} is outside {data}, the only data cluster {spec.name}'s nodes "
            f"may read; upload it there (`sparknet data upload`) or set clusters.{spec.name}'s "
            "bucket and data_prefix"
        )
    return spec.bucket


def progress_line(row: Mapping[str, Any], total: int, cost: float | None) -> str:
    """One plain line per round: round, loss, accuracy (when evaluated), samples/s, cost."""
    acc = f"  acc {row['eval_accuracy']:.3f}" if "eval_accuracy" in row else ""
    usd = "unknown" if cost is None else f"${cost:.2f}"  # a static cluster's: no price
    return (
        f"round {row['round']}/{total}  loss {row['loss']:.4f}{acc}  "
        f"{row['samples_per_s']:.0f} samples/s  cost {usd}"
    )


def last_error(log: str) -> str | None:
    """The driver's last `error: ...` line (what `sparknet train` prints when it fails)."""
    found = [ln.strip() for ln in log.splitlines() if ln.strip().startswith("error:")]
    return found[-1][len("error:") :].strip() if found else None


# --- preflight: nothing is launched before these pass ------------------------------------------


def check_dataset(dataset: Dataset, cfg: TrainConfig | None = None) -> Source:
    """`sparknet train`'s own checks of a shard dataset before Spark starts (`shard_source`):
    the manifest reads, every shard it lists is there with the manifest's size (a HEAD each,
    in parallel), the train split has samples. The source, for `check_training`."""
    # sources imports torch: only once a submit checks its data, not for `--help`
    from sparknet.data.sources import shard_source

    try:
        return shard_source(dataset.uri, cfg or TrainConfig(), dataset.endpoint_url)
    except SparknetError as exc:
        line = _first(exc)
        if not line.startswith(f"dataset {dataset.uri}"):
            line = f"dataset {dataset.uri}: {line}"
        raise PreflightFailed(line) from exc


def planned_master(job: Job) -> Master:
    """The cluster's Spark as the job will find it, known before anything is launched: a
    reused cluster's own; a cluster to make: its master and `workers` instances (a static
    one: its hosts), each with its type's GPUs (`bootstrap.gpus_per_node` when set). A static
    host's GPUs are known only once it is reached: counted as none here, so its task count is
    the least the job can get (one per host)."""
    spec = job.spec
    if job.reused:
        return master_of(spec, job.endpoint_url)
    gpus = spec.bootstrap.gpus_per_node
    if provider.is_static(spec):
        count = len(spec.hosts)
    else:
        count = spec.workers + 1  # the master runs a Spark worker too
        if gpus is None:
            check_gpu_counts(spec, job.endpoint_url)  # one count for every type, or refused
            ec2 = instances.ec2_client(spec.region, job.endpoint_url)
            gpus = lifecycle.instance_gpus(ec2, [spec.master_type])[spec.master_type]
    planned = Node(nodes.Endpoint("master", "planned", 22, "-"), "planned", "-", gpus or 0)
    return Master(planned, None, f"spark://planned:{spec.bootstrap.master_port}", count)  # type: ignore[arg-type]


def check_training(job: Job, source: Source, prefix: str) -> None:
    """What `sparknet train` checks before Spark starts (`driver.prepare`: the model by name
    and on a sample of the data, the Spark tasks against the train shards and samples), on
    the job's settings as the cluster will run them (`job_config` on `planned_master`)."""
    from sparknet.training.driver import prepare  # torch and the driver: only here

    cfg = job_config(job.cfg, job.dataset, prefix, planned_master(job), job.spec.name)
    try:
        prepare(cfg, source)
    except SparknetError as exc:
        raise PreflightFailed(_first(exc)) from exc


def check_writable(prefix: str, endpoint_url: str | None) -> None:
    """Write, then delete, a probe object under the run prefix."""
    store = open_store(prefix, endpoint_url)
    probe = f".sparknet-probe-{secrets.token_hex(4)}"
    try:
        store.write_bytes(probe, b"")
        store.delete([probe])
    except SparknetError as exc:
        raise PreflightFailed(f"run prefix {prefix} is not writable: {_first(exc)}") from exc


def _first(exc: BaseException) -> str:
    return next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)


# --- the cluster --------------------------------------------------------------------------------


def reuse(spec: ClusterSpec, endpoint_url: str | None) -> None:
    """`--cluster NAME`: it must exist and its master run (a static one: be up here), else one
    line and nothing launched."""
    try:
        provider.check_running(spec, endpoint_url)
    except lifecycle.ClusterNotFound as exc:
        raise PreflightFailed(
            f"--cluster {spec.name}: {_first(exc)}, or leave out --cluster to make a new cluster"
        ) from exc


def check_name_free(spec: ClusterSpec, endpoint_url: str | None) -> None:
    """A submit that makes its cluster (no --cluster) must not find one of that name already
    there: `up` would take it over and the teardown after the job would end it, and the jobs
    on it with it."""
    if provider.in_use(spec, endpoint_url):
        raise PreflightFailed(
            f"cluster {spec.name} already runs; pass --cluster {spec.name} to reuse it, "
            "or --name NEW to make another"
        )


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


def check_gpu_counts(spec: ClusterSpec, endpoint_url: str | None) -> None:
    """A cluster to make whose master type and worker types have different GPU counts is
    refused before launch (see `node_gpus`); `bootstrap.gpus_per_node` sets one for all. A
    static cluster's hosts are counted once they are reached (`master_of`)."""
    if spec.bootstrap.gpus_per_node is not None or provider.is_static(spec):
        return
    ec2 = instances.ec2_client(spec.region, endpoint_url)
    counts = lifecycle.instance_gpus(ec2, [spec.master_type, *spec.instance_types])
    if len(set(counts.values())) > 1:
        raise PreflightFailed(_mixed(spec.name, counts))


def node_gpus(name: str, master: Master) -> int:
    """The GPUs of every Spark worker node (the master's included: it runs one too), which
    must be one count: a job runs `gpus_per_worker` tasks on each, so a node with fewer would
    place none and one with more would leave GPUs idle."""
    counts = set(master.gpus or (master.node.gpus,))
    if len(counts) > 1:
        raise PreflightFailed(_mixed(name, {f"node {k}": g for k, g in enumerate(master.gpus)}))
    return counts.pop()


def _mixed(name: str, counts: Mapping[str, int]) -> str:
    listed = ", ".join(f"{k}: {v}" for k, v in counts.items())
    return (
        f"cluster {name}'s nodes have different GPU counts ({listed}); every node runs a Spark "
        "worker with the same number of tasks: give master_type and instance_types the same "
        "GPU count, or set bootstrap.gpus_per_node"
    )


# --- the driver on the master --------------------------------------------------------------------


def job_config(
    cfg: TrainConfig, dataset: Dataset, prefix: str, master: Master, name: str = "cluster"
) -> TrainConfig:
    """The job's settings as the driver runs them: the data, the run prefix, the cluster's Spark
    master and GPUs (its Spark worker nodes', one count: `node_gpus`), and one Spark task per
    worker GPU (per worker node without GPUs) unless the user chose `workers`."""
    gpus = node_gpus(name, master)
    update: dict[str, Any] = {
        "data": dataset.uri, "out": prefix.rstrip("/"), "master": master.spark_url,
        "gpus_per_worker": gpus,
    }  # fmt: skip
    if dataset.endpoint_url:
        update["endpoint_url"] = dataset.endpoint_url
    if "workers" not in cfg.model_fields_set:
        update["workers"] = master.nodes * max(1, gpus)
    return TrainConfig(**{**cfg.model_dump(), **update})


def job_dir(node: Node, run_id: str) -> str:
    return node.path(JOBS_DIR, run_id)


def activity_name(run_id: str) -> str:
    return f"job-{run_id}"


def driver_command(node: Node, run_id: str, max_restarts: int = DEFAULT_MAX_RESTARTS) -> str:
    """The shell command that starts the job's supervisor (`sparknet.supervisor`, run by the
    node's venv Python) in its own session (`setsid`, as daemons.py starts Spark without
    systemd), so it outlives the SSH session that started it. The supervisor stamps the
    autostop activity file while the job runs, runs `sparknet train` (restarting it from the
    last checkpoint when it dies, up to `max_restarts` times), and at the end writes the exit
    code (a file of its own: the submitter may be gone); its output and the driver's are the
    log. The pid file names the supervisor: its session is the job's."""
    jd = job_dir(node, run_id)
    supervisor = [
        node.path("venv", "bin", "python"), "-m", "sparknet.supervisor", jd,
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


# --- following the job ---------------------------------------------------------------------------


@dataclass
class Outcome:
    """How the job ended: its exit code and its metrics rows."""

    rc: int
    rows: list[dict[str, Any]]
    log: str = ""


def follow(
    conn: Conn,
    master: Master,
    run_id: str,
    prefix: str,
    endpoint_url: str | None,
    on_rows: Callable[[list[dict[str, Any]]], None],
    poll_s: float | None = None,
    on_event: Callable[[dict[str, Any]], None] | None = None,
    on_tick: Callable[[], None] | None = None,
    grace_s: float | None = None,
) -> Outcome:
    """Poll metrics.jsonl in the run prefix and the driver on the master until it ends; new
    round rows go to `on_rows` (a round that a restarted driver runs again only once), new
    event rows (a restart) to `on_event`, in file order; the submitter's activity stamp is
    refreshed as it waits, and `on_tick` (the cluster's repair watch) is called every poll.
    A broken SSH connection, or one the master went silent on (every call on it has a
    deadline: `nodes.connection`), is opened again at each poll for `grace_s` (default
    `reconnect_s()`) from the first call that failed (the job runs on without it); past that,
    JobOutOfReach. A job whose supervisor was killed (no exit code) is failed; what it left
    running is stopped (`stop_session`), and the log's last `error:` line says so."""
    grace = reconnect_s() if grace_s is None else grace_s
    poll = POLL_S if poll_s is None else poll_s
    store = open_store(prefix, endpoint_url)
    seen = _Seen()
    last_stamp = 0.0
    lost_since: float | None = None
    lost: ConnectionLost | None = None  # the first failure of a run of them: it says why
    while True:
        asked = time.monotonic()
        try:
            if asked - last_stamp >= autostop.ACTIVITY_EVERY_S / 2:
                stamp_submitter(conn, master.node)
                last_stamp = time.monotonic()
            rc = driver_rc(conn, master.node, run_id)
            why = _killed(conn, master.node, run_id) if rc == -1 else None
        except ConnectionLost as exc:
            lost_since, lost = lost_since or asked, lost or exc
            if time.monotonic() - lost_since >= grace:
                raise JobOutOfReach(
                    f"no answer over SSH from the master ({master.node.endpoint.host}) "
                    f"for {grace:g} s ({lost}); job {run_id} may go on there: "
                    f"`sparknet-submit attach {run_id}` follows it again"
                ) from exc
            _drop(conn)
            time.sleep(poll)
            continue
        lost_since, lost = None, None
        rows = read_metrics(store, events=True)
        seen.dispatch(rows, on_rows, on_event)
        if rc is not None:
            log = driver_log(conn, master.node, run_id) if rc != 0 else ""
            if why:
                log += f"error: {why}\n"
            return Outcome(rc, round_rows(rows), log)
        if on_tick is not None:
            on_tick()
        time.sleep(poll)


#: `sparknet train`'s progress lines in its log (stderr, not a terminal) before a round is done:
#: what it waits for ("starting Spark", "round 1 (starting Python workers)"), and a done round
_STATUS_LINE = r"starting Spark|round [0-9]+ \(.+\)"
_ROUND_LINE = r"round [0-9]+/[0-9]+ .*"


class DriverStatus:
    """What the driver does before its first round is done (starting Spark, its executors
    registered, their Python workers starting), read from its log on the master: each new
    line once through `say`, as `driver: ...`, then nothing more. Called at every poll of
    `follow` (its `on_tick`); best effort: a failed look is `follow`'s business, not this."""

    def __init__(self, conn: Conn, node: Node, run_id: str, say: Say) -> None:
        self.conn, self.say = conn, say
        self.log = q(f"{job_dir(node, run_id)}/{LOG}")
        self.said = 0
        self.done = False

    def __call__(self) -> None:
        if self.done:
            return
        try:
            text = run(
                self.conn, f"grep -E -x '{_STATUS_LINE}|{_ROUND_LINE}' {self.log} 2>/dev/null; true"
            )
        except Exception:  # the next poll looks again
            return
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        statuses = []
        for line in lines:
            if re.fullmatch(_ROUND_LINE, line):
                self.done = True
                break
            statuses.append(line)
        for line in statuses[self.said :]:
            self.say(f"driver: {line}")
        self.said = max(self.said, len(statuses))


def ticks(*actions: Callable[[], None] | None) -> Callable[[], None]:
    """One `on_tick` that calls each of `actions` (None: none) in turn."""

    def tick() -> None:
        for action in actions:
            if action is not None:
                action()

    return tick


def reconnect_s() -> float:
    """GRACE_S, or the seconds `RECONNECT_ENV` gives (`nodes.seconds_setting`)."""
    return nodes.seconds_setting(RECONNECT_ENV, GRACE_S)


def _killed(conn: Conn, node: Node, run_id: str) -> str | None:
    """Of a job that ended without an exit code (`driver_rc` -1): why, for its last `error:`
    line, once what its supervisor left running (its driver: killed with it, the driver is
    stopped by the death signal it has, see `sparknet.supervisor`) is gone too, stopped here
    when need be; None for a malformed exit code (the code says it)."""
    jd = job_dir(node, run_id)
    how = run(conn, how_it_ended(jd)).strip()
    if how == "rc":
        return None
    if succeeds(conn, f"test -e {q(jd + '/' + JOB_CANCELLED)}"):
        return "the job was cancelled (`sparknet-submit cancel`)"
    killed = (
        "the job was killed on the master: its supervisor ended without an exit code (a kill "
        "-9, the out-of-memory killer, the node restarted)"
    )
    if how == ORPHANED:
        stop_session(conn, node, run_id)
        return f"{killed}; the driver it left running was stopped"
    return killed


def _drop(conn: Conn) -> None:
    """Close a broken connection, so that its next command opens a new one (Fabric's
    Connection reconnects on `run` once it is closed)."""
    close = getattr(conn, "close", None)
    if close is not None:
        _quietly(close)


@dataclass
class _Seen:
    """What `follow` has passed on: the last round, and how many events."""

    round: int = 0
    events: int = 0

    def dispatch(
        self,
        rows: list[dict[str, Any]],
        on_rows: Callable[[list[dict[str, Any]]], None],
        on_event: Callable[[dict[str, Any]], None] | None,
    ) -> None:
        """Pass on what is new in `rows` (all of metrics.jsonl), in order."""
        batch: list[dict[str, Any]] = []
        events = 0
        for row in rows:
            if is_event(row):
                events += 1
                if events <= self.events:
                    continue
                self.events = events
                if batch:
                    on_rows(batch)
                    batch = []
                if on_event is not None:
                    on_event(row)
            elif row["round"] > self.round:
                batch.append(row)
                self.round = row["round"]
        if batch:
            on_rows(batch)


def fetch_results(prefix: str, endpoint_url: str | None, dest: Path) -> list[Path]:
    """curves.png and metrics.jsonl of the run into `dest` (runs/RUN/ locally)."""
    store = open_store(prefix, endpoint_url)
    dest.mkdir(parents=True, exist_ok=True)
    got = []
    for name in (METRICS, CURVES):
        if store.size(name) is not None:
            store.fetch(name, dest / name)
            got.append(dest / name)
    return got


def final_accuracy(rows: list[dict[str, Any]]) -> float | None:
    return next((r["eval_accuracy"] for r in reversed(rows) if "eval_accuracy" in r), None)


def summary_lines(
    run_id: str, prefix: str, rows: list[dict[str, Any]], wall_s: float, cost: float | None
) -> list[str]:
    """What the submitter prints at the end."""
    acc = final_accuracy(rows)
    return [
        f"run id: {run_id}",
        f"run prefix: {prefix}",
        f"final accuracy: {'n/a' if acc is None else f'{acc:.4f}'}",
        f"wall time: {wall_s:.0f} s",
        f"estimated cost: {'unknown' if cost is None else f'${cost:.2f}'}",
    ]


# --- the whole flow ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    """One submit: the cluster (reused or to make), the data, the training settings."""

    spec: ClusterSpec
    reused: bool
    keep: bool
    dataset: Dataset
    cfg: TrainConfig
    endpoint_url: str | None = None
    runs_dir: Path = Path("runs")
    #: restarts of a driver that dies (`sparknet.supervisor`); 0: never
    max_restarts: int = DEFAULT_MAX_RESTARTS
    #: return once the driver runs (no follow, no teardown: the master's autostop ends a
    #: cluster this submit made once the job is over and no submitter is attached)
    detach: bool = False


@dataclass
class Result:
    run_id: str
    prefix: str
    #: None for a detached job (it runs on)
    outcome: Outcome | None
    wall_s: float
    cost: float | None
    fetched: list[Path]


def preflight(job: Job) -> tuple[str, str]:
    """Everything that costs nothing, in order; (run id, run prefix)."""
    try:  # a bad setting of the SSH deadlines fails now, not once the job runs
        reconnect_s(), nodes.silence_s(), steps.reboot_wait_s()
    except SparknetError as exc:
        raise PreflightFailed(str(exc)) from exc
    source = check_dataset(job.dataset, job.cfg)
    if job.reused:
        reuse(job.spec, job.endpoint_url)
    run_id = new_run_id()
    bucket = runs_bucket(job.spec, job.dataset, job.reused)
    prefix = run_prefix(bucket, job.spec.name, run_id, job.spec.runs_prefix)
    check_writable(prefix, job.dataset.endpoint_url)
    if not job.reused:
        try:
            provider.check_launch(job.spec, job.endpoint_url)
        except SparknetError as exc:
            raise PreflightFailed(str(exc)) from exc
    check_training(job, source, prefix)
    return run_id, prefix


#: told the job's run id, run prefix, master and settings just before its driver starts
OnJob = Callable[[str, str, Master, TrainConfig], None]


@dataclass
class Ending:
    """What became of the cluster when `submit` returned or raised, for the caller's last
    line: "down" (taken down), "up" (stays up: --keep, --cluster, a job left running), or ""
    (nothing was launched). A teardown that failed raises TeardownFailed instead."""

    cluster: str = ""


def submit_lock_path(name: str) -> Path:
    """`<registry home>/submits/NAME.lock` (beside `clusters/`, where a refused submit leaves
    nothing)."""
    return lifecycle.registry_dir().parent / "submits" / f"{name}.lock"


@contextlib.contextmanager
def submit_lock(name: str) -> Iterator[None]:
    """Hold cluster `name`'s submit lock for the block, or refuse at once (SubmitBusy): one
    submit per cluster name on this machine, so a second never launches on, reuses or tears
    down the cluster of a first that runs (the kernel frees the lock however its holder ends)."""

    def busy(holder: str) -> SubmitBusy:
        return SubmitBusy(
            f"cluster {name} is in use by another sparknet-submit on this machine (PID "
            f"{holder}); wait for it to end, or give --name NEW to run on a cluster of its own"
        )

    path = submit_lock_path(name)
    with lifecycle.held_lock(path, busy):
        try:
            yield
        finally:  # removed while held, as `remove_lock` does: no file left per name tried
            path.unlink(missing_ok=True)


def submit(
    job: Job,
    *,
    say: Say,
    on_rows: Callable[[list[dict[str, Any]], float | None], None],
    on_job: OnJob | None = None,
    ending: Ending | None = None,
) -> Result:
    """Preflight, cluster, driver, follow, fetch; then teardown (see `teardown_due`) whatever
    happened, Ctrl-C and SIGTERM included (the CLI turns those into KeyboardInterrupt). A
    detached job returns once its driver runs, and then nothing is torn down; nor is it for a
    job out of reach (it may run on). `ending` is told what became of the cluster. All of it
    under the cluster's `submit_lock`, taken first."""
    with submit_lock(job.spec.name):
        return _submit(job, say=say, on_rows=on_rows, on_job=on_job, ending=ending)


def _submit(
    job: Job,
    *,
    say: Say,
    on_rows: Callable[[list[dict[str, Any]], float | None], None],
    on_job: OnJob | None,
    ending: Ending | None,
) -> Result:
    ending = Ending() if ending is None else ending
    run_id, prefix = preflight(job)
    if not job.reused:
        check_name_free(job.spec, job.endpoint_url)
        check_gpu_counts(job.spec, job.endpoint_url)
    started = time.monotonic()
    ok = lost = untouched = False
    failure: BaseException | None = None
    try:
        if not job.reused:
            say(f"bringing cluster {job.spec.name} up")
            try:
                provider.up(job.spec, endpoint_url=job.endpoint_url, say=say)
            except lifecycle.ClusterBusy as exc:
                untouched = True  # another `up`/`down` holds it: nothing there is this submit's
                raise PreflightFailed(str(exc)) from exc
        master = master_of(job.spec, job.endpoint_url)
        cfg = job_config(job.cfg, job.dataset, prefix, master, job.spec.name)
        open_store(prefix, job.dataset.endpoint_url).write_bytes(
            "config.yaml", cfg.to_yaml().encode()
        )
        if on_job is not None:
            on_job(run_id, prefix, master, cfg)
        if job.detach:
            start_detached(master, run_id, prefix, cfg, say, job.max_restarts)
            ok = True
            return Result(run_id, prefix, None, time.monotonic() - started, None, [])
        try:
            outcome = _run_driver(job, master, run_id, prefix, cfg, say, on_rows)
        except JobOutOfReach:
            lost = True
            raise
        cost = provider.cost_so_far(job.spec, job.endpoint_url)
        fetched = fetch_results(prefix, job.dataset.endpoint_url, job.runs_dir / run_id)
        if outcome.rc != 0:
            why = last_error(outcome.log) or f"the driver exited {outcome.rc}"
            raise JobFailed(
                f"job {run_id} failed: {why} "
                f"(log: {job_dir(master.node, run_id)}/{LOG} on the master)"
            )
        ok = True
        return Result(run_id, prefix, outcome, time.monotonic() - started, cost, fetched)
    except BaseException as exc:
        failure = exc
        raise
    finally:
        if untouched:
            pass  # nothing launched, so nothing to take down (nor advice that would end it)
        elif teardown_due(job, detached=(job.detach and ok) or lost):
            ending.cluster = "up"  # until it is down: a failed teardown leaves it up
            teardown(job, say, failure)
            ending.cluster = "down"
        else:
            ending.cluster = "up"
            if not ok:
                say(stays_up_line(job))


def _run_driver(
    job: Job,
    master: Master,
    run_id: str,
    prefix: str,
    cfg: TrainConfig,
    say: Say,
    on_rows: Callable[[list[dict[str, Any]], float | None], None],
) -> Outcome:
    """Start the driver and follow it; an interrupt or error of the submitter cancels it as
    `sparknet-submit cancel` does (marked cancelled, waited for until its session is gone)."""
    conn = nodes.connect(master.node.endpoint, master.access)
    try:
        start_driver(conn, master.node, run_id, cfg, job.max_restarts)
        say(f"job {run_id} started on the master; run prefix {prefix}")
        return follow(
            conn,
            master,
            run_id,
            prefix,
            job.dataset.endpoint_url,
            lambda rows: on_rows(rows, provider.cost_so_far(job.spec, job.endpoint_url)),
            on_event=lambda event: say(restart_line(event)),
            on_tick=ticks(
                DriverStatus(conn, master.node, run_id, say),
                repair.Watch(job.spec, endpoint_url=job.endpoint_url, say=say),
            ),
        )
    except JobOutOfReach:
        raise  # the job may run on, out of reach: nothing to cancel it with
    except BaseException:
        # from the start on (Ctrl-C while the driver starts included): a driver left running
        # on a cluster that stays up would hold its GPUs with nobody following it. Over a new
        # connection: an interrupt in the middle of an SSH call can leave this one's transport
        # waiting forever to open its next channel (a submitter hung after SIGTERM so)
        conn.close()
        _quietly(lambda: _cancel_over_a_new_connection(master, run_id, say))
        raise
    finally:
        conn.close()


def _cancel_over_a_new_connection(master: Master, run_id: str, say: Say) -> None:
    """`cancel_job`, saying so: the submitter waits until the job's session is gone (its
    driver's Spark stopped), so a cluster that stays up has nothing of it left running. A
    cancel that fails (the master out of reach) says so and how to end the job: it may run on.
    """
    try:
        conn = nodes.connect(master.node.endpoint, master.access)
        try:
            say(f"cancelling job {run_id}: waiting for its driver to stop")
            if cancel_job(conn, master.node, run_id):
                say(f"job {run_id} cancelled")
            else:  # its driver had not started, or ended: nothing of it runs
                say(f"job {run_id}: nothing of it runs on the master")
        finally:
            conn.close()
    except Exception as exc:
        say(
            f"could not cancel job {run_id} ({_first(exc)}): it may still run on the master; "
            f"`sparknet-submit cancel {run_id}` ends it"
        )


def start_detached(
    master: Master,
    run_id: str,
    prefix: str,
    cfg: TrainConfig,
    say: Say,
    max_restarts: int = DEFAULT_MAX_RESTARTS,
) -> None:
    """`--detach`: start the driver and leave it (it outlives this SSH session); interrupted
    before it is said to run, it is cancelled (the submit failed: nobody knows of the job)."""
    conn = nodes.connect(master.node.endpoint, master.access)
    try:
        start_driver(conn, master.node, run_id, cfg, max_restarts)
        say(f"job {run_id} started on the master; run prefix {prefix}")
    except BaseException:
        conn.close()  # as in `_run_driver`: this one may hang after an interrupt
        _quietly(lambda: _cancel_over_a_new_connection(master, run_id, say))
        raise
    finally:
        conn.close()


def teardown_due(job: Job, detached: bool = False) -> bool:
    """A cluster this submit made goes down unless --keep; a reused one (--cluster) is the
    user's and stays: it was running before and may serve other jobs. A job left `detached`
    (its driver runs) keeps its cluster too: the master's autostop timer ends it after the
    job; a --detach that failed before the driver started tears down as any failure does."""
    return not job.keep and not job.reused and not detached


def teardown(job: Job, say: Say, after: BaseException | None = None) -> None:
    """`sparknet cluster down`'s code; nothing there (up failed early) is no error. A failure
    is TeardownFailed, which says how to end what is left (and keeps `after`, what ended the
    job)."""
    name = job.spec.name
    say(f"taking cluster {name} down")
    try:
        provider.down(job.spec, endpoint_url=job.endpoint_url, say=say)
    except Exception as exc:
        failed = TeardownFailed(
            f"taking cluster {name} down failed: {_first(exc)}; its instances may still run: "
            f"`sparknet cluster down {name}` ends them"
        )
        failed.after = after
        raise failed from exc


def stays_up_line(job: Job) -> str:
    """What ends a cluster that a submit leaves up: its autostop timer (the minutes), or, with
    the timer off, only `sparknet cluster down`."""
    why = "reused with --cluster" if job.reused else "--keep" if job.keep else "the job runs"
    return up_line(job.spec, why)


def up_line(spec: ClusterSpec, why: str) -> str:
    """`cluster NAME stays up (WHY)` and what ends it: `stays_up_line`'s, and `attach`'s at the
    end of a job on a cluster a submit made (WHY: its cost so far)."""
    name, minutes = spec.name, spec.autostop_minutes
    if provider.is_static(spec):
        return (
            f"cluster {name} stays up ({why}): Spark runs on its hosts until `sparknet cluster "
            f"down {name}` stops it (a static cluster has no autostop timer)"
        )
    if not minutes:
        return (
            f"cluster {name} stays up ({why}; autostop off): `sparknet cluster down {name}` ends it"
        )
    return (
        f"cluster {name} stays up ({why}); its autostop timer terminates it {minutes} minutes "
        f"after its last job ends with no submitter attached (`sparknet cluster down {name}` "
        "ends it sooner)"
    )


def _quietly(action: Callable[[], None]) -> None:
    """Best effort while something else is raised: its failure must not replace that."""
    with contextlib.suppress(Exception):
        action()
