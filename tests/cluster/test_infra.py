"""infra/: the Terraform foundation parses, takes its security rules and policies from the shared
data files, validates every input, is `terraform fmt` clean and passes checkov; rules.py reads the
same files exactly as Terraform does."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import hcl2
import pytest

from sparknet.cluster.aws import rules
from sparknet.cluster.aws.rules import policy_document, security_group_rules
from sparknet.cluster.spec import INFRA_DIR, TAG_CLUSTER, TAG_OWNER, TAG_ROLE
from sparknet.errors import SparknetError

REPO = Path(__file__).resolve().parents[2]
TF_FILES = sorted(INFRA_DIR.glob("*.tf"))
HCL = hcl2.SerializationOptions(
    with_comments=False, explicit_blocks=False, strip_string_quotes=True
)

#: what sparknet reads back through `terraform output -json`
OUTPUTS = {
    "vpc_id",
    "subnet_ids",
    "security_group_id",
    "instance_profile_name",
    "instance_profile_arn",
    "role_arn",
    "bucket",
}
POLICY_VALUES = {
    "partition": "aws",
    "region": "us-east-1",
    "account": "123456789012",
    "bucket": "sparknet-data",
    "data_prefix": "datasets/",
    "runs_prefix": "runs/",
    "cluster": "demo",
}
SSH_SOURCE = "203.0.113.7/32"


@pytest.fixture(scope="module")
def module() -> dict[str, list[Any]]:
    """Every top-level block of infra/*.tf, merged across files (`resource`, `variable`, ...)."""
    merged: dict[str, list[Any]] = {}
    for path in TF_FILES:
        with path.open() as f:
            for kind, blocks in hcl2.load(f, serialization_options=HCL).items():
                merged.setdefault(kind, []).extend(blocks)
    return merged


def named(module: dict[str, list[Any]], kind: str) -> dict[str, Any]:
    """`variable`/`output` blocks by name."""
    return {name: body for block in module.get(kind, []) for name, body in block.items()}


def resource(module: dict[str, list[Any]], type_: str, name: str) -> dict[str, Any]:
    for block in module["resource"]:
        if name in block.get(type_, {}):
            return block[type_][name]
    raise AssertionError(f"infra/ has no resource {type_}.{name}")


def terraform() -> str:
    binary = shutil.which("terraform")
    if binary is None:
        pytest.fail("terraform is not on PATH: install Terraform >= 1.9 (infra/ needs it)")
    return binary


def terraform_eval(expression: str, tmp_path: Path) -> Any:
    """The value of an HCL expression as Terraform computes it (`terraform console`, offline)."""
    result = subprocess.run(
        [terraform(), "console"],
        input=f"jsonencode({expression})\n",
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(json.loads(result.stdout.strip().splitlines()[-1]))


# -- the module's structure ----------------------------------------------------------------------


@pytest.mark.parametrize("path", TF_FILES, ids=lambda p: p.name)
def test_every_tf_file_parses(path: Path) -> None:
    with path.open() as f:
        assert hcl2.load(f, serialization_options=HCL)


def test_security_group_rules_come_from_the_shared_rules_file(module) -> None:
    (local_sets,) = [block for block in module["locals"] if "sg_rules" in block]
    assert re.fullmatch(
        r'\$\{jsondecode\(file\("\$\{path\.module\}/rules/security-group\.json"\)\)\}',
        local_sets["sg_rules"],
    )
    group = resource(module, "aws_security_group", "cluster")
    assert "ingress" not in group and "egress" not in group, "rules must not be written inline"
    dynamic = {name: body for block in group["dynamic"] for name, body in block.items()}
    assert dynamic["ingress"]["for_each"] == "${local.sg_rules.ingress}"
    assert dynamic["egress"]["for_each"] == "${local.sg_rules.egress}"
    ingress = dynamic["ingress"]["content"][0]
    assert "var.allowed_cidr" in ingress["cidr_blocks"]
    assert ingress["self"] == '${ingress.value.source == "self"}'


def test_role_policies_come_from_the_shared_policy_files(module) -> None:
    policy = resource(module, "aws_iam_role_policy", "node")["policy"]
    assert policy.startswith(
        '${templatefile("${path.module}/policies/instance-role.json.tftpl", {'
    ), policy
    for name in ("region", "bucket", "data_prefix", "runs_prefix", "cluster"):
        assert re.search(rf"\b{name} = var\.{name}\b", policy), f"{name} not passed to the template"
    assert re.search(r"\baccount = data\.aws_caller_identity\.current\.account_id\b", policy)
    assert re.search(r"\bpartition = data\.aws_partition\.current\.partition\b", policy)
    role = resource(module, "aws_iam_role", "node")
    assert role["assume_role_policy"] == '${file("${path.module}/policies/assume-role.json")}'
    assert resource(module, "aws_iam_instance_profile", "node")["role"] == (
        "${aws_iam_role.node.name}"
    )


def test_every_user_variable_is_validated(module) -> None:
    variables = named(module, "variable")
    assert {"cluster", "region", "allowed_cidr", "bucket", "vpc_id", "subnet_ids"} <= set(variables)
    # a bool's type is its whole validation; everything else needs a validation block
    unvalidated = [
        name
        for name, body in variables.items()
        if body.get("type") != "bool" and not body.get("validation")
    ]
    assert not unvalidated, f"variables without a validation block: {unvalidated}"
    assert all(body.get("description") for body in variables.values())


def test_cluster_name_validation_matches_cluster_spec(module) -> None:
    from sparknet.cluster.spec import ClusterSpec

    metadata = ClusterSpec.model_fields["name"].metadata
    (pattern,) = [m.pattern for m in metadata if getattr(m, "pattern", None)]
    (shortest,) = [m.min_length for m in metadata if getattr(m, "min_length", None)]
    (longest,) = [m.max_length for m in metadata if getattr(m, "max_length", None)]
    condition = named(module, "variable")["cluster"]["validation"][0]["condition"]
    assert f'regex("{pattern}", var.cluster)' in condition
    assert f"length(var.cluster) >= {shortest}" in condition
    assert f"length(var.cluster) <= {longest}" in condition


def test_outputs_include_what_python_reads(module) -> None:
    assert set(named(module, "output")) >= OUTPUTS


def test_provider_tags_every_resource_with_cluster_role_and_owner(module, tmp_path) -> None:
    """default_tags: cluster and role always, sparknet:owner when `owner` is given."""
    (provider,) = [block["aws"] for block in module["provider"] if "aws" in block]
    expression = provider["default_tags"][0]["tags"].removeprefix("${").removesuffix("}")
    for owner, extra in [("null", {}), ('"arn:aws:iam::123456789012:user/a"', {TAG_OWNER: 1})]:
        literal = expression.replace("var.cluster", '"demo"').replace("var.owner", owner)
        tags = terraform_eval(literal, tmp_path)
        want = {TAG_CLUSTER: "demo", TAG_ROLE: "foundation"}
        if extra:
            want[TAG_OWNER] = "arn:aws:iam::123456789012:user/a"
        assert tags == want


def test_terraform_and_aws_provider_versions_are_pinned(module) -> None:
    (settings,) = module["terraform"]
    assert settings["required_version"] == ">= 1.9"
    aws = settings["required_providers"][0]["aws"]
    assert aws["source"] == "hashicorp/aws"
    assert "<" in aws["version"] and ">=" in aws["version"], "the AWS provider needs a range"


def test_network_is_made_only_without_a_given_vpc(module) -> None:
    for type_, name in [
        ("aws_vpc", "this"),
        ("aws_internet_gateway", "this"),
        ("aws_route_table", "public"),
    ]:
        assert resource(module, type_, name)["count"] == "${local.create_network ? 1 : 0}"
    subnets = resource(module, "aws_subnet", "public")
    assert subnets["count"] == "${local.create_network ? length(local.azs) : 0}"


def test_boto3_network_is_the_one_terraform_makes(module, tmp_path) -> None:
    """Both backends take the VPC range, subnet size, zone count and zone type from
    rules/network.json, and cut the same per-AZ subnets."""
    from sparknet.cluster.aws.foundation import subnet_cidr
    from sparknet.cluster.aws.rules import NETWORK_FILE, network

    (local_sets,) = [block for block in module["locals"] if "network" in block]
    assert local_sets["network"] == '${jsondecode(file("${path.module}/rules/network.json"))}'
    assert local_sets["vpc_cidr"] == "${coalesce(var.vpc_cidr, local.network.vpc_cidr)}"
    assert local_sets["az_count"] == "${coalesce(var.az_count, local.network.az_count)}"
    zones = next(d for d in module["data"] if "aws_availability_zones" in d)
    (zone_filter,) = zones["aws_availability_zones"]["available"]["filter"]
    assert zone_filter == {"name": "zone-type", "values": ["${local.network.zone_type}"]}
    settings = network()
    assert settings["zone_type"] == "availability-zone" and settings["az_count"] == 3
    expression = resource(module, "aws_subnet", "public")["cidr_block"]
    for k in range(settings["az_count"]):
        literal = expression.removeprefix("${").removesuffix("}")
        literal = literal.replace("local.network", f'jsondecode(file("{NETWORK_FILE}"))')
        literal = literal.replace("local.vpc_cidr", json.dumps(settings["vpc_cidr"]))
        literal = literal.replace("count.index", str(k))
        assert terraform_eval(literal, tmp_path) == subnet_cidr(k)


GOOD_INPUTS = {
    "cluster": "demo",
    "region": "us-east-1",
    "allowed_cidr": SSH_SOURCE,
    "bucket": "sparknet-data",
}


@pytest.fixture(scope="module")
def variables_only(tmp_path_factory) -> Path:
    """infra/variables.tf alone: a module Terraform plans offline, so validations run for real."""
    root = tmp_path_factory.mktemp("variables")
    shutil.copy(INFRA_DIR / "variables.tf", root)
    subprocess.run([terraform(), "init", "-input=false"], cwd=root, capture_output=True, check=True)
    return root


def plan(root: Path, inputs: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    (root / "inputs.tfvars.json").write_text(json.dumps(inputs))
    return subprocess.run(
        [terraform(), "plan", "-input=false", "-no-color", "-var-file=inputs.tfvars.json"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    "inputs",
    [
        {},
        {"vpc_id": "vpc-0123456789abcdef0", "subnet_ids": ["subnet-0123456789abcdef0"]},
        {"availability_zones": ["us-east-1a", "us-east-1b"], "az_count": 3},
        {"allowed_cidr": "10.0.0.0/16", "region": "us-gov-west-1", "bucket": "a.b-c"},
        {"owner": "arn:aws:sts::123456789012:assumed-role/Dev/alice@example.com"},
        {"cluster": "a-b" + "c" * 28},
        {"data_prefix": "imagenet/shards/", "runs_prefix": "team-a/runs/", "create_bucket": True},
    ],
    ids=["defaults", "own-vpc", "zones", "widest-cidr-gov", "owner", "longest-name", "prefixes"],
)
def test_variables_accept_good_inputs(variables_only, inputs) -> None:
    result = plan(variables_only, {**GOOD_INPUTS, **inputs})
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("cluster", "Demo"),
        ("cluster", "a"),
        ("cluster", "c2-"),
        ("cluster", "a--b"),
        ("cluster", "a" * 32),
        ("region", "useast1"),
        ("allowed_cidr", "0.0.0.0/0"),
        ("allowed_cidr", "0.0.0.0/1"),
        ("allowed_cidr", "10.0.0.0/15"),
        ("owner", "arn:aws:sts::1:assumed-role/a/b,c"),
        ("owner", ""),
        ("allowed_cidr", "300.1.2.3/32"),
        ("allowed_cidr", "2001:db8::/64"),
        ("allowed_cidr", "203.0.113.7"),
        ("az_count", 1),
        ("az_count", 2.5),
        ("availability_zones", ["us-east-1a"]),
        ("vpc_cidr", "10.0.0.0/8"),
        ("vpc_id", "vpc-xyz"),
        ("subnet_ids", ["sub-1"]),
        ("bucket", "Sparknet_Data"),
        ("bucket", "ab"),
        ("bucket", "a.-b"),
        ("bucket", "192.168.1.1"),
        ("bucket", "xn--ab"),
        ("bucket", "ab-s3alias"),
        ("data_prefix", "datasets"),
        ("data_prefix", "/datasets/"),
        ("runs_prefix", "*/"),
    ],
)
def test_variables_refuse_bad_inputs(variables_only, name, value) -> None:
    result = plan(variables_only, {**GOOD_INPUTS, name: value})
    assert result.returncode != 0
    assert "Invalid value for variable" in result.stderr, result.stderr
    assert f"{name} must" in " ".join(result.stderr.split()), result.stderr


