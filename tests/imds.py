"""A stand-in for EC2's instance metadata service (IMDSv2), for the spot interruption notice.

Nothing real can run here: IMDS is a link-local service of an EC2 host, and moto has none. This
one answers what `sparknet.cluster.aws.spot` asks, as AWS documents it: a PUT of
``/latest/api/token`` with a TTL header gives a token, and a GET of
``/latest/meta-data/spot/instance-action`` with that token gives the notice (404 while there is
none, 401 without a valid token). One server on a loopback port serves several instances, each
under its own path (``/<instance id>/``): `endpoint` is what a node's
``AWS_EC2_METADATA_SERVICE_ENDPOINT`` is set to.
"""

from __future__ import annotations

import json
import secrets
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class ImdsStandIn:
    """The metadata service of every instance a test gives a notice to (`notices`: instance id
    -> the notice's JSON object, ``{"action": "terminate", "time": "..."}``)."""

    def __init__(self) -> None:
        self.notices: dict[str, dict[str, str]] = {}
        #: instance id -> its AZ (``placement/availability-zone``, where SDKs read the region)
        self.zones: dict[str, str] = {}
        self.token = secrets.token_hex(8)
        #: answer every read 401, as IMDS does to an expired or foreign token
        self.refuse_tokens = False
        #: (method, path) of every request, in order
        self.requests: list[tuple[str, str]] = []
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def do_PUT(self) -> None:
                stand_in.requests.append(("PUT", self.path))
                _id, path = _split(self.path)
                if path != "/latest/api/token":
                    return self._send(404, "")
                if not self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                    return self._send(400, "")
                self._send(200, stand_in.token)

            def do_GET(self) -> None:
                stand_in.requests.append(("GET", self.path))
                instance, path = _split(self.path)
                token = self.headers.get("X-aws-ec2-metadata-token")
                if stand_in.refuse_tokens or token != stand_in.token:
                    return self._send(401, "")
                if path == "/latest/meta-data/placement/availability-zone":
                    zone = stand_in.zones.get(instance)
                    return self._send(200, zone) if zone else self._send(404, "")
                notice = stand_in.notices.get(instance)
                if path != "/latest/meta-data/spot/instance-action" or notice is None:
                    return self._send(404, "")
                self._send(200, json.dumps(notice))

            def _send(self, code: int, body: str) -> None:
                data = body.encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *_args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()

    def endpoint(self, instance_id: str) -> str:
        return f"http://127.0.0.1:{self.port}/{instance_id}/"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _split(path: str) -> tuple[str, str]:
    """``/<instance>/rest`` -> (instance, ``/rest``)."""
    _, instance, rest = (path.split("?", 1)[0] + "/").split("/", 2)
    return instance, "/" + rest.rstrip("/")
