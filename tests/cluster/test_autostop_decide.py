"""The autostop timer's decision (`autostop.decide`, `autostop.check`) from a real state dir
with mtimes set by hand and a clock passed in; `status_line` as `cluster status` prints it;
and the `autostop_minutes` setting. The AWS half runs against moto in
tests/cluster/test_autostop.py; here `check` gets a stand-in terminate function (the one
thing replaced), which records whom it was asked to terminate."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sparknet.cluster.aws import autostop
from sparknet.cluster.aws.autostop import Settings

NOW = 1_800_000_000.0  # 2027-01-15T08:00:00Z


def state(tmp_path: Path, minutes: int = 30, started_ago_s: float | None = 0) -> Path:
    """A state dir as the bootstrap and `run` leave it, `started` `started_ago_s` before NOW."""
    d = tmp_path / "autostop"
    (d / autostop.ACTIVITY).mkdir(parents=True)
    (d / autostop.SETTINGS).write_text(Settings("c1", "us-east-1", minutes).to_json())
    _age(d / autostop.ACTIVITY, 10 * 3600)
    if started_ago_s is not None:
        (d / autostop.STARTED).touch()
        _age(d / autostop.STARTED, started_ago_s)
    return d


def _age(path: Path, seconds: float) -> None:
    os.utime(path, (NOW - seconds, NOW - seconds), follow_symlinks=False)


def activity(d: Path, name: str, ago_s: float) -> None:
    (d / autostop.ACTIVITY / name).touch()
    _age(d / autostop.ACTIVITY / name, ago_s)
    _age(d / autostop.ACTIVITY, 10 * 3600)  # as if the file had been made long ago


def test_a_fresh_timer_waits_its_minutes_from_its_start(tmp_path) -> None:
    d = state(tmp_path, minutes=30, started_ago_s=60)
    got = autostop.decide(d, NOW)
    assert got.action == "wait"
    assert got.deadline == NOW - 60 + 30 * 60


def test_recent_activity_moves_the_deadline(tmp_path) -> None:
    d = state(tmp_path, minutes=30, started_ago_s=3 * 3600)
    activity(d, "job-r1", ago_s=5 * 60)
    activity(d, "submitter-1", ago_s=2 * 3600)
    got = autostop.decide(d, NOW)
    assert (got.action, got.deadline) == ("wait", NOW - 5 * 60 + 30 * 60)


def test_old_activity_is_past_the_deadline(tmp_path) -> None:
    d = state(tmp_path, minutes=30, started_ago_s=3 * 3600)
    activity(d, "job-r1", ago_s=31 * 60)
    got = autostop.decide(d, NOW)
    assert (got.action, got.deadline) == ("terminate", NOW - 60)
    assert got.settings == Settings("c1", "us-east-1", 30)


def test_a_stamp_removed_when_a_job_ends_counts_as_activity_then(tmp_path) -> None:
    """Removing a file changes its dir's mtime: the job's end is its last activity."""
    d = state(tmp_path, minutes=30, started_ago_s=3 * 3600)
    _age(d / autostop.ACTIVITY, 10 * 60)
    assert autostop.decide(d, NOW).deadline == NOW - 10 * 60 + 30 * 60


def test_minutes_zero_is_off_whatever_the_age(tmp_path) -> None:
    d = state(tmp_path, minutes=0, started_ago_s=30 * 86400)
    got = autostop.decide(d, NOW)
    assert (got.action, got.deadline) == ("off", None)
    asked: list[Settings] = []
    autostop.check(d, NOW, terminate=lambda s: asked.append(s) or [])
    assert asked == []
    assert autostop.status_line((d / autostop.DEADLINE).read_text(), NOW) == "autostop: off"


@pytest.mark.parametrize(
    "settings",
    [None, "{not json", '{"cluster": "c1", "region": "us-east-1", "minutes": -1}', "[]",
     '{"cluster": "", "region": "us-east-1", "minutes": 5}'],
)  # fmt: skip
def test_unreadable_settings_never_terminate(tmp_path, settings) -> None:
    d = state(tmp_path, minutes=1, started_ago_s=3600)
    if settings is None:
        (d / autostop.SETTINGS).unlink()
    else:
        (d / autostop.SETTINGS).write_text(settings)
    asked: list[Settings] = []
    got = autostop.check(d, NOW, terminate=lambda s: asked.append(s) or [])
    assert got.action == "error" and asked == []
    assert "settings.json" in got.why
    line = (d / autostop.LOG).read_text().splitlines()[-1]
    assert line.startswith("2027-01-15T08:00:00Z error: cannot read ")


def test_missing_stamps_fall_back_to_what_is_there(tmp_path) -> None:
    """No `started` stamp: the activity dir's own mtime; neither: an error, nothing done."""
    d = state(tmp_path, minutes=1, started_ago_s=None)
    assert autostop.decide(d, NOW).deadline == NOW - 10 * 3600 + 60
    (d / autostop.ACTIVITY).rmdir()
    got = autostop.decide(d, NOW)
    assert got.action == "error" and "no started stamp" in got.why


