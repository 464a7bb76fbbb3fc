"""A spot worker's two-minute warning, read on the worker itself.

About two minutes before EC2 takes a spot instance back it posts an interruption notice in that
instance's metadata (IMDS), and only the instance itself can read it. So an attached submitter's
loss check (`repair.losses`) asks each spot worker over SSH,
``python -m sparknet.cluster.aws.spot``, and a noticed worker is a loss at once: its
replacement starts launching two minutes before its executors would vanish mid-round.

IMDSv2 only (sparknet's instances require the session token), at the endpoint botocore's
setting names (``AWS_EC2_METADATA_SERVICE_ENDPOINT``, default ``http://169.254.169.254/``),
never through a proxy (the address is link-local: a proxy would answer for another machine).

    python -m sparknet.cluster.aws.spot      # prints {"action": ..., "time": ...}, or {} with none
"""

from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import asdict, dataclass

from sparknet.errors import SparknetError

#: botocore's setting for the instance metadata endpoint (a test points it at a stand-in)
ENDPOINT_ENV = "AWS_EC2_METADATA_SERVICE_ENDPOINT"
DEFAULT_ENDPOINT = "http://169.254.169.254/"
#: the notice's path: 404 until EC2 schedules the instance's interruption
ACTION_PATH = "latest/meta-data/spot/instance-action"
TOKEN_PATH = "latest/api/token"
#: a token lives only as long as one check needs it
TOKEN_TTL_S = 30
#: IMDS answers in milliseconds; anything slower is no IMDS
TIMEOUT_S = 2.0
#: what EC2 does to an interrupted spot instance, as the notice says it
ACTIONS = frozenset({"terminate", "stop", "hibernate"})

_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@dataclass(frozen=True)
class Notice:
    """EC2's interruption notice: what it will do (terminate, stop, hibernate) and when
    (UTC, ISO 8601)."""

    action: str
    time: str

    @classmethod
    def from_json(cls, raw: object) -> Notice:
        """The notice in IMDS's JSON object; ValueError for anything else (a notice read
        wrong would terminate a worker)."""
        if (
            not isinstance(raw, dict)
            or raw.get("action") not in ACTIONS
            or not isinstance(raw.get("time"), str)
        ):
            raise ValueError(f"not an interruption notice: {json.dumps(raw)[:80]}")
        return cls(raw["action"], raw["time"])


def endpoint() -> str:
    """The IMDS base URL, ending in a slash; a one-line error for one that is no http URL."""
    base = (os.environ.get(ENDPOINT_ENV) or DEFAULT_ENDPOINT).rstrip("/") + "/"
    try:
        parts = urllib.parse.urlsplit(base)
        ok = parts.scheme in ("http", "https") and bool(parts.hostname)
    except ValueError:
        ok = False
    if not ok:
        raise SparknetError(f"{ENDPOINT_ENV}={base!r} is not an http:// URL")
    return base


def notice(base: str | None = None, timeout: float = TIMEOUT_S) -> Notice | None:
    """This instance's spot interruption notice, None when there is none; a SparknetError when
    the metadata service does not answer as IMDSv2 does."""
    base = base or endpoint()
    try:
        token = _open(
            urllib.request.Request(
                base + TOKEN_PATH, method="PUT",
                headers={"X-aws-ec2-metadata-token-ttl-seconds": str(TOKEN_TTL_S)},
            ),
            timeout,
        )  # fmt: skip
        try:
            body = _open(
                urllib.request.Request(
                    base + ACTION_PATH, headers={"X-aws-ec2-metadata-token": token}
                ),
                timeout,
            )
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise
        return Notice.from_json(json.loads(body))
    except (OSError, ValueError) as exc:  # URLError and HTTPError are OSErrors
        raise SparknetError(f"instance metadata at {base}: {_describe(exc)}") from exc


def _open(request: urllib.request.Request, timeout: float) -> str:
    with _DIRECT.open(request, timeout=timeout) as response:
        return response.read().decode()


def _describe(exc: BaseException) -> str:
    if isinstance(exc, urllib.error.HTTPError):
        return f"HTTP {exc.code} {exc.reason}"
    if isinstance(exc, urllib.error.URLError):
        return f"unreachable ({exc.reason})"
    if isinstance(exc, json.JSONDecodeError):
        return f"not an interruption notice (not JSON: {exc})"
    if isinstance(exc, ValueError):
        return str(exc)
    return str(exc) or type(exc).__name__


def parse(text: str) -> Notice | None:
    """What `main` printed, read back by the submitter: a Notice, or None for ``{}``."""
    raw = json.loads(text)
    return Notice.from_json(raw) if raw != {} else None


def main() -> int:
    try:
        found = notice()
    except SparknetError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(asdict(found) if found else {}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
