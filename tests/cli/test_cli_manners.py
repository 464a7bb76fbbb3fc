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


@pytest.mark.parametrize(
    ("loaded", "hinted", "refused", "carried"),
    [
        ("sparknet.cli.commands", "sparknet-submit cancel", "--region", "--config"),
        ("sparknet.cli.submit", "sparknet cluster list", "--config", "--region"),
    ],
)
def test_a_hint_naming_the_other_program_carries_only_what_that_command_takes(
    loaded: str, hinted: str, refused: str, carried: str
) -> None:
    """In a process that loaded one program only, a hint naming the other's command carries no
    flag that command would refuse: `sparknet cluster down`'s `sparknet-submit cancel RUN
    --region X` failed with `No such option: --region`."""
    import subprocess
    import sys

    code = (
        f"import {loaded}\nfrom sparknet.cli.common import takes\n"
        "from sparknet.say import Given, carrying, command_line\n"
        "given = Given((('--config', 'c.yaml'), ('--region', 'eu-west-1')), takes)\n"
        f"with carrying(given):\n    print(command_line({hinted!r}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert refused not in done.stdout and carried in done.stdout, done.stdout


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
    """Before the run's config.yaml is written, the command given starts it again (`--resume`
    of a dir with no config.yaml is refused); once written, `--resume` starts it over with its
    settings; after a checkpoint, it continues."""
    from sparknet.cli.train import _kept
    from sparknet.config import TrainConfig
    from sparknet.training import checkpoint

    cfg = TrainConfig(out=str(tmp_path / "run"), lr=0.07)
    with carrying(Given((("--config", "my.yaml"),), takes)):
        given = "sparknet train --lr 0.07 --config my.yaml"
        assert _kept(cfg, again=given) == (
            f"no checkpoint was complete yet; `{given}` starts the run again"
        )
        (tmp_path / "run").mkdir()
        (tmp_path / "run" / "config.yaml").write_text(cfg.to_yaml())
        assert _kept(cfg) == (
            f"no checkpoint was complete yet; `sparknet train --resume --out {cfg.out} --config "
            "my.yaml` starts the run again, as it was set"
        )
        done = tmp_path / "run" / checkpoint.name(12)
        done.mkdir(parents=True)
        (done / checkpoint.MANIFEST).write_text("{}")
        assert _kept(cfg).startswith("round 12's checkpoint is kept; `sparknet train --resume")


def test_the_command_given_is_rebuilt_as_typed() -> None:
    import typer

    from sparknet.cli.common import command_given

    seen: list[str] = []
    command = typer.Typer()

    @command.command()
    def train(
        name: str = typer.Argument(...),
        lr: float | None = typer.Option(None),
        set_: list[str] = typer.Option([], "--set"),  # noqa: B008
        resume: bool = typer.Option(False),
        workers: int = typer.Option(2),
    ) -> None:
        seen.append(command_given())

    args = ["a b", "--lr", "0.07", "--set", "tau=4", "--set", "x=y z", "--no-resume"]
    done = CliRunner().invoke(command, args, prog_name="sparknet train")
    assert done.exit_code == 0, done.output
    assert seen == ["sparknet train 'a b' --lr 0.07 --set tau=4 --set 'x=y z' --no-resume"]


def test_a_resume_before_the_first_checkpoint_starts_the_run_over(tmp_path) -> None:
    """`--resume` of a run dir whose run stopped before its first complete checkpoint (its
    config.yaml written) starts at round 0 with those settings, instead of `nothing to
    resume` (which the interrupt's own hint led to)."""
    from types import SimpleNamespace

    import torch

    from sparknet.config import TrainConfig
    from sparknet.training import driver
    from sparknet.training.rundir import RunDir

    cfg = TrainConfig(out=str(tmp_path / "run"), lr=0.07)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text(cfg.to_yaml())
    problem = SimpleNamespace(model=torch.nn.Linear(2, 2))
    begin = driver._initial_state(cfg, problem, RunDir.open(cfg.out, None), resume=True)
    assert begin.rounds == 0


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


def test_a_resumed_runs_samples_per_s_leaves_out_its_own_start_up_round() -> None:
    """A resume's first round pays the start-up too (round 16 at 58 samples/s counted as steady
    state): each process's first round is left out, and the resume's is the start-up row."""
    from sparknet.cli.train import _summary
    from sparknet.training.driver import RunResult

    rows = [_row(1, 100, 10.0), _row(2, 100, 1.0), _row(3, 100, 20.0), _row(4, 100, 1.0)]
    console = Console(width=100, record=True)
    console.print(_summary(RunResult("runs/x", 4, rows), classes=5, started_at=2))
    text = console.export_text()
    assert re.search(r"samples/s \(without start-up rounds 1, 3\) +│ 100 ", text), text
    assert re.search(r"samples/s \(round 3, with start-up\) +│ 5 ", text), text


def test_every_start_up_round_the_rows_mark_is_left_out_earlier_resumes_too() -> None:
    """Rows mark the first round of each process (and of a replay): a run resumed twice has
    three start-up rounds, and only the last process's is known without the mark."""
    from sparknet.cli.train import _summary
    from sparknet.training.driver import RunResult
    from sparknet.training.report import START_UP

    start = {START_UP: True}
    rows = [
        _row(1, 100, 10.0, **start), _row(2, 100, 1.0), _row(3, 100, 20.0, **start),
        _row(4, 100, 1.0), _row(5, 100, 50.0, **start), _row(6, 100, 1.0),
    ]  # fmt: skip
    console = Console(width=100, record=True)
    console.print(_summary(RunResult("runs/x", 6, rows), classes=5, started_at=4))
    text = console.export_text()
    assert re.search(r"samples/s \(without start-up rounds 1, 3, 5\) +│ 100 ", text), text
    assert re.search(r"samples/s \(round 5, with start-up\) +│ 2 ", text), text


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


def test_a_usage_error_is_one_line_with_rich_off_too() -> None:
    """`TYPER_USE_RICH=0` has typer let click show a refused flag (a usage line, `Try ...`,
    `Error: ...`): one `error:` line, exit 2, as with rich."""
    import os
    import subprocess
    import sys

    code = "import sys; from sparknet.cli import submit_main; sys.argv[0] = 'sparknet-submit'; "
    done = subprocess.run(
        [sys.executable, "-c", code + "submit_main()", "--wrkers", "2"],
        capture_output=True, text=True, env={**os.environ, "TYPER_USE_RICH": "0"},
    )  # fmt: skip
    assert (done.returncode, done.stdout) == (2, ""), done.stderr
    assert done.stderr.startswith("error: No such option: --wrkers"), done.stderr
    assert len(done.stderr.splitlines()) == 1, done.stderr
