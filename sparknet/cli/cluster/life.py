"""`sparknet cluster up|down|status|bootstrap`: a cluster's life, and what each command prints.

On EC2 or on a static cluster's hosts; a command prints the cluster's instances, each node's
`ssh` line, what a `down` removed, Spark's health.

Apart from inventory.py (`list`, `sweep`: every cluster of a region by its tags) and ssh.py
(`ssh`, `tunnel`: one node through the OpenSSH client): these act on one named cluster.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import typer
from rich.console import Console

from sparknet.cli.cluster.options import (
    INSTANCE_TYPE_HELP,
    SPOT_HELP,
    WORKERS_HELP,
    AnyOwnerOption,
    RegionOption,
    cluster_spec,
    fail_cluster,
    on_cluster,
)
from sparknet.cli.common import (
    Caught,
    ConfigOption,
    DebugOption,
    EndpointOption,
    console,
    fail,
    interrupts,
    titled_table,
)
from sparknet.errors import SparknetError, first_line
from sparknet.say import command_line

# `# lazy: X` below: an import kept inside the command that needs it, X being slow to import
# (torch ~2 s; boto3, fabric, numpy ~0.2 s each; `+N ms`: what it adds, measured) while
# `sparknet cluster --help` and every other command import this module


def _say(line: str) -> None:
    """A progress line on stderr as it is: no markup, no wrapping (ids and the bootstrap's
    per-node lines are read and copied whole)."""
    console.print(line, markup=False, highlight=False, soft_wrap=True)


#: "node" is last: scripts that read the tab-separated lines by position keep working
_COLUMNS = ("role", "id", "state", "type", "az", "public ip", "spot", "node")


def _print_instances(info) -> None:
    """The cluster's instances: a table on a terminal; tab-separated lines when stdout is a
    file or a pipe, which has no width (rich would assume 80 columns and cut the ids)."""
    from sparknet.cluster import node_endpoints  # lazy: fabric

    names = {inst.id: name for name, inst in node_endpoints.node_names(info.instances)}
    rows = [
        (i.role, i.id, i.state, i.type, i.az, i.public_ip or "-", "yes" if i.spot else "",
         names.get(i.id, "-"))
        for i in info.instances
    ]  # fmt: skip
    out = Console()
    if not out.is_terminal:
        print(f"cluster {info.name} ({info.region})")
        for row in [_COLUMNS, *rows]:
            print("\t".join(row))
        return
    table = titled_table(f"cluster {info.name} ({info.region})")
    for k, col in enumerate(_COLUMNS):
        # ids and addresses are copied into other commands: never cut, at worst folded
        widest = max((len(row[k]) for row in rows), default=0)
        whole = col in ("id", "public ip")
        table.add_column(col, min_width=widest if whole else None, overflow="fold")
    for row in rows:
        table.add_row(*row)
    out.print(table)


def _print_ssh(spec, info) -> None:
    """Each node's SSH address and the `ssh` command that reaches it (the cluster's key and
    pinned host keys), one tab-separated line per node."""
    from sparknet.cluster import node_endpoints  # lazy: fabric

    for name, inst in node_endpoints.node_names(info.instances):
        try:
            endpoint = node_endpoints.endpoint_of(spec.name, name, inst)
        except SparknetError:
            print(f"ssh {name}	-	(no public address while {inst.state})")
            continue
        _print_ssh_line(spec, endpoint)


def _print_ssh_line(spec, endpoint) -> None:
    from sparknet.cluster import openssh, sshkeys  # lazy: boto3, fabric

    command = shlex.join(openssh.ssh_command(endpoint, sshkeys.access_for(spec)))
    print(f"ssh {endpoint.name}	{endpoint.user}@{endpoint.host}:{endpoint.port}	{command}")


def cluster_up(
    name: str = typer.Argument(..., help="cluster name (a `clusters:` entry, or new)"),
    workers: int | None = typer.Option(None, help=WORKERS_HELP),
    instance_type: list[str] = typer.Option([], help=INSTANCE_TYPE_HELP),
    master_type: str | None = typer.Option(
        None,
        help="the master's instance type (default: the cluster's, else g5.xlarge, or where the "
        "region lacks it the first of the worker defaults it offers)",
    ),
    spot: bool | None = typer.Option(None, "--spot/--on-demand", help=SPOT_HELP),
    region: str | None = RegionOption,
    allowed_cidr: str | None = typer.Option(None, help="SSH source (default: your /32)"),
    ami: str | None = typer.Option(
        None,
        help="AMI id of the nodes, e.g. one `make ami` baked (default: ami_parameter's)",
    ),
    autostop: int | None = typer.Option(
        None,
        "--autostop",
        metavar="MINUTES",
        help="the master terminates the cluster after this many idle minutes (no job running, "
        "no submitter attached); 0: off (default: 30)",
    ),
    any_owner: bool = AnyOwnerOption,
    no_bootstrap: bool = typer.Option(
        False,
        "--no-bootstrap",
        help="only launch the instances; `cluster bootstrap` later, within backstop_minutes "
        "(default: 60) of their boot, or their backstop terminates them",
    ),
    endpoint_url: str | None = EndpointOption,
    config: Path | None = ConfigOption,
    debug: bool = DebugOption,
) -> None:
    """Bring a cluster up (idempotent) and bootstrap Spark on it, ending with its health check.
    On error or Ctrl-C before the bootstrap, remove what was created; a failed or interrupted
    bootstrap leaves the instances up (exit 1: `cluster bootstrap` finishes it) until their
    backstop terminates them, backstop_minutes after their last boot. Refuses
    (exit 1) a cluster of that name tagged with another owner unless --any-owner."""
    from sparknet.cluster import provider  # lazy: boto3, fabric
    from sparknet.cluster.records import Interrupted  # lazy: boto3

    flags = dict(
        workers=workers, instance_types=instance_type, master_type=master_type, spot=spot,
        region=region, allowed_cidr=allowed_cidr, ami=ami, autostop_minutes=autostop,
    )  # fmt: skip
    caught = Caught()
    # a second signal arrives while the first one's clean-up runs: before the bootstrap that
    # removes what this `up` launched, during it nothing is removed (the instances stay)
    note = (
        "finishing the clean-up of the interrupt; "
        f"`{command_line('sparknet cluster status', name)}` shows what is left after"
    )
    try:
        with interrupts(caught, stop_at=1, note=note):
            try:
                spec = cluster_spec(name, config, flags)
                info = provider.of(spec).up(
                    spec, endpoint_url=endpoint_url, say=_say, bootstrap=not no_bootstrap,
                    any_owner=any_owner,
                )  # fmt: skip
            except KeyboardInterrupt as exc:  # before `up` made anything
                raise Interrupted("interrupted; nothing was made") from exc
    except SparknetError as exc:
        fail_cluster(exc, debug, caught)
    _print_up(spec, info, bootstrapped=not no_bootstrap)


def _print_cluster(spec, info) -> None:
    """The cluster's machines: its instances, or the user's hosts with each one's `ssh` line."""
    if info.hosts:
        print(f"cluster {info.name} (static, {len(info.hosts)} hosts)")
        for endpoint in info.hosts:
            _print_ssh_line(spec, endpoint)
        return
    _print_instances(info)


