"""The `static` provider: a cluster of machines the user already has.

On-prem boxes, machines started by hand, given by SSH address (`hosts:`, the master first).
sparknet bootstraps Spark on them and stops it again; it never starts, stops or deletes a
machine, and nothing here calls AWS.

Trust comes from the user's own known_hosts (`known_hosts:`, default ~/.ssh/known_hosts and
/etc/ssh/ssh_known_hosts): the keys the user's first login checked are copied into the
cluster's known_hosts on every use, and a host with no key there is refused before anything
connects (sparknet made these machines no host key to pin, and trusting whatever answers first
is what pinning exists to prevent).

The registry entry is the cluster's only record (there are no tags to find it by): `up` writes
it before it connects anywhere, so a `down` after any failure still finds every host to stop.
Once a cluster is up, its registered hosts are the ones `status`, `ssh` and `down` act on,
whatever the settings file says now: Spark runs there.

A host may be reachable from several machines (several registries): each host carries a marker
of the cluster that holds it (`markers.py`), taken under a lock on the host before anything
runs there, so a second registry's `up` is refused instead of replacing the first's secret and
daemons, and a `down` stops only what its own cluster holds.
"""

from __future__ import annotations

import getpass
import shlex
import socket
import tempfile
from datetime import UTC, datetime
from pathlib import Path

from sparknet.cluster import (
    address,
    inventory,
    markers,
    node_endpoints,
    nodes,
    registry,
    spark_nodes,
    sshkeys,
)
from sparknet.cluster.address import Endpoint
from sparknet.cluster.known_hosts import load_trusted
from sparknet.cluster.nodes import Access
from sparknet.cluster.records import (
    ClusterInfo,
    ClusterNotFound,
    DownReport,
    Interrupted,
    Planned,
)
from sparknet.cluster.remote import Conn, run
from sparknet.cluster.spark import bootstrap as boot
from sparknet.cluster.spark.health import ClusterHealth, Expected, cluster_health
from sparknet.cluster.spark.plan import Node, laid_out
from sparknet.cluster.spec import ClusterSpec
from sparknet.errors import SparknetError
from sparknet.say import Say, command_line

#: commands name a static cluster without a region (`--region`): its hosts are wherever they are
REGIONAL = False
#: no autostop timer: the machines are the user's, and nothing of sparknet's ends them
AUTOSTOP = False
#: the machines are the user's `hosts:`: sparknet chooses no type, market or node role (the
#: hosts reach S3 with their own credentials)
LAUNCHES = False

#: how long `status` waits for the master to take an SSH connection
STATUS_CONNECT_S = 5
#: where a host's keys are trusted from when the spec names no `known_hosts` (OpenSSH's own)
DEFAULT_KNOWN_HOSTS = ("~/.ssh/known_hosts", "/etc/ssh/ssh_known_hosts")
#: counts a node's GPUs (0 where there is no driver): what its worker offers Spark
_COUNT_GPUS = "nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | grep -c .; true"


class StopIncomplete(SparknetError):
    """`down` could not stop Spark on every host: the cluster stays registered."""


class HostsChanged(SparknetError):
    """`up` of a registered static cluster whose hosts were changed other than by appending."""


def endpoints(spec: ClusterSpec) -> list[Endpoint]:
    """The hosts as nodes: ``master``, then ``worker-1``, ... in `hosts` order; a host without
    ``user@`` is logged in to as the local user, as `ssh` does."""
    names = ["master"] + [f"worker-{k}" for k in range(1, len(spec.hosts))]
    user = getpass.getuser()
    return [address.parse_address(n, h, user) for n, h in zip(names, spec.hosts, strict=True)]


def registered_spec(name: str) -> ClusterSpec | None:
    """The static cluster `name` as `up` registered it here; None when it is not."""
    known = registry.registered().get(name)
    return known if known is not None and known.provider == "static" else None


def current(spec: ClusterSpec) -> ClusterSpec:
    """What `status`, `ssh`, `tunnel` and `down` act on: the registered cluster (its hosts run
    Spark, whatever the settings file says now), else `spec`."""
    return registered_spec(spec.name) or spec


# --- trust ---------------------------------------------------------------------------------------


