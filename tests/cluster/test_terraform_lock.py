"""infra/.terraform.lock.hcl: `terraform init` verifies the AWS provider it installs against the
lock file's hashes, on every platform users run it on.

Terraform records two kinds of hash (developer.hashicorp.com/terraform/language/files/
dependency-lock, "Checksum verification"): `h1:` over a package's unpacked files, for each
platform it was computed on, and `zh:`, the SHA-256 of each platform's release zip, which the
registry publishes for every platform in the release's signed SHA256SUMS. An init from a local
plugin directory (`-plugin-dir`, as on this machine) records only its own platform's `h1:`; with
that alone, an init on a Mac or an ARM machine finds no hash that matches its package and stops.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import hcl2
import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from sparknet.cluster.spec import INFRA_DIR

LOCK_FILE = INFRA_DIR / ".terraform.lock.hcl"
PROVIDER = "registry.terraform.io/hashicorp/aws"
PLUGIN_DIR = Path(os.environ.get("SPARKNET_TF_PLUGIN_DIR") or "/opt/tf-plugins")
#: the platforms users run `foundation: terraform` on; the registry publishes a zip for each
USER_PLATFORMS = ("darwin_amd64", "darwin_arm64", "linux_amd64", "linux_arm64", "windows_amd64")
HCL = hcl2.SerializationOptions(
    with_comments=False, explicit_blocks=False, strip_string_quotes=True
)


def _lock() -> dict:
    with LOCK_FILE.open() as f:
        (block,) = hcl2.load(f, serialization_options=HCL)["provider"]
    return block[PROVIDER]


def _required_version() -> str:
    with (INFRA_DIR / "versions.tf").open() as f:
        (settings,) = hcl2.load(f, serialization_options=HCL)["terraform"]
    return settings["required_providers"][0]["aws"]["version"]


def test_lock_file_carries_every_platforms_zip_hash() -> None:
    """A re-lock from one machine's plugin directory (one `h1:`, no `zh:`) fails here: lock with
    `terraform providers lock` from the registry, which records every platform's `zh:`."""
    hashes = _lock()["hashes"]
    zips = [h for h in hashes if h.startswith("zh:")]
    assert all(re.fullmatch(r"zh:[0-9a-f]{64}", h) for h in zips), zips
    assert len(set(zips)) == len(zips)
    assert len(zips) >= len(USER_PLATFORMS), (
        f"{LOCK_FILE} has {len(zips)} zh: hashes; it needs one per platform of the release "
        f"({', '.join(USER_PLATFORMS)} at least): run `terraform -chdir=infra providers lock "
        + " ".join(f"-platform={p}" for p in USER_PLATFORMS)
        + "`"
    )
    # and the h1: of this machine's platform, which an init from a plugin directory checks
    assert [h for h in hashes if h.startswith("h1:")], hashes


def test_locked_version_is_one_versions_tf_allows() -> None:
    lock = _lock()
    wanted = _required_version()
    assert Version(lock["version"]) in SpecifierSet(wanted.replace(" ", ""))
    # terraform writes the constraint it locked against, each version padded to three parts
    padded = re.sub(r"(\d+)\.(\d+)(?![.\d])", r"\1.\2.0", wanted)
    assert lock["constraints"] == padded


@pytest.mark.skipif(
    shutil.which("terraform") is None
    or not (PLUGIN_DIR / "registry.terraform.io" / "hashicorp" / "aws").is_dir(),
    reason=f"needs the terraform binary and the hashicorp/aws provider in {PLUGIN_DIR} "
    "(SPARKNET_TF_PLUGIN_DIR)",
)
def test_init_from_the_plugin_dir_accepts_the_lock_file_and_leaves_it_unchanged(
    tmp_path: Path,
) -> None:
    """This machine's package still matches the lock's `h1:` (a wrong one fails the init), and
    init rewrites nothing: the committed file is what Terraform itself would write."""
    module = tmp_path / "infra"
    shutil.copytree(INFRA_DIR, module, ignore=shutil.ignore_patterns(".terraform"))

    def init() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["terraform", "init", "-input=false", "-no-color", "-backend=false",
             f"-plugin-dir={PLUGIN_DIR}"],
            cwd=module, capture_output=True, text=True, timeout=300,
            env={**os.environ, "TF_DATA_DIR": str(tmp_path / "data")},
        )  # fmt: skip

    done = init()
    assert done.returncode == 0, done.stdout + done.stderr
    assert (module / LOCK_FILE.name).read_text() == LOCK_FILE.read_text()
    # the check is real: a lock whose h1: is not this package's refuses it
    text = LOCK_FILE.read_text()
    (h1,) = re.findall(r'"(h1:[^"]+)"', text)
    (module / LOCK_FILE.name).write_text(text.replace(h1, "h1:" + "A" * 43 + "="))
    refused = init()
    assert refused.returncode != 0
    assert "doesn't match any of the checksums" in " ".join(refused.stderr.split())
