"""AWS as it behaves, not as moto answers: a fault-injecting front for the suite's moto server.

moto answers every call at once and refuses nothing a real account would. AWS throttles bursts
(EC2 `RequestLimitExceeded`, 503; S3 `SlowDown`, 503), runs out of a type in one AZ
(`InsufficientInstanceCapacity`, a 500 that SDKs retry), refuses a launch past a quota
(`VcpuLimitExceeded`, `MaxSpotInstanceCountExceeded`), and is eventually consistent: an instance
just launched may be `InvalidInstanceID.NotFound` by id and absent from a tag-filtered describe for
a while, and a just-made instance profile reads as an invalid `iamInstanceProfile.arn` to
RunInstances for its first seconds (IAM propagation). `FaultFront` is a real HTTP server on
127.0.0.1 serving moto's own WSGI app (so it shares moto's state with the suite's server) behind a
middleware that makes those answers happen, as a per-test `FaultPlan` says. CLI subprocesses and
Spark executors reach it through `AWS_ENDPOINT_URL` like the plain server; the test checks what is
left through the plain server, which injects nothing.

The error bodies are AWS's own shapes, so botocore parses and retries them as it would AWS's: EC2's
`<Response><Errors><Error><Code>` XML (docs.aws.amazon.com/AWSEC2/latest/APIReference/
errors-overview.html: client errors 4xx, server errors 5xx), IAM's `<ErrorResponse>`, S3's
`<Error><Code>` (no body for a HEAD), and the JSON protocols' `__type`.
"""

from __future__ import annotations

import io
import json
import re
import threading
import time
import urllib.parse
import uuid
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

#: the HTTP status AWS answers each injected code with; any other code gets 400
STATUS = {
    "RequestLimitExceeded": 503,  # EC2 throttling
    "SlowDown": 503,  # S3 throttling
    "ServiceUnavailable": 503,
    "Unavailable": 503,
    "InsufficientInstanceCapacity": 500,  # EC2 server error: SDKs retry it ("reached max retries")
    "InsufficientHostCapacity": 500,
    "InsufficientCapacity": 500,
    "InternalError": 500,
}
#: AWS's wording of each code, where a test does not give its own
MESSAGES = {
    "RequestLimitExceeded": "Request limit exceeded.",
    "SlowDown": "Please reduce your request rate.",
    "Throttling": "Rate exceeded",
    "ThrottlingException": "Rate exceeded",
    "InsufficientInstanceCapacity": (
        "We currently do not have sufficient {type} capacity in the Availability Zone you "
        "requested ({az}). Our system will be working on provisioning additional capacity."
    ),
    "VcpuLimitExceeded": (
        "You have requested more vCPU capacity than your current vCPU limit of 0 allows for the "
        "instance bucket that the specified instance type belongs to. Please visit "
        "http://aws.amazon.com/contact-us/ec2-request to request an adjustment to this limit."
    ),
    "MaxSpotInstanceCountExceeded": "Max spot instance count exceeded",
    "InsufficientInstanceCapacity/spot": (
        "There is no Spot capacity available that matches your request."
    ),
}
#: the IAM calls after which EC2 does not see an instance profile for a while
_PROFILE_MADE = ("CreateInstanceProfile", "AddRoleToInstanceProfile")
_SCOPE = re.compile(r"Credential=[^/]+/[^/]+/([^/]+)/([^/]+)/aws4_request")


@dataclass(frozen=True)
class Call:
    """One request the front received: its service (the SigV4 scope's), action, region and
    parameters (the query protocols' form fields; empty for REST and JSON), the AZ a
    RunInstances asked for, when, and its path (S3's ``/bucket/key``: which object)."""

    service: str
    action: str
    region: str
    params: dict[str, str]
    az: str = ""
    at: float = 0.0
    path: str = ""

    def values(self, prefix: str) -> list[str]:
        """The values of a list parameter (`InstanceId` -> InstanceId.1, InstanceId.2...)."""
        pattern = re.compile(rf"{re.escape(prefix)}\.\d+")
        return [v for k, v in self.params.items() if pattern.fullmatch(k)]


@dataclass
class Fault:
    """Answer `action` (``"RunInstances"``, ``"s3:PutBucketTagging"``) with `code`: `times`
    matching calls (None: every one) after letting `skip` through, only where `when` holds."""

    action: str
    code: str
    times: int | None = 1
    skip: int = 0
    message: str | None = None
    status: int | None = None
    when: Callable[[Call], bool] | None = None
    seen: int = 0
    hit: int = 0

    def matches(self, call: Call) -> bool:
        service, _, action = self.action.rpartition(":")
        if action != call.action or (service and service != call.service):
            return False
        if self.when is not None and not self.when(call):
            return False
        self.seen += 1
        if self.seen <= self.skip or (self.times is not None and self.hit >= self.times):
            return False
        self.hit += 1
        return True


