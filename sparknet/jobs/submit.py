"""`sparknet-submit`: one job on a cluster, run from the submitter's machine.

The job trains, or scores a finished run's model (`sparknet.jobs.model_jobs`).

The flow of design.md, section 2. Checks everything that costs nothing first
(`sparknet.jobs.preflight`), ensures the cluster through `cluster.provider` (the same functions
`sparknet cluster up` and `down` use), starts the driver on the master detached from the SSH
session (`sparknet.jobs.driver_control`), follows its metrics in the run prefix
(`sparknet.jobs.follow`), fetches the curves, and takes the cluster down in its `finally` when
the job is over (see `teardown_due`).

It sits between the CLI and cluster/training: no typer here, and the driver itself is the
node's own `sparknet train` (or `evaluate`, `predict`), started with the job's resolved
settings."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparknet.cluster import nodes, provider, registry, repair
from sparknet.cluster.spec import ClusterSpec
from sparknet.config import TrainConfig
from sparknet.data.store import open_store
from sparknet.errors import SparknetError, as_flag, first_line
from sparknet.jobs import model_jobs
from sparknet.jobs.driver_control import (
    LOG,
    Master,
    cancel_job,
    job_dir,
    master_of,
    quietly,
    start_driver,
)
from sparknet.jobs.follow import (
    DriverStatus,
    JobOutOfReach,
    Outcome,
    fetch_results,
    follow,
    last_error,
    ticks,
)
from sparknet.jobs.preflight import (
    Job,
    PreflightFailed,
    check_gpu_counts,
    check_name_free,
    job_config,
    preflight,
    workers_of,
)
from sparknet.jobs.supervisor import DEFAULT_MAX_RESTARTS, restart_line
from sparknet.say import Say, command_line


class JobFailed(SparknetError):
    """The driver on the master ended with a non-zero exit code."""


class SubmitBusy(PreflightFailed):
    """Another `sparknet-submit` of this machine holds the cluster's name (exit 2)."""


class TeardownFailed(SparknetError):
    """Taking the cluster down after the job did not finish: its instances may still run.
    `after` is what ended the job (None: it succeeded), for the caller to name both."""

    after: BaseException | None = None


# --- the whole flow ----------------------------------------------------------------------------


@dataclass
class Result:
    run_id: str
    prefix: str
    #: None for a detached job (it runs on)
    outcome: Outcome | None
    wall_s: float
    cost: float | None
    fetched: list[Path]


#: told the job's run id, run prefix, master and settings just before its driver starts
OnJob = Callable[[str, str, Master, TrainConfig], None]


@dataclass
class ClusterOutcome:
    """What became of the cluster when `submit` returned or raised, for the caller's last
    line: "down" (taken down), "up" (stays up: --keep, --cluster, a job left running), or ""
    (nothing was launched). A teardown that failed raises TeardownFailed instead."""

    cluster: str = ""


def submit_lock_path(name: str) -> Path:
    """`<registry home>/submits/NAME.lock` (beside `clusters/`, where a refused submit leaves
    nothing)."""
    return registry.registry_dir().parent / "submits" / f"{name}.lock"


@contextlib.contextmanager
def submit_lock(name: str) -> Iterator[None]:
    """Hold cluster `name`'s submit lock for the block, or refuse at once (SubmitBusy): one
    submit per cluster name on this machine, so a second never launches on, reuses or tears
    down the cluster of a first that runs (the kernel frees the lock however its holder ends)."""

    def busy(holder: str) -> SubmitBusy:
        return SubmitBusy(
            "cluster {name} is in use by another sparknet-submit on this machine (PID "
            "{holder}); wait for it to end, or give {@name=new} to run on a cluster of its own",
            name=name,
            holder=holder,
            new="NEW",
        )

    path = submit_lock_path(name)
    with registry.held_lock(path, busy):
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
    ending: ClusterOutcome | None = None,
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
    ending: ClusterOutcome | None,
) -> Result:
    ending = ClusterOutcome() if ending is None else ending
    checked = preflight(job)
    run_id, prefix = checked.run_id, checked.prefix
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
                provider.of(job.spec).up(
                    job.spec, endpoint_url=job.endpoint_url, say=say, bootstrap=True,
                    any_owner=False,
                )  # fmt: skip
            except registry.ClusterBusy as exc:
                untouched = True  # another `up`/`down` holds it: nothing there is this submit's
                raise PreflightFailed("{cause}", cause=exc) from exc
        master = master_of(job.spec, job.endpoint_url)
        cfg = job_config(job.cfg, job.dataset, prefix, workers_of(master), job.spec.name)
        from sparknet.training.rundir import CONFIG_FILE  # lazy: torch (its checkpoints)

        open_store(prefix, job.dataset.endpoint_url).write_bytes(
            CONFIG_FILE, cfg.to_yaml().encode()
        )
        command = _model_command(job, prefix)
        if on_job is not None:
            on_job(run_id, prefix, master, cfg)
        if job.detach:
            start_detached(master, run_id, prefix, cfg, say, job.max_restarts, command)
            ok = True
            return Result(run_id, prefix, None, time.monotonic() - started, None, [])
        try:
            outcome = _run_driver(job, master, run_id, prefix, cfg, say, on_rows, command)
        except JobOutOfReach:
            lost = True
            raise
        cost = provider.of(job.spec).cost_so_far(job.spec, job.endpoint_url)
        fetched = fetch_results(prefix, job.dataset.endpoint_url, job.runs_dir / run_id)
        if job.task is not None and job.task.command == "evaluate":
            fetched += model_jobs.fetch_report(
                prefix, job.dataset.endpoint_url, job.runs_dir / run_id
            )
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


