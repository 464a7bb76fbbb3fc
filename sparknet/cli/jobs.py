"""`sparknet-submit attach`, `logs`, `cancel`, `list`: the jobs that sparknet-submit started.

They are found again by their run id (`sparknet.jobs.records`); and how a followed job's rounds
are shown (`Report`, `say`), which `attach` shares with the submit itself.

Separate from the submit command because these act on a job that already runs, on a cluster
that already exists: none of the submit's flags, settings checks or training flags apply."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path
from typing import Any

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from sparknet.cli import train as train_command
from sparknet.cli.cluster.options import cluster_spec
from sparknet.cli.common import ENDPOINT_HELP, Caught, console, fail, interrupts, results
from sparknet.cli.evaluate import summary as evaluation_table
from sparknet.errors import SparknetError
from sparknet.say import command_line

# `# lazy: X` below: an import kept inside the command that needs it, X being slow to import
# (torch ~2 s; boto3, fabric, numpy ~0.2 s each; `+N ms`: what it adds, measured) while
# `sparknet-submit --help` and every other command import this module


def say(line: str) -> None:
    """One line of what the job does, on stderr (stdout keeps the results)."""
    console.print(line, markup=False, highlight=False, soft_wrap=True)


class Report:
    """Round progress: a bar on a terminal, else one plain line per round."""

    def __init__(self, live: bool, total: int) -> None:
        self.live, self.total = live, total
        self.progress = Progress(
            TextColumn("[bold]round"), MofNCompleteColumn(), BarColumn(),
            TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=console,
        )  # fmt: skip
        self.bar = self.progress.add_task("job", total=total, info="starting")
        if live:
            self.progress.start()

    def rows(self, rows: list[dict[str, Any]], cost: float | None) -> None:
        from sparknet.jobs.follow import progress_line  # lazy: boto3, fabric

        for row in rows:
            line = progress_line(row, self.total, cost)
            if self.live:
                self.progress.update(self.bar, completed=row["round"], info=line)
            else:
                train_command._line(line)

    def stop(self) -> None:
        if self.live:
            self.progress.stop()


# --- the jobs started: attach, logs, cancel, list ------------------------------------------------

RunArgument = typer.Argument(..., metavar="RUN", help="run id (printed by sparknet-submit)")
ClusterOption = typer.Option(
    None, "--cluster", help="look for RUN on this cluster's master (a job started elsewhere)"
)
JobsEndpointOption = typer.Option(None, help=f"{ENDPOINT_HELP} (default: the job's record's)")
JobsConfigOption = typer.Option(None, "--config", help="settings YAML (default: ./sparknet.yaml)")
JobsDebugOption = typer.Option(False, help="show tracebacks")


def _spec_of(config: Path | None):
    """How `sparknet.jobs.records` gets a cluster's spec: the registry's, else the settings file's
    entry, in the job's region."""
    return lambda name, region: cluster_spec(name, config, {"region": region} if region else {})


def _located(run_id: str, cluster: str | None, endpoint_url, config, debug: bool):
    """The job and a connection to its master; exit 2 for a run nobody knows or whose
    cluster is gone (or bad settings), 1 when the master does not answer."""
    from sparknet.cluster import nodes  # lazy: fabric
    from sparknet.jobs import records  # lazy: boto3, fabric

    try:
        found = records.locate(run_id, cluster, _spec_of(config), endpoint_url)
    except SparknetError as exc:
        fail(exc, debug, 2)
    try:
        conn = nodes.connect(found.master.node.endpoint, found.master.access)
        if records.state_of(conn, found.master.node, run_id) == "gone":
            conn.close()
            fail(
                records.UnknownRun(
                    f"no job {run_id} on cluster {found.spec.name}'s master (the cluster was "
                    "made again since the job ran)"
                ),
                debug,
                2,
            )
    except SparknetError as exc:
        fail(exc, debug, 1)
    return found, conn


