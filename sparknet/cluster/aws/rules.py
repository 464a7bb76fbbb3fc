"""The cluster security group's rules and the node role's IAM documents.

Read from the data files under infra/ that Terraform reads too, so the Terraform and boto3
foundations cannot drift apart.

`infra/rules/security-group.json` holds ``{"ingress": [...], "egress": [...]}``; a rule is
``{"description", "protocol", "from_port", "to_port"}`` plus, for ingress, ``"source"``:
``"allowed_cidr"`` (the user's SSH source) or ``"self"`` (members of the group), and for egress
``"destination": "anywhere"``. `infra/policies/NAME.json` is a plain policy document;
`infra/policies/NAME.json.tftpl` a template whose only placeholders are ``${identifier}``, which
Terraform's ``templatefile()`` and Python's `string.Template` both substitute the same way.
"""

from __future__ import annotations

import json
import re
import string
from pathlib import Path
from typing import Any, Literal

from sparknet.cluster.spec import INFRA_DIR
from sparknet.errors import SparknetError

RULES_FILE = INFRA_DIR / "rules" / "security-group.json"
#: the network both foundations make: VPC range, subnet size, how many zones, which zone type
NETWORK_FILE = INFRA_DIR / "rules" / "network.json"
#: the settings every sparknet bucket is held to (encryption, ownership, versioning, lifecycle)
BUCKET_FILE = INFRA_DIR / "rules" / "bucket.json"
POLICIES_DIR = INFRA_DIR / "policies"

#: what a rule's peer may be, per direction: the key that names it and its allowed values
PEERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "ingress": ("source", ("allowed_cidr", "self")),
    "egress": ("destination", ("anywhere",)),
}
_RULE_FIELDS = {"description": str, "protocol": str, "from_port": int, "to_port": int}

#: a substituted value stays inside its JSON string and can widen nothing (no quotes, no `*`)
_SAFE_VALUE = re.compile(r"^[A-Za-z0-9._/:-]+$")


def security_group_rules(
    direction: Literal["ingress", "egress"] | None = None,
) -> list[dict[str, Any]]:
    """The cluster security group's rules, each a copy of the file's rule plus ``"direction"``.

    Args:
        direction: only the ``"ingress"`` or the ``"egress"`` rules; default ``None``: both,
            ingress first.

    Example::

        >>> [(r["direction"], r["from_port"], r["source"]) for r in security_group_rules("ingress")]
        [('ingress', 22, 'allowed_cidr'), ('ingress', 0, 'self')]
    """
    data = _read_json(RULES_FILE)
    directions = [direction] if direction else list(PEERS)
    rules = []
    for name in directions:
        if name not in PEERS:
            raise SparknetError(
                f"security group rule direction must be ingress or egress: {name!r}"
            )
        for rule in data.get(name, []):
            _check_rule(name, rule)
            rules.append({"direction": name, **rule})
    return rules


#: the placeholder an ingress rule's description may hold for its source; infra/security.tf
#: substitutes it with Terraform's replace(), `rule_description` the same way
CIDR_PLACEHOLDER = "${allowed_cidr}"


def rule_description(rule: dict[str, Any], allowed_cidr: str) -> str:
    """The description a rule is sent with: the SSH rule names the source it opens to, so it
    stays true for a /32 and a /16 alike."""
    return str(rule["description"]).replace(CIDR_PLACEHOLDER, allowed_cidr)


_NETWORK_FIELDS = {"vpc_cidr": str, "subnet_prefix": int, "az_count": int, "zone_type": str}
_BUCKET_FIELDS = {
    "sse_algorithm": str,
    "bucket_key_enabled": bool,
    "object_ownership": str,
    "versioning": str,
    "noncurrent_version_expiration_days": int,
    "abort_incomplete_multipart_upload_days": int,
}


def network() -> dict[str, Any]:
    """`infra/rules/network.json`: ``vpc_cidr``, ``subnet_prefix`` (each AZ's subnet size),
    ``az_count`` (at most this many zones get a subnet) and ``zone_type`` (regular zones only:
    local and wavelength zones lack most GPU types)."""
    return _settings(NETWORK_FILE, _NETWORK_FIELDS)


