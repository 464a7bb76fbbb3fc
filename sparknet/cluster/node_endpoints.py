"""Where each node of a cluster is reached, and where its files sit.

A node's name (``master``, ``worker-N``) and its `Endpoint`, from its EC2 instance, or from the
`ENDPOINTS_ENV` file that stands in for one (tests map moto's instances to sshd processes on
127.0.0.1 this way), and where its files sit on the machine (`node_layout`).

The one seam between instances and SSH, kept apart from nodes.py: a connection takes an
`Endpoint` and never asks where it came from, so a test, or a static cluster's hosts, are
reached by the same code as EC2's instances.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sparknet.cluster.address import Endpoint, parse_address
from sparknet.cluster.nodes import describe
from sparknet.errors import SparknetError

if TYPE_CHECKING:
    from sparknet.cluster.aws.instances import Instance

#: a JSON file mapping an instance id, or ``<cluster>/<node name>``, to ``user@host:port``; the
#: nodes found there are reached at that address instead of their public IP (tests map moto's
#: instances to sshd processes on 127.0.0.1 this way; CLI subprocesses inherit it)
ENDPOINTS_ENV = "SPARKNET_NODE_ENDPOINTS"
_NODE_NAME = re.compile(r"^(?:master|worker-[1-9][0-9]*)$")


def _entries() -> dict[str, Any]:
    """The `ENDPOINTS_ENV` file's mapping as it is; empty when the variable is unset."""
    path = os.environ.get(ENDPOINTS_ENV)
    if not path:
        return {}
    try:
        found = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise SparknetError(f"{ENDPOINTS_ENV}={path}: {describe(exc)}") from exc
    if not isinstance(found, dict):
        raise SparknetError(f"{ENDPOINTS_ENV}={path}: not a JSON object of name -> address")
    return {str(k): v for k, v in found.items()}


def _overrides() -> dict[str, str]:
    """The endpoints file's addresses: its entries whose value is a ``user@host:port`` string."""
    return {k: v for k, v in _entries().items() if isinstance(v, str)}


def node_layout(cluster: str, name: str) -> dict[str, str]:
    """Where node `name` of `cluster` sits on its machine, from the endpoints file's
    ``<cluster>/<name>/node`` entry (an object): ``address``, the private address its Spark
    daemons bind (default: the instance's private IP) and ``prefix``, where the bootstrap
    installs (default: /opt/sparknet). Tests run several nodes on one host this way."""
    entry = _entries().get(f"{cluster}/{name}/node") or {}
    if not isinstance(entry, dict):
        raise SparknetError(f"{ENDPOINTS_ENV}: {cluster}/{name}/node is not a JSON object")
    return {str(k): str(v) for k, v in entry.items() if k in ("address", "prefix")}


def node_names(found: Sequence[Instance]) -> list[tuple[str, Instance]]:
    """Each instance with its node name: ``master``, then ``worker-1``, ``worker-2``, ... by
    launch time (then id), so a worker keeps its name while it lives and new ones come last."""
    masters = [i for i in found if i.role == "master"]
    workers = sorted((i for i in found if i.role == "worker"), key=lambda i: (i.launched_at, i.id))
    named = [("master", m) for m in masters[:1]]
    return named + [(f"worker-{k}", w) for k, w in enumerate(workers, start=1)]


def endpoint_of(cluster: str, name: str, instance: Instance) -> Endpoint:
    """Where sparknet reaches `instance` (node `name` of `cluster`): its public IP, port 22,
    user ubuntu. The one seam between instances and SSH: an entry in the `ENDPOINTS_ENV` file
    (by instance id, else ``<cluster>/<name>``) replaces the address."""
    override = _overrides()
    text = override.get(instance.id) or override.get(f"{cluster}/{name}")
    if text:
        return parse_address(name, text)
    if not instance.public_ip:
        raise SparknetError(
            f"{name} ({instance.id}, {instance.state}) has no public IP address; SSH needs one "
            "(start it, or run `sparknet cluster up` again)"
        )
    return Endpoint(name, instance.public_ip)


def endpoints(cluster: str, found: Sequence[Instance]) -> list[Endpoint]:
    """The endpoints of a cluster's instances, master first (`node_names` order)."""
    return [endpoint_of(cluster, name, inst) for name, inst in node_names(found)]


def pick(found: Sequence[Endpoint], node: str) -> Endpoint:
    """The endpoint of node `node` (``master`` or ``worker-N``); a one-line error naming the
    nodes there are otherwise."""
    for endpoint in found:
        if endpoint.name == node:
            return endpoint
    raise _no_node(node, [e.name for e in found])


def endpoint_named(cluster: str, found: Sequence[Instance], node: str) -> Endpoint:
    """The endpoint of node `node` of the cluster's instances `found`; only that node needs an
    address (a worker still pending has none yet, and must not keep `cluster ssh` from the
    master). A one-line error naming the nodes there are otherwise."""
    named = node_names(found)
    for name, inst in named:
        if name == node:
            return endpoint_of(cluster, name, inst)
    raise _no_node(node, [name for name, _ in named])


def _no_node(node: str, names: list[str]) -> SparknetError:
    hint = "" if _NODE_NAME.fullmatch(node) else " (master or worker-N)"
    listed = ", ".join(names) or "none"
    return SparknetError(f"no node {node!r}{hint}; the cluster's nodes: {listed}")