def test_a_dangling_activity_link_counts_by_its_own_mtime(tmp_path) -> None:
    d = state(tmp_path, minutes=30, started_ago_s=3 * 3600)
    link = d / autostop.ACTIVITY / "gone"
    link.symlink_to(tmp_path / "nowhere")
    _age(link, 60)
    _age(d / autostop.ACTIVITY, 10 * 3600)
    assert autostop.decide(d, NOW).deadline == NOW - 60 + 30 * 60


def test_check_terminates_past_the_deadline_and_records_it(tmp_path) -> None:
    d = state(tmp_path, minutes=1, started_ago_s=120)
    asked: list[Settings] = []
    got = autostop.check(d, NOW, terminate=lambda s: asked.append(s) or ["i-1", "i-2"])
    assert got.action == "terminate" and asked == [Settings("c1", "us-east-1", 1)]
    written = json.loads((d / autostop.DEADLINE).read_text())
    assert written["action"] == "terminate"
    assert (written["deadline"], written["checked"]) == (NOW - 60, NOW)
    line = (d / autostop.LOG).read_text().splitlines()[-1]
    assert line == (
        "2027-01-15T08:00:00Z terminate: idle past 07:59 UTC (last activity 07:58 UTC, 1 min);"
        " terminated i-1 i-2 of cluster c1 in us-east-1"
    )


def test_an_aws_error_is_one_log_line_and_retried_next_check(tmp_path) -> None:
    d = state(tmp_path, minutes=1, started_ago_s=120)

    def refuse(_s: Settings) -> list[str]:
        raise RuntimeError("TerminateInstances in us-east-1 failed:\nUnauthorizedOperation")

    got = autostop.check(d, NOW, terminate=refuse)
    assert got.action == "error"
    lines = (d / autostop.LOG).read_text().splitlines()
    assert lines[-1].endswith(
        "failed: TerminateInstances in us-east-1 failed: UnauthorizedOperation; retrying at the"
        " next check"
    )
    shown = autostop.status_line((d / autostop.DEADLINE).read_text(), NOW + 5)
    assert shown.startswith("autostop: due since 07:59 UTC, retrying: TerminateInstances")
    again = autostop.check(d, NOW + 30, terminate=lambda s: ["i-1"])
    assert again.action == "terminate"
    assert len((d / autostop.LOG).read_text().splitlines()) == 2


@pytest.mark.parametrize(
    ("written", "now", "line"),
    [
        ({"action": "wait", "deadline": NOW + 23 * 60, "checked": NOW - 10}, NOW,
         "autostop: in 23 min (08:23 UTC)"),
        ({"action": "wait", "deadline": NOW + 20, "checked": NOW}, NOW,
         "autostop: in 1 min (08:00 UTC)"),
        ({"action": "off", "deadline": None, "checked": NOW - 9999}, NOW, "autostop: off"),
        ({"action": "terminate", "deadline": NOW - 60, "checked": NOW}, NOW,
         "autostop: due since 07:59 UTC, terminating"),
        ({"action": "wait", "deadline": NOW + 600, "checked": NOW - 3600}, NOW,
         "autostop: unknown: the timer has not checked since 07:00 UTC"),
        ({"action": "error", "deadline": None, "checked": NOW, "why": "cannot read x"}, NOW,
         "autostop: unknown: cannot read x"),
    ],
)  # fmt: skip
def test_status_line(written, now, line) -> None:
    assert autostop.status_line(json.dumps(written), now) == line