@dataclass
class FaultPlan:
    """What the front does to one test's calls, and what it saw (`calls`, `injected`)."""

    faults: list[Fault] = field(default_factory=list)
    #: for this long after RunInstances answered, its instances are NotFound by id and absent
    #: from tag-filtered DescribeInstances (EC2's eventual consistency)
    unseen_instances_s: float = 0.0
    #: whether those fresh instances are also missing from tag-filtered DescribeInstances (they
    #: are on EC2; off, a test sees only the NotFound by id)
    lag_tag_filters: bool = True
    #: for this long after CreateInstanceProfile / AddRoleToInstanceProfile, RunInstances finds
    #: the profile's ARN invalid (IAM's propagation to EC2)
    unseen_profiles_s: float = 0.0
    calls: list[Call] = field(default_factory=list)
    #: (action, code) of every answer the front made up, in order
    injected: list[tuple[str, str]] = field(default_factory=list)
    launched: dict[str, float] = field(default_factory=dict)
    profiles: dict[str, float] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def fail(self, action: str, code: str, **how: Any) -> Fault:
        """Add a `Fault`; see there for `how`."""
        fault = Fault(action, code, **how)
        self.faults.append(fault)
        return fault

    def clear(self) -> None:
        """Drop the faults and what was seen (the eventual-consistency settings stay)."""
        with self.lock:
            self.faults.clear()
            self.calls.clear()
            self.injected.clear()

    def in_az(self, az: str) -> Callable[[Call], bool]:
        """A `when`: the call asks for `az` (RunInstances' subnet or placement)."""
        return lambda call: call.az == az

    def actions(self, action: str, **where: str) -> list[Call]:
        """The calls of `action` the front received (injected or not), those with `where`'s
        attributes (``az="us-east-1a"``)."""
        return [
            c
            for c in self.calls
            if c.action == action and all(getattr(c, k) == v for k, v in where.items())
        ]

    def codes(self) -> list[str]:
        return [code for _action, code in self.injected]


class FaultMiddleware:
    """The WSGI middleware in front of moto's app: read the request, answer with a fault when
    the plan says so, else pass it on (and hide fresh instances from a tag-filtered describe)."""

    def __init__(self, app: Callable[..., Any]) -> None:
        self.app = app
        self.plan = FaultPlan()

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        body = environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
        environ["wsgi.input"] = io.BytesIO(body)
        environ["CONTENT_LENGTH"] = str(len(body))
        plan = self.plan
        call = _call(environ, body)
        with plan.lock:
            plan.calls.append(call)
            answer = self._fault(plan, call)
            if answer is not None:
                plan.injected.append((call.action, answer[0]))
        if answer is not None:
            return _error(call, environ, start_response, *answer)
        status, headers, chunks = _run(self.app, environ)
        if call.service == "ec2" and status.startswith("200"):
            chunks = self._after_ec2(plan, call, b"".join(chunks))
            headers = [(k, v) for k, v in headers if k.lower() != "content-length"]
            headers.append(("Content-Length", str(len(chunks[0]))))
        elif call.action in _PROFILE_MADE and status.startswith("200"):
            with plan.lock:
                plan.profiles[call.params.get("InstanceProfileName", "")] = time.monotonic()
        start_response(status, headers)
        return chunks

    def _fault(self, plan: FaultPlan, call: Call) -> tuple[str, str, int] | None:
        """(code, message, status) of the answer to make up for `call`, or None. An unseen
        profile comes first: EC2 checks a request's parameters before it looks for capacity."""
        now = time.monotonic()
        if call.action == "RunInstances" and plan.unseen_profiles_s > 0:
            arn = call.params.get("IamInstanceProfile.Arn", "")
            made = plan.profiles.get(arn.rpartition("/")[2])
            if made is not None and now - made < plan.unseen_profiles_s:
                message = (
                    f"Value ({arn}) for parameter iamInstanceProfile.arn is invalid. "
                    "Invalid IAM Instance Profile ARN"
                )
                return "InvalidParameterValue", message, 400
        for fault in plan.faults:
            if fault.matches(call):
                spot = call.params.get("InstanceMarketOptions.MarketType") == "spot"
                default = MESSAGES.get(f"{fault.code}/spot" if spot else "", "")
                default = default or MESSAGES.get(fault.code, f"injected {fault.code}")
                message = fault.message or default
                type_ = call.params.get("InstanceType", "")
                message = message.format(type=type_, az=call.az or "us-east-1a")
                return fault.code, message, fault.status or STATUS.get(fault.code, 400)
        if call.service == "ec2" and plan.unseen_instances_s > 0:
            named = call.values("InstanceId") + call.values("ResourceId")
            fresh = [i for i in named if now - plan.launched.get(i, -1e9) < plan.unseen_instances_s]
            if fresh:
                ids = ", ".join(fresh)
                return "InvalidInstanceID.NotFound", f"The instance ID '{ids}' does not exist", 400
        return None

    def _after_ec2(self, plan: FaultPlan, call: Call, body: bytes) -> list[bytes]:
        """Note RunInstances' instances; drop fresh ones from a tag-filtered describe."""
        if call.action == "RunInstances":
            with plan.lock:
                for iid in re.findall(rb"<instanceId>(i-[0-9a-f]+)</instanceId>", body):
                    plan.launched[iid.decode()] = time.monotonic()
            return [body]
        tagged = any(
            k.startswith("Filter.") and k.endswith(".Name") and v.startswith("tag")
            for k, v in call.params.items()
        )
        lag = plan.lag_tag_filters and plan.unseen_instances_s > 0
        if call.action != "DescribeInstances" or not tagged or not lag:
            return [body]
        now = time.monotonic()
        with plan.lock:
            fresh = {i for i, t in plan.launched.items() if now - t < plan.unseen_instances_s}
        hidden = _without_instances(body, fresh)
        if hidden is not body:
            with plan.lock:
                plan.injected.append((call.action, "lagging"))
        return [hidden]


