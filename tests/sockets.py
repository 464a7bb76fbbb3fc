"""What processes listen on, from /proc: the TCP sockets a process tree holds in LISTEN state,
with their addresses (no psutil or `ss` needed)."""

from __future__ import annotations

import contextlib
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

#: /proc/net/tcp's state code of a listening socket
_LISTEN = "0A"


@dataclass(frozen=True)
class Listener:
    pid: int
    address: str
    port: int

    @property
    def wildcard(self) -> bool:
        """Listens on every interface (0.0.0.0 or ::)."""
        return ipaddress.ip_address(self.address).is_unspecified

    def __str__(self) -> str:
        return f"pid {self.pid} ({_name(self.pid)}) on {self.address}:{self.port}"


def descendants(pid: int) -> set[int]:
    """`pid` and every process below it."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        if p not in out:
            out.add(p)
            todo.extend(children.get(p, []))
    return out


def listeners(pids: set[int]) -> list[Listener]:
    """The listening TCP sockets the processes `pids` hold open."""
    owner: dict[str, int] = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith("socket:["):
                        owner[target[len("socket:[") : -1]] = pid
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == _LISTEN and fields[9] in owner:
                address, port = fields[1].split(":")
                out.append(Listener(owner[fields[9]], _address(address), int(port, 16)))
    return out


def _address(hex_address: str) -> str:
    """/proc/net/tcp{,6}'s address (32-bit words in host, little-endian, order); an IPv4
    address mapped into IPv6 (a JVM's sockets) as the IPv4 one."""
    raw = bytes.fromhex(hex_address)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(words)
    return str(getattr(ip, "ipv4_mapped", None) or ip)


def _name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"
