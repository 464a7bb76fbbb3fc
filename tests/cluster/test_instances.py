"""Cluster instances (launch, fallback, wait, find, terminate, prices, caller address) against
moto's real EC2/IAM/SSM server.

The network, security group and instance profile are made here with plain boto3, so these tests
do not depend on `foundation.py`. Each test uses its own cluster name, so they share the one moto
server without seeing each other's instances.
"""

from __future__ import annotations

import http.server
import socket
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import boto3
import botocore.exceptions as bx
import pytest

from sparknet.cluster.aws import instances, launcher, preflight, prices
from sparknet.cluster.spec import TAG_CLUSTER, TAG_ROLE, ClusterSpec
from sparknet.errors import SparknetError

pytestmark = pytest.mark.integration

REGION = "us-east-1"
AZS = ("us-east-1a", "us-east-1b")
#: put_parameter refuses names starting with "aws", so the tests seed their own parameter
AMI_PARAMETER = "/test/sparknet/ami"
#: tiny waiter delays: moto's instances are running (and terminated) at once
FAST = 0.05


@dataclass(frozen=True)
class Network:
    subnet_by_az: dict[str, str]
    security_group_id: str
    instance_profile_arn: str
    ami: str


def assert_one_line(err: BaseException, *needles: str) -> None:
    text = str(err)
    assert "\n" not in text, text
    for needle in needles:
        assert needle in text, f"{needle!r} not in {text!r}"


@pytest.fixture(scope="module")
def network(moto_endpoint: str) -> Network:
    """VPC, a subnet in each of two AZs, a security group, an instance profile, and the SSM
    parameter holding one of moto's registered AMIs."""
    ec2 = boto3.client("ec2", endpoint_url=moto_endpoint, region_name=REGION)
    vpc = ec2.create_vpc(CidrBlock="10.42.0.0/16")["Vpc"]["VpcId"]
    subnets = {
        az: ec2.create_subnet(VpcId=vpc, CidrBlock=f"10.42.{i}.0/24", AvailabilityZone=az)[
            "Subnet"
        ]["SubnetId"]
        for i, az in enumerate(AZS)
    }
    sg = ec2.create_security_group(GroupName="sparknet-test", Description="test", VpcId=vpc)
    iam = boto3.client("iam", endpoint_url=moto_endpoint, region_name=REGION)
    iam.create_role(RoleName="sparknet-test-node", AssumeRolePolicyDocument="{}")
    profile = iam.create_instance_profile(InstanceProfileName="sparknet-test-node")
    iam.add_role_to_instance_profile(
        InstanceProfileName="sparknet-test-node", RoleName="sparknet-test-node"
    )
    # filtered: listing all of moto's ~1300 default AMIs takes seconds
    ubuntu = [{"Name": "name", "Values": ["ubuntu/*"]}]
    image = ec2.describe_images(Owners=["amazon"], Filters=ubuntu)["Images"][0]
    ssm = boto3.client("ssm", endpoint_url=moto_endpoint, region_name=REGION)
    ssm.put_parameter(Name=AMI_PARAMETER, Value=image["ImageId"], Type="String", Overwrite=True)
    return Network(
        subnet_by_az=subnets,
        security_group_id=sg["GroupId"],
        instance_profile_arn=profile["InstanceProfile"]["Arn"],
        ami=image["ImageId"],
    )


@pytest.fixture(scope="module")
def ec2(moto_endpoint: str) -> Any:
    """One client for the module: making one loads EC2's service model (~0.5 s)."""
    return instances.ec2_client(REGION, moto_endpoint)


@pytest.fixture
def spec(ec2: Any) -> Iterator[ClusterSpec]:
    """A cluster of its own for each test, terminated afterwards."""
    cluster = ClusterSpec(
        name=f"t-{uuid.uuid4().hex[:10]}",
        ami_parameter=AMI_PARAMETER,
        root_volume_gb=40,
        instance_types=["g5.xlarge", "g4dn.xlarge"],
    )
    yield cluster
    instances.terminate_cluster(ec2, cluster.name, delay_s=FAST)