def _print_up(spec, info, *, bootstrapped: bool) -> None:
    """What `up` made, what it costs, and what ends it: the instances, or Spark on the user's
    hosts (the machines stay)."""
    name = info.name
    _print_cluster(spec, info)
    if info.hosts:
        done = "is up" if bootstrapped else "is registered (not bootstrapped)"
        print(
            f"cluster {name} {done}; `{command_line('sparknet cluster down', name)}` stops its "
            "Spark (the machines stay)"
        )
        return
    print(
        f"cluster {name} is up; estimated cost {info.cost.describe()}; "
        f"`{command_line('sparknet cluster down', name, region=info.region)}` ends it"
    )
    if not bootstrapped:
        print(
            f"not bootstrapped: the instances power off (terminate) {spec.backstop_minutes} "
            "minutes after their last boot unless "
            f"`{command_line('sparknet cluster bootstrap', name, region=info.region)}` finishes "
            "them by then"
        )


def cluster_down(
    name: str = typer.Argument(...),
    region: str | None = RegionOption,
    any_owner: bool = AnyOwnerOption,
    forget_unreachable: bool = typer.Option(
        False,
        "--forget-unreachable",
        help="static cluster: forget hosts that do not answer instead of failing (stop "
        "Spark there yourself)",
    ),
    yes: bool = typer.Option(
        False, "--yes", "-y", help="do not ask before cancelling the jobs that run on it"
    ),
    endpoint_url: str | None = EndpointOption,
    config: Path | None = ConfigOption,
    debug: bool = DebugOption,
) -> None:
    """Terminate the cluster's instances, delete its resources, and list what was deleted; exit
    1 when the region has nothing of that name (the line names the clusters it has), or when
    its owner tag names another principal (unless --any-owner). A static cluster: stop Spark on
    its hosts and forget it (exit 1 naming a host that does not answer). The sparknet-submit
    jobs running on it are named first, as they are cancelled with it: on a terminal it asks
    (unless --yes); otherwise it goes on."""
    from sparknet.cluster import provider  # lazy: boto3, fabric
    from sparknet.cluster.records import Interrupted  # lazy: boto3

    caught = Caught()
    spec = on_cluster(lambda spec: spec, name, region, config, debug)
    _confirm_jobs_end(spec, endpoint_url, yes, debug, any_owner)
    cluster = provider.of(spec)
    region = spec.region if cluster.REGIONAL else None
    finish = f"`{command_line('sparknet cluster down', name, region=region)}`"
    note = f"taking {name} down to the end so nothing is left half-deleted; again to stop it"
    try:
        with interrupts(caught, stop_at=2, note=note):
            report = cluster.down(
                spec, endpoint_url=endpoint_url, say=_say, any_owner=any_owner,
                forget_unreachable=forget_unreachable,
            )  # fmt: skip
    except KeyboardInterrupt:
        fail_cluster(Interrupted(f"interrupted; run {finish} to finish"), debug, caught)
    except SparknetError as exc:
        fail_cluster(exc, debug, caught)
    if report.stopped is not None:  # the machines stay: Spark on them was stopped
        print(f"stopped Spark on {', '.join(report.stopped) or 'no host'}")
        print(f"cluster {name} is down (static: its hosts keep running)")
        return
    print_down(report)
    print(f"cluster {name} is down")


