"""The limits of a cluster spec, checked before anything is launched: every number has a range
(workers, autostop minutes, volume size, ports, ...), the bucket's two prefixes follow one rule
that both foundations apply (Python here, the same words in infra/variables.tf, run by the real
terraform binary), and an s3:// URI with `.`, `..` or empty parts is refused wherever one is
parsed."""

from __future__ import annotations

import json
import shutil
import subprocess
import typing
from pathlib import Path
from typing import Any

import annotated_types
import hcl2
import pytest
from pydantic import BaseModel, ValidationError

from sparknet.cluster.aws import boto3_foundation, rules, terraform_foundation
from sparknet.cluster.spec import (
    INFRA_DIR,
    MAX_WORKERS,
    PREFIX_EXAMPLES,
    PREFIX_MAX_LENGTH,
    PREFIX_PATTERN,
    PREFIX_RULE,
    PREFIXES_APART_RULE,
    BootstrapSettings,
    ClusterSpec,
    check_prefixes,
)
from sparknet.config import load_datasets
from sparknet.data.s3 import S3Uri
from sparknet.data.store import open_store
from sparknet.errors import SparknetError
from tests.jobs.test_submit_parts import _submit_cli

#: the page that documents clusters: (its "Ranges" paragraph)
CLUSTERS_DOC = Path(__file__).resolve().parents[2] / "docs" / "clusters.md"

# -- numbers: each has a range ------------------------------------------------------------------


def _numbers(model: type[BaseModel]) -> dict[str, Any]:
    """The fields of `model` that hold a number (int or float, optional or not)."""
    out = {}
    for name, field in model.model_fields.items():
        kinds = typing.get_args(field.annotation) or (field.annotation,)
        if {int, float} & set(kinds) and bool not in kinds:
            out[name] = field
    return out


@pytest.mark.parametrize("model", [ClusterSpec, BootstrapSettings])
def test_every_number_of_a_cluster_spec_has_a_lower_and_an_upper_bound(model) -> None:
    numbers = _numbers(model)
    assert numbers, model
    for name, field in numbers.items():
        kinds = {type(m) for m in field.metadata}
        assert kinds & {annotated_types.Ge, annotated_types.Gt}, f"{name} has no lower bound"
        assert kinds & {annotated_types.Le, annotated_types.Lt}, f"{name} has no upper bound"


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        ({"workers": 10**12}, "workers"),
        ({"workers": MAX_WORKERS + 1}, "workers"),
        ({"workers": -1}, "workers"),
        ({"autostop_minutes": 1e20}, "autostop_minutes"),
        ({"autostop_minutes": 1e18}, "autostop_minutes"),
        ({"autostop_minutes": 10081}, "autostop_minutes"),
        ({"root_volume_gb": 16385}, "root_volume_gb"),
        ({"root_volume_gb": 7}, "root_volume_gb"),
        ({"bootstrap": {"worker_cores": 0}}, "bootstrap.worker_cores"),
        ({"bootstrap": {"worker_cores": 10**6}}, "bootstrap.worker_cores"),
        ({"bootstrap": {"worker_memory_mb": 2**40}}, "bootstrap.worker_memory_mb"),
        ({"bootstrap": {"gpus_per_node": 17}}, "bootstrap.gpus_per_node"),
        ({"bootstrap": {"master_port": 0}}, "bootstrap.master_port"),
        ({"bootstrap": {"master_ui_port": 65536}}, "bootstrap.master_ui_port"),
    ],
)
def test_numbers_out_of_range_are_refused(settings, field) -> None:
    with pytest.raises(ValidationError) as err:
        ClusterSpec(name="demo", **settings)
    (problem,) = err.value.errors()
    assert ".".join(map(str, problem["loc"])) == field


@pytest.mark.parametrize("model", [ClusterSpec, BootstrapSettings])
@pytest.mark.parametrize("value", [True, False])
def test_no_number_of_a_cluster_spec_takes_true_or_false(model, value) -> None:
    """YAML reads `yes`, `no`, `on`, `off` as true/false, which pydantic took as 1 and 0:
    `autostop_minutes: on` was one idle minute, `workers: yes` one worker."""
    for name in _numbers(model):
        settings = {"name": "demo", name: value} if model is ClusterSpec else {name: value}
        with pytest.raises(ValidationError, match=f"a number, not {str(value).lower()}") as err:
            model(**settings)
        (problem,) = err.value.errors()
        assert problem["loc"] == (name,)