def trusted_keys_files(spec: ClusterSpec) -> list[Path]:
    """Where the hosts' keys are trusted from: `known_hosts`, else OpenSSH's own files."""
    if spec.known_hosts:
        return [Path(spec.known_hosts).expanduser()]
    return [Path(p).expanduser() for p in DEFAULT_KNOWN_HOSTS]


def access(spec: ClusterSpec) -> Access:
    """The cluster's key (the user's `key_file`, checked) and its known_hosts, holding exactly
    each host's keys from `trusted_keys_files`; a one-line error naming every host that has none
    there, and how to add it, before anything connects (the cluster's file then holds only the
    keys that were found: a key the user removed is not kept)."""
    found = sshkeys.access_for(spec)
    sshkeys.check_key_file(found)
    pins = _trusted_pins(spec)
    sshkeys.pin(found.known_hosts, pins, only=True)
    _check_all_trusted(spec, pins)
    return found


def preflight(spec: ClusterSpec) -> None:
    """What `up` checks before it writes or connects anything (the name, the hosts, the key and
    each host's key), writing nothing: a submit asks it before it starts anything."""
    _check_not_ec2(spec)
    _check_hosts(spec)
    sshkeys.check_key_file(sshkeys.access_for(spec))
    _check_all_trusted(spec, _trusted_pins(spec))


def _trusted_pins(spec: ClusterSpec) -> dict[str, list[str]]:
    """Each host's keys from `trusted_keys_files`, by SSH address; a host with none is left out."""
    trusted = load_trusted(trusted_keys_files(spec), required=bool(spec.known_hosts))
    pins: dict[str, list[str]] = {}
    for endpoint in endpoints(spec):
        keys = trusted.lookup(endpoint.address)
        if keys:
            pins[endpoint.address] = [f"{k.get_name()} {k.get_base64()}" for k in keys.values()]
    return pins


def _check_all_trusted(spec: ClusterSpec, pins: dict[str, list[str]]) -> None:
    missing = [e for e in endpoints(spec) if e.address not in pins]
    sources = trusted_keys_files(spec)
    if missing:
        first = missing[0]
        login = shlex.join(
            ["ssh", "-F", "none", "-p", str(first.port), f"{first.user}@{first.host}"]
        )
        raise SparknetError(
            f"no host key for {', '.join(str(e) for e in missing)} in "
            f"{', '.join(str(p) for p in sources)}; sparknet connects only to hosts whose key "
            f"you have checked: log in once with `{login}` and compare the fingerprint, or set "
            "known_hosts to a file that holds their keys"
        )


# --- nodes ---------------------------------------------------------------------------------------


def plan_nodes(spec: ClusterSpec, reach: Access) -> list[Node]:
    """The hosts as the bootstrap's nodes: the daemons bind the host's address (the endpoints file's
    ``<cluster>/<node>/node`` entry may give another, and an install prefix: the tests run
    several nodes on one machine); GPUs `bootstrap.gpus_per_node`, else as many as
    `nvidia-smi` lists on each host."""
    fixed = spec.bootstrap.gpus_per_node
    if fixed is not None:
        return _nodes(spec, {e.name: fixed for e in endpoints(spec)})
    answers = nodes.run_all(endpoints(spec), reach, lambda _e, c: run(c, _COUNT_GPUS), 120)
    return _nodes(spec, {name: int(text.strip() or 0) for name, text in answers.items()})


def _nodes(spec: ClusterSpec, gpus: dict[str, int] | None = None) -> list[Node]:
    """The hosts as nodes with their addresses and prefixes, and `gpus` by node name (none
    given: 0, as stopping the daemons and asking the master need no count)."""
    return [laid_out(spec.name, e, e.host, (gpus or {}).get(e.name, 0)) for e in endpoints(spec)]


def _where(endpoint: Endpoint) -> tuple[str, int]:
    return endpoint.host, endpoint.port


# --- up ------------------------------------------------------------------------------------------


def _check_not_ec2(spec: ClusterSpec) -> None:
    """Refuse a static cluster under the name of an EC2 cluster this machine runs: they would
    share one registry entry, and the EC2 one would be left to its tags."""
    known = registry.registered().get(spec.name)
    if known is not None and known.provider != "static":
        raise inventory.OtherRegion(
            f"cluster {spec.name} is an EC2 cluster here ({known.region}); take it down first "
            f"(`{command_line('sparknet cluster down', spec.name, region=known.region)}`) or "
            "choose another name"
        )