def launch(ec2: Any, spec: ClusterSpec, network: Network, **overrides: Any) -> list[Any]:
    """`launcher.launch` with the test network and worker defaults."""
    args: dict[str, Any] = {
        "role": "worker",
        "count": 2,
        "subnet_by_az": network.subnet_by_az,
        "security_group_id": network.security_group_id,
        "instance_profile_arn": network.instance_profile_arn,
        "ami": network.ami,
        "spot": False,
        "instance_types": spec.instance_types,
        "client_token_prefix": f"{spec.name}-1",
    }
    args.update(overrides)
    return launcher.launch(ec2, spec, **args)


def describe(ec2: Any, ids: list[str]) -> list[dict[str, Any]]:
    pages = ec2.describe_instances(InstanceIds=ids)["Reservations"]
    return [i for r in pages for i in r["Instances"]]


def tags_of(resource: dict[str, Any]) -> dict[str, str]:
    return {t["Key"]: t["Value"] for t in resource.get("Tags", [])}


def run_error(code: str) -> bx.ClientError:
    """A RunInstances error as boto3 raises it (InvalidParameterValue: the profile one)."""
    message = (
        "Value (arn:aws:iam::123456789012:instance-profile/x) for parameter "
        "iamInstanceProfile.arn is invalid. Invalid IAM Instance Profile ARN"
        if code == "InvalidParameterValue"
        else f"injected {code}"
    )
    return bx.ClientError({"Error": {"Code": code, "Message": message}}, "RunInstances")


def fail_first(ec2: Any, monkeypatch: pytest.MonkeyPatch, codes: list[str]) -> list[tuple]:
    """Make the client's first len(codes) RunInstances calls raise those error codes; record
    the (type, AZ subnet) of every call.

    The one stub in these tests: moto has no capacity limits, quotas or IAM propagation delay,
    so it can never answer InsufficientInstanceCapacity (or the others). The error is a real
    botocore ClientError, as boto3 raises it, and later calls go to moto unchanged."""
    real: Callable[..., Any] = ec2.run_instances
    calls: list[tuple] = []

    def run_instances(**kwargs: Any) -> Any:
        calls.append((kwargs["InstanceType"], kwargs["NetworkInterfaces"][0]["SubnetId"]))
        if len(calls) <= len(codes):
            raise run_error(codes[len(calls) - 1])
        return real(**kwargs)

    monkeypatch.setattr(ec2, "run_instances", run_instances)
    return calls


def test_launch_tags_and_hardens_master_and_workers(ec2: Any, spec: ClusterSpec, network):
    master = launch(
        ec2, spec, network, role="master", count=1, spot=False, instance_types=["g5.xlarge"]
    )
    workers = launch(ec2, spec, network, role="worker", count=2)

    assert [i.role for i in master] == ["master"] and [i.role for i in workers] == ["worker"] * 2
    assert {i.az for i in master + workers} == {AZS[0]}
    assert all(i.type == "g5.xlarge" and not i.spot and i.private_ip for i in master + workers)
    for raw in describe(ec2, [i.id for i in master + workers]):
        role = "master" if raw["InstanceId"] == master[0].id else "worker"
        assert tags_of(raw) == {
            TAG_CLUSTER: spec.name,
            TAG_ROLE: role,
            "Name": f"{spec.name}-{role}",
        }
        assert raw["MetadataOptions"]["HttpTokens"] == "required"
        assert raw["MetadataOptions"]["HttpPutResponseHopLimit"] == 1
        eni = raw["NetworkInterfaces"][0]
        assert [g["GroupId"] for g in eni["Groups"]] == [network.security_group_id]
        assert eni.get("Association", {}).get("PublicIp") or raw.get("PublicIpAddress")
        shutdown = ec2.describe_instance_attribute(
            InstanceId=raw["InstanceId"], Attribute="instanceInitiatedShutdownBehavior"
        )
        assert shutdown["InstanceInitiatedShutdownBehavior"]["Value"] == "terminate"
        volumes = ec2.describe_volumes(
            Filters=[{"Name": "attachment.instance-id", "Values": [raw["InstanceId"]]}]
        )["Volumes"]
        assert len(volumes) == 1
        root = volumes[0]
        assert root["Attachments"][0]["Device"] == raw["RootDeviceName"]
        assert (root["VolumeType"], root["Size"], root["Encrypted"]) == ("gp3", 40, True)
        assert tags_of(root)[TAG_CLUSTER] == spec.name and tags_of(root)[TAG_ROLE] == role

    # moto leaves IamInstanceProfile out of DescribeInstances and associates the profile with
    # the first instance of each RunInstances call only: one association per launch
    ids = {i.id for i in master + workers}
    profiles = [
        a["IamInstanceProfile"]["Arn"]
        for a in ec2.describe_iam_instance_profile_associations()["IamInstanceProfileAssociations"]
        if a["InstanceId"] in ids
    ]
    assert profiles == [network.instance_profile_arn] * 2