def test_a_yes_for_a_number_in_the_settings_file_is_one_line_exit_2(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from sparknet.cli.cluster import cluster_app
    from sparknet.cluster import registry

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(registry.HOME_ENV, str(tmp_path / "home"))
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    (tmp_path / "sparknet.yaml").write_text("clusters:\n  c1: {autostop_minutes: on}\n")
    done = CliRunner().invoke(cluster_app, ["up", "c1"])
    assert done.exit_code == 2, done.stderr
    assert done.stderr == (
        "error: cluster c1: invalid setting autostop_minutes: a number, not true (got True)\n"
    )


def test_numbers_at_the_ends_of_their_ranges_are_accepted() -> None:
    low = ClusterSpec(name="demo", workers=0, autostop_minutes=0, root_volume_gb=8)
    high = ClusterSpec(name="demo", workers=MAX_WORKERS, autostop_minutes=10080,
                       root_volume_gb=16384)  # fmt: skip
    assert (low.workers, high.workers, high.autostop_minutes) == (0, 250, 10080)


def test_max_workers_fit_one_subnet_of_the_foundation() -> None:
    """Every worker of a cluster launches into one AZ's subnet; AWS keeps 5 of its addresses and
    the master may take one more."""
    addresses = 2 ** (32 - rules.network()["subnet_prefix"]) - 5
    assert addresses - 1 == MAX_WORKERS


def test_two_spark_daemons_on_one_port_are_refused() -> None:
    with pytest.raises(ValidationError, match="master_port and master_ui_port are both 8080"):
        BootstrapSettings(master_port=8080)
    with pytest.raises(ValidationError, match="master_ui_port and worker_ui_port are both 9000"):
        BootstrapSettings(master_ui_port=9000, worker_ui_port=9000)
    assert BootstrapSettings(master_port=8081, worker_ui_port=0).worker_ui_port == 0


def test_cluster_and_submit_flags_out_of_range_are_one_line_exit_2_before_anything(
    tmp_path, monkeypatch
) -> None:
    """`autostop_minutes: 1.0e+18` once passed (1e20 only failed as too big for an int) and
    crashed the master's timer (OverflowError) on a billed cluster; `--workers 10**12` passed.
    Refused in one line before AWS is asked anything (AWS is at a port nothing listens on)."""
    from typer.testing import CliRunner

    from sparknet.cli.cluster import cluster_app
    from sparknet.cluster import registry

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(registry.HOME_ENV, str(tmp_path / "home"))
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")

    (tmp_path / "sparknet.yaml").write_text(
        "clusters:\n  big: {autostop_minutes: 1.0e+18}\n  c1: {}\n"
    )
    cases = [
        (cluster_app, ["up", "c1", "--workers", str(10**12)], "c1", "workers"),
        (cluster_app, ["up", "c1", "--autostop", "100000"], "c1", "autostop_minutes"),
        (cluster_app, ["up", "big"], "big", "autostop_minutes"),
        # sparknet-submit names its own flag and what it counts
        (None, ["--s3", "s3://bkt/x", "--name", "c1", "--workers", str(10**12)], "c1",
         f"--workers {10**12} (worker instances)"),
        (None, ["--s3", "s3://bkt/x", "--name", "big"], "big", "autostop_minutes"),
    ]  # fmt: skip
    for app, args, name, field in cases:
        if app is None:
            done = _submit_cli(tmp_path, monkeypatch, *args)
        else:
            done = CliRunner().invoke(app, args)
        assert done.exit_code == 2, (args, done.stderr)
        what = field if field.startswith("--") else f"invalid setting {field}"
        line = f"error: cluster {name}: {what}: Input should be less than or equal"
        assert done.stderr.startswith(line), done.stderr
        assert len(done.stderr.splitlines()) == 1, done.stderr
    assert not (tmp_path / "home" / "clusters").exists() or not any(
        (tmp_path / "home" / "clusters").iterdir()
    )


def test_the_clusters_doc_states_the_ranges() -> None:
    text = " ".join(CLUSTERS_DOC.read_text().split())
    for words in (
        "`workers` 0-250",
        "`autostop_minutes` 0-10080",
        "`root_volume_gb` 8-16384",
        "`gpus_per_node` 0-16",
        "ports 1-65535",
    ):
        assert words in text, words


# -- the bucket's prefixes: one rule, two foundations -------------------------------------------

#: (data_prefix, runs_prefix, refused because): None when the pair is good
PREFIX_CASES = [
    ("datasets/", "runs/", None),
    ("team-a/data/", "team-a/runs/", None),
    ("data/", "data-runs/", None),
    ("v1.2/", "runs_2/", None),
    ("r", "runs/", "data_prefix must be a key prefix"),
    ("datasets/", "datasets/", "must not overlap"),
    ("r/", "r/uns/", "must not overlap"),
    ("datasets/", "datasets/runs/", "must not overlap"),
    ("runs/shared/", "runs/", "must not overlap"),
    ("", "runs/", "data_prefix must be a key prefix"),
    ("datasets/", "", "runs_prefix must be a key prefix"),
    ("datasets", "runs/", "data_prefix must be a key prefix"),
    ("/datasets/", "runs/", "data_prefix must be a key prefix"),
    ("datasets/", "runs//", "runs_prefix must be a key prefix"),
    ("data/../runs/", "runs/", "data_prefix must be a key prefix"),
    ("./", "runs/", "data_prefix must be a key prefix"),
    ("datasets/", "*/", "runs_prefix must be a key prefix"),
    ("d" * PREFIX_MAX_LENGTH + "/", "runs/", "data_prefix must be a key prefix"),
]
PREFIX_IDS = [f"{d[:20] or 'empty'}|{r or 'empty'}" for d, r, _ in PREFIX_CASES]


@pytest.mark.parametrize(("data", "runs", "why"), PREFIX_CASES, ids=PREFIX_IDS)
def test_prefix_rule(data: str, runs: str, why: str | None) -> None:
    if why is None:
        check_prefixes(data, runs)
        assert ClusterSpec(name="demo", data_prefix=data, runs_prefix=runs).runs_prefix == runs
        return
    with pytest.raises(ValueError, match=why):
        check_prefixes(data, runs)
    with pytest.raises(ValidationError, match=why):
        ClusterSpec(name="demo", data_prefix=data, runs_prefix=runs)


@pytest.mark.parametrize("data", ["r", "runs/x/"])
def test_both_foundations_refuse_overlapping_prefixes_before_any_call(data) -> None:
    """A spec changed past its validators (`model_copy`) is checked again by both foundations:
    the boto3 one before its first AWS call, Terraform's before its inputs are written."""
    spec = ClusterSpec(name="demo", bucket="sparknet-data").model_copy(update={"data_prefix": data})
    with pytest.raises(SparknetError, match=r"^cluster demo: data_prefix"):
        boto3_foundation.ensure_boto3(
            spec, allowed_cidr="203.0.113.7/32", endpoint_url="http://127.0.0.1:9"
        )
    with pytest.raises(SparknetError, match=r"^cluster demo: data_prefix"):
        terraform_foundation.terraform_variables(spec, "203.0.113.7/32")


def _variable(name: str) -> dict[str, Any]:
    options = hcl2.SerializationOptions(
        with_comments=False, explicit_blocks=False, strip_string_quotes=True
    )
    with (INFRA_DIR / "variables.tf").open() as f:
        blocks = hcl2.load(f, serialization_options=options)["variable"]
    return next(block[name] for block in blocks if name in block)


def test_terraform_states_the_prefix_rule_in_the_same_words() -> None:
    for name, example in PREFIX_EXAMPLES.items():
        first = _variable(name)["validation"][0]
        # hcl2 gives the strings as written in HCL: backslashes doubled
        assert first["error_message"] == PREFIX_RULE.format(name=name, example=example)
        assert f"length(var.{name}) <= {PREFIX_MAX_LENGTH}" in first["condition"]
        assert PREFIX_PATTERN.replace("\\", "\\\\") in first["condition"]
    apart = _variable("runs_prefix")["validation"][1]
    assert apart["error_message"] == PREFIXES_APART_RULE


@pytest.fixture(scope="module")
def variables_module(tmp_path_factory) -> Path:
    """infra/variables.tf alone: Terraform plans it offline (no provider), validations for real."""
    terraform = shutil.which("terraform")
    if terraform is None:
        pytest.fail("terraform is not on PATH: install Terraform >= 1.9 (infra/ needs it)")
    root = tmp_path_factory.mktemp("prefixes")
    shutil.copy(INFRA_DIR / "variables.tf", root)
    (root / "versions.tf").write_text('terraform {\n  required_version = ">= 1.9"\n}\n')
    subprocess.run([terraform, "init", "-input=false"], cwd=root, capture_output=True, check=True)
    return root


@pytest.mark.parametrize(("data", "runs", "why"), PREFIX_CASES, ids=PREFIX_IDS)
def test_terraform_applies_the_same_prefix_rule(variables_module, data, runs, why) -> None:
    inputs = {
        "cluster": "demo", "region": "us-east-1", "allowed_cidr": "203.0.113.7/32",
        "bucket": "sparknet-data", "data_prefix": data, "runs_prefix": runs,
    }  # fmt: skip
    (variables_module / "inputs.tfvars.json").write_text(json.dumps(inputs))
    result = subprocess.run(
        ["terraform", "plan", "-input=false", "-no-color", "-var-file=inputs.tfvars.json"],
        cwd=variables_module, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    if why is None:
        assert result.returncode == 0, result.stderr
        return
    assert result.returncode != 0
    said = " ".join(result.stderr.split())
    with pytest.raises(ValueError) as refused:
        check_prefixes(data, runs)
    # Terraform prints the rule's own words; Python's line is those words and the value refused
    rule = str(refused.value)[: str(refused.value).index(" Got ")]
    assert rule in said, said
    assert why in rule


# -- s3:// URIs ---------------------------------------------------------------------------------

BAD_URIS = [
    "s3://bkt\n/datasets/",
    "s3://bkt\n",
    "s3://bkt/../datasets/",
    "s3://bkt/runs/../datasets/x",
    "s3://bkt/./x",
    "s3://bkt/x/.",
    "s3://bkt//x",
    "s3://bkt/x//y/",
    "s3://bkt/x//",
    "s3://bkt//",
]


@pytest.mark.parametrize("uri", BAD_URIS)
def test_s3_uris_with_dot_dotdot_or_empty_parts_are_refused_in_one_line(uri: str) -> None:
    """A bucket name ending in a newline once passed (`$` matches before a final newline)."""
    why = "no valid bucket name" if "\n" in uri else "write it as s3://BUCKET/PREFIX with no"
    with pytest.raises(SparknetError, match=why) as err:
        S3Uri.parse(uri)
    assert "\n" not in str(err.value) and repr(uri) in str(err.value)
    with pytest.raises(SparknetError, match=why):
        open_store(uri, "http://127.0.0.1:9")


@pytest.mark.parametrize(
    ("uri", "why"),
    [
        ("s3://bkt/datasets/mnist ", "a space at the start or end of a part"),
        ("s3://bkt/datasets/ mnist/", "a space at the start or end of a part"),
        ("s3://bkt/datasets/mnist\n", "a control character"),
        ("s3://bkt/data\tsets/", "a control character"),
        ("s3://bkt/" + "é" * 513, "is 1026 bytes; S3 keys hold at most 1024"),
    ],
)
def test_s3_uris_with_a_pasted_space_a_control_character_or_too_long_a_key_are_refused(
    uri: str, why: str
) -> None:
    """`s3://b/datasets/mnist ` was the prefix `datasets/mnist /`, which an upload made and no
    listing tells apart from `datasets/mnist/`."""
    with pytest.raises(SparknetError, match=why) as err:
        S3Uri.parse(uri)
    assert "\n" not in str(err.value)


def test_s3_uris_with_spaces_inside_parts_and_any_letters_parse() -> None:
    assert S3Uri.parse("s3://bkt/my data/données/").key == "my data/données/"
    assert S3Uri.parse("s3://bkt/" + "é" * 512).key == "é" * 512


def test_a_bucket_name_ending_in_a_newline_is_refused_as_terraform_refuses_it() -> None:
    with pytest.raises(ValidationError, match="is not an S3 bucket name"):
        ClusterSpec(name="demo", bucket="sparknet-data\n")


@pytest.mark.parametrize(
    ("uri", "key"),
    [
        ("s3://bkt", ""),
        ("s3://bkt/", ""),
        ("s3://bkt/datasets/", "datasets/"),
        ("s3://bkt/a.b/..c/.d", "a.b/..c/.d"),
    ],
)
def test_s3_uris_without_such_parts_parse_as_before(uri: str, key: str) -> None:
    assert S3Uri.parse(uri) == S3Uri("bkt", key)


def test_a_dataset_entry_with_a_dotdot_uri_is_refused_naming_the_settings_file(tmp_path) -> None:
    path = tmp_path / "sparknet.yaml"
    path.write_text("datasets:\n  up: s3://bkt/runs/../datasets/\n")
    with pytest.raises(SparknetError, match=r"sparknet.yaml: datasets.up: .*'\.\.' part"):
        load_datasets(path)


def test_submit_refuses_a_dotdot_dataset_uri_before_anything(tmp_path, monkeypatch) -> None:
    (tmp_path / "sparknet.yaml").write_text("clusters:\n  c1: {}\n")
    done = _submit_cli(tmp_path, monkeypatch, "--s3", "s3://bkt/runs/../datasets", "--name", "c1")
    assert done.exit_code == 2, done.stderr
    assert done.stderr.startswith("error: 's3://bkt/runs/../datasets' has a '..' part")
    assert len(done.stderr.splitlines()) == 1
