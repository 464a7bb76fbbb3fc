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

import base64
import contextlib
import hashlib
import json
import logging
import math
import os
import re
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv6Address, ip_address
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import fabric
import paramiko
from invoke.exceptions import UnexpectedExit

from sparknet import aws, interrupts
from sparknet.errors import SparknetError

# paramiko logs a failed handshake (a node still booting) with its traceback from the transport
# thread; with no handler Python prints that to stderr. The error reaches the user as one line.
logging.getLogger("paramiko").addHandler(logging.NullHandler())

if TYPE_CHECKING:
    from sparknet.cluster.instances import Instance
    from sparknet.cluster.spec import ClusterSpec

T = TypeVar("T")

#: how often `connect` tries again while a node does not accept connections yet (booting sshd)
RETRY_S = 0.5
#: how long a node may leave an open connection unanswered before the connection counts as lost
#: (OpenSSH's ServerAliveInterval 15 x ServerAliveCountMax 3); `SILENCE_ENV` sets other seconds
SILENCE_S = 45.0
SILENCE_ENV = "SPARKNET_SSH_SILENCE_S"


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
    """Fabric's defaults only: not the user's ~/.fabric.yaml nor /etc/fabric.yaml (`lazy`:
    they could forward the user's agent to the nodes or route through a gateway), nor
    ~/.ssh/config and /etc/ssh/ssh_config (a Host entry there could rename the node, add
    identities or a proxy: the cluster's nodes are reached the same way from every machine).
    No agent forwarding and no gateway, said outright; no stdin forwarded to remote commands
    (they run unattended, in threads; a terminal's input belongs to sparknet)."""
    return fabric.Config(
        lazy=True,
        overrides={
            "load_ssh_configs": False,
            "forward_agent": False,
            "gateway": None,
            "run": {"in_stream": False},
            "runners": {"remote": _Remote},
        },
    )


class _Remote(fabric.runners.Remote):
    """Fabric's runner of a remote command, whose Ctrl-C (or SIGTERM: the CLI raises both as
    KeyboardInterrupt) ends the wait at once: the channel is closed, then the interrupt raised.
    Fabric's own raises it only after joining its output threads, which wait for the command
    to end (up to its timeout, or the keepalive's deadline on a silent node)."""

    def send_interrupt(self, interrupt: KeyboardInterrupt) -> None:
        with contextlib.suppress(Exception):
            self.channel.close()
        raise interrupt


#: the most seconds a wait's setting (`seconds_setting`) may give: a day. More is no deadline,
#: and threading's waits overflow (a keepalive thread died so, leaving the connection unwatched)
MAX_WAIT_S = 86400.0
#: the fewest: less is no wait (a silence of 1 ms closed every connection as it opened)
MIN_WAIT_S = 1.0


def seconds_setting(env: str, default: float) -> float:
    """`default`, or the seconds the environment variable `env` gives: a number from MIN_WAIT_S
    to MAX_WAIT_S, else a one-line SparknetError naming the variable."""
    text = os.environ.get(env)
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not MIN_WAIT_S <= value <= MAX_WAIT_S:
        raise SparknetError(
            f"{env}={text!r}: give a number of seconds from {MIN_WAIT_S:g} to {MAX_WAIT_S:g} "
            "(a day)"
        )
    return value


def silence_s() -> float:
    """SILENCE_S, or the seconds `SILENCE_ENV` gives (`seconds_setting`)."""
    return seconds_setting(SILENCE_ENV, SILENCE_S)


def went_silent(conn: Any) -> float | None:
    """The seconds of silence after which `_Keepalive` closed `conn`'s connection (the node
    stopped answering on it); None while it answers, or when it ended otherwise."""
    transport = getattr(conn, "transport", None)
    return getattr(transport, _SILENT, None)


#: the attribute `_Keepalive` sets on a transport it closed (on the transport: a connection
#: may be handed another one, see `reconnect_after_restart`)
_SILENT = "sparknet_silent_s"


