"""The spot interruption notice as a node reads it (`sparknet.cluster.aws.spot`), against the
stand-in metadata service of tests/imds.py (IMDS runs only on EC2 hosts: nothing real answers
here), and the loss check's interval setting."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from sparknet.cluster import repair
from sparknet.cluster.aws import spot
from sparknet.errors import SparknetError
from tests.imds import ImdsStandIn
from tests.sshd import free_port

NOTICE = {"action": "terminate", "time": "2026-12-02T08:22:00Z"}


@pytest.fixture
def imds():
    stand_in = ImdsStandIn()
    yield stand_in
    stand_in.close()


def test_no_notice_then_the_notice_with_a_session_token(imds) -> None:
    assert spot.notice(imds.endpoint("i-1")) is None
    imds.notices["i-1"] = NOTICE
    assert spot.notice(imds.endpoint("i-1")) == spot.Notice("terminate", "2026-12-02T08:22:00Z")
    assert spot.notice(imds.endpoint("i-2")) is None  # another instance's own metadata
    # IMDSv2: a token PUT before every read (the stand-in answers 401 to a read without one)
    assert [m for m, _ in imds.requests] == ["PUT", "GET"] * 3


def test_the_endpoint_setting_and_no_proxy(imds, monkeypatch) -> None:
    imds.notices["i-1"] = NOTICE
    monkeypatch.setenv(spot.ENDPOINT_ENV, imds.endpoint("i-1").rstrip("/"))
    # a proxy would answer for another machine: the link-local service is asked directly
    monkeypatch.setenv("http_proxy", f"http://127.0.0.1:{free_port()}")
    assert spot.endpoint() == imds.endpoint("i-1")
    assert spot.notice() == spot.Notice(**NOTICE)
    monkeypatch.delenv(spot.ENDPOINT_ENV)
    assert spot.endpoint() == spot.DEFAULT_ENDPOINT
    for bad in ("169.254.169.254", "http://[::1", "ftp://x/"):
        monkeypatch.setenv(spot.ENDPOINT_ENV, bad)
        with pytest.raises(SparknetError, match=rf"^{spot.ENDPOINT_ENV}=.* is not an http:// URL$"):
            spot.endpoint()


def test_a_service_that_is_no_imds_is_a_one_line_error(imds) -> None:
    with pytest.raises(SparknetError, match=r"instance metadata at .*: unreachable"):
        spot.notice(f"http://127.0.0.1:{free_port()}/", timeout=1)
    # a notice read wrong would terminate a worker: anything but IMDS's object is an error
    for odd in ({"when": "soon"}, {"action": None, "time": None}, [NOTICE], {**NOTICE, "time": 1}):
        imds.notices["i-1"] = odd
        with pytest.raises(SparknetError, match=r"^instance metadata at .*: not an interruption"):
            spot.notice(imds.endpoint("i-1"))
    # any answer but the notice or its 404 is no "no notice"
    imds.notices["i-1"] = NOTICE
    imds.refuse_tokens = True
    with pytest.raises(SparknetError, match=r"instance metadata at .*: HTTP 401 Unauthorized$"):
        spot.notice(imds.endpoint("i-1"))


def test_the_node_command_prints_the_notice_as_json(imds) -> None:
    def node(instance: str) -> subprocess.CompletedProcess:
        env = {"PATH": "/usr/bin:/bin", spot.ENDPOINT_ENV: instance}
        return subprocess.run(
            [sys.executable, "-m", "sparknet.cluster.aws.spot"], env=env, capture_output=True,
            text=True, timeout=60,
        )  # fmt: skip

    imds.notices["i-1"] = NOTICE
    got = node(imds.endpoint("i-1"))
    assert (got.returncode, json.loads(got.stdout)) == (0, NOTICE)
    assert spot.parse(got.stdout) == spot.Notice(**NOTICE)
    none = node(imds.endpoint("i-2"))
    assert (none.returncode, none.stdout, spot.parse(none.stdout)) == (0, "{}\n", None)
    dead = node(f"http://127.0.0.1:{free_port()}/")
    assert dead.returncode == 1 and dead.stdout == ""
    assert dead.stderr.startswith("error: instance metadata at http://127.0.0.1:")
    assert len(dead.stderr.splitlines()) == 1


def test_the_loss_check_interval(monkeypatch) -> None:
    monkeypatch.delenv(repair.CHECK_EVERY_ENV, raising=False)
    assert repair.check_every_s() == repair.CHECK_EVERY_S == 30
    monkeypatch.setenv(repair.CHECK_EVERY_ENV, "2.5")
    assert repair.check_every_s() == 2.5
    for bad in ("0", "-1", "soon", "inf", "nan"):
        monkeypatch.setenv(repair.CHECK_EVERY_ENV, bad)
        with pytest.raises(SparknetError, match=rf"^{repair.CHECK_EVERY_ENV}='{bad}': give a "):
            repair.check_every_s()