def _check_hosts(spec: ClusterSpec) -> None:
    """Refuse hosts that would leave Spark running unseen or fight another cluster: a
    registered cluster's hosts may only be appended to (a dropped host would keep its worker,
    a new first host would make a second master), and no host may belong to another static
    cluster registered here (the install prefix and the daemons are per machine)."""
    want = [_where(e) for e in endpoints(spec)]
    known = registered_spec(spec.name)
    if known is not None:
        have = [_where(e) for e in endpoints(known)]
        if want[: len(have)] != have:
            raise HostsChanged(
                f"static cluster {spec.name} runs Spark on {', '.join(known.hosts)}; hosts may "
                f"only be added after those: `{command_line('sparknet cluster down', spec.name)}` "
                "first to change them"
            )
    for name, other in registry.registered().items():
        if name == spec.name or other.provider != "static":
            continue
        shared = sorted(set(want) & {_where(e) for e in endpoints(other)})
        if shared:
            host, port = shared[0]
            raise HostsChanged(
                f"{host}:{port} is a host of static cluster {name} too: one machine runs one "
                f"cluster's Spark; `{command_line('sparknet cluster down', name)}` first, or "
                "choose other hosts"
            )


def _info(spec: ClusterSpec) -> ClusterInfo:
    """The cluster as the records say it: its hosts, no instance, no price."""
    return ClusterInfo(spec.name, spec.region, None, [], None, endpoints(spec))


def up(
    spec: ClusterSpec,
    *,
    endpoint_url: str | None = None,
    say: Say = lambda _: None,
    bootstrap: bool = True,
    any_owner: bool = False,
    force: bool = False,
) -> ClusterInfo:
    """Register the static cluster and, with `bootstrap`, bring Spark up on its hosts (a healthy
    master and a worker on every host, as for EC2); its hosts. `endpoint_url` and `any_owner`
    change nothing here (no AWS; each host's marker says whose it is).

    Everything that can fail without touching a host fails first: the hosts against the
    registry, the key file, each host's key in the trusted known_hosts. The hosts are checked
    against the other static clusters registered here and the entry written under the
    registry's lock (two `up`s of different names at once cannot both pass). Then every host
    is taken (`markers`: a host another cluster holds, of this registry or another machine's,
    is refused naming it, and nothing runs anywhere), and the wheel of this checkout and the
    cluster's secret are made (a failure gives back the hosts this call took), before the
    bootstrap. The registry entry stays from then on, so a failed or
    interrupted bootstrap (`BootstrapIncomplete`, `Interrupted`) leaves the cluster registered
    for `cluster bootstrap` to finish or `cluster down` to stop; nothing is billed either way.
    Unless `force`, a bootstrap that would restart the master under a running job is refused
    (`bootstrap.JobRunning`)."""
    _check_not_ec2(spec)
    _check_hosts(spec)
    reach = access(spec)
    found = endpoints(spec)
    with (
        registry.cluster_lock(spec.name),
        tempfile.TemporaryDirectory(prefix="sparknet-wheel-") as tmp,
    ):
        had_entry = registered_spec(spec.name) is not None
        try:
            with registry.registry_lock():  # again: another `up` may have registered since
                _check_not_ec2(spec)
                _check_hosts(spec)
                registry.save_entry(spec, None)
            if not bootstrap:
                return _info(spec)
            me = holder(spec.name)
            fresh = markers.take_all(_nodes(spec), reach, me)
            try:
                carried = spark_nodes.carry(spec, Path(tmp))
            except BaseException:
                if not had_entry:
                    markers.release_all([n for n in _nodes(spec) if n.name in fresh], reach, me)
                raise
        except BaseException:
            if not had_entry:  # nothing ran on any host: as if this `up` never was
                registry.forget_entry(spec.name, spec.region)
                registry.remove_lock(spec.name)
            raise
        say(f"static cluster {spec.name}: {len(found)} hosts")
        stay = (
            f"`{command_line('sparknet cluster bootstrap', spec.name)}` finishes it, "
            f"`{command_line('sparknet cluster down', spec.name)}` stops what started"
        )
        try:
            report = spark_nodes.bootstrap_locked(
                spec, plan_nodes(spec, reach), reach, say, carried, force
            )
        except KeyboardInterrupt as exc:
            raise Interrupted(f"interrupted during the bootstrap; {stay}") from exc
        except boot.JobRunning:
            raise  # refused before anything changed
        except SparknetError as exc:
            raise spark_nodes.BootstrapIncomplete(
                "{cause:line}; {stay}", cause=exc, stay=stay
            ).with_details(exc.details) from exc
    spark_nodes.say_report(report, say)
    return _info(spec)