def _without_instances(body: bytes, hide: set[str]) -> bytes:
    """A DescribeInstances answer without the instances `hide` (and reservations left empty);
    `body` itself when none of them is in it."""
    if not hide or not any(i.encode() in body for i in hide):
        return body
    root = ET.fromstring(body)
    ns = {"e": root.tag[1:].partition("}")[0] if root.tag.startswith("{") else ""}
    ET.register_namespace("", ns["e"])  # written back as the default namespace, as it came
    for reservations in root.findall("e:reservationSet", ns):
        for reservation in list(reservations):
            for instances in reservation.findall("e:instancesSet", ns):
                for item in list(instances):
                    if item.findtext("e:instanceId", "", ns) in hide:
                        instances.remove(item)
                if not len(instances):
                    reservations.remove(reservation)
    return ET.tostring(root, encoding="utf-8", xml_declaration=True)


def _run(app: Callable[..., Any], environ: dict[str, Any]) -> tuple[str, list, list[bytes]]:
    """Call the wrapped app; its status, headers and body."""
    got: dict[str, Any] = {}

    def start_response(status: str, headers: list, exc_info: Any = None) -> None:
        got["status"], got["headers"] = status, list(headers)

    result = app(environ, start_response)
    try:
        chunks = [bytes(c) for c in result]
    finally:
        if hasattr(result, "close"):
            result.close()
    return got["status"], got["headers"], chunks


def _call(environ: dict[str, Any], body: bytes) -> Call:
    """What a request asks: service and region from the SigV4 scope, the action from the query
    protocols' `Action`, the JSON protocols' X-Amz-Target, or S3's method and path."""
    scope = _SCOPE.search(environ.get("HTTP_AUTHORIZATION", ""))
    region, service = scope.groups() if scope else ("us-east-1", "")
    query = dict(urllib.parse.parse_qsl(environ.get("QUERY_STRING", ""), keep_blank_values=True))
    params: dict[str, str] = {}
    if environ.get("CONTENT_TYPE", "").startswith("application/x-www-form-urlencoded"):
        params = dict(urllib.parse.parse_qsl(body.decode(), keep_blank_values=True))
    target = environ.get("HTTP_X_AMZ_TARGET", "")
    if "Action" in params:
        action = params["Action"]
    elif target:
        action = target.rpartition(".")[2]
    elif service == "s3":
        action = _s3_action(environ["REQUEST_METHOD"], environ.get("PATH_INFO", ""), query)
    else:
        action = query.get("Action", environ["REQUEST_METHOD"])
    az = ""
    if action == "RunInstances":
        az = params.get("Placement.AvailabilityZone", "")
        subnet = params.get("NetworkInterface.1.SubnetId") or params.get("SubnetId")
        if subnet and not az:
            az = _subnet_az(region, subnet)
    path = environ.get("PATH_INFO", "")
    return Call(service, action, region, params, az, time.monotonic(), path)


