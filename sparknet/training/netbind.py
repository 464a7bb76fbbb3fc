"""Where the allreduce transport's own sockets listen: the node's cluster address only.

Rank 0's TCPStore and every rank's gloo (and NCCL bootstrap) sockets, never on every interface.

Neither is authenticated or encrypted (Spark's RPC encryption does not cover them), so they
must stay on the addresses the cluster keeps to itself. torch's TCPStore server listens on
every interface whatever host it is given, so it gets a socket bound here already
(`master_listen_fd`); gloo listens on the address of the interface `GLOO_SOCKET_IFNAME` names
(else on whatever the machine's hostname resolves to).
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import socket
import struct
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from sparknet.errors import SparknetError

#: ioctl that reads an interface's IPv4 address (linux/sockios.h)
_SIOCGIFADDR = 0x8915


def listen_address(host: str) -> str:
    """`host` (a name or an address, as Spark advertises an executor) as the one IP address
    to listen on; IPv4 first where the name has both."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise SparknetError(f"cannot resolve this node's address {host!r}: {exc}") from exc
    infos.sort(key=lambda info: info[0] != socket.AF_INET)
    return str(infos[0][4][0])


def store_server(address: str, world: int, timeout: timedelta | None = None) -> dist.TCPStore:
    """Rank 0's TCPStore for `world` ranks, listening on `address` only (port chosen by the
    kernel: `store.port`)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.create_server((address, 0), family=family, backlog=max(128, world))
    kwargs = {} if timeout is None else {"timeout": timeout}
    fd = sock.detach()  # the store owns the socket from here
    try:
        return dist.TCPStore(
            address, 0, world, True, wait_for_workers=False, master_listen_fd=fd, **kwargs
        )
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(fd)
        raise


def interface_of(address: str) -> str:
    """The name of this machine's network interface that holds `address` (any loopback
    address: `lo`). A SparknetError when none does."""
    ip = ipaddress.ip_address(address)
    if ip.is_loopback:
        return _loopback_interface()
    found = _ipv4_interfaces() if ip.version == 4 else _ipv6_interfaces()
    for name, held in found:
        if held == ip:
            return name
    raise SparknetError(
        f"no network interface of this node holds {address}, the address its Spark executor "
        "advertises: start the worker with --host set to one of the node's addresses"
    )


def bind_collectives(address: str) -> None:
    """Gloo and NCCL of the process groups this process makes from now on listen on the
    interface that holds `address` (gloo takes that interface's address)."""
    name = interface_of(listen_address(address))
    os.environ["GLOO_SOCKET_IFNAME"] = name
    os.environ["NCCL_SOCKET_IFNAME"] = f"={name}"  # '=': this name exactly, not a prefix


def _loopback_interface() -> str:
    names = [name for _, name in socket.if_nameindex()]
    return "lo" if "lo" in names or not names else names[0]


def _ipv4_interfaces() -> list[tuple[str, ipaddress.IPv4Address | ipaddress.IPv6Address]]:
    out = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                answer = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, request)
            except OSError:
                continue  # no IPv4 address
            out.append((name, ipaddress.ip_address(answer[20:24])))
    return out


def _ipv6_interfaces() -> list[tuple[str, ipaddress.IPv4Address | ipaddress.IPv6Address]]:
    table = Path("/proc/net/if_inet6")
    lines = table.read_text().splitlines() if table.exists() else []
    out = []
    for line in lines:
        fields = line.split()
        if len(fields) >= 6:
            out.append((fields[5], ipaddress.ip_address(bytes.fromhex(fields[0]))))
    return out
