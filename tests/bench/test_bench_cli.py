"""`sparknet bench`: every benchmark is a subcommand, each with its help; a bad option or an
unknown name is one line and exit 2, before anything is measured."""

import pytest
from typer.testing import CliRunner

from sparknet.cli import app

PAPER = ("sync", "scaling", "convergence", "peers")
ENGINE = (
    "throughput",
    "sync-cost",
    "data-stream",
    "images-per-core",
    "shard-workers",
    "precision",
    "startup",
)
ALL = (*PAPER, *ENGINE, "all")


def invoke(*args: str):
    # wide: rich wraps the help at the terminal's width, 80 columns when there is none
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})


def listed(help_text: str) -> set[str]:
    """The command names in the help's Commands box: the first word of each row that does not
    continue the description above it (those are indented further)."""
    rows, inside = set(), False
    for line in help_text.splitlines():
        body = line.strip().removeprefix("│")
        if "Commands" in line:
            inside = True
        elif inside and line.lstrip().startswith("╰"):
            break
        elif inside and body.startswith(" ") and body[1:2].strip():
            rows.add(body.split()[0])
    return rows


def test_bench_help_lists_every_subcommand():
    done = invoke("bench", "--help")
    assert done.exit_code == 0, done.output
    assert set(ALL) <= listed(done.output)


@pytest.mark.parametrize("name", (*ENGINE, "all"))
def test_each_new_subcommand_has_help(name):
    done = invoke("bench", name, "--help")
    assert done.exit_code == 0, done.output
    assert "--out" in done.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["all", "nope"], "unknown benchmark nope; choose from throughput, sync-cost"),
        (["shard-workers", "--small", "20", "--big", "10"], "--big takes a whole number >= 21"),
        (["startup", "--rounds", "1"], "--rounds takes a whole number >= 2, got 1"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, message):
    done = invoke("bench", *args, "--out", str(tmp_path / "b"))
    assert done.exit_code == 2, done.output
    assert message in done.output
    assert not any((tmp_path / "b").glob("*.json"))
