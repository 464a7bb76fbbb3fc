"""The owner marker of a machine of the user's (a static cluster's host).

It says which cluster holds the machine, that cluster's registry (its id, and the user, machine
and dir it lives in) and since when.

Two sparknets that do not share a registry (two machines, two SPARKNET_HOMEs) cannot see each
other's entries, so the host itself says whose it is: a small JSON file in the node's install
prefix (`MARKER`), read, taken and given back under `flock` on a lock file beside it, in the
same remote command that reads or writes it (the package's `marker.sh`: a host is taken before
anything of sparknet's is there), so two of them never both take a host. `up` and
`cluster bootstrap` take every host before anything runs there (a host held by another cluster
is refused, naming it); `down` stops Spark only where the marker is its own (or no marker is)
and gives the host back. The marker's identity is the registry id with the cluster name: the
same name in two registries is two clusters.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from sparknet.cluster import nodes
from sparknet.cluster.address import Endpoint
from sparknet.cluster.nodes import Access
from sparknet.cluster.remote import Conn, run_script
from sparknet.cluster.spark.plan import Node
from sparknet.errors import InputError, SparknetError
from sparknet.say import command_line

#: the marker and its lock, in the node's install prefix
MARKER, MARKER_LOCK = "owner.json", ".owner.lock"
#: how long a command waits for another's hold on a host's marker lock (it holds it for
#: milliseconds)
LOCK_WAIT_S = 30
#: the first line of a take's answer: the host was free (now ours), already ours, another's, or
#: had no install prefix (and none was made); the words `scripts/marker.sh` prints
TAKEN, MINE, HELD, ABSENT = "taken", "mine", "held", "absent"
#: a take's verdict where the host is `me`'s already, as another node of the same cluster: one
#: machine listed twice (`127.0.0.1` and `localhost`)
TWICE = "twice"
#: the cluster and registry of a holder whose marker does not read (`Holder.unread`)
UNREAD = "(unknown)"


class HostHeld(SparknetError):
    """A host of the cluster is held by another cluster (its marker names it)."""


class SameMachine(InputError):
    """Two hosts of the cluster are one machine (one install prefix, one marker), spelled two
    ways: its Spark daemons and install would be made twice there."""


@dataclass(frozen=True)
class Holder:
    """Who holds a host: a cluster of one registry."""

    cluster: str
    #: the registry's id (`registry.registry_id`)
    registry: str
    #: where that registry lives: ``user@machine:dir``
    where: str = ""
    #: when it took the host (UTC, ISO 8601)
    since: str = ""
    #: the node of the cluster the host is (a host's marker says it; not part of who holds it)
    node: str = field(default="", compare=False)

    @property
    def unread(self) -> bool:
        """Whether this stands for a marker that does not read (whose it is, nobody knows)."""
        return self.registry == UNREAD

    @property
    def key(self) -> str:
        return f"{self.registry}/{self.cluster}"

    def to_json(self) -> str:
        """One line; ``holder`` first, the only field a host's shell compares (`_match`)."""
        fields = {"holder": self.key, "cluster": self.cluster, "registry": self.registry}
        node = {"node": self.node} if self.node else {}
        return json.dumps({**fields, "where": self.where, "since": self.since, **node})

    @classmethod
    def parse(cls, text: str) -> Holder | None:
        """The marker's text as a Holder; None for an empty or unreadable one. Its fields are
        another's words, said in a refusal: control characters (a line break, a terminal's
        escape) become `?`, and each is cut at 200 characters."""

        def said(value: object) -> str:
            return re.sub(r"[\x00-\x1f\x7f-\x9f]", "?", str(value))[:200]

        try:
            raw = json.loads(text)
            return cls(said(raw["cluster"]), said(raw["registry"]), said(raw.get("where", "")),
                       said(raw.get("since", "")), said(raw.get("node", "")))  # fmt: skip
        except (ValueError, KeyError, TypeError, AttributeError):
            return None

    def former_self(self, me: Holder) -> bool:
        """Whether this is `me` under the id its registry had before that id's file was lost
        or remade: the same cluster of the same registry dir of the same user and machine."""
        return (self.cluster, self.where) == (me.cluster, me.where) and self.key != me.key

    def describe(self, me: Holder) -> str:
        """Who this is, as a refusal names it to `me`."""
        if self.former_self(me):
            return (
                f"this very cluster under its registry's former id {self.registry} (the id's "
                f"file was remade: write {self.registry} back into .registry-id of "
                f"{self.where.partition(':')[2]})"
            )
        if self.registry == me.registry:
            return f"static cluster {self.cluster} registered here"
        where = f" {self.where}" if self.where else ""
        return f"static cluster {self.cluster} of the sparknet registry{where} ({self.registry})"


def _match(me: Holder) -> str:
    """The text only `me`'s marker holds (JSON escapes quotes inside values)."""
    return json.dumps({"holder": me.key})[1:-1]