class _Keepalive:
    """A deadline for every call on one SSH connection that holds when the node goes silent.

    A peer that stops answering (its sshd stopped, a host frozen, a link that drops packets)
    leaves an open TCP connection that never ends: paramiko waits on it without a deadline
    (opening a channel, a command's start, its exit status), a command timeout does not cover
    those, and TCP itself notices nothing (the peer's kernel acknowledges what it gets).
    paramiko's own `set_keepalive` wants no reply, so it cannot tell either. So, as OpenSSH's
    ServerAliveInterval does: every third of `silence_s` a keepalive that wants a reply; one
    unanswered for `silence_s` closes the transport, which ends every wait on it (the calls
    fail, and `went_silent` says why)."""

    #: what OpenSSH's client sends (any server answers it, if only with a failure)
    REQUEST = "keepalive@openssh.com"

    def __init__(self, transport: paramiko.Transport, silence: float) -> None:
        self.transport, self.silence = transport, silence
        self.stopped = threading.Event()
        threading.Thread(target=self._loop, name="sparknet-ssh-keepalive", daemon=True).start()

    def stop(self) -> None:
        self.stopped.set()

    def _loop(self) -> None:
        while not self.stopped.wait(self.silence / 3):
            if not self.transport.is_active():
                return
            answered = threading.Event()
            threading.Thread(
                target=self._ask, args=(answered,), name="sparknet-ssh-keepalive-ask", daemon=True
            ).start()
            if not answered.wait(self.silence) and not self.stopped.is_set():
                setattr(self.transport, _SILENT, self.silence)
                self.transport.close()
                return

    def _ask(self, answered: threading.Event) -> None:
        # returns on the node's answer, or once the transport is closed
        with contextlib.suppress(Exception):
            self.transport.global_request(self.REQUEST, wait=True)
        answered.set()


class _Connection(fabric.Connection):
    """Fabric's Connection whose every opening (its own reopening after a `close` too) is
    watched by a `_Keepalive`."""

    #: class attributes: invoke's Context stores the attributes it does not know in its config
    _keepalive: _Keepalive | None = None

    def open(self) -> Any:
        result = super().open()
        transport = self.client.get_transport()
        if transport is not None and (
            self._keepalive is None or self._keepalive.transport is not transport
        ):
            if self._keepalive is not None:
                self._keepalive.stop()
            self._keepalive = _Keepalive(transport, silence_s())
        return result

    def close(self) -> None:
        if self._keepalive is not None:
            self._keepalive.stop()
        super().close()