def test_spot_workers_are_one_time_spot_instances(ec2: Any, spec: ClusterSpec, network):
    workers = launch(ec2, spec, network, spot=True)

    assert all(i.spot for i in workers)
    assert all(raw["InstanceLifecycle"] == "spot" for raw in describe(ec2, [i.id for i in workers]))


@pytest.mark.parametrize(
    ("codes", "expected"),
    [
        (["InsufficientInstanceCapacity"], ("g5.xlarge", AZS[1])),
        (["InsufficientInstanceCapacity", "Unsupported"], ("g4dn.xlarge", AZS[0])),
        # a quota is regional: the second AZ of the same type is skipped
        (["VcpuLimitExceeded"], ("g4dn.xlarge", AZS[0])),
        (["InsufficientInstanceCapacity", "SpotMaxPriceTooLow"], ("g4dn.xlarge", AZS[0])),
    ],
)
def test_capacity_errors_fall_back_across_azs_then_types(
    ec2: Any, spec: ClusterSpec, network, monkeypatch, codes, expected
):
    calls = fail_first(ec2, monkeypatch, codes)

    workers = launch(ec2, spec, network, spot="SpotMaxPriceTooLow" in codes)

    itype, az = expected
    assert calls[-1] == (itype, network.subnet_by_az[az])
    assert len(calls) == len(codes) + 1
    assert {(i.type, i.az) for i in workers} == {expected}
    assert sorted(i.id for i in instances.find(ec2, spec.name)) == [i.id for i in workers]


def test_no_capacity_anywhere_is_one_line_and_launches_nothing(
    ec2: Any, spec: ClusterSpec, network, monkeypatch
):
    calls = fail_first(ec2, monkeypatch, ["InsufficientInstanceCapacity"] * 4)

    with pytest.raises(SparknetError) as err:
        launch(ec2, spec, network)

    assert len(calls) == 4
    assert_one_line(err.value, "no capacity for 2", "g5.xlarge/g4dn.xlarge", ", ".join(AZS))
    assert instances.find(ec2, spec.name) == []


def test_quota_everywhere_names_the_quota(ec2: Any, spec: ClusterSpec, network, monkeypatch):
    calls = fail_first(ec2, monkeypatch, ["VcpuLimitExceeded", "VcpuLimitExceeded"])

    with pytest.raises(SparknetError) as err:
        launch(ec2, spec, network)

    assert len(calls) == 2
    assert_one_line(err.value, "Running On-Demand G and VT instances", "request a higher quota")


@pytest.mark.parametrize("bad_type", ["p3.2xlarge", "zz9.gigantic"])
def test_type_not_offered_is_rejected_before_any_launch(
    ec2: Any, spec: ClusterSpec, network, monkeypatch, bad_type
):
    calls = fail_first(ec2, monkeypatch, [])

    with pytest.raises(SparknetError) as err:
        launch(ec2, spec, network, instance_types=["g5.xlarge", bad_type])

    assert_one_line(err.value, bad_type, REGION, "not offered")
    assert calls == []
    assert instances.find(ec2, spec.name) == []


def test_check_offered_keeps_given_az_order(ec2: Any):
    offered = preflight.check_offered(
        ec2, ["g5.xlarge", "g4dn.xlarge"], ["us-east-1b", "us-east-1a"]
    )

    assert offered == {t: ["us-east-1b", "us-east-1a"] for t in ("g5.xlarge", "g4dn.xlarge")}


def test_check_offered_names_the_azs_that_offer_a_type(ec2: Any):
    # moto offers p4d.24xlarge in us-east-1a..d only
    with pytest.raises(SparknetError) as err:
        preflight.check_offered(ec2, ["p4d.24xlarge"], ["us-east-1e", "us-east-1f"])

    assert_one_line(err.value, "p4d.24xlarge", "only in us-east-1a", "us-east-1e, us-east-1f")