def _marker(conn: Conn, node: Node, action: str, me: Holder, make: bool, *holder: str) -> str:
    """`action` (take, release) of the package's `marker.sh` on the node, under the marker
    lock (the script says how it is held); what it prints. A prefix that is not there yet is
    made for the login user, or, unless `make`, the answer is `ABSENT` and nothing runs."""
    return run_script(
        conn, "marker.sh", action, node.prefix, node.path(MARKER), node.path(MARKER_LOCK),
        LOCK_WAIT_S, int(make), _match(me), *holder,
    )  # fmt: skip


def take(conn: Conn, node: Node, me: Holder, make: bool = True) -> tuple[str, Holder | None]:
    """Take the host for `me` unless another cluster holds it: (TAKEN, None) where it was free
    (the marker is written now), (MINE, None) where `me` held it already, (HELD, holder) where
    another does (nothing is written); (TWICE, holder) where `me` holds it as another node
    (`holder.node`) of the cluster: the same machine spelled two ways; unless `make`, (ABSENT,
    None) where the node has no install prefix (nothing of sparknet's is there; none is
    made)."""
    mine = replace(me, node=node.name)
    answer = _marker(conn, node, "take", me, make, mine.to_json())
    first, _, rest = answer.strip().partition("\n")
    if first == HELD:
        unread = Holder(UNREAD, UNREAD, f"(its marker {node.path(MARKER)} does not read)")
        return HELD, Holder.parse(rest) or unread
    found = Holder.parse(rest) if first == MINE else None
    if found is not None and found.node and found.node != node.name:
        return TWICE, found
    return first, None


def release(conn: Conn, node: Node, me: Holder) -> None:
    """Remove the host's marker when it is `me`'s (another's stays)."""
    _marker(conn, node, "release", me, False)


def take_all(
    planned: Sequence[Node], access: Access, me: Holder, timeout: float = 120
) -> list[str]:
    """Take every host for `me`, or none; the names of the nodes this call took (the others
    were `me`'s already). A host another cluster holds is a HostHeld naming it (the first, in
    host order), and the hosts this call took are given back first, as they are where a host
    cannot be reached or the call is interrupted.

    The master's host is taken alone before the others: of two `up`s of the same hosts at once
    (two registries), the one that takes it goes on and the other is refused with nothing taken
    (taken all at once, each could take some and both be refused)."""
    by_name = {n.name: n for n in planned}
    answers: dict[str, tuple[str, Holder | None]] = {}

    def one(endpoint: Endpoint, conn: Conn) -> tuple[str, Holder | None]:
        answers[endpoint.name] = take(conn, by_name[endpoint.name], me)
        return answers[endpoint.name]

    first = planned[0]
    try:
        for batch in ([first], [n for n in planned if n is not first]):
            if batch and all(verdict in (TAKEN, MINE) for verdict, _ in answers.values()):
                nodes.run_all([n.endpoint for n in batch], access, one, timeout)
    except BaseException:
        fresh = [by_name[name] for name, (verdict, _) in answers.items() if verdict == TAKEN]
        with contextlib.suppress(Exception):  # best effort: what is raised says what failed
            release_all(fresh, access, me, timeout)
        raise
    fresh = [name for name, (verdict, _) in answers.items() if verdict == TAKEN]
    held = [(by_name[name], h) for name, (verdict, h) in answers.items() if verdict == HELD]
    twice = [(by_name[name], h) for name, (verdict, h) in answers.items() if verdict == TWICE]
    if not held and not twice:
        return fresh
    release_all([by_name[name] for name in fresh], access, me, timeout)
    if twice:
        node, holder = twice[0]
        raise SameMachine(
            f"{_host(node.endpoint)} ({node.name}) is the machine of {holder.node} too (one "
            f"install prefix {node.prefix}, one marker): give each machine once in hosts"
        )
    node, holder = min(held, key=lambda pair: list(by_name).index(pair[0].name))
    if holder.former_self(me):
        raise HostHeld(f"{_host(node.endpoint)} ({node.name}) is held by {holder.describe(me)}")
    raise HostHeld(
        f"{_host(node.endpoint)} ({node.name}) is held by {holder.describe(me)} since "
        f"{holder.since or 'an unknown time'}; one machine runs one cluster's Spark: "
        f"`{command_line('sparknet cluster down', holder.cluster)}` where it is registered frees "
        "it (where it "
        f"is registered nowhere now, remove {node.path(MARKER)} on the host once nothing of "
        "it runs there), or choose other hosts"
    )


def release_all(planned: Sequence[Node], access: Access, me: Holder, timeout: float = 120) -> None:
    """`release` on each of `planned` (where the marker is `me`'s)."""
    by_name = {n.name: n for n in planned}
    nodes.run_all(
        [n.endpoint for n in planned], access, lambda e, c: release(c, by_name[e.name], me),
        timeout,
    )  # fmt: skip


def _host(endpoint: Endpoint) -> str:
    return f"{endpoint.user}@{endpoint.host}:{endpoint.port}"