def bootstrap(
    spec: ClusterSpec,
    *,
    endpoint_url: str | None = None,
    say: Say = lambda _: None,
    force: bool = False,
) -> ClusterInfo:
    """`sparknet cluster bootstrap`: `up` again with its bootstrap (the hosts registered anew,
    what is done skipped); its hosts."""
    return up(spec, say=say, bootstrap=True, force=force)


def holder(name: str) -> markers.Holder:
    """Cluster `name` of this registry as its hosts' markers name it: the registry's id, and
    the user, machine and dir of the registry (what another user is told of whose hosts
    they are)."""
    where = f"{getpass.getuser()}@{socket.gethostname()}:{registry.registry_dir()}"
    since = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return markers.Holder(name, registry.registry_id(), where, since)


# --- status and down -----------------------------------------------------------------------------


def status(spec: ClusterSpec, *, endpoint_url: str | None = None) -> ClusterInfo:
    """The registered static cluster's hosts; `ClusterNotFound` when it is not registered."""
    known = registered_spec(spec.name)
    if known is None:
        raise ClusterNotFound(
            f"static cluster {spec.name} is not up here (not registered); "
            f"`{command_line('sparknet cluster up', spec.name)}` bootstraps its hosts"
        )
    return _info(known)


def health(
    spec: ClusterSpec, info: ClusterInfo | None = None, *, endpoint_url: str | None = None
) -> ClusterHealth:
    """The Spark cluster's health as its master tells it, asked over SSH of the master host
    only (a dead worker host shows as a worker not registered; GPUs are checked where
    `bootstrap.gpus_per_node` fixes them); a SparknetError when the master takes no SSH
    connection within `STATUS_CONNECT_S`."""
    spec = current(spec)
    reach = access(spec)
    planned = _nodes(spec)
    fixed = spec.bootstrap.gpus_per_node
    expected = [Expected(n.name, n.rpc_host, spec.bootstrap.worker_cores, fixed) for n in planned]
    return cluster_health(
        planned[0], spark_nodes.ports_of(spec), expected, reach, connect_timeout=STATUS_CONNECT_S
    )


def down(
    spec: ClusterSpec,
    *,
    endpoint_url: str | None = None,
    say: Say = lambda _: None,
    any_owner: bool = False,
    forget_unreachable: bool = False,
) -> DownReport:
    """Stop Spark on every host of the cluster (as registered; from the settings where this
    machine has no entry: stopping what does not run is harmless), its daemons, their systemd
    units and the conf with the secret, and forget the cluster here; the machines stay as they
    are. The stopped nodes' names.

    Only what this cluster holds is stopped: a host whose marker names another cluster (it
    took the host after this one's hosts were given up by hand, or this registry was copied)
    is said and left alone, and a host without a marker is held while it stops. Each stopped
    host's marker is removed.

    A host that cannot be reached keeps the cluster registered (`StopIncomplete` names it: its
    daemons may still hold the secret), unless `forget_unreachable`: then it is said and
    forgotten, and stopping whatever still runs there is the user's. What it stopped, as a
    `DownReport` that terminated and deleted nothing."""
    spec = current(spec)
    reach = access(spec)
    me = holder(spec.name)
    with registry.cluster_lock(spec.name):
        planned = _nodes(spec)
        left: dict[str, markers.Holder] = {}

        def stop(endpoint: Endpoint, conn: Conn) -> None:
            node = next(n for n in planned if n.name == endpoint.name)
            # a free host is held while it stops; one without the prefix gets none made
            verdict, other = markers.take(conn, node, me, make=False)
            if verdict == markers.TWICE:  # the machine of another node too: stopped as well
                verdict, other = markers.MINE, None
            if other is not None and other.unread:  # it may be this cluster's: not given up
                raise SparknetError(
                    f"its marker {node.path(markers.MARKER)} does not read: Spark there may be "
                    "this cluster's; remove the marker by hand if it is, or if nothing runs there"
                )
            if other is not None and other.former_self(me):  # this cluster's: not given up
                raise SparknetError(f"it is held by {other.describe(me)}")
            if other is not None:
                left[node.name] = other
                return
            boot.stop_on(planned, node.name, conn)
            if verdict != markers.ABSENT:
                markers.release(conn, node, me)

        try:
            nodes.run_all([n.endpoint for n in planned], reach, stop, 120)
            failed: set[str] = set()
        except nodes.NodesFailed as exc:
            if not forget_unreachable:
                raise StopIncomplete(
                    "could not stop Spark on every host ({cause}); the cluster stays "
                    "registered: run `{down}` again once they answer, or "
                    "with {@forget_unreachable} to forget hosts that are gone for good",
                    cause=exc,
                    down=command_line("sparknet cluster down", spec.name),
                ) from exc
            failed = set(exc.failures)
            say(f"forgetting without stopping Spark there: {exc}")
        for name, other in left.items():
            say(f"{name}: Spark there is not this cluster's, left alone: {other.describe(me)}")
        stopped = [n.name for n in planned if n.name not in failed and n.name not in left]
        say(f"stopped Spark on {len(stopped)} of {len(planned)} hosts")
        registry.forget_local(spec.name)
        registry.forget_entry(spec.name, spec.region)
        registry.remove_lock(spec.name)
    return DownReport(spec.name, spec.region, [], [], None, stopped)