def _confirm_jobs_end(
    spec, endpoint_url: str | None, yes: bool, debug: bool, any_owner: bool
) -> None:
    """Name the jobs that `down` of `spec` cancels; on a terminal, without --yes, go on only
    when the user says so (exit 1 otherwise). Not on a terminal (a script, CI, a clean-up),
    `down` goes on after the line: a teardown that waits for an answer nobody gives would
    leave the cluster billed."""
    from sparknet.jobs import driver_control  # lazy: boto3, fabric

    try:
        running = driver_control.jobs_on(spec, endpoint_url, any_owner=any_owner)
    except KeyboardInterrupt:  # while the master is asked: nothing was done yet
        fail(SparknetError(f"interrupted; cluster {spec.name} not taken down"), debug, 130)
    if not running:
        return
    them = "it" if len(running) == 1 else "them"
    _say(
        f"cluster {spec.name} runs job {', '.join(running)}: taking it down cancels {them} "
        f"(`{command_line('sparknet-submit cancel', 'RUN')}` ends one job alone)"
    )
    if yes or not _on_terminal():
        return
    kept = f"cluster {spec.name} not taken down: job {', '.join(running)} runs on"
    try:
        answer = _ask(f"cancel {them} and take cluster {spec.name} down?")
    except KeyboardInterrupt:  # at the question: nothing was done yet
        print(file=sys.stderr)
        fail(SparknetError(f"interrupted; {kept}"), debug, 130)
    if answer is None:  # end of input (Ctrl-D): nobody answered
        print(file=sys.stderr)
        fail(SparknetError(f"no answer; {kept}; `--yes` takes it down without asking"), debug, 1)
    if not answer:
        fail(SparknetError(f"{kept}; `--yes` takes it down without asking"), debug, 1)


def _ask(question: str) -> bool | None:
    """`question [y/N]: ` on stderr and the answer from stdin: yes for y or yes, None at the end
    of input (click's confirm says only `Aborted.` there and at Ctrl-C)."""
    print(f"{question} [y/N]: ", end="", file=sys.stderr, flush=True)
    line = sys.stdin.readline()
    return line.strip().lower() in ("y", "yes") if line else None


def _on_terminal() -> bool:
    """Whether a person can answer a question: stdin and stderr are terminals."""
    return sys.stdin.isatty() and sys.stderr.isatty()