def attach(
    run_id: str = RunArgument,
    cluster: str | None = ClusterOption,
    endpoint_url: str | None = JobsEndpointOption,
    config: Path | None = JobsConfigOption,
    debug: bool = JobsDebugOption,
) -> None:
    """Follow a job as an attached submit does: its rounds so far, then each new one, the
    summary, and curves.png and metrics.jsonl into runs/RUN/ (a job that already ended: how
    it ended, without its rounds). A cluster the job's submit made is said to be still up, with
    its cost and what ends it. Ctrl-C or SIGTERM only detach: the job goes on (exit 130 /
    143)."""
    from sparknet.cluster import provider, repair  # lazy: boto3, fabric
    from sparknet.jobs import model_jobs, records  # lazy: boto3, fabric
    from sparknet.jobs.driver_control import LOG, job_dir  # lazy: boto3, fabric
    from sparknet.jobs.follow import (  # lazy: boto3, fabric
        DriverStatus,
        fetch_results,
        follow,
        last_error,
        ticks,
    )
    from sparknet.jobs.submit import JobFailed  # lazy: boto3, fabric
    from sparknet.jobs.supervisor import restart_line  # lazy: +7 ms to `sparknet-submit --help`

    try:
        repair.check_every_s()  # a bad setting fails before anything is asked
    except SparknetError as exc:
        fail(exc, debug, 2)
    found, conn = _located(run_id, cluster, endpoint_url, config, debug)
    rec, node = found.record, found.master.node
    endpoint = endpoint_url or rec.endpoint_url
    cost_so_far = provider.of(found.spec).cost_so_far
    report = Report(console.is_terminal, rec.rounds)
    caught = Caught()
    try:
        with interrupts(caught):
            state = records.state_of(conn, node, run_id)
            if state not in ("running", records.ORPHANED):  # an orphan's driver runs on
                outcome = _ended_outcome(conn, found, run_id, state)
            else:
                say(
                    f"attached to job {run_id} on cluster {rec.cluster}; Ctrl-C detaches "
                    "(it goes on)"
                )
                try:
                    outcome = follow(
                        conn, found.master, run_id, rec.prefix, rec.s3_endpoint_url,
                        lambda rows: report.rows(rows, cost_so_far(found.spec, endpoint)),
                        on_event=lambda event: say(restart_line(event)),
                        on_tick=ticks(
                            DriverStatus(conn, node, run_id, say),
                            repair.Watch(found.spec, endpoint_url=endpoint, say=say),
                        ),
                    )  # fmt: skip
                finally:
                    report.stop()
                state = records.state_of(conn, node, run_id)
            ended = records.ended_at(conn, node, run_id) or time.time()
            cost = cost_so_far(found.spec, endpoint)
            fetched = fetch_results(rec.prefix, rec.s3_endpoint_url, Path("runs") / run_id)
    except KeyboardInterrupt:
        signum = caught.signum or signal.SIGINT
        print(
            f"detached from job {run_id}: it goes on on cluster {rec.cluster}; "
            f"`{command_line('sparknet-submit attach', run_id)}` follows it again",
            file=sys.stderr,
        )
        raise typer.Exit(128 + signum) from None
    except SparknetError as exc:
        fail(exc, debug, 1)
    finally:
        conn.close()
    still_up = _still_up(rec, found.spec, cost)
    if state == "cancelled":
        still_up()
        fail(SparknetError(f"job {run_id} was cancelled"), debug, 1)
    if outcome.rc != 0:
        why = last_error(outcome.log) or f"the driver exited {outcome.rc}"
        log = f"{job_dir(node, run_id)}/{LOG}"
        still_up()
        fail(JobFailed(f"job {run_id} failed: {why} (log: {log} on the master)"), debug, 1)
    if rec.kind == "evaluate":
        fetched += model_jobs.fetch_report(rec.prefix, rec.s3_endpoint_url, Path("runs") / run_id)
    lines = finished_lines(
        rec.kind, rec.output, run_id, rec.prefix, rec.s3_endpoint_url, outcome.rows,
        ended - rec.started, cost, fetched,
    )  # fmt: skip
    for line in lines:
        results.print(line, markup=False, highlight=False, soft_wrap=True)
    for path in fetched:
        results.print(f"fetched {path}", markup=False, highlight=False, soft_wrap=True)
    still_up()


def finished_lines(
    kind: str,
    output: str | None,
    run_id: str,
    prefix: str,
    endpoint_url: str | None,
    rows: list[dict[str, Any]],
    wall_s: float,
    cost: float | None,
    fetched: list[Path],
) -> list[Any]:
    """What a job that ended well prints (a submit attached to it, or `attach`): training's
    summary lines (`summary_lines`); a model's job's run id and prefix, then `sparknet
    evaluate`'s table of the fetched report, or where predict wrote (`output`) how many rows."""
    from sparknet.jobs import model_jobs  # lazy: boto3, fabric
    from sparknet.jobs.follow import summary_lines  # lazy: boto3, fabric

    if kind == "train":
        return summary_lines(run_id, prefix, rows, wall_s, cost)
    head = [f"run id: {run_id}", f"run prefix: {prefix}"]
    if kind == "predict" and output is not None:
        count = model_jobs.predicted_rows(output, endpoint_url)
        rows_text = "unknown" if count is None else str(count)
        return [*head, f"predictions: parquet:{output}", f"rows: {rows_text}"]
    report = next((p for p in fetched if p.name == "evaluation.json"), None)
    if report is None:
        return [*head, "evaluation.json: not found in the run prefix"]
    evaluation = model_jobs.read_evaluation(report)
    written = [p.name for p in fetched if p.name in model_jobs.REPORT]
    return [*head, evaluation_table(evaluation, prefix.rstrip("/"), written)]


