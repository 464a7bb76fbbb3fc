"""The `static` provider: a cluster of machines the user already has (on-prem boxes, machines
started by hand), given by SSH address (`hosts:`, the master first). sparknet bootstraps Spark
on them and stops it again; it never starts, stops or deletes a machine, and nothing here calls
AWS.

Trust comes from the user's own known_hosts (`known_hosts:`, default ~/.ssh/known_hosts): the
keys the user's first login checked are copied into the cluster's known_hosts on every use, and a
host with no key there is refused before anything connects (sparknet made these machines no
host key to pin, and trusting whatever answers first is what pinning exists to prevent).

The registry entry is the cluster's only record (there are no tags to find it by): `up` writes
it before it connects anywhere, so a `down` after any failure still finds every host to stop.
"""

from __future__ import annotations

import getpass
import tempfile
from pathlib import Path

import paramiko

from sparknet.cluster import bootstrap as boot
from sparknet.cluster import lifecycle, nodes
from sparknet.cluster.health import ClusterHealth, Expected, cluster_health
from sparknet.cluster.nodes import Access, Endpoint
from sparknet.cluster.plan import Node
from sparknet.cluster.remote import run
from sparknet.cluster.spark_conf import DEFAULT_PREFIX
from sparknet.cluster.spec import ClusterSpec
from sparknet.errors import SparknetError

Say = lifecycle.Say

#: how long `status` waits for a host to take an SSH connection
STATUS_CONNECT_S = 5
#: counts a node's GPUs (0 where there is no driver): what its worker offers Spark
_COUNT_GPUS = "nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | grep -c .; true"


class StopIncomplete(SparknetError):
    """`down` could not stop Spark on every host: the cluster stays registered."""


def endpoints(spec: ClusterSpec) -> list[Endpoint]:
    """The hosts as nodes: ``master``, then ``worker-1``, ... in `hosts` order; a host without
    ``user@`` is logged in to as the local user, as `ssh` does."""
    names = ["master"] + [f"worker-{k}" for k in range(1, len(spec.hosts))]
    user = getpass.getuser()
    return [nodes.parse_address(n, h, user) for n, h in zip(names, spec.hosts, strict=True)]


def trusted_keys_file(spec: ClusterSpec) -> Path:
    """Where the hosts' keys are trusted from: `known_hosts`, else ~/.ssh/known_hosts."""
    return Path(spec.known_hosts or "~/.ssh/known_hosts").expanduser()