# -- tools: terraform fmt, checkov ---------------------------------------------------------------


def test_terraform_fmt_is_clean() -> None:
    result = subprocess.run(
        [
            terraform(),
            "fmt",
            "-check",
            "-recursive",
            "infra",
            "tests/terraform_module",
            "tests/terraform_foundation",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, f"run `terraform fmt -recursive infra`: {result.stdout}"


def rendered_module() -> str:
    """infra/'s security group and node role with the data files written out literally: checkov
    cannot see through `dynamic` over `jsondecode(file())` or through `templatefile()`."""

    def block(kind: str, rule: dict[str, Any]) -> str:
        peer = rule.get("source") or rule["destination"]
        target = {
            "allowed_cidr": f"cidr_blocks = [{json.dumps(SSH_SOURCE)}]",
            "self": "self = true",
            "anywhere": 'cidr_blocks = ["0.0.0.0/0"]',
        }[peer]
        return (
            f"  {kind} {{\n    description = {json.dumps(rule['description'])}\n"
            f"    protocol = {json.dumps(rule['protocol'])}\n"
            f"    from_port = {rule['from_port']}\n    to_port = {rule['to_port']}\n"
            f"    {target}\n  }}\n"
        )

    rule_blocks = "".join(block(r["direction"], r) for r in security_group_rules())
    return f"""
resource "aws_security_group" "rendered" {{
  #checkov:skip=CKV2_AWS_5:a rendered copy of infra/security.tf, checked for its rules only
  #checkov:skip=CKV_AWS_382:egress to anywhere: S3 and package mirrors have no fixed addresses
  name        = "rendered"
  description = "infra/rules/security-group.json, written out"
  vpc_id      = "vpc-0123456789abcdef0"
{rule_blocks}}}

resource "aws_s3_bucket_policy" "rendered" {{
  bucket = "sparknet-data"
  policy = <<-JSON
    {json.dumps(policy_document("bucket-tls-only", partition="aws", bucket="sparknet-data"))}
  JSON
}}

resource "aws_iam_role" "rendered" {{
  name               = "rendered"
  assume_role_policy = <<-JSON
    {json.dumps(policy_document("assume-role"))}
  JSON
}}

resource "aws_iam_role_policy" "rendered" {{
  name   = "rendered"
  role   = aws_iam_role.rendered.id
  policy = <<-JSON
    {json.dumps(policy_document("instance-role", **POLICY_VALUES))}
  JSON
}}
"""


@pytest.fixture(scope="module")
def checkov_report(tmp_path_factory) -> dict[str, Any]:
    """One checkov run over a copy of infra/ and the rendered module beside it (~5 s)."""
    checkov = Path(os.environ.get("CHECKOV") or REPO / ".venv-checkov" / "bin" / "checkov")
    if not os.access(checkov, os.X_OK):
        pytest.fail(
            f"checkov not found at {checkov}: run `make checkov` (it gets its own venv, "
            ".venv-checkov, as its boto3 pin conflicts with moto's) or set CHECKOV=/path/to/checkov"
        )
    root = tmp_path_factory.mktemp("checkov")
    shutil.copytree(INFRA_DIR, root / "infra")
    (root / "rendered").mkdir()
    (root / "rendered" / "main.tf").write_text(rendered_module())
    result = subprocess.run(
        [
            str(checkov),
            "-d",
            str(root),
            "--framework",
            "terraform",
            "-o",
            "json",
            "--skip-download",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    try:
        report = json.loads(result.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"checkov printed no JSON report (exit {result.returncode}): {result.stderr}")
    reports = report if isinstance(report, list) else [report]
    (terraform_report,) = [r for r in reports if r["check_type"] == "terraform"]
    return terraform_report


@pytest.mark.integration  # checkov: its own venv, made by `make checkov` (`make test` does)
def test_checkov_reports_no_failed_checks(checkov_report) -> None:
    failed = [
        f"{c['check_id']} {c['resource']} ({c['file_path']}): {c['check_name']}"
        for c in checkov_report["results"]["failed_checks"]
    ]
    assert not failed, "checkov failed checks:\n" + "\n".join(failed)
    assert checkov_report["summary"]["parsing_errors"] == 0
    resources = {c["resource"] for c in checkov_report["results"]["passed_checks"]}
    assert {"aws_security_group.rendered", "aws_iam_role_policy.rendered"} <= resources


@pytest.mark.integration  # checkov: its own venv, made by `make checkov` (`make test` does)
def test_checkov_skips_carry_a_reason(checkov_report) -> None:
    skipped = checkov_report["results"]["skipped_checks"]
    assert skipped, "expected the inline skips of infra/ to be reported"
    without_reason = [
        f"{c['check_id']} {c['resource']}"
        for c in skipped
        if len((c["check_result"].get("suppress_comment") or "").strip()) < 10
    ]
    assert not without_reason, f"checkov skips need a reason: {without_reason}"


# -- rules.py: the same files, read by Python ----------------------------------------------------


def test_security_group_rules_open_ssh_to_allowed_cidr_only_and_all_between_members() -> None:
    ingress = security_group_rules("ingress")
    assert [(r["protocol"], r["from_port"], r["to_port"], r["source"]) for r in ingress] == [
        ("tcp", 22, 22, "allowed_cidr"),
        ("-1", 0, 0, "self"),
    ]
    egress = security_group_rules("egress")
    assert [(r["protocol"], r["destination"]) for r in egress] == [("-1", "anywhere")]
    assert security_group_rules() == ingress + egress
    assert all(r["description"] for r in ingress + egress)


def test_rules_are_what_terraform_reads(tmp_path) -> None:
    from_terraform = terraform_eval(f'jsondecode(file("{rules.RULES_FILE}"))', tmp_path)
    for direction in ("ingress", "egress"):
        expected = [
            {k: v for k, v in r.items() if k != "direction"}
            for r in security_group_rules(direction)
        ]
        assert from_terraform[direction] == expected


def test_rule_descriptions_are_what_terraform_sends(tmp_path) -> None:
    """infra/security.tf fills a description's ${allowed_cidr} with replace(), as Python does."""
    source = "10.200.0.0/16"
    expression = (
        f'[for r in jsondecode(file("{rules.RULES_FILE}")).ingress : '
        f'replace(r.description, "$${{allowed_cidr}}", "{source}")]'
    )
    expected = [rules.rule_description(r, source) for r in security_group_rules("ingress")]
    assert terraform_eval(expression, tmp_path) == expected
    assert source in expected[0]
    security = (INFRA_DIR / "security.tf").read_text()
    assert 'replace(ingress.value.description, "$${allowed_cidr}", var.allowed_cidr)' in security


def test_policy_is_what_terraform_templatefile_renders(tmp_path) -> None:
    values = ", ".join(f'{k} = "{v}"' for k, v in POLICY_VALUES.items())
    template = rules.POLICIES_DIR / "instance-role.json.tftpl"
    from_terraform = terraform_eval(
        f'jsondecode(templatefile("{template}", {{{values}}}))', tmp_path
    )
    assert policy_document("instance-role", **POLICY_VALUES) == from_terraform


def test_instance_policy_terminates_only_own_cluster_and_grants_no_wildcard_actions() -> None:
    doc = policy_document("instance-role", **POLICY_VALUES)
    statements = {s["Sid"]: s for s in doc["Statement"]}
    actions = [a for s in doc["Statement"] for a in _as_list(s["Action"])]
    assert not [a for a in actions if "*" in a], actions
    assert all(s["Effect"] == "Allow" for s in doc["Statement"])
    terminate = [s for s in doc["Statement"] if "ec2:TerminateInstances" in _as_list(s["Action"])]
    assert len(terminate) == 1
    assert terminate[0]["Condition"] == {"StringEquals": {f"aws:ResourceTag/{TAG_CLUSTER}": "demo"}}
    # only instances of the cluster's own region and account
    assert terminate[0]["Resource"] == "arn:aws:ec2:us-east-1:123456789012:instance/*"
    describe = statements["FindInstancesInOwnRegion"]
    assert describe["Condition"] == {"StringEquals": {"aws:RequestedRegion": "us-east-1"}}
    # nothing the nodes do not use (no part listing); DeleteObject: the driver on the master
    # discards an incomplete checkpoint on a restart and releases the run dir's lock
    assert set(actions) == {
        "s3:ListBucket",
        "s3:GetObject",
        "s3:PutObject",
        "s3:DeleteObject",
        "s3:AbortMultipartUpload",
        "ec2:DescribeInstances",
        "ec2:TerminateInstances",
    }
    # data: read only; runs: read and write under the cluster's own prefix only
    read_data = statements["ReadDataPrefix"]
    assert (read_data["Action"], read_data["Resource"]) == (
        "s3:GetObject",
        "arn:aws:s3:::sparknet-data/datasets/*",
    )
    runs = statements["ReadWriteOwnRunsPrefix"]
    assert runs["Resource"] == "arn:aws:s3:::sparknet-data/runs/demo/*"
    # deletes: only under the cluster's own runs prefix, never in the data or another cluster's
    deletes = [s for s in doc["Statement"] if "s3:DeleteObject" in _as_list(s["Action"])]
    assert [s["Resource"] for s in deletes] == ["arn:aws:s3:::sparknet-data/runs/demo/*"]
    assert statements["ListDataAndOwnRunsPrefixes"]["Condition"] == {
        "StringLike": {"s3:prefix": ["datasets/*", "runs/demo/*"]}
    }
    wildcard_resources = [s["Sid"] for s in doc["Statement"] if s["Resource"] == "*"]
    assert wildcard_resources == ["FindInstancesInOwnRegion"]  # EC2 Describe* takes no ARN
    no_arn_wildcards = [s["Resource"] for s in doc["Statement"] if ":*:" in str(s["Resource"])]
    assert not no_arn_wildcards


def test_policies_name_the_partition_of_gov_regions() -> None:
    values = {**POLICY_VALUES, "partition": "aws-us-gov", "region": "us-gov-west-1"}
    doc = policy_document("instance-role", **values)
    arns = [a for s in doc["Statement"] for a in _as_list(s["Resource"]) if a != "*"]
    assert arns and all(a.startswith("arn:aws-us-gov:") for a in arns)


def test_bucket_policy_refuses_plain_http() -> None:
    doc = policy_document("bucket-tls-only", partition="aws", bucket="sparknet-data")
    (statement,) = doc["Statement"]
    assert statement["Effect"] == "Deny"
    assert statement["Condition"] == {"Bool": {"aws:SecureTransport": "false"}}
    assert statement["Resource"] == ["arn:aws:s3:::sparknet-data", "arn:aws:s3:::sparknet-data/*"]


def test_bucket_policy_comes_from_the_shared_policy_file(module) -> None:
    policy = resource(module, "aws_s3_bucket_policy", "data")["policy"]
    template = '"${path.module}/policies/bucket-tls-only.json.tftpl"'
    assert policy.startswith(f"${{templatefile({template}, {{")
    assert "bucket = var.bucket" in policy
    assert "partition = data.aws_partition.current.partition" in policy


def test_assume_role_lets_only_ec2_assume_the_role() -> None:
    (statement,) = policy_document("assume-role")["Statement"]
    assert statement["Principal"] == {"Service": "ec2.amazonaws.com"}
    assert statement["Action"] == "sts:AssumeRole"


def test_policy_document_missing_value_is_a_one_line_error() -> None:
    values = {k: v for k, v in POLICY_VALUES.items() if k != "cluster"}
    with pytest.raises(SparknetError, match=r"needs a value for \$\{cluster\}") as err:
        policy_document("instance-role", **values)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("bad", ['a", "Action": "iam:PassRole', "*", "", "data/*"])
def test_policy_document_refuses_values_that_could_widen_the_policy(bad: str) -> None:
    with pytest.raises(SparknetError, match="must be a non-empty string"):
        policy_document("instance-role", **{**POLICY_VALUES, "data_prefix": bad})


def test_unknown_policy_names_the_ones_there() -> None:
    with pytest.raises(SparknetError, match="have: assume-role, bucket-tls-only, instance-role"):
        policy_document("admin")


def test_policy_files_use_only_placeholders_both_readers_agree_on() -> None:
    """Terraform's templatefile() and string.Template agree on `${identifier}` and nothing else:
    a bare `$name` is text to Terraform, `$$` and `%{` mean different things to each."""
    for path in rules.POLICIES_DIR.iterdir():
        text = path.read_text()
        assert "%{" not in text and "$$" not in text, path
        dollars = re.findall(r"\$(\{[A-Za-z_][A-Za-z0-9_]*\})?", text)
        assert all(dollars), f"{path}: a `$` that is not a ${{identifier}} placeholder"
        placeholders = set(re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", text))
        assert placeholders <= set(POLICY_VALUES), placeholders - set(POLICY_VALUES)


def _as_list(value: str | list[str]) -> list[str]:
    return [value] if isinstance(value, str) else list(value)
