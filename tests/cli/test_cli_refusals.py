"""Refusals of bad input that did not hold to the project's rule (one `error:` line, what to
fix, exit 2 for bad input): typer's own usage errors, a submit lock that cannot be made, and
`cluster down`'s question left unanswered or interrupted."""

from __future__ import annotations

import io

import pytest
import typer.testing
from typer.testing import CliRunner

from sparknet.cluster import ec2 as aws_provider
from sparknet.cluster import registry
from sparknet.errors import SparknetError
from sparknet.jobs import driver_control


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv(registry.HOME_ENV, str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    return tmp_path / "home"


def _one_error_line(done) -> str:
    assert done.exit_code == 2, done.output
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    return lines[0]


def test_a_flag_typer_refuses_is_one_error_line_exit_2() -> None:
    """A value of the wrong type, a value given to a switch, a misspelled option or command, a
    missing argument: one `error:` line naming the help (typer's own is a usage line, a hint
    and a box cut at 80 columns), exit 2, in every command."""
    from sparknet.cli import app
    from sparknet.cli.submit import submit_app

    runner = CliRunner()
    workers = _one_error_line(runner.invoke(submit_app, ["--s3", "s3://b-b/x", "--workers", "2.5"]))
    assert workers.startswith("error: Invalid value for '--workers': ")
    assert workers.endswith(" --help`)")  # (the runner names the program `root`)
    for args, said in (
        (["cluster", "down", "c1", "--yes=1"], "Option '--yes' does not take a value"),
        (["cluster", "down", "c1", "--Yes"], "No such option: --Yes"),
        (["cluster", "down"], "Missing argument 'NAME'"),
        (["train", "--rounds", "x"], "Invalid value for '--rounds'"),
    ):
        assert said in _one_error_line(runner.invoke(app, args)), args
    assert "Did you mean 'attach'" in _one_error_line(runner.invoke(submit_app, ["attch"]))


def test_a_submit_lock_that_cannot_be_made_is_one_line_exit_2(tmp_path, monkeypatch) -> None:
    """SPARKNET_HOME a file (or its submits/ not writable): one line naming the lock and the
    setting, exit 2, and `up` never reached (it was a traceback, exit 1)."""
    from sparknet.cli.submit import submit_app

    monkeypatch.chdir(tmp_path)
    (tmp_path / "home").write_text("")
    monkeypatch.setenv(registry.HOME_ENV, str(tmp_path / "home"))
    (tmp_path / "sparknet.yaml").write_text("clusters:\n  c1: {bucket: b-b}\n")
    ups: list[str] = []
    monkeypatch.setattr(aws_provider, "up", lambda spec, **kw: ups.append(spec.name))
    line = _one_error_line(CliRunner().invoke(submit_app, ["--s3", "s3://b-b/x"]))
    assert line == (
        f"error: cannot take the lock {tmp_path}/home/submits/c1.lock: Not a directory; make "
        "its directory writable, or set SPARKNET_HOME to a directory of yours"
    )
    assert ups == []
    lock = registry.held_lock(tmp_path / "home" / "x.lock", SparknetError)
    with pytest.raises(registry.LockUnavailable, match=r"cannot take the lock .*/home/x\.lock"):
        lock.__enter__()


class _CtrlC(io.BytesIO):
    """A terminal whose user presses Ctrl-C at the question."""

    def read(self, *args):
        raise KeyboardInterrupt

    read1 = readline = read

    def readinto(self, buffer):
        raise KeyboardInterrupt


def test_cluster_down_question_unanswered_or_interrupted_is_one_line(home, monkeypatch) -> None:
    """At `cluster down`'s question on a terminal: end of input (Ctrl-D) and Ctrl-C each leave
    the cluster up with one `error:` line (exit 1; 130 for Ctrl-C), not click's `Aborted.`."""
    from sparknet.cli.cluster import cluster_app, life

    downs: list[str] = []
    monkeypatch.setattr(aws_provider, "down", lambda spec, **kw: downs.append(spec.name))
    monkeypatch.setattr(driver_control, "jobs_on", lambda *args, **kwargs: ["R1"])
    monkeypatch.setattr(life, "_on_terminal", lambda: True)
    runner = CliRunner()
    eof = runner.invoke(cluster_app, ["down", "c1"], input="")
    assert eof.exit_code == 1, eof.output
    assert eof.stderr.splitlines()[-1] == (
        "error: no answer; cluster c1 not taken down: job R1 runs on; `--yes` takes it down "
        "without asking"
    )
    monkeypatch.setattr(typer.testing, "make_input_stream", lambda input, charset: _CtrlC())
    ctrl_c = runner.invoke(cluster_app, ["down", "c1"])
    assert ctrl_c.exit_code == 130, ctrl_c.output
    assert ctrl_c.stderr.splitlines()[-1] == (
        "error: interrupted; cluster c1 not taken down: job R1 runs on"
    )
    assert "Aborted" not in eof.stderr + ctrl_c.stderr and downs == []

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt  # Ctrl-C while the master is asked for its jobs

    monkeypatch.setattr(driver_control, "jobs_on", interrupted)
    asking = runner.invoke(cluster_app, ["down", "c1"])
    assert (asking.exit_code, asking.stderr) == (
        130,
        "error: interrupted; cluster c1 not taken down\n",
    )
    assert downs == []


def test_a_line_said_is_printed_as_it_is(capsys) -> None:
    """What `cluster up`/`down`, `ami bake` and `bench` relay (remote output, AWS errors) goes
    out as it came: rich's markup dropped `[sudo]` and raised MarkupError on `[/x]`."""
    from sparknet.cli.common import console

    line = "[sudo] password for ubuntu: [i-0abc] stopped; rm: cannot remove [/x]"
    console.print(line)
    assert capsys.readouterr().err == line + "\n"


def test_an_unknown_setting_of_a_cluster_or_dataset_lists_the_known_ones(home, tmp_path) -> None:
    """A misspelled key of a `clusters:` or `datasets:` entry named `sparknet train --help`,
    whose settings are other ones: the line lists the entry's own (a nested one's too)."""
    from sparknet.cli.cluster.options import cluster_spec
    from sparknet.config import load_datasets

    yaml = tmp_path / "sparknet.yaml"
    yaml.write_text("clusters:\n  c1: {ssh_user: x}\n  c2: {bootstrap: {foo: 1}}\n")
    with pytest.raises(SparknetError) as bad:
        cluster_spec("c1", yaml, {})
    assert str(bad.value).startswith("cluster c1: unknown setting 'ssh_user' (known: ")
    known = "autostop_minutes, availability_zones, backstop_minutes, bootstrap, bucket"
    assert known in str(bad.value)
    with pytest.raises(SparknetError, match=r"'bootstrap\.foo' \(known: gpus_per_node, "):
        cluster_spec("c2", yaml, {})
    yaml.write_text("datasets:\n  d: {uri: s3://a-b/c, nope: 1}\n")
    with pytest.raises(SparknetError) as bad:
        load_datasets(yaml)
    assert str(bad.value).endswith("datasets.d: unknown setting 'nope' (known: endpoint_url, uri)")


def test_a_submit_lock_leaves_no_file_and_a_killed_holder_blocks_nothing(home) -> None:
    """The submit lock's file goes with its holder (one was left under submits/ for every
    cluster name ever tried); one a killed submit left (kill -9) refuses nobody."""
    import subprocess
    import sys

    from sparknet.jobs import submit as flow

    path = flow.submit_lock_path("c1")
    with flow.submit_lock("c1"):
        assert path.exists()
        with (
            pytest.raises(flow.SubmitBusy, match="another sparknet-submit"),
            flow.submit_lock("c1"),
        ):
            pass
    assert not path.exists() and list(path.parent.iterdir()) == []
    code = (
        "from sparknet.jobs import submit as f\n"
        "with f.submit_lock('c1'):\n print(1, flush=True)\n input()"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert holder.stdout.readline() == b"1\n"
        with pytest.raises(flow.SubmitBusy, match=f"PID {holder.pid}"), flow.submit_lock("c1"):
            pass
    finally:
        holder.kill()
        holder.wait()
    assert path.exists()  # what kill -9 left
    with flow.submit_lock("c1"):
        pass
    assert not path.exists()


def test_a_submit_whose_ami_does_not_resolve_is_refused_before_up(
    home, bucket, tmp_path, monkeypatch
) -> None:
    """`cluster up` refuses an AMI parameter that does not exist before anything is made; a
    submit said `bringing cluster c1 up`, then `taking cluster c1 down`, exit 1. Now its
    preflight runs up's own checks: one line, exit 2, up never called, nothing written."""
    import boto3

    from sparknet.cli.submit import submit_app
    from tests.jobs.test_submitter import _dataset

    uri = _dataset(bucket)
    (tmp_path / "sparknet.yaml").write_text(
        f"clusters:\n  c1: {{bucket: {bucket}, data_prefix: ds/, ami_parameter: /no/such}}\n"
    )
    calls: list[str] = []
    monkeypatch.setattr(aws_provider, "up", lambda spec, **kw: calls.append(f"up {spec.name}"))
    monkeypatch.setattr(aws_provider, "down", lambda spec, **kw: calls.append(f"down {spec.name}"))
    line = _one_error_line(CliRunner().invoke(submit_app, ["--s3", uri]))
    assert line.startswith("error: SSM parameter /no/such does not exist in us-east-1"), line
    assert calls == []
    s3 = boto3.client("s3")
    assert s3.list_objects_v2(Bucket=bucket, Prefix="runs/")["KeyCount"] == 0


def test_an_option_before_a_submit_command_is_refused_where_it_would_be_dropped(home) -> None:
    """`sparknet-submit --s3 D evaluate RUN`: the group's options are a training job's; a
    command never saw them (it said `--s3` was missing, or ran without `--rounds`)."""
    from sparknet.cli.submit import submit_app

    runner = CliRunner()
    for args, said in (
        (["--s3", "tiny", "evaluate", "r"], "--s3 goes after the command: `sparknet-submit "
         "evaluate RUN --s3 ...`"),
        (["--rounds", "3", "predict", "r", "--s3", "x"], "--rounds is a training option; "
         "`sparknet-submit predict` scores the run's model"),
        (["--set", "a=b", "list"], "--set is for a new job; `sparknet-submit list` takes its "
         "options after it"),
        (["evaluate", "r"], "--s3 DATASET is required: the dataset to evaluate on"),
    ):  # fmt: skip
        assert said in _one_error_line(runner.invoke(submit_app, args)), args
