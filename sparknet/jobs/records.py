"""Jobs that `sparknet-submit` started on clusters' masters, seen from the submitter's machine.

The local records that find a run id again, and what `attach`, `logs`, `cancel` and `list` do.

A record (`JobRecord`) is a small JSON file per run under the registry home
(`$SPARKNET_HOME/jobs/RUN.json`, next to `clusters/`), written atomically when the job starts.
Like the cluster registry it is a convenience, not the truth: the job's state is always asked of
its master (the driver's pid, exit code and a `cancelled` marker in its job dir), and a run
started on another machine is found on a named cluster's master from its job dir alone
(`job.yaml` says where it writes). A cluster that is gone takes its jobs' state with it; its
run prefix on S3 keeps what the jobs wrote.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from sparknet.cluster import nodes, provider, registry
from sparknet.cluster.remote import Conn, q, run
from sparknet.cluster.spark.plan import JOB_CANCELLED, Node
from sparknet.cluster.spec import ClusterSpec
from sparknet.config import TrainConfig
from sparknet.data.s3 import S3Uri
from sparknet.errors import SparknetError, as_flag
from sparknet.jobs import driver_control
from sparknet.jobs.follow import POLL_S
from sparknet.jobs.preflight import Job
from sparknet.jobs.supervisor import JOB_CONFIG, RC
from sparknet.node import job as node_job

#: the records' dir under the registry home, and the marker `cancel` leaves in a job dir
JOBS_DIR = "jobs"
CANCELLED = JOB_CANCELLED
#: the state of a job whose supervisor died and left its driver (or a child of it) running
ORPHANED = driver_control.ORPHANED
#: the state of a job whose supervisor was killed (no exit code) and of which nothing is left
KILLED = node_job.KILLED
#: how long `cancel` waits for the driver's session to end before it kills it outright
CANCEL_WAIT_S = driver_control.CANCEL_WAIT_S
#: what `list` shows for the jobs of a cluster without a running master
GONE = "cluster gone"
_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")

SpecOf = Callable[[str, str | None], ClusterSpec]


class UnknownRun(SparknetError):
    """A run id that no record and no named cluster's master knows (exit 2)."""


class ClusterGone(SparknetError):
    """The job's cluster has no running master any more (exit 2)."""


# --- the local records ---------------------------------------------------------------------------


