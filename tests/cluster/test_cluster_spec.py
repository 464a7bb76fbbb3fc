"""ClusterSpec refuses, in one line, what would open the cluster to the internet or what AWS
refuses, before anything is made (the same limits as infra/variables.tf)."""

from __future__ import annotations

import os
import subprocess

import pytest
from pydantic import ValidationError

from sparknet.cluster.spec import MIN_SSH_PREFIX, ClusterSpec
from tests.conftest import SPARKNET


@pytest.mark.parametrize(
    ("cidr", "normalized"),
    [
        ("203.0.113.7", "203.0.113.7/32"),
        ("10.1.0.0/16", "10.1.0.0/16"),
        ("10.1.2.3/24", "10.1.2.0/24"),
    ],
)
def test_ssh_sources_of_16_or_narrower_are_accepted(cidr: str, normalized: str) -> None:
    assert ClusterSpec(name="demo", allowed_cidr=cidr).allowed_cidr == normalized


@pytest.mark.parametrize(
    ("cidr", "says"),
    [
        ("0.0.0.0/0", "open to 4,294,967,296 addresses"),
        ("0.0.0.0/1", "open to 2,147,483,648 addresses"),
        ("10.0.0.0/15", "give your own /32 or a network of /16 or narrower"),
        ("2001:db8::/32", "IPv6"),
        ("2001:db8::/64", "IPv4 only"),
        ("300.1.2.3/32", "is not an IPv4 CIDR"),
    ],
)
def test_wider_ssh_sources_are_refused(cidr: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        ClusterSpec(name="demo", allowed_cidr=cidr)
    assert MIN_SSH_PREFIX == 16


def test_cli_refuses_half_the_internet_in_one_line(tmp_path) -> None:
    """`cluster up --allowed-cidr 0.0.0.0/1`: exit 2, one line that says what to give; no AWS
    call is made (no endpoint or credentials are set)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env["HOME"] = str(tmp_path)
    result = subprocess.run(
        [str(SPARKNET), "cluster", "up", "demo", "--allowed-cidr", "0.0.0.0/1"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "0.0.0.0/1" in lines[0] and "/16 or narrower" in lines[0]
    assert "Traceback" not in result.stderr + result.stdout


@pytest.mark.parametrize("name", ["c2-", "a--b", "-ab", "2ab", "Ab", "a", "a" * 32, "a_b"])
def test_names_with_a_trailing_or_double_hyphen_or_outside_the_pattern_are_refused(name):
    with pytest.raises(ValueError, match="name"):
        ClusterSpec(name=name)


@pytest.mark.parametrize("name", ["c2", "a-b-c", "gpu-1", "a" * 31])
def test_names_of_letters_digits_and_single_inner_hyphens_are_accepted(name):
    assert ClusterSpec(name=name).name == name


# --- provider: static ----------------------------------------------------------------------------


def _static(**kw):
    return ClusterSpec(name="onprem", provider="static", key_file="/keys/id", **kw)


def test_a_static_clusters_workers_are_its_hosts_after_the_master() -> None:
    spec = _static(hosts=["alice@10.0.0.5:2222", "10.0.0.6", "gpu-box"])
    assert spec.workers == 2
    # what the registry stores reads back the same
    assert ClusterSpec.model_validate(spec.model_dump()).workers == 2


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"hosts": []}, "needs hosts"),
        ({"hosts": ["10.0.0.5"], "spot": True}, "spot: EC2 settings, not for `provider: static`"),
        (
            {"hosts": ["10.0.0.5"], "instance_types": ["p4d.24xlarge"], "allowed_cidr": "1.2.3.4"},
            "instance_types, allowed_cidr: EC2 settings",
        ),
        ({"hosts": ["10.0.0.5", "10.0.0.5:22"]}, "'10.0.0.5:22' is '10.0.0.5' again"),
        ({"hosts": ["a@@b"]}, "master: 'a@@b' is not an SSH address"),
        ({"hosts": ["10.0.0.5", "h:99999"]}, "worker-1: 'h:99999' is not an SSH address"),
        ({"hosts": ["10.0.0.5", "10.0.0.6"], "workers": 3}, "(2 hosts: workers 1), not 3"),
    ],
)
def test_a_static_cluster_refuses_what_it_cannot_honour(settings, message) -> None:
    with pytest.raises(ValidationError) as err:
        _static(**settings)
    assert message in str(err.value)


def test_a_static_cluster_needs_the_key_that_logs_in() -> None:
    with pytest.raises(ValidationError, match="needs key_file"):
        ClusterSpec(name="onprem", provider="static", hosts=["10.0.0.5"])


def test_hosts_are_refused_on_an_ec2_cluster() -> None:
    with pytest.raises(ValidationError, match="hosts and known_hosts are for `provider: static`"):
        ClusterSpec(name="demo", hosts=["10.0.0.5"])
