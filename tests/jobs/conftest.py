"""The fixtures of the submitter's tests: the registry home and `up`/`down` recorders."""

from __future__ import annotations

import pytest

from sparknet.cluster import ec2 as aws_provider
from sparknet.cluster import registry
from sparknet.errors import SparknetError


@pytest.fixture
def home(tmp_path, monkeypatch):
    """The registry home (locks, job records) and the working dir under tmp_path."""
    monkeypatch.setenv(registry.HOME_ENV, str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    return tmp_path / "home"


@pytest.fixture
def launches(monkeypatch) -> list[str]:
    """`up` and `down` of every cluster, recorded: `up` then fails (nothing is really
    launched), `down` finds nothing."""
    calls: list[str] = []

    def up(spec, **kwargs):
        calls.append(f"up {spec.name}")
        raise SparknetError("up was called")

    def down(spec, **kwargs):
        calls.append(f"down {spec.name}")

    monkeypatch.setattr(aws_provider, "up", up)
    monkeypatch.setattr(aws_provider, "down", down)
    return calls