@dataclass(frozen=True)
class JobRecord:
    """What finds a job again: its cluster (name, region, the EC2 endpoint it was reached
    through), its run prefix (and S3 endpoint), its job dir on the master, when it started and
    how many rounds it runs."""

    run_id: str
    cluster: str
    region: str
    prefix: str
    job_dir: str
    started: float
    rounds: int
    endpoint_url: str | None = None
    s3_endpoint_url: str | None = None
    #: the submit made the cluster (no --cluster): `attach` says at the end that it is still
    #: up, and what ends it (a record of an older sparknet, or found on a master: False)
    made: bool = False
    #: what the job does: train, or a model's evaluate or predict (`model_jobs`)
    kind: str = "train"
    #: where a predict job writes its rows (an s3:// prefix)
    output: str | None = None

    def started_text(self) -> str:
        return datetime.fromtimestamp(self.started, UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def jobs_dir() -> Path:
    """`<registry home>/jobs`: beside the cluster registry, moved by SPARKNET_HOME alike."""
    return registry.registry_dir().parent / JOBS_DIR


def check_run_id(run_id: str) -> str:
    """A run id as `new_run_id` makes them (a file name on both machines), else UnknownRun."""
    if not _RUN_ID.fullmatch(run_id):
        raise UnknownRun(f"{run_id!r} is not a run id (like 20261201-210000-ab12)")
    return run_id


def save(record: JobRecord) -> Path:
    """Write the record atomically (a reader never sees half of it); its path."""
    check_run_id(record.run_id)
    path = jobs_dir() / f"{record.run_id}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(asdict(record), sort_keys=True) + "\n")
    os.replace(tmp, path)
    return path


def load(run_id: str) -> JobRecord | None:
    """The record of `run_id`; None when there is none or it does not read (hand-edited)."""
    path = jobs_dir() / f"{check_run_id(run_id)}.json"
    try:
        return JobRecord(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def records() -> list[JobRecord]:
    """Every readable record, oldest first."""
    found = [load(p.stem) for p in sorted(jobs_dir().glob("*.json")) if _RUN_ID.fullmatch(p.stem)]
    return sorted((r for r in found if r is not None), key=lambda r: (r.started, r.run_id))


def record_of(
    job: Job, run_id: str, prefix: str, master: driver_control.Master, cfg: TrainConfig
) -> JobRecord:
    """The record of a job `sparknet-submit` starts now."""
    return JobRecord(
        run_id, job.spec.name, job.spec.region, prefix, driver_control.job_dir(master.node, run_id),
        time.time(), cfg.rounds if job.task is None else 0, job.endpoint_url,
        job.dataset.endpoint_url, not job.reused,
        "train" if job.task is None else job.task.command,
        job.task.target(prefix) if job.task is not None and job.task.command == "predict"
        else None,
    )  # fmt: skip


def run_dir_of(text: str, endpoint_url: str | None) -> tuple[str, str | None, str | None]:
    """RUN as given: an s3:// run dir (read through `endpoint_url`), a local run dir, or the
    run id of a job some submit of this machine ran (its run prefix, from the job's record,
    read through the S3 endpoint it was written through); (where, endpoint, the run id where
    RUN was one)."""
    if text.startswith("s3://"):
        S3Uri.parse(text)
        return text.rstrip("/"), endpoint_url, None
    if Path(text).is_dir():
        return str(Path(text).resolve()), None, None
    try:
        record = load(text)
    except UnknownRun:  # not a run id's spelling either: the line below
        record = None
    if record is None:
        raise SparknetError(
            "{text}: no such run dir here, nor a job of `sparknet-submit list`; give a run dir "
            "(local or s3://bucket/prefix) or the run id of a training job submitted from here",
            text=text,
        )
    return record.prefix.rstrip("/"), record.s3_endpoint_url or endpoint_url, record.run_id


# --- finding a job's master ----------------------------------------------------------------------


@dataclass
class Located:
    """A job, its cluster's spec and its running master."""

    record: JobRecord
    spec: ClusterSpec
    master: driver_control.Master


def locate(
    run_id: str, cluster: str | None, spec_of: SpecOf, endpoint_url: str | None = None
) -> Located:
    """The job `run_id`: by its local record, or on `cluster`'s master (a run started from
    another machine; its record is then written here). UnknownRun or ClusterGone otherwise."""
    record = load(check_run_id(run_id))
    if record is not None and cluster is not None and record.cluster != cluster:
        record = None  # the record's run is on another cluster: look where the user said
    if record is None and cluster is None:
        raise UnknownRun(
            "no job {run_id} in {dir}; give {@cluster=name} to look for it on that cluster's "
            "master",
            run_id=run_id,
            dir=jobs_dir(),
            name="NAME",
        )
    name = cluster if record is None else record.cluster
    spec = spec_of(name, None if record is None else record.region)
    endpoint = endpoint_url or (record.endpoint_url if record else None)
    if not provider.of(spec).master_running(spec, endpoint):
        raise ClusterGone(
            f"job {run_id}: cluster {name} has no running master (gone: taken down or "
            "stopped by its autostop timer)"
            + (f"; its run prefix {record.prefix} keeps what the job wrote" if record else "")
        )
    master = driver_control.master_of(spec, endpoint)
    if record is None:
        record = _record_from_master(spec, master, run_id, endpoint)
        save(record)
    return Located(record, spec, master)


def _record_from_master(
    spec: ClusterSpec, master: driver_control.Master, run_id: str, endpoint_url: str | None
) -> JobRecord:
    """A record built from the job dir on the master: job.yaml says the run prefix, the S3
    endpoint and the rounds; its mtime is when the job started."""
    jd = driver_control.job_dir(master.node, run_id)
    conn = nodes.connect(master.node.endpoint, master.access)
    try:
        text = run(conn, f"cat {q(jd + '/' + JOB_CONFIG)} 2>/dev/null || true")
        started = run(conn, f"stat -c %Y {q(jd + '/' + JOB_CONFIG)} 2>/dev/null || true")
    finally:
        conn.close()
    if not text.strip():
        raise UnknownRun(f"no job {run_id} on cluster {spec.name}'s master")
    try:
        doc = yaml.safe_load(text) or {}
        settings: dict[str, Any] = doc["train"]
        out = str(settings["out"])
        command = [str(a) for a in doc.get("command") or ["train"]]
    except (yaml.YAMLError, KeyError, TypeError) as exc:
        raise UnknownRun(
            f"job {run_id} on cluster {spec.name}: its {jd}/job.yaml does not read"
        ) from exc
    return JobRecord(
        run_id, spec.name, spec.region, out.rstrip("/") + "/", jd,
        float(started.strip() or time.time()),
        int(settings.get("rounds") or 0) if command[0] == "train" else 0, endpoint_url,
        settings.get("endpoint_url"), False, command[0], _predict_output(command),
    )  # fmt: skip


def _predict_output(command: list[str]) -> str | None:
    """Where a predict job's command writes (its `--out parquet:PATH`), else None."""
    out = as_flag("out")  # `sparknet predict`'s own option, as the job's command spells it
    if command[0] != "predict" or out not in command[:-1]:
        return None
    return command[command.index(out) + 1].removeprefix("parquet:")


# --- the job on its master -----------------------------------------------------------------------


def state_of(conn: Conn, node: Node, run_id: str) -> str:
    """running, succeeded, failed RC, cancelled, orphaned (its supervisor died, killed, and left
    its driver running: the driver's death signal or `cancel` ends it), killed (its supervisor
    died without an exit code, and nothing of the job is left), or `gone` (no job dir on this
    master: the cluster was made again under the same name). An exit code wins over the cancel
    marker: a job that ended on its own while a cancel came in ended as its code says."""
    return run(
        conn, driver_control.on_master(node, "job-state", driver_control.job_dir(node, run_id))
    ).strip()


def ended_at(conn: Conn, node: Node, run_id: str) -> float | None:
    """When the driver wrote its exit code (None: it did not)."""
    rc = f"{driver_control.job_dir(node, run_id)}/{RC}"
    text = run(conn, f"stat -c %Y {q(rc)} 2>/dev/null || true").strip()
    return float(text) if text else None


def cancel(conn: Conn, node: Node, run_id: str, wait_s: float = CANCEL_WAIT_S) -> str | None:
    """End the job (`driver_control.cancel_job`: marked cancelled, its session ended and waited for,
    SIGKILL after `wait_s`); None. A job none of whose processes is left is left as it is: its
    state."""
    if not driver_control.cancel_job(conn, node, run_id, wait_s):
        return state_of(conn, node, run_id)
    return None


def print_log(
    conn: Conn,
    node: Node,
    run_id: str,
    lines: int,
    follow: bool,
    write: Callable[[str], None],
    poll_s: float = POLL_S,
) -> None:
    """The driver's last `lines` lines; with `follow`, then what it adds until it ends (read
    from the byte the first look ended at, so nothing is written twice or skipped)."""
    log = f"{driver_control.job_dir(node, run_id)}/{driver_control.LOG}"
    head = run(conn, driver_control.on_master(node, "log-since", log, 0, "--lines", int(lines)))
    size, _, text = head.partition("\n")
    write(text)
    offset = int(size.strip() or 0)
    while follow:
        ended = driver_control.driver_rc(conn, node, run_id) is not None
        # the node counts the bytes it sends (the log's size now): a byte that is no UTF-8
        # arrives as U+FFFD, 3 bytes here, so counting what arrived would shift the offset
        out = run(conn, driver_control.on_master(node, "log-since", log, offset))
        size, _, chunk = out.partition("\n")
        if chunk:
            write(chunk)
        offset = max(offset, int(size.strip() or 0))
        if ended:
            return
        time.sleep(poll_s)


# --- list ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Listed:
    record: JobRecord
    state: str


def listing(spec_of: SpecOf, endpoint_url: str | None = None) -> list[Listed]:
    """Every recorded job with its state from its master: one EC2 call and one SSH connection
    per cluster; `cluster gone` for the jobs of a cluster without a running master."""
    by_cluster: dict[tuple[str, str], list[JobRecord]] = {}
    for record in records():
        by_cluster.setdefault((record.cluster, record.region), []).append(record)
    states: dict[str, str] = {}
    for (name, region), recs in by_cluster.items():
        states.update(_cluster_states(name, region, recs, spec_of, endpoint_url))
    return [Listed(r, states[r.run_id]) for r in records() if r.run_id in states]


def _cluster_states(
    name: str, region: str, recs: list[JobRecord], spec_of: SpecOf, endpoint_url: str | None
) -> dict[str, str]:
    endpoint = endpoint_url or recs[0].endpoint_url
    try:
        spec = spec_of(name, region)
        alive = provider.of(spec).master_running(spec, endpoint)
    except SparknetError:
        alive = False
    if not alive:
        return {r.run_id: GONE for r in recs}
    master = driver_control.master_of(spec, endpoint)
    conn = nodes.connect(master.node.endpoint, master.access)
    try:
        return {r.run_id: state_of(conn, master.node, r.run_id) for r in recs}
    finally:
        conn.close()