def _ended_outcome(conn, found, run_id: str, state: str):
    """The outcome of a job that ended before `attach` came: said in one line (how, after how
    many rounds), its rounds not replayed."""
    from sparknet.data.store import open_store  # lazy: boto3
    from sparknet.jobs.driver_control import driver_log, driver_rc  # lazy: boto3, fabric
    from sparknet.jobs.follow import Outcome  # lazy: boto3, fabric
    from sparknet.training.report import read_metrics  # lazy: boto3

    rec, node = found.record, found.master.node
    rc = driver_rc(conn, node, run_id)
    rows = read_metrics(open_store(rec.prefix, rec.s3_endpoint_url))
    done = max((row["round"] for row in rows), default=0)
    rounds = f" after round {done} of {rec.rounds}" if rec.kind == "train" else ""
    say(f"job {run_id} already ended ({state}){rounds}")
    return Outcome(rc, rows, driver_log(conn, node, run_id) if rc else "")


def _still_up(rec, spec, cost: float | None):
    """What `attach` says last of a cluster that the job's submit made (and that runs: the job
    was just asked of its master): it is still up, its cost so far, and what ends it."""
    from sparknet.jobs.submit import up_line  # lazy: boto3, fabric

    def say_still_up() -> None:
        if rec.made:
            usd = "unknown" if cost is None else f"${cost:.2f}"
            say(up_line(spec, f"made by sparknet-submit; cost so far {usd}"))

    return say_still_up


def logs(
    run_id: str = RunArgument,
    follow: bool = typer.Option(False, "--follow", "-f", help="go on until the job ends"),
    lines: int = typer.Option(200, "--lines", "-n", min=1, help="the log's last N lines"),
    cluster: str | None = ClusterOption,
    endpoint_url: str | None = JobsEndpointOption,
    config: Path | None = JobsConfigOption,
    debug: bool = JobsDebugOption,
) -> None:
    """The driver's log on the master: its last --lines, and with --follow what it adds until
    the job ends (Ctrl-C stops following; the job goes on)."""
    from sparknet.jobs import records  # lazy: boto3, fabric

    found, conn = _located(run_id, cluster, endpoint_url, config, debug)
    caught = Caught()

    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    try:
        with interrupts(caught):
            records.print_log(conn, found.master.node, run_id, lines, follow, write)
    except KeyboardInterrupt:
        raise typer.Exit(128 + (caught.signum or signal.SIGINT)) from None
    except SparknetError as exc:
        fail(exc, debug, 1)
    finally:
        conn.close()


def cancel(
    run_id: str = RunArgument,
    cluster: str | None = ClusterOption,
    endpoint_url: str | None = JobsEndpointOption,
    config: Path | None = JobsConfigOption,
    debug: bool = JobsDebugOption,
) -> None:
    """End the job: its driver's whole process session on the master, waited for until none
    of it is left. A job that already ended stays as it ended (exit 0 both)."""
    from sparknet.jobs import records  # lazy: boto3, fabric

    found, conn = _located(run_id, cluster, endpoint_url, config, debug)
    try:
        before = records.cancel(conn, found.master.node, run_id)
    except SparknetError as exc:
        fail(exc, debug, 1)
    finally:
        conn.close()
    if before is None:
        say(f"job {run_id} cancelled: its driver's session on the master is gone")
    else:
        say(f"job {run_id} already ended: {before}")


def list_jobs(
    endpoint_url: str | None = JobsEndpointOption,
    config: Path | None = JobsConfigOption,
    debug: bool = JobsDebugOption,
) -> None:
    """The jobs this machine started or attached to, one per line: run id, cluster, state
    (running, succeeded, failed RC, cancelled, or `cluster gone`), started (UTC), and what it
    does (train, evaluate, predict)."""
    from sparknet.jobs import records  # lazy: boto3, fabric

    try:
        listed = records.listing(_spec_of(config), endpoint_url)
    except SparknetError as exc:
        fail(exc, debug, 1)
    if not listed:  # a note on stderr: stdout stays the lines
        console.print("no jobs: this machine started or attached to none")
    for item in listed:
        rec = item.record
        print(f"{rec.run_id}\t{rec.cluster}\t{item.state}\t{rec.started_text()}\t{rec.kind}")