def print_down(report) -> None:
    """What a `down` removed, one line each, and what the instances cost as they ran."""
    for item in report.terminated:
        print(f"terminated instance:{item}")
    for item in report.deleted:
        print(f"deleted {item}")
    if not report.terminated:
        print(f"{report.name}: no instances were running")
        return
    if report.cost_usd is None:
        cost = f"an unknown amount (no price for {report.region} or one of its types)"
    else:
        cost = f"about ${report.cost_usd:.2f}"
    print(f"{report.name}: its instances (with their volumes and public addresses) cost {cost}")


def cluster_status(
    name: str = typer.Argument(...),
    region: str | None = RegionOption,
    ssh: bool = typer.Option(
        True,
        "--ssh/--no-ssh",
        help="ask the master over SSH for Spark's health and the autostop timer; --no-ssh: "
        "what AWS (or the registry) says only, at once, with no wait for a node",
    ),
    endpoint_url: str | None = EndpointOption,
    config: Path | None = ConfigOption,
    debug: bool = DebugOption,
) -> None:
    """The cluster's instances, found by tag, each node's SSH address and command, and (unless
    --no-ssh) Spark's health and the autostop timer; exit 1 when it has none."""
    from sparknet.cluster import ec2, provider, spark_nodes  # lazy: boto3, fabric

    spec = on_cluster(lambda spec: spec, name, region, config, debug)
    cluster = provider.of(spec)
    try:
        info = cluster.status(spec, endpoint_url=endpoint_url)
    except SparknetError as exc:
        fail_cluster(exc, debug)
    spec = cluster.current(spec)
    if not info.instances and not info.hosts:
        note = ec2.leftover_note(name, info.region)
        print(f"cluster {name} has no live instances in {info.region}: {note}")
        raise typer.Exit(1)
    _print_cluster(spec, info)
    if info.hosts:  # the user's machines: Spark's health is what there is to say of them
        if ssh and not _print_health(spec, info, endpoint_url):
            raise typer.Exit(1)
        return
    _print_ssh(spec, info)
    print(f"estimated cost {info.cost.describe()}")
    if not ssh:
        return
    if _print_health(spec, info, endpoint_url) is None:  # no second wait for the same master
        print("autostop: unknown: the master does not answer")
    else:
        print(spark_nodes.autostop_status(spec, info.instances, endpoint_url=endpoint_url))


def _print_health(spec, info, endpoint_url: str | None) -> bool | None:
    """The Spark cluster's health (workers registered, cores, GPUs) as its master tells it; one
    line when the nodes cannot be asked. Whether it is healthy (None: the nodes cannot be
    asked)."""
    from sparknet.cluster import provider  # lazy: boto3, fabric

    try:
        health = provider.of(spec).health(spec, info, endpoint_url=endpoint_url)
    except SparknetError as exc:
        print(f"Spark: the nodes cannot be reached ({first_line(exc)})")
        return None
    for line in health.lines():
        print(line)
    return health.ok


def cluster_bootstrap(
    name: str = typer.Argument(...),
    region: str | None = RegionOption,
    force: bool = typer.Option(
        False,
        "--force",
        help="restart the Spark master (or a running worker) even while a job runs on the "
        "cluster: the job's executors are killed",
    ),
    endpoint_url: str | None = EndpointOption,
    config: Path | None = ConfigOption,
    debug: bool = DebugOption,
) -> None:
    """Bootstrap Spark on the cluster's running instances again (idempotent: a done step is
    skipped, and a cluster with nothing to do says so), ending with its health check; exit 1
    when a step fails (the line names node and step) or the cluster is not healthy. Refuses
    (exit 2) to start or restart the master, or restart a running worker, while a job runs on
    the cluster, unless --force."""
    from sparknet.cluster import provider  # lazy: boto3, fabric
    from sparknet.cluster.records import Interrupted  # lazy: boto3

    spec = on_cluster(lambda spec: spec, name, region, config, debug)
    try:
        info = provider.of(spec).bootstrap(spec, endpoint_url=endpoint_url, say=_say, force=force)
    except KeyboardInterrupt:
        fail_cluster(Interrupted("interrupted; run it again to finish"), debug)
    except SparknetError as exc:
        fail_cluster(exc, debug)
    if info.hosts:  # a static cluster's bootstrap registers its hosts anew, as `up` does
        _print_up(spec, info, bootstrapped=True)