def _model_command(job: Job, prefix: str) -> list[str]:
    """A model's job (`model_jobs`): the model's copy staged in the run prefix, and the
    driver's `sparknet evaluate|predict` arguments; none for training."""
    if job.task is None:
        return []
    model_jobs.stage(job.task, prefix, job.dataset.endpoint_url)
    return job.task.args(prefix, job.dataset.uri, job.dataset.endpoint_url)


def _run_driver(
    job: Job,
    master: Master,
    run_id: str,
    prefix: str,
    cfg: TrainConfig,
    say: Say,
    on_rows: Callable[[list[dict[str, Any]], float | None], None],
    command: list[str] | None = None,
) -> Outcome:
    """Start the driver and follow it; an interrupt or error of the submitter cancels it as
    `sparknet-submit cancel` does (marked cancelled, waited for until its session is gone)."""
    conn = nodes.connect(master.node.endpoint, master.access)
    try:
        start_driver(conn, master.node, run_id, cfg, job.max_restarts, command or ())
        say(f"job {run_id} started on the master; run prefix {prefix}")
        return follow(
            conn,
            master,
            run_id,
            prefix,
            job.dataset.endpoint_url,
            lambda rows: on_rows(
                rows, provider.of(job.spec).cost_so_far(job.spec, job.endpoint_url)
            ),
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
        quietly(lambda: _cancel_over_a_new_connection(master, run_id, say))
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
    except Exception as exc:  # however the master is out of reach: said, with the way out
        say(
            f"could not cancel job {run_id} ({first_line(exc)}): it may still run on the master; "
            f"`{command_line('sparknet-submit cancel', run_id)}` ends it"
        )


def start_detached(
    master: Master,
    run_id: str,
    prefix: str,
    cfg: TrainConfig,
    say: Say,
    max_restarts: int = DEFAULT_MAX_RESTARTS,
    command: list[str] | None = None,
) -> None:
    """`--detach`: start the driver and leave it (it outlives this SSH session); interrupted
    before it is said to run, it is cancelled (the submit failed: nobody knows of the job)."""
    conn = nodes.connect(master.node.endpoint, master.access)
    try:
        start_driver(conn, master.node, run_id, cfg, max_restarts, command or ())
        say(f"job {run_id} started on the master; run prefix {prefix}")
    except BaseException:
        conn.close()  # as in `_run_driver`: this one may hang after an interrupt
        quietly(lambda: _cancel_over_a_new_connection(master, run_id, say))
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
        provider.of(job.spec).teardown(job.spec, endpoint_url=job.endpoint_url, say=say)
    except Exception as exc:
        failed = TeardownFailed(
            "taking cluster {name} down failed: {cause:line}; its instances may still run: "
            "`{down}` ends them",
            name=name,
            cause=exc,
            down=command_line("sparknet cluster down", name),
        )
        failed.after = after
        raise failed from exc


def stays_up_line(job: Job) -> str:
    """What ends a cluster that a submit leaves up: its autostop timer (the minutes), or, with
    the timer off, only `sparknet cluster down`. The settings it names are spelt as flags: a
    submit's lines are `sparknet-submit`'s alone."""
    if job.reused:
        return up_line(job.spec, f"reused with {as_flag('cluster')}")
    return up_line(job.spec, as_flag("keep") if job.keep else "the job runs")


def up_line(spec: ClusterSpec, why: str) -> str:
    """`cluster NAME stays up (WHY)` and what ends it: `stays_up_line`'s, and `attach`'s at the
    end of a job on a cluster a submit made (WHY: its cost so far)."""
    name, minutes = spec.name, spec.autostop_minutes
    down = command_line("sparknet cluster down", name)
    if not provider.of(spec).AUTOSTOP:
        return (
            f"cluster {name} stays up ({why}): Spark runs on its hosts until `{down}` stops it "
            "(a static cluster has no autostop timer)"
        )
    if not minutes:
        return f"cluster {name} stays up ({why}; autostop off): `{down}` ends it"
    return (
        f"cluster {name} stays up ({why}); its autostop timer terminates it {minutes} minutes "
        f"after its last job ends with no submitter attached (`{down}` ends it sooner)"
    )
