"""`sparknet cluster ...`: EC2 GPU clusters up, down, status, list and sweep."""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from sparknet.cli.common import (
    Caught,
    ConfigOption,
    DebugOption,
    EndpointOption,
    console,
    fail,
    first_line,
    interrupts,
    signal_exit,
)
from sparknet.config import find_config_file
from sparknet.errors import SparknetError

cluster_app = typer.Typer(no_args_is_help=True, help="EC2 GPU clusters: up, down, status, list.")
RegionOption = typer.Option(None, help="AWS region; default: the cluster's, else us-east-1")
AnyOwnerOption = typer.Option(
    False, "--any-owner", help="act on the cluster even if its sparknet:owner tag names another"
)


def _say(line: str) -> None:
    """A progress line on stderr as it is: no markup, no wrapping (ids and the bootstrap's
    per-node lines are read and copied whole)."""
    console.print(line, markup=False, highlight=False, soft_wrap=True)


#: a valid name that stands in while a spec named by a tag is validated (`_cluster_spec`)
_STAND_IN = "removal"


def _cluster_spec(name: str, config: Path | None, flags: dict[str, Any], *, any_name: bool = False):
    """The spec of cluster `name`: the registry's, else `clusters:` in the settings file, plus
    flags; a one-line error when the result is invalid.

    `any_name`: `down` and `sweep` remove by tag, and a tag may carry a name sparknet no longer
    accepts (an older sparknet's, or a person's): everything else is validated, the name is not.
    """
    from pydantic import ValidationError

    from sparknet.cluster import nodes, steps
    from sparknet.cluster.lifecycle import registered
    from sparknet.cluster.spec import ClusterSpec
    from sparknet.config import describe_validation_error, read_section

    nodes.silence_s(), steps.reboot_wait_s()  # a bad SSH wait setting fails before any launch

    base: dict[str, Any] = {}
    known = registered().get(name)
    if known is not None:
        base = known.model_dump()
        if known.provider == "static":
            del base["workers"]  # counted from hosts, which the settings file may change
    path = find_config_file(config)
    if path is not None:
        entry = read_section(path, "clusters").get(name) or {}
        if "owner" in entry:
            raise SparknetError(
                f"cluster {name}: `owner` is set by `up` from your AWS identity (STS); remove it "
                f"from `clusters: {name}:` in {path}"
            )
        base.update(_resolved_paths(entry, path))
    base.update({k: v for k, v in flags.items() if v not in (None, [])})
    if known is not None and base.get("provider", "aws") != known.provider:
        raise SparknetError(
            f"cluster {name} is registered here as {_PROVIDERS[known.provider]}, but "
            f"{path} says provider: {base.get('provider')}; `sparknet cluster down {name}` "
            "first, or give the other one another name"
        )
    base["name"] = _STAND_IN if any_name else name
    try:
        spec = ClusterSpec.model_validate(base)
    except ValidationError as exc:
        raise SparknetError(
            f"cluster {name}: {describe_validation_error(exc, ClusterSpec)}"
        ) from exc
    return spec.model_copy(update={"name": name})


_PROVIDERS = {
    "aws": "an EC2 cluster (provider: aws)",
    "static": "a static cluster (provider: static)",
}


def _resolved_paths(entry: dict[str, Any], path: Path) -> dict[str, Any]:
    """`entry` with its key_file and known_hosts absolute: a relative path is relative to the
    settings file's folder (as the registry stores it, for commands run from anywhere)."""
    out = dict(entry)
    for key in ("key_file", "known_hosts"):
        value = out.get(key)
        if isinstance(value, str) and value:
            out[key] = str((path.parent / Path(value).expanduser()).resolve())
    return out


#: "node" is last: scripts that read the tab-separated lines by position keep working
_COLUMNS = ("role", "id", "state", "type", "az", "public ip", "spot", "node")


