"""The CLI's manners: a hint's command line carries the flags the user gave (followed, it reaches
the same endpoint), a misspelt `--set` key names the likeliest setting, an empty list says so,
the Ctrl-C line names the checkpoint kept and the command that continues, and the run's summary
says what its figures are."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
from rich.console import Console
from typer.testing import CliRunner

from sparknet.cli import app
from sparknet.cli.common import takes
from sparknet.cli.submit import submit_app
from sparknet.cluster import registry
from sparknet.say import Given, carrying, command_line

MOTO = "http://127.0.0.1:5000"


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv(registry.HOME_ENV, str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_the_hints_of_up_carry_the_endpoint_it_was_given(home, monkeypatch) -> None:
    """`cluster up nb1 --region us-east-1 --endpoint-url URL` names `down` and `bootstrap` with
    the same endpoint: following the hint without it failed with 'cannot reach AWS'."""
    from sparknet.cluster import provider

    info = SimpleNamespace(
        name="nb1", region="us-east-1", hosts=[], instances=[],
        cost=SimpleNamespace(describe=lambda: "$1.00/h"),
    )  # fmt: skip
    monkeypatch.setattr(provider, "of", lambda spec: SimpleNamespace(up=lambda s, **kw: info))
    done = CliRunner().invoke(
        app,
        ["cluster", "up", "nb1", "--region", "us-east-1", "--endpoint-url", MOTO, "--no-bootstrap"],
    )
    assert done.exit_code == 0, done.output
    where = f"--region us-east-1 --endpoint-url {MOTO}"
    assert f"`sparknet cluster down nb1 {where}` ends it" in done.stdout
    assert f"`sparknet cluster bootstrap nb1 {where}` finishes them" in done.stdout


def test_a_hint_carries_only_the_flags_its_command_takes() -> None:
    given = Given((("--config", "my.yaml"), ("--endpoint-url", MOTO), ("--region", "eu-west-1")))
    with carrying(Given(given.flags, takes)):
        down = command_line("sparknet cluster down", "nb1", region="us-east-1")
        listed = command_line("sparknet cluster list")
        attach = command_line("sparknet-submit attach", "20260101-000000-abcd")
    # the region the hint knows wins over the one given
    assert (
        down
        == f"sparknet cluster down nb1 --region us-east-1 --config my.yaml --endpoint-url {MOTO}"
    )
    assert (
        listed == f"sparknet cluster list --endpoint-url {MOTO} --region eu-west-1"
    )  # no --config
    assert (
        attach
        == f"sparknet-submit attach 20260101-000000-abcd --config my.yaml --endpoint-url {MOTO}"
    )
    assert (
        command_line("sparknet cluster down", "a b") == "sparknet cluster down 'a b'"
    )  # none given


def test_a_misspelt_set_key_names_the_setting_meant() -> None:
    for command_app, args in ((app, ["train"]), (submit_app, [])):
        done = CliRunner().invoke(command_app, [*args, "--set", "tua=3"])
        assert done.exit_code == 2, done.output
        assert "unknown setting 'tua' (did you mean tau?)" in done.stderr, done.stderr


def test_an_empty_list_says_so(home, monkeypatch) -> None:
    from sparknet.cluster import inventory

    monkeypatch.setattr(inventory, "tagged_clusters", lambda region, endpoint_url=None: {})
    clusters = CliRunner().invoke(app, ["cluster", "list", "--endpoint-url", MOTO])
    assert (clusters.exit_code, clusters.stdout) == (0, ""), clusters.output
    assert clusters.stderr == "no clusters in us-east-1 (none tagged there, none registered here)\n"
    jobs = CliRunner().invoke(submit_app, ["list"])
    assert (jobs.exit_code, jobs.stdout) == (0, ""), jobs.output
    assert jobs.stderr == "no jobs: this machine started or attached to none\n"


def test_the_interrupt_line_names_the_checkpoint_kept_and_the_resume_command(tmp_path) -> None:
    from sparknet.cli.train import _kept
    from sparknet.config import TrainConfig
    from sparknet.training import checkpoint

    cfg = TrainConfig(out=str(tmp_path / "run"))
    with carrying(Given((("--config", "my.yaml"),), takes)):
        assert _kept(cfg) == (
            f"no checkpoint was complete yet; `sparknet train --resume --out {cfg.out} --config "
            "my.yaml` starts the run again"
        )
        done = tmp_path / "run" / checkpoint.name(12)
        done.mkdir(parents=True)
        (done / checkpoint.MANIFEST).write_text("{}")
        assert _kept(cfg).startswith("round 12's checkpoint is kept; `sparknet train --resume")


def _row(rnd: int, samples: int, seconds: float, **more) -> dict:
    return {"round": rnd, "loss": 1.0, "samples": samples, "seconds": {"total": seconds},
            "elapsed_s": 10.0, **more}  # fmt: skip


def test_the_summary_leaves_round_1_out_of_samples_per_s_and_top5_of_few_classes() -> None:
    from sparknet.cli.train import _summary
    from sparknet.training.driver import RunResult

    evaluated = {"eval_loss": 0.5, "eval_accuracy": 0.9, "eval_top5": 1.0}
    rows = [_row(1, 100, 10.0), _row(2, 100, 1.0), _row(3, 100, 1.0, **evaluated)]
    console = Console(width=80, record=True)
    console.print(_summary(RunResult("runs/x", 3, rows), classes=5))
    text = console.export_text()
    assert re.search(r"samples/s \(after round 1\) +│ 100 ", text), text
    assert re.search(r"samples/s \(round 1, with start-up\) +│ 10 ", text), text
    assert "top-5" not in text
    console.print(_summary(RunResult("runs/x", 3, rows), classes=10))
    assert "test top-5" in console.export_text()


def test_a_table_title_is_not_wrapped_at_80_columns() -> None:
    from sparknet.bench.common import BenchReport, show_report
    from sparknet.cli.common import titled_table

    title = "a title longer than its two narrow columns are wide together"
    table = titled_table(title)
    table.add_column("a")
    table.add_row("1")
    console = Console(width=80, record=True)
    console.print(table)
    assert title in console.export_text()
    report = BenchReport(name="x", title=title, columns=["k"], rows=[{"k": 1}])
    show_report(report, console)
    assert console.export_text().count(title) == 1
