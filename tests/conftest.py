"""Shared fixtures: one real local Spark session for the whole test run."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SPARKNET = Path(sys.executable).with_name("sparknet")


@pytest.fixture(scope="session")
def spark():
    """local[2,2]: two task slots, and a failed task is retried once (local mode retries nothing
    unless told). Python workers run from the repo root, so `tests.helpers:...` imports there."""
    from sparknet.training.session import start_session

    os.chdir(REPO)
    session = start_session("local[2,2]", workers=2)
    yield session
    session.stop()


@pytest.fixture
def sc(spark):
    return spark.sparkContext
