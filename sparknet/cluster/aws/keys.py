"""A cluster's SSH keys on EC2: the key pair its instances launch with, and each node's host key.

The key pair is sparknet's own (imported and tagged) or the user's; a node's host key is handed
to the node through cloud-init user data and pinned from EC2's copy of it (an authenticated
channel, unlike the first connection)."""

from __future__ import annotations

import base64
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import botocore.exceptions as bx
import yaml

from sparknet import aws
from sparknet.cluster import node_endpoints, sshkeys
from sparknet.cluster.aws import instances, preflight, userdata
from sparknet.cluster.aws.instances import Instance
from sparknet.cluster.spec import TAG_CLUSTER, ClusterSpec
from sparknet.errors import SparknetError
from sparknet.say import Say

# --- host keys through cloud-init --------------------------------------------------------------


def host_key_user_data(backstop_minutes: int) -> tuple[str, str]:
    """A fresh ed25519 host key as cloud-init user data, with the instance's backstop of
    `backstop_minutes` (`userdata.cloud_config`): (user data, public key line).

    cloud-init installs `ssh_keys` as the instance's host key before sshd starts, deletes the
    AMI's own keys (`ssh_deletekeys`) and, given `ssh_keys`, makes no others, so the key
    sparknet pins is the only one the node can present. The user data is readable on the node
    through IMDS (see docs/security.md, "What the user data exposes")."""
    private, public = sshkeys.new_ed25519()
    return userdata.cloud_config(private, public, backstop_minutes), public


def host_public_key(user_data: str) -> str | None:
    """The ed25519 public host key in cloud-init user data; None when it has none (an instance
    launched by an older sparknet, or by hand)."""
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
    for name, inst in node_endpoints.node_names(found):
        try:
            endpoint = node_endpoints.endpoint_of(cluster, name, inst)
        except SparknetError:
            continue  # no address yet (pending): nothing can connect to it to be refused
        public = host_public_key(user_data_of(ec2, inst.id))
        if public:
            pins[endpoint.address] = public
        else:
            unpinned.append(endpoint.name)
    sshkeys.pin(known_hosts, pins, only=True)
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


def ensure_key_pair(ec2: Any, spec: ClusterSpec, say: Say) -> str | None:
    """The EC2 key pair the cluster's instances launch with, and its private key here.

    With the spec's own `key_name` (and `key_file`) nothing is made: the name is checked to
    exist. Else sparknet's: an ed25519 key made here (0600 in the cluster's registry dir) and
    imported as ``sparknet-<name>``, tagged like every other resource so `down` and `sweep` find
    it. A key pair of that name whose public key is not the local one (the registry was lost,
    or another machine made it) is replaced: its private key is not here, so it could let
    nobody from here in. Returns the name when this call imported it, else None."""
    if spec.key_name:
        preflight.check_key_pair(ec2, spec.key_name)
        sshkeys.check_key_file(sshkeys.access_for(spec))
        return None
    access = sshkeys.access_for(spec)
    public_file = access.key_file.with_name(access.key_file.name + ".pub")
    if not (access.key_file.is_file() and public_file.is_file()):
        private, public = sshkeys.new_ed25519()
        sshkeys.write_private_key(access.key_file, private)
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
    tags = [t for t in instances.role_tags(spec, "foundation") if t["Key"] != "Name"]
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