#: S3 sub-resources named by a bucket request's query, as the action names them
_S3_SUB = {
    "tagging": "Tagging",
    "policy": "Policy",
    "versioning": "Versioning",
    "encryption": "Encryption",
    "publicAccessBlock": "PublicAccessBlock",
    "lifecycle": "LifecycleConfiguration",
    "ownershipControls": "OwnershipControls",
}


def _s3_action(method: str, path: str, query: dict[str, str]) -> str:
    """S3's operation name of a path-style request (HeadBucket, PutBucketTagging, GetObject)."""
    bucket, _, key = path.lstrip("/").partition("/")
    if not bucket:
        return "ListBuckets"
    verb = {"GET": "Get", "PUT": "Put", "HEAD": "Head", "DELETE": "Delete", "POST": "Post"}
    if key:
        return f"{verb.get(method, method)}Object"
    sub = next((name for q, name in _S3_SUB.items() if q in query), "")
    if sub:
        return f"{verb.get(method, method)}Bucket{sub}"
    if method == "GET":
        return "ListObjectsV2" if query.get("list-type") == "2" else "ListObjects"
    return {"PUT": "CreateBucket", "HEAD": "HeadBucket", "DELETE": "DeleteBucket"}.get(
        method, method
    )


def _subnet_az(region: str, subnet_id: str) -> str:
    """The AZ of a moto subnet (the front shares moto's state)."""
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.ec2.models import ec2_backends

    try:
        return str(ec2_backends[DEFAULT_ACCOUNT_ID][region].get_subnet(subnet_id).availability_zone)
    except Exception:  # a subnet moto does not know: RunInstances will say so itself
        return ""


def _error(
    call: Call, environ: dict[str, Any], start_response: Callable[..., Any], code: str,
    message: str, status: int,
) -> Iterable[bytes]:  # fmt: skip
    """AWS's error answer for `call`'s protocol."""
    rid = str(uuid.uuid4())
    if call.service == "s3":
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>\n<Error>'
            f"<Code>{code}</Code><Message>{_esc(message)}</Message>"
            f"<RequestId>{rid[:16]}</RequestId><HostId>{rid}</HostId></Error>"
        ).encode()
        if environ["REQUEST_METHOD"] == "HEAD":
            body = b""
        content_type = "application/xml"
    elif environ.get("HTTP_X_AMZ_TARGET"):
        body = json.dumps({"__type": code, "message": message}).encode()
        content_type = "application/x-amz-json-1.1"
    elif call.service == "ec2":
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>\n<Response><Errors><Error>'
            f"<Code>{code}</Code><Message>{_esc(message)}</Message></Error></Errors>"
            f"<RequestID>{rid}</RequestID></Response>"
        ).encode()
        content_type = "text/xml;charset=UTF-8"
    else:  # the other query protocols (IAM, STS)
        kind = "Receiver" if status >= 500 else "Sender"
        body = (
            "<ErrorResponse><Error>"
            f"<Type>{kind}</Type><Code>{code}</Code><Message>{_esc(message)}</Message></Error>"
            f"<RequestId>{rid}</RequestId></ErrorResponse>"
        ).encode()
        content_type = "text/xml"
    reason = {400: "Bad Request", 500: "Internal Server Error", 503: "Service Unavailable"}
    start_response(
        f"{status} {reason.get(status, 'Error')}",
        [("Content-Type", content_type), ("Content-Length", str(len(body))),
         ("x-amzn-RequestId", rid)],
    )  # fmt: skip
    return [body]


def _esc(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


class FaultFront:
    """The front server: moto's app behind `FaultMiddleware`, threaded, on 127.0.0.1."""

    def __init__(self) -> None:
        from moto.moto_server.threaded_moto_server import MotoRequestHandler
        from moto.server import DomainDispatcherApplication, create_backend_app
        from werkzeug.serving import make_server

        self.middleware = FaultMiddleware(DomainDispatcherApplication(create_backend_app))
        self._server = make_server(
            "127.0.0.1", 0, self.middleware, True, request_handler=MotoRequestHandler
        )
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        self.url = f"http://localhost:{self._server.server_address[1]}"

    def new_plan(self) -> FaultPlan:
        """A fresh plan for the next test (the last one's faults and calls are dropped)."""
        self.middleware.plan = FaultPlan()
        return self.middleware.plan

    def stop(self) -> None:
        self._server.shutdown()
        self._thread.join()
