"""SSH to a cluster's nodes: the access, one connection, and one function on every node.

With what key and pinned host keys (`Access`), one connection (`connect`, and again after a
node's reboot: `reconnect_after_restart`), and one function on every node at once (`run_all`).
Where each node is reached is node_endpoints.py's (an `Endpoint`), the key and the pins are
sshkeys.py's, and the same trust in OpenSSH's options is openssh.py's.

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
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import fabric
import paramiko
from invoke.exceptions import UnexpectedExit

from sparknet import interrupts
from sparknet.cluster.address import Endpoint
from sparknet.errors import SparknetError, first_line

# paramiko logs a failed handshake (a node still booting) with its traceback from the transport
# thread; with no handler Python prints that to stderr. The error reaches the user as one line.
logging.getLogger("paramiko").addHandler(logging.NullHandler())

T = TypeVar("T")

#: how often `connect` tries again while a node does not accept connections yet (booting sshd)
RETRY_S = 0.5
#: how long a node may leave an open connection unanswered before the connection counts as lost
#: (OpenSSH's ServerAliveInterval 15 x ServerAliveCountMax 3); `SILENCE_ENV` sets other seconds
SILENCE_S = 45.0
SILENCE_ENV = "SPARKNET_SSH_SILENCE_S"


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
    return first_line(exc)


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
        with contextlib.suppress(Exception):  # a channel already gone: the interrupt still counts
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
