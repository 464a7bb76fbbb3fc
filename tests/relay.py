"""A man in the middle of Spark's RPC, for tests: a TCP relay on 127.0.0.1 in front of a Spark
daemon that answers each connection's first RPC (the client's first authentication message)
with an `RpcFailure`, as an attacker on the path does to talk both ends down to SASL without
encryption, then passes the bytes on both ways and keeps them all.

Spark's frames (common/network-common, `MessageEncoder` / `TransportFrameDecoder`): an 8-byte
big-endian length that counts itself, a 1-byte message type, then the message. An RpcRequest
(type 3) starts with its 8-byte request id; an RpcFailure (type 5) is that id and the error as
a 4-byte length and UTF-8 bytes.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading

RPC_REQUEST, RPC_FAILURE = 3, 5


def rpc_failure(request_id: bytes, error: str) -> bytes:
    """The frame of an RpcFailure answering the request `request_id` (its 8 bytes)."""
    text = error.encode()
    body = bytes([RPC_FAILURE]) + request_id + struct.pack(">i", len(text)) + text
    return struct.pack(">q", 8 + len(body)) + body


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data


class DowngradeRelay:
    """Listens on 127.0.0.1 (`port`) and relays to `target`. `downgrades` counts the first
    messages it answered with a failure; `seen` holds every byte that crossed it, both ways
    (the failures it made up itself not included)."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.seen = bytearray()
        self.downgrades = 0
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            self._socks.append(client)
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _keep(self, data: bytes) -> None:
        with self._lock:
            self.seen += data

    def _serve(self, client: socket.socket) -> None:
        with contextlib.suppress(OSError, ConnectionError):
            head = _read_exactly(client, 8)
            rest = _read_exactly(client, struct.unpack(">q", head)[0] - 8)
            self._keep(head + rest)
            upstream = socket.create_connection(self.target, timeout=10)
            upstream.settimeout(None)
            self._socks.append(upstream)
            if rest[0] == RPC_REQUEST:
                with self._lock:
                    self.downgrades += 1
                client.sendall(rpc_failure(rest[1:9], "java.lang.IllegalArgumentException"))
            else:
                upstream.sendall(head + rest)
            threading.Thread(target=self._pump, args=(upstream, client), daemon=True).start()
            self._pump(client, upstream)

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while chunk := src.recv(65536):
                self._keep(chunk)
                dst.sendall(chunk)
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.server.close()
        for sock in self._socks:
            with contextlib.suppress(OSError):
                sock.close()