def teardown(spec: ClusterSpec, *, endpoint_url: str | None, say: Say) -> None:
    """`down` after a submit's job, of a cluster registered here only: the hosts of one that
    is not are none of sparknet's business (they may be another cluster's)."""
    if registered_spec(spec.name) is not None:
        down(spec, say=say)


# --- what the job side asks of a running cluster -------------------------------------------------


def in_use(spec: ClusterSpec, endpoint_url: str | None) -> bool:
    """The cluster is registered here (its hosts run Spark)."""
    return registered_spec(spec.name) is not None


def master_running(spec: ClusterSpec, endpoint_url: str | None) -> bool:
    """The cluster is up here (registered)."""
    return registered_spec(spec.name) is not None


def check_running(spec: ClusterSpec, endpoint_url: str | None) -> None:
    """`ClusterNotFound` unless the cluster is up here."""
    status(spec)


def check_launch(spec: ClusterSpec, endpoint_url: str | None) -> None:
    """`preflight`: the name, the hosts, the key and each host's key, writing nothing."""
    preflight(spec)


def check_owner(spec: ClusterSpec, endpoint_url: str | None) -> None:
    """Nothing to check here: the hosts are the user's, and each one's marker says which
    cluster holds it."""


def gpus_by_type(spec: ClusterSpec, endpoint_url: str | None) -> dict[str, int]:
    """None known before the hosts are reached: they are counted then (`plan_nodes`)."""
    return {}


def planned_nodes(spec: ClusterSpec, endpoint_url: str | None) -> tuple[int, int | None]:
    """(Spark worker nodes, GPUs of each): every host runs a worker; the GPUs are
    `bootstrap.gpus_per_node`, else known only once the hosts are reached (None)."""
    return len(spec.hosts), spec.bootstrap.gpus_per_node


def planned(spec: ClusterSpec, endpoint_url: str | None) -> list[Planned]:
    """The user's hosts, as they are: nothing of sparknet's to choose or to pay."""
    return [Planned("hosts", len(spec.hosts), [], False, None)]


def nodes_of(spec: ClusterSpec, endpoint_url: str | None) -> tuple[Access, list[Node]]:
    """How to reach the registered cluster's hosts (their keys from the trusted known_hosts),
    and the hosts as the bootstrap laid them out, master first."""
    spec = current(spec)
    reach = access(spec)
    return reach, plan_nodes(spec, reach)


def reach_node(
    spec: ClusterSpec, node: str, *, endpoint_url: str | None
) -> tuple[Endpoint, Access, ClusterSpec]:
    """Node `node` of the registered cluster (else of `spec`), its access, and that spec."""
    spec = current(spec)
    return node_endpoints.pick(endpoints(spec), node), access(spec), spec


def cost_so_far(spec: ClusterSpec, endpoint_url: str | None) -> float | None:
    """None: the machines are the user's, and sparknet knows no price of them."""
    return None
