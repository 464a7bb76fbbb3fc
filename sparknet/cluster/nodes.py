"""SSH to a cluster's nodes: where each node is reached (`Endpoint`), with what key and pinned
host keys (`Access`), one connection (`connect`), and one function on every node at once
(`run_all`).

Every connection refuses a host whose key is not already pinned in the cluster's known_hosts
(paramiko's `RejectPolicy`): Fabric's default (`AutoAddPolicy`, no known_hosts) would trust
whatever answers at a node's address on first use, which is exactly when a fresh node is most
exposed. Nothing here reads the user's ~/.ssh (config, agent, keys): a cluster is reached with
its own key and its own known_hosts only, so two clusters, or a user's other machines, never mix.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import fabric
import paramiko
from invoke.exceptions import UnexpectedExit

from sparknet.errors import SparknetError

T = TypeVar("T")

#: how often `connect` tries again while a node does not accept connections yet (booting sshd)
RETRY_S = 0.5


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


@dataclass(frozen=True)
class Access:
    """What every connection to one cluster's nodes uses."""

    #: the private key (mode 0600)
    key_file: Path
    #: the cluster's pinned host keys (OpenSSH known_hosts format)
    known_hosts: Path


class NodesFailed(SparknetError):
    """`run_all` failed on some nodes; `failures` maps each failed node's name to its error."""

    def __init__(self, message: str, failures: dict[str, BaseException]) -> None:
        super().__init__(message)
        self.failures = failures


def describe(exc: BaseException) -> str:
    """One line about an error on a node: a failed command's exit code and last output line
    (invoke's message is a multi-line report), else the exception's first line."""
    if isinstance(exc, UnexpectedExit):
        result = exc.result
        tail = (result.stderr or result.stdout or "").strip().splitlines()
        last = f": {tail[-1].strip()}" if tail else ""
        return f"`{result.command}` exited {result.exited}{last}"
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return lines[0] if lines else type(exc).__name__


def _fabric_config() -> fabric.Config:
    """Fabric's settings without the user's ~/.ssh/config and /etc/ssh/ssh_config (a Host entry
    there could rename the node, add identities or a proxy: the cluster's nodes are reached the
    same way from every machine), and with no stdin forwarded to remote commands (they run
    unattended, in threads; a terminal's input belongs to sparknet)."""
    return fabric.Config(overrides={"load_ssh_configs": False, "run": {"in_stream": False}})


def connection(endpoint: Endpoint, access: Access, timeout: float = 20) -> fabric.Connection:
    """An unopened Fabric Connection to `endpoint` that trusts only `access.known_hosts`.

    Fabric sets `AutoAddPolicy` in its constructor; it is replaced before anything connects,
    and the user's known_hosts, agent and keys are not consulted."""
    conn = fabric.Connection(
        endpoint.host,
        user=endpoint.user,
        port=endpoint.port,
        config=_fabric_config(),
        connect_timeout=timeout,
        connect_kwargs={
            "key_filename": [str(access.key_file)],
            "look_for_keys": False,
            "allow_agent": False,
        },
    )
    conn.client.set_missing_host_key_policy(paramiko.RejectPolicy())
    if access.known_hosts.is_file():
        # into the client's own table, not load_host_keys(): that would also remember the file
        # to write keys back to, and nothing may add to the pinned keys but sparknet's pinning
        conn.client.get_host_keys().load(str(access.known_hosts))
    return conn


def connect(endpoint: Endpoint, access: Access, timeout: float = 20) -> fabric.Connection:
    """An open Connection to `endpoint`, whose host key must be the one pinned for its address.

    A node that does not accept TCP connections yet (sshd still starting) is tried again until
    `timeout`; an unknown host, a changed host key or a refused login is a one-line
    SparknetError at once, naming the node and what to do."""
    deadline = time.monotonic() + timeout
    while True:
        conn = connection(endpoint, access, timeout=max(1.0, deadline - time.monotonic()))
        try:
            conn.open()
            return conn
        except OSError as exc:  # refused, unreachable, timed out (NoValidConnectionsError too)
            conn.close()
            if time.monotonic() + RETRY_S >= deadline:
                raise SparknetError(
                    f"{endpoint}: no SSH connection within {timeout:g} s ({describe(exc)}); "
                    "check that the node runs and that its security group lets your address in"
                ) from exc
        except paramiko.BadHostKeyException as exc:
            conn.close()
            raise SparknetError(
                f"{endpoint}: its host key changed ({exc.key.get_name()} "
                f"{exc.key.get_fingerprint().hex()}) and does not match the key pinned in "
                f"{access.known_hosts}; refusing to connect (someone may be intercepting); if "
                "the node was replaced, run `sparknet cluster up` again to pin its new key"
            ) from exc
        except paramiko.AuthenticationException as exc:
            conn.close()
            raise SparknetError(
                f"{endpoint}: login refused for key {access.key_file} ({describe(exc)}); check "
                "the cluster's key_name and key_file"
            ) from exc
        except paramiko.SSHException as exc:
            conn.close()
            if "not found in known_hosts" in str(exc):
                raise SparknetError(
                    f"{endpoint}: no host key pinned for {endpoint.address} in "
                    f"{access.known_hosts}; refusing an unknown host; run `sparknet cluster up` "
                    "again to pin the nodes' keys"
                ) from exc
            raise SparknetError(f"{endpoint}: SSH failed ({describe(exc)})") from exc
        time.sleep(RETRY_S)


