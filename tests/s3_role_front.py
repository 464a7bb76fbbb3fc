"""S3 as a cluster's nodes see it on AWS, for tests: an HTTP front on 127.0.0.1 for the suite's
moto server that answers as S3 answers a caller holding only the node role's policy.

moto does not show it: its IAM checks are off unless `INITIAL_NO_AUTH_ACTION_COUNT` is set, and
with them on (moto 5: `moto/iam/access_control.py`) it evaluates no `s3:prefix` (only
`sts:ExternalId` reaches a condition; a statement whose condition does not hold counts as an
explicit deny), and its S3 answers a missing key with 404 whatever the caller may list. AWS
answers a GET or HEAD of a missing key with 404 only when the caller holds s3:ListBucket for
that request, else with 403 (the GetObject and HeadObject references, "Permissions"); the node
role's ListBucket holds only for the `s3:prefix` values it names, and a GET carries no prefix.

So the front evaluates the role's own policy document (Allow statements; `StringLike` /
`StringEquals` conditions on `s3:prefix`, a missing key failing them as in IAM): a request the
policy does not allow gets 403 AccessDenied; a GET or HEAD of a missing key that it allows gets
403 too, never 404. Everything else is moto's answer. Path-style requests only (the client's
endpoint is an IP address, so botocore addresses buckets by path).
"""

from __future__ import annotations

import http.client
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

DENIED = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n'
    b"<Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>"
)
#: hop-by-hop headers a proxy does not pass on (RFC 9110 7.6.1), the length it sets itself, and
#: the 100-continue it already answered
_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "expect"}


def _like(pattern: str, value: str) -> bool:
    """IAM's StringLike and resource matching: `*` any run of characters, `?` one."""
    regex = "".join({"*": ".*", "?": "."}.get(c, re.escape(c)) for c in pattern)
    return re.fullmatch(regex, value, re.DOTALL) is not None


def _listed(value: str | list[str]) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


def allowed(policy: dict[str, Any], action: str, resource: str, context: dict[str, str]) -> bool:
    """Whether an Allow statement of `policy` grants `action` on `resource` in `context`."""
    for st in policy["Statement"]:
        if st["Effect"] != "Allow" or not any(_like(a, action) for a in _listed(st["Action"])):
            continue
        if not any(_like(r, resource) for r in _listed(st["Resource"])):
            continue
        if all(
            key in context and any(
                _like(v, context[key]) if op == "StringLike" else v == context[key]
                for v in _listed(values)
            )
            for op, tests in st.get("Condition", {}).items()
            for key, values in tests.items()
        ):  # fmt: skip
            return True
    return False


def _read_body(req: BaseHTTPRequestHandler) -> bytes:
    if req.headers.get("Transfer-Encoding", "").lower() != "chunked":
        return req.rfile.read(int(req.headers.get("Content-Length") or 0))
    body = b""
    while size := int(req.rfile.readline().split(b";")[0], 16):
        body += req.rfile.read(size)
        req.rfile.readline()
    while req.rfile.readline() not in (b"\r\n", b"\n", b""):  # trailer fields
        pass
    return body


class RoleFront:
    """Listens on 127.0.0.1 (`url`) and relays to moto at `target` (`http://host:port`).
    `missing_as_denied` counts GETs and HEADs of missing keys it answered with 403."""

    def __init__(self, target: str, policy: dict[str, Any], partition: str = "aws") -> None:
        parts = urlsplit(target)
        self.target = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.policy = policy
        self.partition = partition
        self.missing_as_denied = 0
        self.denied = 0
        self._lock = threading.Lock()
        front = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _relay(self) -> None:
                front._handle(self)

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _relay

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> RoleFront:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- what the role may do ------------------------------------------------------------------

    def _permitted(self, method: str, bucket: str, key: str, query: dict[str, list[str]]) -> bool:
        arn = f"arn:{self.partition}:s3:::{bucket}"
        if not key:
            listing = method == "GET" and (
                query.get("list-type") == ["2"] or not (set(query) - {"prefix", "delimiter",
                                                                      "max-keys", "marker",
                                                                      "encoding-type"})
            )  # fmt: skip
            if method == "HEAD" or listing:  # HeadBucket and ListObjects(V2): s3:ListBucket
                context = {"s3:prefix": query["prefix"][0]} if "prefix" in query else {}
                return allowed(self.policy, "s3:ListBucket", arn, context)
            return True  # DeleteObjects and the rest: moto's answer (each key is checked there)
        action = {
            "GET": "s3:GetObject", "HEAD": "s3:GetObject", "PUT": "s3:PutObject",
            "DELETE": "s3:AbortMultipartUpload" if "uploadId" in query else "s3:DeleteObject",
            "POST": "s3:PutObject",
        }[method]  # fmt: skip
        return allowed(self.policy, action, f"{arn}/{key}", {})

    # -- relaying ------------------------------------------------------------------------------

    def _handle(self, req: BaseHTTPRequestHandler) -> None:
        parts = urlsplit(req.path)
        bucket, _, key = unquote(parts.path).lstrip("/").partition("/")
        query = parse_qs(parts.query, keep_blank_values=True)
        body = _read_body(req)
        if not self._permitted(req.command, bucket, key, query):
            with self._lock:
                self.denied += 1
            return self._deny(req)
        conn = http.client.HTTPConnection(*self.target, timeout=60)
        try:
            headers = {k: v for k, v in req.headers.items() if k.lower() not in _HOP}
            conn.request(req.command, req.path, body=body or None, headers=headers)
            answer = conn.getresponse()
            data = answer.read()
        finally:
            conn.close()
        if (
            key
            and req.command in ("GET", "HEAD")
            and answer.status == 404
            and (req.command == "HEAD" or b"<Code>NoSuchKey</Code>" in data)
        ):  # the role's ListBucket does not hold for a GET: AWS says 403, not 404
            with self._lock:
                self.missing_as_denied += 1
            return self._deny(req)
        req.send_response(answer.status)
        for name, value in answer.getheaders():
            if name.lower() not in _HOP:
                req.send_header(name, value)
        if req.command == "HEAD":
            req.send_header("Content-Length", answer.getheader("Content-Length") or "0")
            req.end_headers()
            return None
        req.send_header("Content-Length", str(len(data)))
        req.end_headers()
        req.wfile.write(data)
        return None

    def _deny(self, req: BaseHTTPRequestHandler) -> None:
        req.send_response(403)
        req.send_header("Content-Type", "application/xml")
        req.send_header("Content-Length", "0" if req.command == "HEAD" else str(len(DENIED)))
        req.end_headers()
        if req.command != "HEAD":
            req.wfile.write(DENIED)
