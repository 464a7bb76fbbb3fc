"""An installed sparknet can make a cluster: the wheel built from the repo carries infra/ (the
Terraform module and the shared rule and policy files) as package data, read from the install with
the repository nowhere on the path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sparknet.cluster.spark.wheel import build_wheel

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]

#: what the install must read back: rules and policies through rules.py, and the module's files
CHECK = """
import sys
from pathlib import Path
import sparknet
from sparknet.cluster.aws import rules
from sparknet.cluster.spec import INFRA_DIR
here = Path(sparknet.__file__).resolve()
assert here.is_relative_to(Path(sys.argv[1]).resolve()), here
assert INFRA_DIR.resolve().is_relative_to(Path(sys.argv[1]).resolve()), INFRA_DIR
ingress = [r["from_port"] for r in rules.security_group_rules("ingress")]
policy = rules.policy_document("instance-role", partition="aws", region="us-east-1",
    account="123456789012", bucket="b-data", data_prefix="datasets/", runs_prefix="runs/",
    cluster="demo")
print(ingress, rules.network()["az_count"], rules.bucket_settings()["versioning"],
      len(policy["Statement"]), sorted(p.name for p in INFRA_DIR.glob("*.tf")))
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The wheel the nodes get (`build_wheel`: from a copy of the repo's sources, no build/ or
    egg-info in the checkout), installed with --target into an empty directory."""
    root = tmp_path_factory.mktemp("wheel")
    wheel = build_wheel(REPO, root / "dist")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    target = root / "site"
    subprocess.run(
        [*pip, "install", "--no-deps", "--target", str(target), str(wheel.path)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    return target


def test_wheel_carries_infra_files_as_package_data(installed) -> None:
    infra = installed / "sparknet" / "cluster" / "infra"
    assert not infra.is_symlink() and infra.is_dir()
    have = {p.relative_to(infra).as_posix() for p in infra.rglob("*") if p.is_file()}
    want = {
        p.relative_to(REPO / "infra").as_posix()
        for p in (REPO / "infra").rglob("*")
        if p.is_file() and ".terraform/" not in p.as_posix() and not p.name.endswith("tfstate")
    }
    assert have == want


def test_an_installed_sparknet_reads_the_rules_without_the_repo(installed, tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PYTHONPATH"] = str(installed)
    result = subprocess.run(
        [sys.executable, "-c", CHECK, str(installed)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("[", 2)[1].startswith("22, 0]"), result.stdout
    assert "3 Enabled 5" in result.stdout and "'versions.tf'" in result.stdout


def test_the_package_links_infra_rather_than_copying_it() -> None:
    """One copy: sparknet/cluster/infra in the checkout is a link to infra/."""
    link = REPO / "sparknet" / "cluster" / "infra"
    assert link.is_symlink() and link.resolve() == (REPO / "infra").resolve()