def run_all(
    endpoints: Sequence[Endpoint],
    access: Access,
    fn: Callable[[Endpoint, fabric.Connection], T],
    timeout: float,
    *,
    connect_timeout: float = 20,
) -> dict[str, T]:
    """`fn(endpoint, connection)` on every node at once; node name -> what `fn` returned.

    A thread per node over its own Connection, all within `timeout` seconds together (Fabric's
    ThreadingGroup joins its threads with no timeout: one hung node would hang sparknet).
    Any failure, or a node still busy at the timeout, is one `NodesFailed` naming each failed
    node and its error; the connections of nodes still busy are closed, which ends their work.
    """
    if not endpoints:
        return {}
    conns: dict[str, fabric.Connection] = {}

    def one(endpoint: Endpoint) -> T:
        conn = connect(endpoint, access, connect_timeout)
        conns[endpoint.name] = conn
        try:
            return fn(endpoint, conn)
        finally:
            conn.close()

    pool = ThreadPoolExecutor(max_workers=len(endpoints), thread_name_prefix="sparknet-ssh")
    futures = {pool.submit(one, ep): ep for ep in endpoints}
    try:
        # every node runs to its end even when another failed: a half-run step is worse than
        # a whole one, and the error then names every node that failed, not just the first
        _done, busy = wait(futures, timeout=timeout)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    failures: dict[str, BaseException] = {}
    for future, ep in futures.items():
        if future in busy:
            failures[ep.name] = TimeoutError(f"still running after {timeout:g} s")
            conn = conns.get(ep.name)
            if conn is not None:
                conn.close()
        elif (exc := future.exception()) is not None:
            failures[ep.name] = exc
    if failures:
        raise NodesFailed(_failed_line(endpoints, failures), failures)
    return {ep.name: future.result() for future, ep in futures.items()}


def _failed_line(endpoints: Sequence[Endpoint], failures: dict[str, BaseException]) -> str:
    """One line: how many nodes failed, and each one's name and error, in node order."""
    parts = []
    for ep in endpoints:
        if ep.name in failures:
            line = describe(failures[ep.name])
            # connect's errors begin with the node already
            parts.append(line if line.startswith(ep.name) else f"{ep.name}: {line}")
    return f"{len(failures)} of {len(endpoints)} nodes failed: {'; '.join(parts)}"


# --- keys ------------------------------------------------------------------------------------


def new_ed25519() -> tuple[str, str]:
    """A fresh ed25519 key pair: (private key in OpenSSH format, public key line
    ``ssh-ed25519 AAAA...``). ed25519: small, fast, and accepted by EC2 and every OpenSSH."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = Ed25519PrivateKey.generate()
    private = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.OpenSSH,
        serialization.NoEncryption(),
    ).decode("ascii")
    public = key.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    )
    return private, public.decode("ascii")


def write_private_key(path: Path, private: str) -> None:
    """Write a private key readable by its owner only (0600 from the start: never a moment in
    which another user could read it), replacing any file there."""
    import os

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(private)
    os.replace(tmp, path)


def pin(known_hosts: Path, pins: dict[str, str]) -> None:
    """Pin host keys: `pins` maps an address (`Endpoint.address`) to its public key line
    (``ssh-ed25519 AAAA...``). An address pinned before gets the new key instead of its old one
    (a replaced node at a reused address); every other line stays."""
    keep = []
    if known_hosts.is_file():
        for line in known_hosts.read_text().splitlines():
            hosts = line.split(" ", 1)[0].split(",")
            if line.strip() and not set(hosts) & set(pins):
                keep.append(line)
    lines = keep + [f"{address} {' '.join(key.split()[:2])}" for address, key in pins.items()]
    known_hosts.parent.mkdir(parents=True, exist_ok=True)
    tmp = known_hosts.with_name(f".{known_hosts.name}.tmp")
    tmp.write_text("".join(f"{line}\n" for line in lines))
    tmp.replace(known_hosts)
