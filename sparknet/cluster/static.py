"""The `static` provider: a cluster of machines the user already has (on-prem boxes, machines
started by hand), given by SSH address (`hosts:`, the master first). sparknet bootstraps Spark
on them and stops it again; it never starts, stops or deletes a machine, and nothing here calls
AWS.

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

import paramiko

from sparknet.cluster import (
    address,
    inventory,
    lifecycle,
    markers,
    nodes,
    registry,
    sparkops,
    sshkeys,
)
from sparknet.cluster.address import Endpoint
from sparknet.cluster.nodes import Access
from sparknet.cluster.remote import Conn, run
from sparknet.cluster.spark import bootstrap as boot
from sparknet.cluster.spark.health import ClusterHealth, Expected, cluster_health
from sparknet.cluster.spark.plan import Node, laid_out
from sparknet.cluster.spec import ClusterSpec
from sparknet.errors import SparknetError

Say = lifecycle.Say

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


def load_trusted(paths: list[Path], *, required: bool) -> paramiko.HostKeys:
    """The host keys in OpenSSH known_hosts files, read as OpenSSH reads them: comments and
    lines it cannot parse are skipped, `@cert-authority` lines are not host keys (certificates
    are not supported: such hosts need their own key line), and a key listed `@revoked` is
    trusted for no host. A file that cannot be read is an error when `required` (the spec
    named it), else skipped."""
    entries: list[paramiko.hostkeys.HostKeyEntry] = []
    revoked: set[tuple[str, str]] = set()
    for path in paths:
        try:
            text = path.read_text(errors="replace")
        except OSError as exc:
            if required:
                raise SparknetError(
                    f"cannot read the hosts' keys from {path} ({nodes.describe(exc)}); set "
                    "known_hosts to an OpenSSH known_hosts file with them"
                ) from exc
            continue
        for line in text.splitlines():
            line = line.strip()
            if not line or line.startswith("#") or line.startswith("@cert-authority"):
                continue
            marker = line.startswith("@revoked")
            entry = _entry(line.split(None, 1)[1] if marker else line)
            if entry is None:
                continue
            if marker:
                revoked.add((entry.key.get_name(), entry.key.get_base64()))
            else:
                entries.append(entry)
    trusted = paramiko.HostKeys()
    for entry in entries:
        if (entry.key.get_name(), entry.key.get_base64()) not in revoked:
            for host in entry.hostnames:
                trusted.add(host, entry.key.get_name(), entry.key)
    return trusted


def _entry(line: str) -> paramiko.hostkeys.HostKeyEntry | None:
    """One known_hosts line, or None for a line paramiko cannot read (OpenSSH skips those)."""
    try:
        return paramiko.hostkeys.HostKeyEntry.from_line(line)
    except Exception:  # InvalidHostKey, binascii errors, unknown key types: not a usable line
        return None


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
    """The hosts as the bootstrap's nodes: the daemons bind the host's address (the seam's
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
            f"(`sparknet cluster down {spec.name}`) or choose another name"
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
                f"only be added after those: `sparknet cluster down {spec.name}` first to change "
                "them"
            )
    for name, other in registry.registered().items():
        if name == spec.name or other.provider != "static":
            continue
        shared = sorted(set(want) & {_where(e) for e in endpoints(other)})
        if shared:
            host, port = shared[0]
            raise HostsChanged(
                f"{host}:{port} is a host of static cluster {name} too: one machine runs one "
                f"cluster's Spark; `sparknet cluster down {name}` first, or choose other hosts"
            )


def up(
    spec: ClusterSpec,
    *,
    say: Say = lambda _: None,
    bootstrap: bool = True,
    force: bool = False,
) -> list[Endpoint]:
    """Register the static cluster and, with `bootstrap`, bring Spark up on its hosts (a healthy
    master and a worker on every host, as for EC2); its nodes.

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
                return found
            me = holder(spec.name)
            fresh = markers.take_all(_nodes(spec), reach, me)
            try:
                carried = sparkops.carry(spec, Path(tmp))
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
            f"`sparknet cluster bootstrap {spec.name}` finishes it, `sparknet cluster down "
            f"{spec.name}` stops what started"
        )
        try:
            report = sparkops.bootstrap_locked(
                spec, plan_nodes(spec, reach), reach, say, carried, force
            )
        except KeyboardInterrupt as exc:
            raise lifecycle.Interrupted(f"interrupted during the bootstrap; {stay}") from exc
        except boot.JobRunning:
            raise  # refused before anything changed
        except SparknetError as exc:
            first, *rest = str(exc).splitlines() or [type(exc).__name__]
            raise sparkops.BootstrapIncomplete("\n".join([f"{first}; {stay}", *rest])) from exc
    sparkops.say_report(report, say)
    return found


def holder(name: str) -> markers.Holder:
    """Cluster `name` of this registry as its hosts' markers name it: the registry's id, and
    the user, machine and dir of the registry (what another user is told of whose hosts
    they are)."""
    where = f"{getpass.getuser()}@{socket.gethostname()}:{registry.registry_dir()}"
    since = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return markers.Holder(name, registry.registry_id(), where, since)


# --- status and down -----------------------------------------------------------------------------


def status(spec: ClusterSpec) -> list[Endpoint]:
    """The registered static cluster's nodes; `ClusterNotFound` when it is not registered."""
    known = registered_spec(spec.name)
    if known is None:
        raise lifecycle.ClusterNotFound(
            f"static cluster {spec.name} is not up here (not registered); "
            f"`sparknet cluster up {spec.name}` bootstraps its hosts"
        )
    return endpoints(known)


def health(spec: ClusterSpec) -> ClusterHealth:
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
        planned[0], sparkops.ports_of(spec), expected, reach, connect_timeout=STATUS_CONNECT_S
    )


def down(
    spec: ClusterSpec, *, say: Say = lambda _: None, forget_unreachable: bool = False
) -> list[str]:
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
    forgotten, and stopping whatever still runs there is the user's."""
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
                    f"could not stop Spark on every host ({exc}); the cluster stays registered: "
                    f"run `sparknet cluster down {spec.name}` again once they answer, or with "
                    "--forget-unreachable to forget hosts that are gone for good"
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
    return stopped