def access(spec: ClusterSpec) -> Access:
    """The cluster's key (the user's `key_file`, checked 0600) and its known_hosts, holding
    exactly each host's keys from `trusted_keys_file`; a one-line error naming every host that
    has none there, and how to add it, before anything connects."""
    found = nodes.access_for(spec)
    nodes.check_key_file(found)
    source = trusted_keys_file(spec)
    trusted = paramiko.HostKeys()
    try:
        trusted.load(str(source))
    except OSError as exc:
        raise SparknetError(
            f"cannot read the hosts' keys from {source} ({nodes.describe(exc)}); set known_hosts "
            "to an OpenSSH known_hosts file with them"
        ) from exc
    pins: dict[str, list[str]] = {}
    missing = []
    for endpoint in endpoints(spec):
        keys = trusted.lookup(endpoint.address)
        if not keys:
            missing.append(endpoint)
            continue
        pins[endpoint.address] = [f"{k.get_name()} {k.get_base64()}" for k in keys.values()]
    if missing:
        first = missing[0]
        raise SparknetError(
            f"no host key for {', '.join(str(e) for e in missing)} in {source}; sparknet "
            "connects only to hosts whose key you have checked: log in once with `ssh -p "
            f"{first.port} {first.user}@{first.host}` and compare the fingerprint, or set "
            "known_hosts to a file that holds their keys"
        )
    nodes.pin(found.known_hosts, pins, only=True)
    return found


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
    given: 0, as stopping the daemons needs no count)."""
    out = []
    for endpoint in endpoints(spec):
        layout = nodes.node_layout(spec.name, endpoint.name)
        out.append(
            Node(
                endpoint,
                address=layout.get("address") or endpoint.host,
                prefix=layout.get("prefix") or DEFAULT_PREFIX,
                gpus=(gpus or {}).get(endpoint.name, 0),
            )
        )
    return out


def _check_not_ec2(spec: ClusterSpec) -> None:
    """Refuse a static cluster under the name of an EC2 cluster this machine runs: they would
    share one registry entry, and the EC2 one would be left to its tags."""
    known = lifecycle.registered().get(spec.name)
    if known is not None and known.provider != "static":
        raise lifecycle.OtherRegion(
            f"cluster {spec.name} is an EC2 cluster here ({known.region}); take it down first "
            f"(`sparknet cluster down {spec.name}`) or choose another name"
        )


def up(spec: ClusterSpec, *, say: Say = lambda _: None, bootstrap: bool = True) -> list[Endpoint]:
    """Register the static cluster and, with `bootstrap`, bring Spark up on its hosts (a healthy
    master and a worker on every host, as for EC2); its nodes.

    Everything that can fail without touching a host fails first: the key file, each host's
    key in the trusted known_hosts, the wheel of this checkout and the cluster's secret. The
    registry entry is written before any connection, so a failed or interrupted bootstrap
    (`BootstrapIncomplete`, `Interrupted`) leaves the cluster registered for `cluster
    bootstrap` to finish or `cluster down` to stop; nothing is billed either way."""
    _check_not_ec2(spec)
    reach = access(spec)
    found = endpoints(spec)
    with lifecycle.cluster_lock(spec.name):
        if not bootstrap:
            lifecycle.save_entry(spec, None)
            return found
        with tempfile.TemporaryDirectory(prefix="sparknet-wheel-") as tmp:
            carried = lifecycle.carry_or_unlock(spec, Path(tmp))
            lifecycle.save_entry(spec, None)
            say(f"static cluster {spec.name}: {len(found)} hosts")
            stay = (
                f"`sparknet cluster bootstrap {spec.name}` finishes it, `sparknet cluster down "
                f"{spec.name}` stops what started"
            )
            try:
                report = lifecycle.bootstrap_locked(
                    spec, plan_nodes(spec, reach), reach, say, carried
                )
            except KeyboardInterrupt as exc:
                raise lifecycle.Interrupted(f"interrupted during the bootstrap; {stay}") from exc
            except SparknetError as exc:
                first, *rest = str(exc).splitlines() or [type(exc).__name__]
                raise lifecycle.BootstrapIncomplete("\n".join([f"{first}; {stay}", *rest])) from exc
    lifecycle.say_report(report, say)
    return found


def _registered(spec: ClusterSpec) -> None:
    """`ClusterNotFound` unless this machine has the static cluster registered (brought up)."""
    known = lifecycle.registered().get(spec.name)
    if known is None or known.provider != "static":
        raise lifecycle.ClusterNotFound(
            f"static cluster {spec.name} is not up here (not registered); "
            f"`sparknet cluster up {spec.name}` bootstraps its hosts"
        )


def health(spec: ClusterSpec) -> ClusterHealth:
    """The Spark cluster's health as its master tells it; a SparknetError when a host takes no
    SSH connection within `STATUS_CONNECT_S`."""
    reach = access(spec)
    planned = plan_nodes(spec, reach)
    expected = [Expected(n.name, n.rpc_host, spec.bootstrap.worker_cores, n.gpus) for n in planned]
    return cluster_health(
        planned[0], lifecycle.ports_of(spec), expected, reach, connect_timeout=STATUS_CONNECT_S
    )


def status(spec: ClusterSpec) -> list[Endpoint]:
    """The registered static cluster's nodes; `ClusterNotFound` when it is not registered."""
    _registered(spec)
    return endpoints(spec)


def down(spec: ClusterSpec, *, say: Say = lambda _: None) -> list[str]:
    """Stop Spark on every host (daemons, their systemd units, the secret's conf) and forget the
    cluster here; the machines stay as they are. When a host cannot be reached the cluster stays
    registered and the error names the host: its daemons may still run with the secret."""
    _registered(spec)
    reach = access(spec)
    with lifecycle.cluster_lock(spec.name):
        planned = _nodes(spec)
        try:
            boot.stop_daemons(planned, reach, timeout=120)
        except nodes.NodesFailed as exc:
            raise StopIncomplete(
                f"could not stop Spark on every host ({exc}); the cluster stays registered: "
                f"run `sparknet cluster down {spec.name}` again once they answer, or remove a "
                "host that is gone for good from its hosts first"
            ) from exc
        say(f"stopped Spark on {len(planned)} hosts")
        nodes.forget_local(spec.name)
        lifecycle.forget_entry(spec.name, spec.region)
        lifecycle.remove_lock(spec.name)
    return [n.name for n in planned]