def _print_instances(info) -> None:
    """The cluster's instances: a table on a terminal; tab-separated lines when stdout is a
    file or a pipe, which has no width (rich would assume 80 columns and cut the ids)."""
    from sparknet.cluster import nodes

    names = {inst.id: name for name, inst in nodes.node_names(info.instances)}
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
    table = Table(title=f"cluster {info.name} ({info.region})")
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
    from sparknet.cluster import nodes

    for name, inst in nodes.node_names(info.instances):
        try:
            endpoint = nodes.endpoint_of(spec.name, name, inst)
        except SparknetError:
            print(f"ssh {name}	-	(no public address while {inst.state})")
            continue
        _print_ssh_line(spec, endpoint)


def _print_ssh_line(spec, endpoint) -> None:
    from sparknet.cluster import nodes

    command = shlex.join(nodes.ssh_command(endpoint, nodes.access_for(spec)))
    print(f"ssh {endpoint.name}	{endpoint.user}@{endpoint.host}:{endpoint.port}	{command}")


def _fail(exc: SparknetError, debug: bool, caught: Caught | None = None) -> None:
    """`fail` with exit 1 where the command was right but the cluster's state says no (busy,
    not there, another's, in another region), 128 + the signal's number where a signal stopped
    it (130 Ctrl-C, 143 SIGTERM), and 2 for everything a user fixes in the command or settings."""
    from sparknet.cluster import lifecycle, static

    state = (
        lifecycle.ClusterBusy, lifecycle.ClusterNotFound, lifecycle.NotYours,
        lifecycle.OtherRegion, lifecycle.BootstrapIncomplete, static.StopIncomplete,
        static.HostsChanged,
    )  # fmt: skip
    if isinstance(exc, lifecycle.Interrupted) and (code := signal_exit(caught)):
        fail(exc, debug, code)
    if isinstance(exc, lifecycle.BootstrapIncomplete) and not debug:
        # the error line, then each failed node's last output lines
        first, *rest = str(exc).splitlines()
        print("\n".join([f"error: {first}", *rest]), file=sys.stderr)
        raise typer.Exit(1)
    fail(exc, debug, 1 if isinstance(exc, state) else 2)


@cluster_app.command("up")
def cluster_up(
    name: str = typer.Argument(..., help="cluster name (a `clusters:` entry, or new)"),
    workers: int | None = typer.Option(None, help="worker instances"),
    instance_type: list[str] = typer.Option([], help="worker type, repeatable: fallback order"),
    master_type: str | None = typer.Option(None),
    spot: bool | None = typer.Option(None, "--spot/--on-demand", help="workers on spot"),
    region: str | None = RegionOption,
    allowed_cidr: str | None = typer.Option(None, help="SSH source; default: your /32"),
    ami: str | None = typer.Option(
        None, help="AMI id of the nodes (e.g. one `make ami` baked); default: ami_parameter"
    ),
    autostop: int | None = typer.Option(
        None,
        "--autostop",
        metavar="MINUTES",
        help="the master terminates the cluster after this many idle minutes (no job running, "
        "no submitter attached); 0: off; default 30",
    ),
    any_owner: bool = AnyOwnerOption,
    no_bootstrap: bool = typer.Option(
        False, "--no-bootstrap", help="only launch the instances; `cluster bootstrap` later"
    ),
    endpoint_url: str | None = EndpointOption,
    config: Path | None = ConfigOption,
    debug: bool = DebugOption,
) -> None:
    """Bring a cluster up (idempotent) and bootstrap Spark on it, ending with its health check.
    On error or Ctrl-C before the bootstrap, remove what was created; a failed or interrupted
    bootstrap leaves the instances up (exit 1: `cluster bootstrap` finishes it). Refuses
    (exit 1) a cluster of that name tagged with another owner unless --any-owner."""
    from sparknet.cluster import lifecycle

    flags = dict(
        workers=workers, instance_types=instance_type, master_type=master_type, spot=spot,
        region=region, allowed_cidr=allowed_cidr, ami=ami, autostop_minutes=autostop,
    )  # fmt: skip
    caught = Caught()
    # a second signal arrives while the first one's clean-up runs: before the bootstrap that
    # removes what this `up` launched, during it nothing is removed (the instances stay)
    note = (
        f"finishing the clean-up of the interrupt; `sparknet cluster status {name}` shows what "
        "is left after"
    )
    try:
        with interrupts(caught, stop_at=1, note=note):
            try:
                spec = _cluster_spec(name, config, flags)
                if spec.provider == "static":
                    _static_up(spec, bootstrap=not no_bootstrap)
                    return
                info = lifecycle.up(
                    spec, endpoint_url=endpoint_url, say=_say, any_owner=any_owner,
                    bootstrap=not no_bootstrap,
                )  # fmt: skip
            except KeyboardInterrupt as exc:  # before `up` made anything
                raise lifecycle.Interrupted("interrupted; nothing was made") from exc
    except SparknetError as exc:
        _fail(exc, debug, caught)
    _print_instances(info)
    print(
        f"cluster {name} is up; estimated cost {info.cost.describe()}; "
        f"`sparknet cluster down {name} --region {info.region}` ends it"
    )