def bucket_settings() -> dict[str, Any]:
    """`infra/rules/bucket.json`: what every sparknet bucket is reconciled to on each `up`."""
    return _settings(BUCKET_FILE, _BUCKET_FIELDS)


def _settings(path: Path, fields: dict[str, type]) -> dict[str, Any]:
    data = _read_json(path)
    for key, kind in fields.items():
        if type(data.get(key)) is not kind:  # exact: a bool is no int here
            raise SparknetError(f"{path}: {key} must be a {kind.__name__}, got {data.get(key)!r}")
    return data


def policy_document(name: str, **values: str) -> dict[str, Any]:
    """The IAM policy document `infra/policies/<name>.json[.tftpl]`, placeholders filled, parsed.

    Args:
        name: ``"instance-role"`` (needs ``partition``, ``region``, ``account``, ``bucket``,
            ``data_prefix``, ``runs_prefix``, ``cluster``), ``"bucket-tls-only"`` (``partition``,
            ``bucket``) or ``"assume-role"`` (no values).
        values: one string per ``${placeholder}``; letters, digits and ``. _ / : -`` only, so no
            value can leave its JSON string or add a wildcard. Extra values are ignored.

    Example::

        >>> doc = policy_document("instance-role", partition="aws", region="us-east-1",
        ...     account="123456789012", bucket="my-data", data_prefix="datasets/",
        ...     runs_prefix="runs/", cluster="demo")
        >>> doc["Statement"][2]["Resource"]
        'arn:aws:s3:::my-data/runs/demo/*'
    """
    path = _policy_path(name)
    for key, value in values.items():
        if not isinstance(value, str) or not _SAFE_VALUE.match(value):
            raise SparknetError(
                f"policy {name}: {key}={value!r} must be a non-empty string of letters, digits "
                "and . _ / : - (a bucket, prefix or cluster name)"
            )
    try:
        text = string.Template(path.read_text()).substitute(values)
    except KeyError as missing:
        raise SparknetError(
            f"policy {name} needs a value for ${{{missing.args[0]}}}: "
            f"pass {missing.args[0]}=... to policy_document"
        ) from None
    except ValueError as bad:
        raise SparknetError(
            f"{path}: only ${{identifier}} placeholders are allowed ({bad})"
        ) from None
    return _parse_json(text, path)


#: what fills ${bucket} for a cluster without one; `without_s3` then drops every statement
#: that names it, so it is never granted
NO_BUCKET = "no-bucket"


def without_s3(document: dict[str, Any]) -> dict[str, Any]:
    """`document` without its S3 statements (those whose resources are S3 ARNs): the node
    policy of a cluster that has no bucket."""

    def on_s3(statement: dict[str, Any]) -> bool:
        resources = statement.get("Resource", [])
        resources = [resources] if isinstance(resources, str) else resources
        return any(":s3:::" in str(r) for r in resources)

    return {**document, "Statement": [s for s in document["Statement"] if not on_s3(s)]}


def _policy_path(name: str) -> Path:
    for candidate in (POLICIES_DIR / f"{name}.json.tftpl", POLICIES_DIR / f"{name}.json"):
        if candidate.is_file():
            return candidate
    have = sorted(p.name.split(".")[0] for p in POLICIES_DIR.glob("*.json*"))
    raise SparknetError(f"no policy document {name!r} in {POLICIES_DIR} (have: {', '.join(have)})")


def _check_rule(direction: str, rule: Any) -> None:
    peer_key, peers = PEERS[direction]
    if not isinstance(rule, dict):
        raise SparknetError(f"{RULES_FILE}: each {direction} rule must be an object, got {rule!r}")
    for field, kind in _RULE_FIELDS.items():
        if not isinstance(rule.get(field), kind):
            raise SparknetError(
                f"{RULES_FILE}: {direction} rule {rule!r} needs {field} ({kind.__name__})"
            )
    if rule.get(peer_key) not in peers:
        raise SparknetError(
            f"{RULES_FILE}: {direction} rule {rule['description']!r} needs {peer_key} "
            f"one of {', '.join(peers)}"
        )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as err:
        raise SparknetError(f"cannot read {path}: {err.strerror}") from None
    return _parse_json(text, path)


def _parse_json(text: str, path: Path) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise SparknetError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise SparknetError(f"{path} must hold a JSON object")
    return data