def test_status_line_of_a_missing_or_broken_file() -> None:
    assert autostop.status_line(None, NOW).startswith("autostop: unknown: the master has no ")
    assert autostop.status_line("{", NOW).startswith("autostop: unknown: the deadline file is ")
    assert autostop.status_line('{"action": "wait"}', NOW).startswith("autostop: unknown: ")


def test_activity_command_touches_a_file_in_the_activity_dir(tmp_path) -> None:
    prefix = str(tmp_path / "pre fix")
    subprocess.run(["sh", "-c", autostop.activity_command(prefix, "job-r1")], check=True)
    assert (Path(autostop.state_dir(prefix)) / "activity" / "job-r1").is_file()
    with pytest.raises(ValueError):
        autostop.activity_command(prefix, "../x")
    autostop.record_activity(tmp_path / "state", "job-r2")
    stamp = tmp_path / "state" / "activity" / "job-r2"
    assert stamp.stat().st_mtime == pytest.approx(time.time(), abs=5)
    assert autostop.last_activity(tmp_path / "state") == pytest.approx(stamp.stat().st_mtime, abs=1)


def test_check_of_a_dir_that_is_not_there_is_one_line_exit_2(tmp_path) -> None:
    got = subprocess.run(
        [sys.executable, "-m", "sparknet.cluster.aws.autostop", "check", "--state",
         str(tmp_path / "none")],
        capture_output=True, text=True,
    )  # fmt: skip
    assert got.returncode == 2
    assert got.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'none'} is not a directory; give the timer's state dir"
    ]


def test_autostop_minutes_setting() -> None:
    from pydantic import ValidationError

    from sparknet.cluster.spec import ClusterSpec

    assert ClusterSpec(name="c1").autostop_minutes == 30
    assert ClusterSpec(name="c1", autostop_minutes=0).autostop_minutes == 0
    with pytest.raises(ValidationError, match="autostop_minutes"):
        ClusterSpec(name="c1", autostop_minutes=-1)
    static = {"name": "c1", "provider": "static", "hosts": ["h1"], "key_file": "/k"}
    with pytest.raises(ValidationError, match="autostop_minutes: EC2 settings"):
        ClusterSpec.model_validate({**static, "autostop_minutes": 5})


def test_a_cluster_whose_instances_autostop_ended_says_down_cleans_up(
    moto_endpoint, tmp_path, monkeypatch
) -> None:
    """The timer terminates instances only: a cluster with none live but its registry entry
    (or foundation) left shows in `cluster status` and `cluster list` as terminated, with the
    `down` that removes the rest (moto: the registry entry stands for what is left)."""
    from sparknet.cluster import registry
    from sparknet.cluster.spec import ClusterSpec
    from tests.conftest import SPARKNET

    monkeypatch.setenv(registry.HOME_ENV, str(tmp_path / "home"))
    registry.save_entry(ClusterSpec(name="idle1", region="us-east-1"), moto_endpoint)
    where = ["--region", "us-east-1", "--endpoint-url", moto_endpoint]
    # the hint carries the region and the endpoint given: followed, it reaches the same place
    down = f"sparknet cluster down idle1 --region us-east-1 --endpoint-url {moto_endpoint}"
    note = f"terminated (autostop?); `{down}` cleans up"

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(SPARKNET), "cluster", *args, *where], cwd=tmp_path, capture_output=True,
            text=True, timeout=120,
        )  # fmt: skip

    shown = cli("status", "idle1")
    assert shown.returncode == 1, shown.stderr
    assert shown.stdout == f"cluster idle1 has no live instances in us-east-1: {note}\n"
    listed = cli("list")
    assert listed.returncode == 0, listed.stderr
    assert [ln for ln in listed.stdout.splitlines() if ln.startswith("idle1\t")] == [
        f"idle1\t0 instances\t0 other resources\tregistered\towner -\t{note}"
    ]