def _static_up(spec, *, bootstrap: bool, force: bool = False) -> None:
    """`up` (and `cluster bootstrap`) of a static cluster: its hosts bootstrapped, each node's
    SSH line."""
    from sparknet.cluster import static

    found = static.up(spec, say=_say, bootstrap=bootstrap, force=force)
    print(f"cluster {spec.name} (static, {len(found)} hosts)")
    for endpoint in found:
        _print_ssh_line(spec, endpoint)
    done = "is up" if bootstrap else "is registered (not bootstrapped)"
    print(
        f"cluster {spec.name} {done}; `sparknet cluster down {spec.name}` stops its Spark "
        "(the machines stay)"
    )


def _on_cluster(
    action, name: str, region: str | None, config: Path | None, debug: bool, **kw
) -> Any:
    """`action(spec, **kw)` for the named cluster (any name a tag may carry); a one-line error on
    failure."""
    try:
        return action(_cluster_spec(name, config, {"region": region}, any_name=True), **kw)
    except SparknetError as exc:
        _fail(exc, debug)


@cluster_app.command("down")
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
    from sparknet.cluster import lifecycle

    caught = Caught()
    spec = _on_cluster(lambda spec: spec, name, region, config, debug)
    _confirm_jobs_end(spec, endpoint_url, yes, debug, any_owner)
    static = spec.provider == "static"
    finish = f"`sparknet cluster down {name}" + ("`" if static else f" --region {spec.region}`")
    note = f"taking {name} down to the end so nothing is left half-deleted; again to stop it"
    try:
        with interrupts(caught, stop_at=2, note=note):
            if static:
                _static_down(spec, forget_unreachable)
                return
            report = lifecycle.down(
                spec, endpoint_url=endpoint_url, say=console.print, any_owner=any_owner
            )
    except KeyboardInterrupt:
        _fail(lifecycle.Interrupted(f"interrupted; run {finish} to finish"), debug, caught)
    except SparknetError as exc:
        _fail(exc, debug, caught)
    _print_down(report)
    print(f"cluster {name} is down")