def test_a_profile_not_yet_visible_to_ec2_is_waited_for(
    ec2: Any, spec: ClusterSpec, network, monkeypatch
):
    # IAM propagation delay, injected like the capacity errors: moto sees new profiles at once
    monkeypatch.setattr(launcher, "PROFILE_RETRY_S", FAST)
    calls = fail_first(ec2, monkeypatch, ["InvalidParameterValue"] * 2)

    workers = launch(ec2, spec, network)

    assert len(calls) == 3 and len(set(calls)) == 1  # the same type and AZ, retried
    assert len(workers) == 2


def test_same_client_token_prefix_returns_the_same_instances(ec2: Any, spec: ClusterSpec, network):
    first = launch(ec2, spec, network)
    again = launch(ec2, spec, network)

    assert again == first
    assert len(instances.find(ec2, spec.name)) == 2


def test_retry_after_a_fallback_does_not_launch_again(
    ec2: Any, spec: ClusterSpec, network, monkeypatch
):
    # the first `up` lands in the second AZ; a retry would try the first AZ again (new token)
    fail_first(ec2, monkeypatch, ["InsufficientInstanceCapacity"])
    first = launch(ec2, spec, network)
    monkeypatch.undo()

    again = launch(ec2, spec, network)

    assert again == first
    assert len(instances.find(ec2, spec.name)) == 2


def test_a_new_prefix_launches_a_new_generation(ec2: Any, spec: ClusterSpec, network):
    first = launch(ec2, spec, network, count=1)
    # a prefix that merely extends the first one is still a new generation
    second = launch(ec2, spec, network, count=1, client_token_prefix=f"{spec.name}-1-b")

    assert first != second
    assert len(instances.find(ec2, spec.name)) == 2


def test_wait_ready_returns_running_instances(ec2: Any, spec: ClusterSpec, network):
    workers = launch(ec2, spec, network)

    ready = instances.wait_ready(ec2, [i.id for i in workers], timeout_s=5, delay_s=FAST)

    assert [i.id for i in ready] == [i.id for i in workers]
    assert {raw["State"]["Name"] for raw in describe(ec2, [i.id for i in ready])} == {"running"}


def test_terminate_cluster_leaves_no_live_instance(ec2: Any, spec: ClusterSpec, network):
    master = launch(ec2, spec, network, role="master", count=1)
    workers = launch(ec2, spec, network, spot=True)

    ids = instances.terminate_cluster(ec2, spec.name, delay_s=FAST)

    assert sorted(ids) == sorted(i.id for i in master + workers)
    assert instances.find(ec2, spec.name) == []
    live = ec2.describe_instances(
        Filters=[
            {"Name": f"tag:{TAG_CLUSTER}", "Values": [spec.name]},
            {"Name": "instance-state-name", "Values": ["pending", "running", "stopped"]},
        ]
    )["Reservations"]
    assert live == []


def test_find_lists_master_first(ec2: Any, spec: ClusterSpec, network):
    workers = launch(ec2, spec, network)
    master = launch(ec2, spec, network, role="master", count=1)

    found = instances.find(ec2, spec.name)

    assert [i.id for i in found] == [master[0].id, *sorted(i.id for i in workers)]


def test_root_volume_smaller_than_the_ami_is_refused(ec2: Any, network):
    cluster = ClusterSpec(name=f"t-{uuid.uuid4().hex[:10]}", root_volume_gb=8)
    image = ec2.describe_images(ImageIds=[network.ami])["Images"][0]
    snapshot_gb = image["BlockDeviceMappings"][0]["Ebs"]["VolumeSize"]
    assert snapshot_gb > 8, "the test needs an AMI whose root snapshot is over 8 GiB"

    with pytest.raises(SparknetError) as err:
        launch(ec2, cluster, network)

    assert_one_line(err.value, "root_volume_gb 8", f"at least {snapshot_gb}")


