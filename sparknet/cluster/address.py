"""Where a node is reached over SSH: its `Endpoint`, and the one parser of users' addresses.

The addresses users give are ``[user@]host[:port]`` (static hosts, the endpoints file of
`node_endpoints`). At the bottom of `cluster/`: a cluster's spec checks its hosts with it, before
anything reaches a node."""

from __future__ import annotations

import re
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv6Address, ip_address

from sparknet.errors import SparknetError


@dataclass(frozen=True)
class Endpoint:
    """Where sparknet reaches one node over SSH."""

    #: "master", "worker-1", ...: what errors and `cluster ssh` call the node
    name: str
    host: str
    port: int = 22
    user: str = "ubuntu"

    @property
    def address(self) -> str:
        """`host` as known_hosts and OpenSSH name it: ``[host]:port`` for a port other than 22."""
        return self.host if self.port == 22 else f"[{self.host}]:{self.port}"

    def __str__(self) -> str:
        return f"{self.name} ({self.user}@{self.host}:{self.port})"


#: the login user of the AWS Deep Learning AMIs (Ubuntu)
DEFAULT_USER = "ubuntu"
_ADDRESS = re.compile(
    r"^(?:(?P<user>[A-Za-z_][A-Za-z0-9_.-]*)@)?(?P<host>[^@:\s]+)(?::(?P<port>\d+))?$"
)
#: a host name as RFC 1123 has it: dot-separated labels of 1-63 letters, digits and hyphens,
#: neither first nor last a hyphen (so never an `ssh` option), 253 characters at most
_HOST_NAME = re.compile(
    r"^(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
    r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$"
)
#: an IPv6 literal where a host goes, bare or in brackets (with a port after them)
_IPV6 = re.compile(
    r"^(?:[^@]*@)?(?:\[(?P<bracketed>[^\]]*)\](?::\d*)?|(?P<bare>[^@\[\]]*:[^@]*:[^@]*))$"
)


def parse_address(name: str, text: str, default_user: str = DEFAULT_USER) -> Endpoint:
    """``[user@]host[:port]`` as the Endpoint of node `name`: the host an IPv4 address or an
    RFC 1123 host name, nothing else (the host reaches `ssh`'s command line and known_hosts:
    `-oProxyCommand=...` or shell words must never pass); an IPv6 address is refused as such
    (the cluster's network is IPv4 only). A one-line error otherwise."""
    if _is_ipv6(text.strip()):
        raise SparknetError(
            f"{name}: {text!r}: IPv6 addresses are not supported (give an IPv4 address or a "
            "host name)"
        )
    match = _ADDRESS.fullmatch(text.strip())
    port = int(match["port"]) if match and match["port"] else 22
    if not match or not 0 < port < 65536 or not _is_host(match["host"]):
        raise SparknetError(f"{name}: {text!r} is not an SSH address (user@host:port)")
    return Endpoint(name, match["host"], port, match["user"] or default_user)


def _is_ipv6(text: str) -> bool:
    """`text` is an SSH address whose host is an IPv6 literal (``::1``, ``[::1]:22``)."""
    match = _IPV6.fullmatch(text)
    if not match:
        return False
    try:
        return isinstance(ip_address(match["bracketed"] or match["bare"]), IPv6Address)
    except ValueError:
        return False


def _is_host(host: str) -> bool:
    """An IPv4 address (dotted decimal, as ssh and known_hosts write it) or an RFC 1123 host
    name; digits and dots alone must be an IPv4 address (``256.1.1.1`` is neither)."""
    if re.fullmatch(r"[0-9.]+", host):
        try:
            return str(IPv4Address(host)) == host
        except ValueError:
            return False
    return bool(_HOST_NAME.fullmatch(host))