def _confirm_jobs_end(
    spec, endpoint_url: str | None, yes: bool, debug: bool, any_owner: bool
) -> None:
    """Name the jobs that `down` of `spec` cancels; on a terminal, without --yes, go on only
    when the user says so (exit 1 otherwise). Not on a terminal (a script, CI, a clean-up),
    `down` goes on after the line: a teardown that waits for an answer nobody gives would
    leave the cluster billed."""
    try:
        running = _running_jobs(spec, endpoint_url, any_owner)
    except KeyboardInterrupt:  # while the master is asked: nothing was done yet
        fail(SparknetError(f"interrupted; cluster {spec.name} not taken down"), debug, 130)
    if not running:
        return
    them = "it" if len(running) == 1 else "them"
    _say(
        f"cluster {spec.name} runs job {', '.join(running)}: taking it down cancels {them} "
        "(`sparknet-submit cancel RUN` ends one job alone)"
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


#: seconds `down` gives the master to answer which jobs run there before it goes on without
#: naming them (a master that is running but unreachable is taken down all the same)
JOBS_ASK_S = 10.0


def _running_jobs(spec, endpoint_url: str | None, any_owner: bool = False) -> list[str]:
    """The run ids of the sparknet-submit jobs whose session is alive on the cluster's master;
    none where it has no running master or it does not answer (`down` ends what runs there
    all the same). Asked only of a cluster bootstrapped from here (its secret is here, as for
    any job submitted from here) and, unless `any_owner`, the caller's own: `down` refuses
    another principal's cluster, and logs in to nothing of theirs before it does."""
    from sparknet import submit as flow
    from sparknet.cluster import lifecycle, nodes, provider
    from sparknet.cluster.bootstrap import running_jobs

    if not lifecycle.secret_file(spec.name).is_file():
        return []
    try:
        if not provider.master_running(spec, endpoint_url):
            return []
        if not any_owner and not provider.is_static(spec):
            owner = lifecycle.caller_owner(spec.region, endpoint_url)
            lifecycle.check_owner(spec, owner, endpoint_url)
        master = flow.master_of(spec, endpoint_url)
        conn = nodes.connect(master.node.endpoint, master.access, timeout=JOBS_ASK_S)
        try:
            return running_jobs(conn, master.node)
        finally:
            conn.close()
    except SparknetError:
        return []


def _static_down(spec, forget_unreachable: bool) -> None:
    from sparknet.cluster import static

    stopped = static.down(spec, say=_say, forget_unreachable=forget_unreachable)
    print(f"stopped Spark on {', '.join(stopped) or 'no host'}")
    print(f"cluster {spec.name} is down (static: its hosts keep running)")


def _print_down(report) -> None:
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


@cluster_app.command("status")
def cluster_status(
    name: str = typer.Argument(...),
    region: str | None = RegionOption,
    endpoint_url: str | None = EndpointOption,
    config: Path | None = ConfigOption,
    debug: bool = DebugOption,
) -> None:
    """The cluster's instances, found by tag, and each node's SSH address and command; exit 1
    when it has none."""
    from sparknet.cluster import lifecycle

    spec = _on_cluster(lambda spec: spec, name, region, config, debug)
    if spec.provider == "static":
        _static_status(spec, debug)
        return
    try:
        info = lifecycle.status(spec, endpoint_url=endpoint_url)
    except SparknetError as exc:
        _fail(exc, debug)
    if not info.instances:
        print(
            f"cluster {name} has no live instances in {info.region}: "
            f"{lifecycle.leftover_note(name)}"
        )
        raise typer.Exit(1)
    _print_instances(info)
    _print_ssh(spec, info)
    print(f"estimated cost {info.cost.describe()}")
    if _print_health(spec, info, endpoint_url) is None:  # no second wait for the same master
        print("autostop: unknown: the master does not answer")
    else:
        print(lifecycle.autostop_status(spec, info.instances, endpoint_url=endpoint_url))


def _print_health(spec, info, endpoint_url: str | None) -> bool | None:
    """The Spark cluster's health (workers registered, cores, GPUs) as its master tells it; one
    line when the nodes cannot be asked. Whether it is healthy (None: the nodes cannot be
    asked)."""
    from sparknet.cluster import lifecycle, static

    try:
        if spec.provider == "static":
            health = static.health(spec)
        else:
            health = lifecycle.spark_health(spec, info.instances, endpoint_url=endpoint_url)
    except SparknetError as exc:
        print(f"Spark: the nodes cannot be reached ({first_line(exc)})")
        return None
    for line in health.lines():
        print(line)
    return health.ok


def _static_status(spec, debug: bool) -> None:
    """A static cluster's hosts (each node's SSH line) and its Spark health; exit 1 when it is
    not registered here, not healthy, or its master cannot be asked."""
    from sparknet.cluster import static

    try:
        found = static.status(spec)
        spec = static.current(spec)
    except SparknetError as exc:
        _fail(exc, debug)
    print(f"cluster {spec.name} (static, {len(found)} hosts)")
    for endpoint in found:
        _print_ssh_line(spec, endpoint)
    if not _print_health(spec, None, None):
        raise typer.Exit(1)


@cluster_app.command("bootstrap")
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
    from sparknet.cluster import lifecycle

    spec = _on_cluster(lambda spec: spec, name, region, config, debug)
    try:
        if spec.provider == "static":
            _static_up(spec, bootstrap=True, force=force)
            return
        lifecycle.bootstrap_nodes(spec, endpoint_url=endpoint_url, say=_say, force=force)
    except KeyboardInterrupt:
        _fail(lifecycle.Interrupted("interrupted; run it again to finish"), debug)
    except SparknetError as exc:
        _fail(exc, debug)


@cluster_app.command("list")
def cluster_list(
    region: str = typer.Option("us-east-1"),
    endpoint_url: str | None = EndpointOption,
    debug: bool = DebugOption,
) -> None:
    """Clusters with resources in the region (by tag), whether this machine knows them, and
    their owners (`-`: resources made before sparknet tagged owners)."""
    from sparknet import aws
    from sparknet.cluster import lifecycle

    specs = lifecycle.registered()
    # static clusters first, whatever the region and whether AWS answers: nothing of them is
    # in AWS
    for name, spec in sorted(specs.items()):
        if spec.provider == "static":
            print(f"{name}\tstatic, {len(spec.hosts)} hosts\t-\tregistered\towner -")
    try:
        found = lifecycle.tagged_clusters(aws.check_region(region), endpoint_url=endpoint_url)
    except SparknetError as exc:
        fail(exc, debug)
    known = {
        name for name, spec in specs.items() if spec.region == region and spec.provider == "aws"
    }
    for name in sorted(set(found) | known):
        cluster = found.get(name, lifecycle.TaggedCluster(name))
        live = sum(item.startswith("instance:") for item in cluster.items)
        where = "registered" if name in known else "not registered"
        owners = ", ".join(sorted(owner or "-" for owner in cluster.owners)) or "-"
        left = "" if live else f"\t{lifecycle.leftover_note(name)}"
        print(
            f"{name}\t{live} instances\t{len(cluster.items) - live} other resources\t{where}"
            f"\towner {owners}{left}"
        )


def _not_yours(cluster, caller: str) -> str:
    """Why `sweep` leaves a cluster alone: whose it is."""
    others = sorted(o for o in cluster.owners if o is not None and o != caller)
    if others:
        return f"owned by {', '.join(others)}"
    return "resources without an owner tag (made before sparknet tagged owners)"


@cluster_app.command("sweep")
def cluster_sweep(
    region: str = typer.Option("us-east-1"),
    yes: bool = typer.Option(False, "--yes", help="take them down; default: only list"),
    all_owners: bool = typer.Option(
        False, "--all-owners", help="also other principals' clusters, and untagged ones"
    ),
    endpoint_url: str | None = EndpointOption,
    config: Path | None = ConfigOption,
    debug: bool = DebugOption,
) -> None:
    """Tagged resources of your clusters (sparknet:owner = your AWS identity) that are neither
    registered here nor in `clusters:`; `--yes` deletes them (the bucket is kept)."""
    from sparknet import aws
    from sparknet.cluster import lifecycle

    try:
        region = aws.check_region(region)
        wanted = _wanted(region, config)
        caller = None if all_owners else lifecycle.caller_owner(region, endpoint_url)
        found = lifecycle.orphans(region, wanted, endpoint_url=endpoint_url)
    except SparknetError as exc:
        _fail(exc, debug)
    swept = skipped = 0
    failed = []
    for name, cluster in sorted(found.items()):
        if caller is not None and not cluster.owned_by(caller):
            print(f"skipped {name}: {_not_yours(cluster, caller)}")
            skipped += 1
            continue
        print(f"orphan {name}: {' '.join(cluster.items)}")
        swept += 1
        if yes:
            try:
                spec = _cluster_spec(name, config, {"region": region}, any_name=True)
                report = lifecycle.down(
                    spec, endpoint_url=endpoint_url, say=console.print, any_owner=all_owners
                )
            except Exception as exc:  # any failure (an AWS 500 too): report it, go on to the next
                print(f"failed {name}: {first_line(exc)}")
                failed.append(name)
                continue
            _print_down(report)
            print(f"took {name} down")
    if skipped:
        print(f"{skipped} cluster(s) not yours were left alone; --all-owners includes them")
    if swept and not yes:
        print("run again with --yes to delete them")
    if failed:
        fail(SparknetError(f"could not take down {', '.join(failed)} (see above)"), debug, 1)


def _wanted(region: str, config: Path | None) -> set[str]:
    """The clusters of `region` that `sweep` leaves alone: registered here, or in `clusters:`
    of the settings file (whose region is us-east-1 unless it says otherwise)."""
    from sparknet.cluster import lifecycle
    from sparknet.config import read_section

    # a static cluster owns nothing in AWS: resources tagged with its name are another's
    wanted = {
        name
        for name, spec in lifecycle.registered().items()
        if spec.region == region and spec.provider == "aws"
    }
    path = find_config_file(config)
    if path is not None:
        for name, entry in read_section(path, "clusters").items():
            entry = entry or {}
            if entry.get("region", "us-east-1") == region and entry.get("provider") != "static":
                wanted.add(name)
    return wanted


def _reach(
    name: str, node: str, region: str | None, endpoint_url: str | None, config: Path | None,
    debug: bool,
):  # fmt: skip
    """The endpoint of `node` of cluster `name` and the cluster's access, its host keys pinned
    afresh from EC2 (the instances' user data: right even after a lost registry or a new public
    address); a one-line error (exit 2) for an unknown node, exit 1 for a cluster not there."""
    from sparknet.cluster import instances, lifecycle, nodes

    spec = _on_cluster(lambda spec: spec, name, region, config, debug)
    try:
        if shutil.which("ssh") is None:
            raise SparknetError("the OpenSSH client `ssh` is not on PATH; install openssh-client")
        if spec.provider == "static":
            from sparknet.cluster import static

            spec = static.current(spec)
            return nodes.pick(static.endpoints(spec), node), static.access(spec), spec
        ec2 = instances.ec2_client(spec.region, endpoint_url)
        found = [i for i in instances.find(ec2, spec.name) if i.state in ("pending", "running")]
        if not found:
            raise lifecycle.ClusterNotFound(
                f"cluster {name} has no running instances in {spec.region}; "
                f"`sparknet cluster up {name}` starts it"
            )
        access = nodes.access_for(spec)
        nodes.check_key_file(access)
        nodes.pin_cluster(ec2, spec.name, found, access.known_hosts)
        endpoint = nodes.endpoint_named(spec.name, found, node)
    except SparknetError as exc:
        _fail(exc, debug)
    return endpoint, access, spec


#: the options of `cluster ssh` that may also follow NAME (click reads none there: the command
#: takes no interspersed options, so the remote command's own stay its own), and whether each
#: takes a value
_SSH_OPTIONS = {"--region": True, "--endpoint-url": True, "--config": True, "--debug": False}


def _split_command(words: list[str]) -> tuple[str, list[str], dict[str, str]]:
    """(node, command, options) of `cluster ssh NAME [NODE] [OPTIONS] [-- CMD...]`: the command
    is what follows the first `--` (click keeps the `--`, as the command takes no interspersed
    options); `_SSH_OPTIONS` before it are taken out (``--debug`` maps to "")."""
    cut = words.index("--") if "--" in words else len(words)
    before, options = _late_options(words[:cut])
    command = words[cut + 1 :]
    if len(before) > 1:
        raise SparknetError(
            f"put the command after `--`: sparknet cluster ssh NAME {before[0]} -- "
            f"{shlex.join(before[1:])}"
        )
    return (before[0] if before else "master"), command, options


def _late_options(words: list[str]) -> tuple[list[str], dict[str, str]]:
    """`words` without the `_SSH_OPTIONS` in them (``--opt VALUE`` or ``--opt=VALUE``), and
    those options; a one-line error for any other word beginning with ``-``."""
    rest: list[str] = []
    options: dict[str, str] = {}
    items = iter(words)
    for word in items:
        if not word.startswith("-"):
            rest.append(word)
            continue
        flag, eq, value = word.partition("=")
        if flag not in _SSH_OPTIONS:
            raise SparknetError(
                f"no option {flag} of `cluster ssh` (its options: {', '.join(_SSH_OPTIONS)}); "
                "put a command and its options after `--`"
            )
        if _SSH_OPTIONS[flag] and not eq:
            value = next(items, "")
        if _SSH_OPTIONS[flag] and not value:
            raise SparknetError(f"{flag} needs a value")
        options[flag] = value
    return rest, options


@cluster_app.command(
    "ssh", context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True}
)
def cluster_ssh(
    name: str = typer.Argument(...),
    words: list[str] = typer.Argument(
        None, metavar="[NODE] [-- CMD...]", help="master (default) or worker-N; then a command"
    ),
    region: str | None = RegionOption,
    endpoint_url: str | None = EndpointOption,
    config: Path | None = ConfigOption,
    debug: bool = DebugOption,
) -> None:
    """A shell on a node, or with `-- CMD` a command there (the exit code is the command's);
    through `ssh` with the cluster's key and pinned host keys (an unknown or changed host key
    is refused)."""
    from sparknet.cluster import nodes

    try:
        node, command, late = _split_command(list(words or []))
    except SparknetError as exc:
        _fail(exc, debug)
    region = late.get("--region", region)
    endpoint_url = late.get("--endpoint-url", endpoint_url)
    config = Path(late["--config"]) if "--config" in late else config
    debug = debug or "--debug" in late
    endpoint, access, _spec = _reach(name, node, region, endpoint_url, config, debug)
    argv = nodes.ssh_command(endpoint, access, *([] if command else ["-t"]))
    sys.stdout.flush()
    os.execvp(argv[0], [*argv, *(["--", *command] if command else [])])