def connection(endpoint: Endpoint, access: Access, timeout: float = 20) -> fabric.Connection:
    """An unopened Fabric Connection to `endpoint` that trusts only `access.known_hosts`, each
    of whose waits ends once the node is silent for `silence_s()` (`_Keepalive`; its banner,
    login and channel openings within that too, and within `timeout`).

    Fabric sets `AutoAddPolicy` in its constructor; it is replaced before anything connects,
    and the user's known_hosts, agent and keys are not consulted."""
    wait = min(timeout, silence_s())
    conn = _Connection(
        endpoint.host,
        user=endpoint.user,
        port=endpoint.port,
        config=_fabric_config(),
        connect_timeout=timeout,
        connect_kwargs={
            "key_filename": [str(access.key_file)],
            "look_for_keys": False,
            "allow_agent": False,
            "banner_timeout": wait,
            "auth_timeout": wait,
            "channel_timeout": silence_s(),
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

    A node whose sshd does not serve yet (`_still_starting`) is tried again until `timeout`; an
    unknown host, a changed host key or a refused login is a one-line SparknetError at once,
    naming the node and what to do."""
    deadline = time.monotonic() + timeout
    while True:
        conn = connection(endpoint, access, timeout=max(1.0, deadline - time.monotonic()))
        try:
            conn.open()
            return conn
        except (OSError, EOFError, paramiko.SSHException) as exc:
            conn.close()
            exc = _unfinished(exc)
            if not _still_starting(exc):
                raise _refused(endpoint, access, exc) from exc
            if time.monotonic() + RETRY_S >= deadline:
                raise SparknetError(
                    f"{endpoint}: no SSH connection within {timeout:g} s ({describe(exc)}); "
                    "check that the node runs and that it lets your address in on its SSH port "
                    "(on EC2: its security group)"
                ) from exc
        time.sleep(RETRY_S)


def _unfinished(exc: BaseException) -> BaseException:
    """paramiko's "No existing session" for a handshake the node left unfinished (it sent its
    banner, or only took the TCP connection, then went silent: paramiko's negotiation stops at
    its timeout without an error, and only the host key check after it fails), and its
    "Authentication timeout." for a login it left unanswered, told as what they are, and as a
    node not serving yet; any other error as it is."""
    if isinstance(exc, paramiko.SSHException) and str(exc) == "No existing session":
        unfinished = EOFError("the node did not finish the SSH handshake (it went silent)")
    elif isinstance(exc, paramiko.AuthenticationException) and "timeout" in str(exc):
        # not a refused login (no answer is no refusal): a node slow to log in (at boot, its
        # PAM or logind not up yet) is tried again, a reboot's wait goes on
        unfinished = EOFError("the node did not answer the login in time (it went silent)")
    else:
        return exc
    unfinished.__cause__ = exc
    return unfinished


def _still_starting(exc: BaseException) -> bool:
    """The node's sshd does not serve yet: the TCP connection is refused, unreachable or timed
    out (OSError, NoValidConnectionsError too), or it is accepted and closed before the SSH
    banner (paramiko: "Error reading SSH protocol banner") or during the handshake (EOFError),
    as while a fresh node's sshd starts, or cloud-init restarts it with the pinned key. Never
    a refusal: a bad host key, an unknown host or a refused login is the node's answer."""
    if isinstance(exc, paramiko.BadHostKeyException | paramiko.AuthenticationException):
        return False
    if isinstance(exc, OSError | EOFError):
        return True
    return str(exc).startswith("Error reading SSH protocol banner")


def fingerprint(key: paramiko.PKey) -> str:
    """The key's fingerprint as OpenSSH prints it (ssh-keygen -l, the "host key changed"
    warning): ``SHA256:`` and the unpadded base64 of the SHA-256 of the key blob, so a user can
    compare it with what ssh and the console output show (paramiko's is MD5 hex)."""
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode("ascii").rstrip("=")


def _refused(endpoint: Endpoint, access: Access, exc: BaseException) -> SparknetError:
    """The one line for an SSH connection the node refused, naming it and what to do."""
    if isinstance(exc, paramiko.BadHostKeyException):
        # the pin is the node's own key, read from EC2 (or given) on every pinning: a key other
        # than it means another machine answers at the node's address
        return SparknetError(
            f"{endpoint}: its host key changed: it presents {exc.key.get_name()} "
            f"{fingerprint(exc.key)}, not the key pinned for {endpoint.address} in "
            f"{access.known_hosts}, so the machine at that address is not the node (the address "
            "now another machine's, or someone intercepting); refusing to connect; check the "
            "node's address; `sparknet cluster down` and `up` replace the node"
        )
    if isinstance(exc, paramiko.AuthenticationException):
        return SparknetError(
            f"{endpoint}: login refused for key {access.key_file} ({describe(exc)}); check "
            "key_file (and key_name on EC2)"
        )
    if "not found in known_hosts" in str(exc):
        return SparknetError(
            f"{endpoint}: no host key pinned for {endpoint.address} in "
            f"{access.known_hosts}; refusing an unknown host; run `sparknet cluster up` "
            "again to pin the nodes' keys"
        )
    return SparknetError(f"{endpoint}: SSH failed ({describe(exc)})")


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
    A Ctrl-C (any BaseException) while waiting closes every connection too before it goes on,
    so no thread keeps a remote command running behind sparknet's back.
    """
    if not endpoints:
        return {}
    conns: dict[str, fabric.Connection] = {}
    stop = threading.Event()

    def one(endpoint: Endpoint) -> T:
        _run.stop = stop  # what `stopped()` asks from inside `fn`
        conn = connect(endpoint, access, connect_timeout)
        conns[endpoint.name] = conn
        try:
            if stop.is_set():  # interrupted while this node was connecting
                raise SparknetError(f"{endpoint}: interrupted")
            return fn(endpoint, conn)
        finally:
            conn.close()

    pool = ThreadPoolExecutor(max_workers=len(endpoints), thread_name_prefix="sparknet-ssh")
    with interrupts.deferred():  # submit() takes the pool's locks (see _wait_all)
        futures = {pool.submit(one, ep): ep for ep in endpoints}
    try:
        # every node runs to its end even when another failed: a half-run step is worse than
        # a whole one, and the error then names every node that failed, not just the first
        busy = _wait_all(futures, timeout)
    except BaseException:
        stop.set()
        for conn in list(conns.values()):
            conn.close()
        raise
    finally:
        stop.set()  # a thread still busy now is abandoned: a wait in it may end (`stopped`)
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


def _wait_all(futures: Iterable[Future], timeout: float) -> set[Future]:
    """The futures still busy once all are done or `timeout` has passed. A Ctrl-C is raised
    between short waits, never inside one (see `sparknet.interrupts`)."""
    deadline = time.monotonic() + timeout
    while True:
        with interrupts.deferred():
            _done, busy = wait(futures, timeout=max(0.0, min(0.2, deadline - time.monotonic())))
        if not busy or time.monotonic() >= deadline:
            return busy


def _failed_line(endpoints: Sequence[Endpoint], failures: dict[str, BaseException]) -> str:
    """One line: how many nodes failed, and each one's name and error, in node order."""
    parts = []
    for ep in endpoints:
        if ep.name in failures:
            line = describe(failures[ep.name])
            # connect's errors begin with the node already
            parts.append(line if line.startswith(ep.name) else f"{ep.name}: {line}")
    return f"{len(failures)} of {len(endpoints)} nodes failed: {'; '.join(parts)}"


#: the `run_all` a thread works for: its stop event (see `stopped`)
_run = threading.local()


def stopped() -> bool:
    """Whether the `run_all` this thread works for has stopped waiting for it (Ctrl-C, or its
    timeout): a long wait inside its `fn` that runs no command (nothing for `run_all` to close
    under it) ends then, so no thread outlives its caller by minutes."""
    event = getattr(_run, "stop", None)
    return event is not None and event.is_set()


class NotBack(SparknetError):
    """`reconnect_after_restart` gave up: the node did not answer as restarted within its
    time; `why` says what it last saw."""

    def __init__(self, endpoint: Endpoint, timeout: float, why: str) -> None:
        super().__init__(f"{endpoint}: not back within {timeout:g} s ({why})")
        self.endpoint, self.timeout, self.why = endpoint, timeout, why


#: the longest one `connect` inside `reconnect_after_restart` tries before it looks again
#: whether its `run_all` stopped
RECONNECT_SLICE_S = 5.0


def reconnect_after_restart(
    conn: fabric.Connection,
    endpoint: Endpoint,
    access: Access,
    timeout: float,
    restarted: Callable[[fabric.Connection], bool],
) -> None:
    """Give `conn` a fresh connection to `endpoint` once the node is back from a restart (a
    reboot), within `timeout`; else `NotBack`.

    Each try is `connect`'s: only the host key pinned for the node is accepted (a refusal is
    raised at once, as there), and a node whose sshd does not serve is tried again. A node told
    to reboot serves for a while before its sshd stops, so what answers counts only once
    `restarted(fresh)` says so (its boot id changed); an error in it (the old sshd going down
    under it) counts as not yet. `conn`'s old connection is closed, and `conn` stays the
    object its caller holds (the next steps use it; `run_all` closes it, on Ctrl-C too)."""
    deadline = time.monotonic() + timeout
    why = "no answer"
    conn.close()
    while not stopped():
        left = deadline - time.monotonic()
        if left <= 0:
            raise NotBack(endpoint, timeout, why)
        try:
            fresh = connect(endpoint, access, min(left, RECONNECT_SLICE_S))
        except SparknetError as exc:
            if not _restarting(exc.__cause__):
                raise  # the node's answer: another host key, an unknown host, a refused login
            why = describe(exc.__cause__)
            continue
        try:
            if restarted(fresh):
                conn.client, conn.transport = fresh.client, fresh.transport
                return
            why = "it still runs the boot it had before"
        except (SparknetError, OSError, EOFError, paramiko.SSHException) as exc:
            why = describe(exc)
        fresh.close()
        time.sleep(RETRY_S)
    raise SparknetError(f"{endpoint}: interrupted while waiting for it to restart")


def _restarting(exc: BaseException | None) -> bool:
    """A connection failed as one to a restarting node does: its sshd does not serve yet
    (`_still_starting`), or the link died amid the handshake or the login as the old sshd went
    down (paramiko: "transport shut down or saw EOF", "No existing session"). Never a host key
    other than the pinned one, an unknown host, or a login the node refused."""
    if exc is None or isinstance(exc, paramiko.BadHostKeyException):
        return False
    if isinstance(exc, paramiko.AuthenticationException):
        return "transport shut down or saw EOF" in str(exc)
    if "not found in known_hosts" in str(exc):
        return False
    return isinstance(exc, OSError | EOFError | paramiko.SSHException)


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
    _replace_file(path, private)


def _replace_file(path: Path, text: str) -> None:
    """Replace `path` with `text` at once: written to a temporary file of its own beside it
    (mkstemp: mode 0600, a unique name, so concurrent writers never share one), then renamed
    over `path`; a reader sees the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def pin(known_hosts: Path, pins: Mapping[str, str | Sequence[str]], *, only: bool = False) -> None:
    """Pin host keys: `pins` maps an address (`Endpoint.address`) to its public key line
    (``ssh-ed25519 AAAA...``), or several (a host with keys of several types). An address pinned
    before gets the new keys instead of its old ones (a replaced node at a reused address); every
    other line stays, unless `only` (the file then holds exactly `pins`: a cluster's current
    nodes)."""
    keep = []
    if known_hosts.is_file() and not only:
        for line in known_hosts.read_text().splitlines():
            hosts = line.split(" ", 1)[0].split(",")
            if line.strip() and not set(hosts) & set(pins):
                keep.append(line)
    lines = keep + [
        f"{address} {' '.join(key.split()[:2])}"
        for address, keys in pins.items()
        for key in ([keys] if isinstance(keys, str) else keys)
    ]
    _replace_file(known_hosts, "".join(f"{line}\n" for line in lines))


# --- the seam: instance -> endpoint ----------------------------------------------------------

#: a JSON file mapping an instance id, or ``<cluster>/<node name>``, to ``user@host:port``; the
#: nodes found there are reached at that address instead of their public IP (tests map moto's
#: instances to sshd processes on 127.0.0.1 this way; CLI subprocesses inherit it)
ENDPOINTS_ENV = "SPARKNET_NODE_ENDPOINTS"
#: the login user of the AWS Deep Learning AMIs (Ubuntu)
DEFAULT_USER = "ubuntu"
_ADDRESS = re.compile(
    r"^(?:(?P<user>[A-Za-z_][A-Za-z0-9_.-]*)@)?(?P<host>[^@:\s]+)(?::(?P<port>\d+))?$"
)
_NODE_NAME = re.compile(r"^(?:master|worker-[1-9][0-9]*)$")
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


def _seam() -> dict[str, Any]:
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
    """The seam's addresses: its entries whose value is a ``user@host:port`` string."""
    return {k: v for k, v in _seam().items() if isinstance(v, str)}


def node_layout(cluster: str, name: str) -> dict[str, str]:
    """Where node `name` of `cluster` sits on its machine, from the seam's
    ``<cluster>/<name>/node`` entry (an object): ``address``, the private address its Spark
    daemons bind (default: the instance's private IP) and ``prefix``, where the bootstrap
    installs (default: /opt/sparknet). Tests run several nodes on one host this way."""
    entry = _seam().get(f"{cluster}/{name}/node") or {}
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


# --- host keys through cloud-init --------------------------------------------------------------


def host_key_user_data() -> tuple[str, str]:
    """A fresh ed25519 host key as cloud-init user data: (user data, public key line).

    cloud-init installs `ssh_keys` as the instance's host key before sshd starts, deletes the
    AMI's own keys (`ssh_deletekeys`) and makes no others (`ssh_genkeytypes: []`), so the key
    sparknet pins is the only one the node can present. The user data is readable on the node
    through IMDS (see the README's "Logging in to the nodes")."""
    import yaml

    private, public = new_ed25519()
    config = {
        "ssh_deletekeys": True,
        "ssh_genkeytypes": [],
        "ssh_keys": {"ed25519_private": private, "ed25519_public": public},
    }
    return "#cloud-config\n" + yaml.safe_dump(config, sort_keys=False), public


def host_public_key(user_data: str) -> str | None:
    """The ed25519 public host key in cloud-init user data; None when it has none (an instance
    launched by an older sparknet, or by hand)."""
    import yaml

    if not user_data.startswith("#cloud-config"):
        return None
    try:
        config = yaml.safe_load(user_data)
    except yaml.YAMLError:
        return None
    keys = config.get("ssh_keys") if isinstance(config, dict) else None
    public = keys.get("ed25519_public") if isinstance(keys, dict) else None
    return str(public) if public else None


def user_data_of(ec2: Any, instance_id: str) -> str:
    """The instance's user data as text ('' when it has none), read back from EC2: the copy
    there is the one the instance got, so it is what its host key is pinned from."""
    region = aws.region_of(ec2)
    with aws.aws_call("DescribeInstanceAttribute", region):
        answer = ec2.describe_instance_attribute(InstanceId=instance_id, Attribute="userData")
    value = answer.get("UserData", {}).get("Value")
    return base64.b64decode(value).decode("utf-8", "replace") if value else ""


def pin_cluster(ec2: Any, cluster: str, found: Sequence[Instance], known_hosts: Path) -> list[str]:
    """Pin each node's host key (from its user data in EC2) under its address in the cluster's
    `known_hosts`, which then holds exactly the cluster's current nodes; the names of nodes
    with no key to pin (launched without one: they will be refused). EC2's API is an
    authenticated channel, so a key read there is the node's, not whatever answers at its
    address."""
    pins: dict[str, str] = {}
    unpinned = []
    for name, inst in node_names(found):
        try:
            endpoint = endpoint_of(cluster, name, inst)
        except SparknetError:
            continue  # no address yet (pending): nothing can connect to it to be refused
        public = host_public_key(user_data_of(ec2, inst.id))
        if public:
            pins[endpoint.address] = public
        else:
            unpinned.append(endpoint.name)
    pin(known_hosts, pins, only=True)
    return unpinned


# --- the cluster's client key pair ---------------------------------------------------------------

#: EC2 key pair names: at most 255 ASCII characters (AWS's limit; moto checks none)
KEY_NAME_MAX = 255


def key_pair_name(cluster: str) -> str:
    """The EC2 key pair sparknet imports for `cluster`: one per cluster and region, found again
    by name on a later `up` (and by its tags on `down` and `sweep`)."""
    name = f"sparknet-{cluster}"
    check_key_name(name)
    return name


def check_key_name(name: str) -> str:
    """`name`, if EC2 accepts it as a key pair name (1-255 ASCII characters); else a one-line
    error."""
    if not name or len(name) > KEY_NAME_MAX or not name.isascii():
        raise SparknetError(f"key pair name {name!r} is not 1-{KEY_NAME_MAX} ASCII characters")
    return name


def cluster_dir(cluster: str) -> Path:
    """The cluster's registry dir (``<registry>/<name>/``): its key, its known_hosts."""
    from sparknet.cluster.lifecycle import _file_stem, registry_dir

    return registry_dir() / _file_stem(cluster)


def access_for(spec: ClusterSpec) -> Access:
    """How sparknet logs in to the cluster's nodes: the user's `key_file` when the spec names
    its own `key_name`, else the key pair sparknet made (``<registry>/<name>/id_ed25519``); the
    cluster's own known_hosts either way."""
    base = cluster_dir(spec.name)
    key = Path(spec.key_file).expanduser() if spec.key_file else base / "id_ed25519"
    return Access(key, base / "known_hosts")


def check_key_file(access: Access) -> None:
    """The private key exists, only its owner can read it (OpenSSH refuses a key others can
    read, and so does this, before any node is asked), and it opens with no passphrase as an
    ed25519, ECDSA or RSA key (what paramiko logs in with): sparknet asks for no passphrase and
    uses no SSH agent, so a key it cannot open would fail at every node, later and less clearly."""
    try:
        mode = access.key_file.stat().st_mode & 0o777
    except OSError as exc:
        raise SparknetError(
            f"key file {access.key_file} cannot be read ({describe(exc)}); set key_file to the "
            "private key of key_name"
        ) from exc
    if mode & 0o077:
        raise SparknetError(
            f"key file {access.key_file} is readable by others (mode {mode:o}); "
            f"chmod 600 {access.key_file}"
        )
    _load_key(access.key_file)


#: the private key types sparknet logs in with (paramiko's; it has no DSA any more)
KEY_TYPES: tuple[type[paramiko.PKey], ...] = (
    paramiko.Ed25519Key,
    paramiko.ECDSAKey,
    paramiko.RSAKey,
)


def _load_key(path: Path) -> paramiko.PKey:
    """The private key in `path`, in OpenSSH or PEM format; a one-line error for one protected
    by a passphrase or a file that holds none."""
    for kind in KEY_TYPES:
        try:
            return kind.from_private_key_file(str(path))
        except paramiko.PasswordRequiredException:
            raise SparknetError(
                f"key file {path} is protected by a passphrase, and sparknet uses no SSH agent: "
                "give a key without a passphrase (e.g. one made for the cluster)"
            ) from None
        except OSError as exc:
            raise SparknetError(f"key file {path} cannot be read ({describe(exc)})") from exc
        except (paramiko.SSHException, ValueError):
            continue  # another type's file, or not a key at all
    raise SparknetError(
        f"key file {path} is not an ed25519, ECDSA or RSA private key; set key_file to the "
        "private key (not its .pub)"
    )


def ensure_key_pair(ec2: Any, spec: ClusterSpec, say: Callable[[str], None]) -> str | None:
    """The EC2 key pair the cluster's instances launch with, and its private key here.

    With the spec's own `key_name` (and `key_file`) nothing is made: the name is checked to
    exist. Else sparknet's: an ed25519 key made here (0600 in the cluster's registry dir) and
    imported as ``sparknet-<name>``, tagged like every other resource so `down` and `sweep` find
    it. A key pair of that name whose public key is not the local one (the registry was lost,
    or another machine made it) is replaced: its private key is not here, so it could let
    nobody from here in. Returns the name when this call imported it, else None."""
    from sparknet.cluster import instances

    if spec.key_name:
        instances.check_key_pair(ec2, spec.key_name)
        check_key_file(access_for(spec))
        return None
    access = access_for(spec)
    public_file = access.key_file.with_name(access.key_file.name + ".pub")
    if not (access.key_file.is_file() and public_file.is_file()):
        private, public = new_ed25519()
        write_private_key(access.key_file, private)
        public_file.write_text(public + "\n")
    public = public_file.read_text().strip()
    name = key_pair_name(spec.name)
    found = _key_pair(ec2, name)
    if found is not None and _same_key(found.get("PublicKey", ""), public):
        return None
    region = aws.region_of(ec2)
    if found is not None:
        say(f"replacing key pair {name}: its private key is not in {access.key_file.parent}")
        with aws.aws_call("DeleteKeyPair", region):
            ec2.delete_key_pair(KeyName=name)
    tags = [t for t in instances._tags(spec, "foundation") if t["Key"] != "Name"]
    with aws.aws_call("ImportKeyPair", region):
        ec2.import_key_pair(
            KeyName=name,
            PublicKeyMaterial=public.encode("ascii"),
            TagSpecifications=[{"ResourceType": "key-pair", "Tags": tags}],
        )
    return name


def _same_key(a: str, b: str) -> bool:
    """Two public key lines hold the same key (type and base64; comments may differ)."""
    return a.split()[:2] == b.split()[:2]


def _key_pair(ec2: Any, name: str) -> dict[str, Any] | None:
    """The key pair `name` with its public key; None when there is none."""
    import botocore.exceptions as bx

    region = aws.region_of(ec2)
    try:
        found = ec2.describe_key_pairs(KeyNames=[name], IncludePublicKey=True)["KeyPairs"]
    except bx.ClientError as exc:
        if aws.error_code(exc) == "InvalidKeyPair.NotFound":
            return None
        raise aws.describe_error(exc, f"DescribeKeyPairs in {region}") from exc
    except bx.BotoCoreError as exc:
        raise aws.describe_error(exc, f"DescribeKeyPairs in {region}") from exc
    return dict(found[0]) if found else None


def tagged_key_pairs(ec2: Any, cluster: str | None = None) -> list[dict[str, Any]]:
    """The key pairs carrying the `sparknet:cluster` tag (of `cluster`, when given): by tag, so
    `down` and `sweep` find them with the local registry lost. DescribeKeyPairs has no pages."""
    from sparknet.cluster.spec import TAG_CLUSTER

    filters = [
        {"Name": f"tag:{TAG_CLUSTER}", "Values": [cluster]}
        if cluster is not None
        else {"Name": "tag-key", "Values": [TAG_CLUSTER]}
    ]
    with aws.aws_call("DescribeKeyPairs", aws.region_of(ec2)):
        return list(ec2.describe_key_pairs(Filters=filters)["KeyPairs"])


def delete_key_pairs(ec2: Any, cluster: str) -> list[str]:
    """Delete the cluster's tagged key pairs (never a user's own: sparknet tags only what it
    imported); "key-pair:<name>" of each."""
    deleted = []
    for pair in tagged_key_pairs(ec2, cluster):
        with aws.aws_call("DeleteKeyPair", aws.region_of(ec2)):
            ec2.delete_key_pair(KeyName=pair["KeyName"])  # moto ignores KeyPairId
        deleted.append(f"key-pair:{pair['KeyName']}")
    return deleted


#: the cluster's Spark secret in its registry dir (mode 0600; `spark_conf.load_or_create_secret`)
SPARK_SECRET = "spark-secret"


def forget_local(cluster: str) -> None:
    """Remove the cluster's key, known_hosts and Spark secret from its registry dir (after
    `down`: the nodes they reached are gone), and the dir when nothing else is left in it."""
    base = cluster_dir(cluster)
    for name in ("id_ed25519", "id_ed25519.pub", "known_hosts", SPARK_SECRET):
        (base / name).unlink(missing_ok=True)
    with contextlib.suppress(OSError):  # Terraform state or other files stay
        base.rmdir()


# --- the OpenSSH client ------------------------------------------------------------------------


def ssh_command(endpoint: Endpoint, access: Access, *extra: str) -> list[str]:
    """The `ssh` command line that reaches `endpoint` as sparknet does: the cluster's key only
    (`IdentitiesOnly`, no agent), its known_hosts only, and a host whose key is not pinned
    there refused (`StrictHostKeyChecking=yes`). `-F none`: no ssh_config of the user's can
    rename the node or add a proxy. `extra` goes before the destination (`-N`, `-L ...`).
    A node that goes silent ends it as it ends sparknet's own calls (`_Keepalive`): keepalives
    every third of `silence_s()`, the third unanswered one closes it; a connection not made
    within `silence_s()` (a listener that never sends the banner) fails too."""
    silence = silence_s()
    return [
        "ssh",
        "-F",
        "none",
        "-o",
        f"ServerAliveInterval={max(1, math.ceil(silence / 3))}",
        "-o",
        "ServerAliveCountMax=3",
        "-o",
        f"ConnectTimeout={max(1, math.ceil(silence))}",
        "-i",
        str(access.key_file),
        "-o",
        "IdentitiesOnly=yes",
        "-o",
        "IdentityAgent=none",
        "-o",
        "StrictHostKeyChecking=yes",
        "-o",
        # quoted: OpenSSH splits an option's value on whitespace (a registry under "My Files")
        f'UserKnownHostsFile="{access.known_hosts}"',
        "-o",
        "GlobalKnownHostsFile=/dev/null",
        "-p",
        str(endpoint.port),
        *extra,
        f"{endpoint.user}@{endpoint.host}",
    ]