def test_resolve_ami_reads_the_parameter_unless_an_ami_is_given(moto_endpoint, network):
    ssm = instances.ssm_client(REGION, moto_endpoint)
    base = ClusterSpec(name="amitest", ami_parameter=AMI_PARAMETER)

    assert preflight.resolve_ami(base, ssm) == network.ami
    assert preflight.resolve_ami(base.model_copy(update={"ami": "ami-12345678"}), ssm) == (
        "ami-12345678"
    )
    with pytest.raises(SparknetError) as err:
        preflight.resolve_ami(base.model_copy(update={"ami_parameter": "/test/missing"}), ssm)
    assert_one_line(err.value, "/test/missing", "does not exist", REGION, "pass --ami")


@pytest.fixture
def checkip_server() -> Iterator[Callable[[bytes], str]]:
    """A tiny HTTP server on 127.0.0.1 that answers every GET with the body it is given."""
    body = [b""]

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(body[0])))
            self.end_headers()
            self.wfile.write(body[0])

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()

    def serve(text: bytes) -> str:
        body[0] = text
        return f"http://127.0.0.1:{server.server_address[1]}/"

    yield serve
    server.shutdown()
    server.server_close()
    thread.join()


def test_caller_cidr_is_the_checkip_answer_as_a_slash_32(checkip_server, monkeypatch):
    monkeypatch.setenv(preflight.CHECKIP_ENV, checkip_server(b"203.0.113.7\n"))

    assert preflight.caller_cidr() == "203.0.113.7/32"


def test_caller_cidr_says_pass_allowed_cidr_when_unusable(checkip_server, monkeypatch):
    monkeypatch.setenv(preflight.CHECKIP_ENV, checkip_server(b"<html>captive portal</html>"))
    with pytest.raises(SparknetError) as err:
        preflight.caller_cidr()
    assert_one_line(err.value, "--allowed-cidr")

    with socket.socket() as sock:  # a port nobody listens on: bound, then closed
        sock.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}/"
    monkeypatch.setenv(preflight.CHECKIP_ENV, closed)
    with pytest.raises(SparknetError) as err:
        preflight.caller_cidr(timeout=1)
    assert_one_line(err.value, closed, "--allowed-cidr")


def test_hourly_price_from_the_table_and_spot_history(ec2: Any):
    assert prices.hourly_price("g5.xlarge") == pytest.approx(1.006)
    assert prices.hourly_price("g4dn.xlarge", ec2=ec2) == pytest.approx(0.526)
    assert prices.hourly_price("zz9.gigantic") is None
    assert prices.hourly_price("g5.xlarge", spot=True) is None  # spot needs a client
    other = instances.ec2_client("eu-west-1", ec2.meta.endpoint_url)
    assert prices.hourly_price("g5.xlarge", ec2=other) is None  # the table is us-east-1

    history = ec2.describe_spot_price_history(InstanceTypes=["g5.xlarge"], AvailabilityZone=AZS[0])[
        "SpotPriceHistory"
    ]
    spot = prices.hourly_price("g5.xlarge", True, AZS[0], ec2)
    if history:
        newest = max(history, key=lambda h: h["Timestamp"])
        assert spot == pytest.approx(float(newest["SpotPrice"]))
    else:
        assert spot is None


def test_missing_credentials_are_one_line(moto_endpoint, monkeypatch, tmp_path):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    ec2 = instances.ec2_client(REGION, moto_endpoint)

    with pytest.raises(SparknetError) as err:
        instances.find(ec2, "anything")

    assert_one_line(err.value, "no AWS credentials", "AWS_PROFILE")


def test_unreachable_region_endpoint_is_one_line():
    ec2 = instances.ec2_client("us-east-9", "http://127.0.0.1:9", max_attempts=1)

    with pytest.raises(SparknetError) as err:
        instances.find(ec2, "anything")

    assert_one_line(err.value, "cannot reach AWS at http://127.0.0.1:9", "us-east-9")


def test_malformed_region_is_one_line():
    with pytest.raises(SparknetError) as err:
        instances.ec2_client("us east 1!")

    assert_one_line(err.value, "not an AWS region name")


def test_client_token_prefix_is_bounded():
    with pytest.raises(ValueError, match="client_token_prefix"):
        launcher.client_token(
            "x" * 60, role="worker", instance_type="g5.xlarge", az="a", spot=False, count=1
        )
    token = launcher.client_token(
        "c-1", role="worker", instance_type="g5.xlarge", az="a", spot=False, count=1
    )
    assert token.startswith("c-1-") and len(token) <= 64
