"""Shared fixtures: one real local Spark session for the whole test run."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SPARKNET = Path(sys.executable).with_name("sparknet")


@pytest.fixture(scope="session")
def spark(moto_endpoint):
    """local[2,2]: two task slots, and a failed task is retried once (local mode retries nothing
    unless told). Python workers run from the repo root, so `tests.helpers:...` imports there.
    The moto server starts first: Spark's Python workers inherit AWS_ENDPOINT_URL from the JVM."""
    from sparknet.training.session import start_session

    os.chdir(REPO)
    session = start_session("local[2,2]", workers=2)
    yield session
    session.stop()


@pytest.fixture
def sc(spark):
    return spark.sparkContext


@pytest.fixture(scope="session")
def moto_endpoint():
    """A real S3 API (moto's server) on localhost for the whole run.

    Spark executors and CLI subprocesses are other processes: they reach it only through
    `AWS_ENDPOINT_URL`, which is set here for them (an in-process mock would be invisible).
    """
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    _host, port = server.get_host_and_port()
    url = f"http://localhost:{port}"
    saved = {k: os.environ.get(k) for k in MOTO_ENV}
    os.environ.update(MOTO_ENV, AWS_ENDPOINT_URL=url)
    yield url
    server.stop()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


#: fake credentials and region for moto; AWS_ENDPOINT_URL is added by the fixture
MOTO_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_ENDPOINT_URL": "",
}


@pytest.fixture
def bucket(moto_endpoint):
    """A fresh, empty bucket on the moto server; its name."""
    import uuid

    import boto3

    name = f"test-{uuid.uuid4().hex[:12]}"
    s3 = boto3.client("s3", endpoint_url=moto_endpoint)
    s3.create_bucket(Bucket=name)
    yield name
