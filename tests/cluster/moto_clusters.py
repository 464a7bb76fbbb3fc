"""The clusters on moto that several test modules start from, made one way: a `ClusterSpec` with
its AMI parameter in moto's SSM (`moto_spec`), and a `clusters:` entry in ./sparknet.yaml whose
nodes are loopback sshd nodes with their own addresses and prefixes (`loopback_cluster`). Each is
a context manager that takes down what is left of its cluster when it ends; a test module's
fixture wraps it and adds what is its own."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from sparknet.cluster import ec2 as aws_provider
from sparknet.cluster import records, registry
from sparknet.cluster.spec import ClusterSpec
from tests.conftest import SPARKNET
from tests.moto_server import amazon_ami
from tests.sshd import MotoNodes, loopback_cluster_entry

REGION = "us-east-1"
#: the private addresses a loopback cluster's nodes bind (all of 127/8 is loopback on Linux)
ADDRESSES = {"master": "127.0.0.2", "worker-1": "127.0.0.3"}


def moto_ec2(region: str = REGION):
    import boto3  # slow to import: only the tests that reach moto pay for it

    return boto3.client("ec2", region_name=region)


def _put_ami_parameter(name: str, region: str) -> None:
    import boto3  # slow to import: only the tests that reach moto pay for it

    boto3.client("ssm", region_name=region).put_parameter(
        Name=name, Value=amazon_ami(region), Type="String", Overwrite=True
    )


def cli(*args: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    """`sparknet cluster ARGS` as a user runs it, in `cwd`."""
    return subprocess.run(
        [str(SPARKNET), "cluster", *args], cwd=cwd, env=os.environ.copy(),
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def up_signalled_at_bootstrap(name: str, cwd: Path, signum: int) -> tuple[subprocess.Popen, str]:
    """`sparknet cluster up NAME` started in `cwd` and sent `signum` once it says it is
    bootstrapping: the process (to `communicate` with) and its stderr until then."""
    proc = subprocess.Popen(
        [str(SPARKNET), "cluster", "up", name], cwd=cwd, env=os.environ.copy(),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if line.startswith("bootstrapping "):
            proc.send_signal(signum)
            break
    return proc, "".join(seen)


@contextlib.contextmanager
def moto_spec(
    endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, prefix: str,
    ami_parameter: str, region: str = REGION,
) -> Iterator[ClusterSpec]:  # fmt: skip
    """A spec of a g5.xlarge master and 2 g4dn.xlarge workers on moto at `endpoint`, named
    `prefix` and 8 random hex digits, its registry under `tmp_path`; taken down at the end."""
    monkeypatch.setenv(registry.HOME_ENV, str(tmp_path / "home"))
    _put_ami_parameter(ami_parameter, region)
    spec = ClusterSpec(
        name=f"{prefix}{uuid.uuid4().hex[:8]}", region=region, workers=2, master_type="g5.xlarge",
        instance_types=["g4dn.xlarge"], ami_parameter=ami_parameter,
        allowed_cidr="203.0.113.9/32", root_volume_gb=120,
    )  # fmt: skip
    try:
        yield spec
    finally:
        with contextlib.suppress(records.ClusterNotFound):
            aws_provider.down(spec, endpoint_url=endpoint)


@contextlib.contextmanager
def loopback_cluster(
    moto_nodes: Callable[[str, int], MotoNodes], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    *, prefix: str, ami_parameter: str, region: str = REGION, **changes: Any,
) -> Iterator[tuple[str, MotoNodes, dict[str, Any]]]:  # fmt: skip
    """A cluster of a master and one worker: its name (`prefix` and 8 random hex digits), its
    `MotoNodes` and its `clusters:` entry (`loopback_cluster_entry` with `changes` on top) in
    ./sparknet.yaml (cwd tmp_path), its registry under tmp_path, each node at its ADDRESSES
    address with its own prefix tmp_path/<node>. Whatever is left is taken down (`cluster
    down`) at the end."""
    monkeypatch.setenv(registry.HOME_ENV, str(tmp_path / "home"))
    _put_ami_parameter(ami_parameter, region)
    name = f"{prefix}{uuid.uuid4().hex[:8]}"
    entry = {**loopback_cluster_entry(region, ami_parameter), **changes}
    (tmp_path / "sparknet.yaml").write_text(yaml.safe_dump({"clusters": {name: entry}}))
    group = moto_nodes(name, 1)
    layout = json.loads(group.file.read_text())
    for node, address in ADDRESSES.items():
        layout[f"{name}/{node}/node"] = {"address": address, "prefix": str(tmp_path / node)}
    group.file.write_text(json.dumps(layout))
    try:
        yield name, group, entry
    finally:
        if registry.registered().get(name) is not None:
            cli("down", name, cwd=tmp_path, timeout=300)