@cluster_app.command("tunnel")
def cluster_tunnel(
    name: str = typer.Argument(...),
    master_ui_port: int = typer.Option(8080, help="local port of the Spark master's UI"),
    app_ui_port: int = typer.Option(4040, help="local port of the running application's UI"),
    remote_master_ui_port: int | None = typer.Option(
        None, help="the master UI's port on the master; default: the cluster's master_ui_port"
    ),
    remote_app_ui_port: int = typer.Option(
        4040, help="the application UI's port on the master (4041, ... for a second application)"
    ),
    region: str | None = RegionOption,
    endpoint_url: str | None = EndpointOption,
    config: Path | None = ConfigOption,
    debug: bool = DebugOption,
) -> None:
    """Forward the master's Spark UIs (master 8080, application 4040: reachable only on the
    node itself) to ports on localhost until Ctrl-C."""
    from sparknet.cluster import nodes

    ports = {
        "--master-ui-port": master_ui_port, "--app-ui-port": app_ui_port,
        "--remote-master-ui-port": remote_master_ui_port,
        "--remote-app-ui-port": remote_app_ui_port,
    }  # fmt: skip
    for option, port in ports.items():
        if port is not None and not 0 < port < 65536:
            _fail(SparknetError(f"{option} {port} is not a port (1-65535)"), debug)
    endpoint, access, spec = _reach(name, "master", region, endpoint_url, config, debug)
    remote_master_ui_port = remote_master_ui_port or spec.bootstrap.master_ui_port
    # the UIs bind 127.0.0.1 on the node (not `localhost`, which may be ::1 there)
    forwards = [
        "-N", "-o", "ExitOnForwardFailure=yes",
        "-L", f"127.0.0.1:{master_ui_port}:127.0.0.1:{remote_master_ui_port}",
        "-L", f"127.0.0.1:{app_ui_port}:127.0.0.1:{remote_app_ui_port}",
    ]  # fmt: skip
    console.print(
        f"Spark master UI: http://localhost:{master_ui_port}  application UI: "
        f"http://localhost:{app_ui_port}  (tunnel to {endpoint}; Ctrl-C ends it)"
    )
    argv = nodes.ssh_command(endpoint, access, *forwards)
    os.execvp(argv[0], argv)
