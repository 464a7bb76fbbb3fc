"""`--help` of every command and subcommand of `sparknet` and `sparknet-submit`, read at 80
columns (a log file's, a narrow terminal's): no option name cut (`--checkpoint-eve…`), every
option with a default shows it as `(default: X)`, every option says what it is; and the lists,
the usage lines and `--version` that go with them."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from sparknet.cli.commands import app
from sparknet.cli.settings import PANELS, flag_of, shown_default
from sparknet.cli.submit import submit_app
from sparknet.config import TrainConfig

PROGRAMS = {"sparknet": app, "sparknet-submit": submit_app}
#: an option's own lines end where a line starts with another option's name (after the column
#: of the `*` of a required one, where the panel has one)
_ROW = re.compile(r"^│ (?:\*  |   )?(-\S+)")


def _commands(command: Any, path: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], Any]]:
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        yield from _commands(sub, (*path, name))


def every_command() -> list[tuple[str, tuple[str, ...], Any]]:
    return [
        (program, path, command)
        for program, typer_app in PROGRAMS.items()
        for path, command in _commands(typer.main.get_command(typer_app), ())
    ]


def _help(program: str, path: tuple[str, ...]) -> str:
    done = CliRunner().invoke(
        PROGRAMS[program], [*path, "--help"], prog_name=program, env={"COLUMNS": "80"}
    )
    assert done.exit_code == 0, done.output
    return done.stdout


def _blocks(shown: str, command: Any) -> dict[str, str]:
    """Each option's lines of the help, by the option's first name: its names, type and help."""
    firsts = {p.opts[0]: p for p in command.params if p.opts[0].startswith("-")}
    blocks: dict[str, list[str]] = {}
    current = None
    for line in shown.splitlines():
        match = _ROW.match(line)
        if match and match.group(1) in firsts:
            current = match.group(1)
        if line.startswith(("╰", "╭")):
            current = None
        if current is not None:
            blocks.setdefault(current, []).append(line.strip("│ "))
    return {opt: " ".join(" ".join(lines).split()) for opt, lines in blocks.items()}


def _default(param: Any) -> str | None:
    """What an option's default is (None: none to show): click's own, or the training
    setting's the option leaves it to; a switch that is off unless given has none."""
    setting = getattr(param, "rich_help_panel", None) in PANELS.values()
    if setting and param.name in TrainConfig.model_fields:
        field = TrainConfig.model_fields[param.name]
        flag = flag_of(field)
        if flag is None:
            return None
        kind = bool if param.is_flag else str
        return shown_default(param.name, field, kind, negatable=flag.negatable)
    default = param.default
    if default in (None, [], ()) or (param.is_flag and not default):  # a switch off: none
        return None
    return str(default)


@pytest.mark.parametrize(
    ("program", "path", "command"),
    every_command(),
    ids=[" ".join((p, *path)) for p, path, _ in every_command()],
)
def test_help_at_80_columns_cuts_no_option_and_shows_every_default_and_help(
    program: str, path: tuple[str, ...], command: Any
) -> None:
    shown = _help(program, path)
    assert "…" not in shown, shown  # a name, a word or a default cut with an ellipsis
    words = set(re.findall(r"(?<![\w-])--?[\w][\w-]*", shown))
    options = [p for p in command.params if p.opts[0].startswith("-") and not p.hidden]
    for param in options:
        for name in (*param.opts, *param.secondary_opts):
            assert name in words, f"{name} is not shown whole:\n{shown}"
    blocks = _blocks(shown, command)
    missing = [
        p.opts[0] for p in options if not re.sub(r"\(default: .*?\)", "", p.help or "").strip()
    ]
    unshown = [
        f"{p.opts[0]} ({default}): {blocks[p.opts[0]]}"
        for p in options
        if (default := _default(p)) is not None and "default" not in blocks[p.opts[0]]
    ]
    assert (missing, unshown) == ([], []), f"no help: {missing}; no default shown: {unshown}"
    assert "{" not in shown.splitlines()[1], shown  # arguments as NAME, not {name}


def test_help_groups_the_submit_options_into_panels_and_shows_the_model_defaults() -> None:
    shown = _help("sparknet-submit", ())
    panels = re.findall(r"╭─ (.+?) ─", shown)
    assert panels[:3] == ["Options", "Job and cluster", "Model and data"], panels
    assert "Commands" in panels and "Training" in panels
    blocks = _blocks(shown, typer.main.get_command(submit_app))
    assert "(default: 30)" in blocks["--rounds"]
    assert "(default: 10)" in blocks["--tau"]
    assert "(default:" not in blocks["--deterministic"]  # a switch off unless given
    assert "(default: 2)" in blocks["--max-restarts"]


def test_a_group_lists_each_command_by_its_first_clause_whole() -> None:
    """A command's line in a group's list ends at a clause, not mid-sentence at a colon inside
    parentheses (`(idempotent: ...`), and every command of the group is in the group's help."""
    shown = _help("sparknet", ("cluster",))
    assert "(idempotent: a done step is skipped, and a cluster with nothing to do says so)" in (
        " ".join(re.sub(r"[│╭╰─]", " ", shown).split())
    )
    summary = shown.split("╭")[0]
    for name in typer.main.get_command(app).commands["cluster"].commands:
        assert name in summary, f"`cluster --help` does not name {name}"


def test_usage_names_arguments_in_capitals() -> None:
    assert "Usage: sparknet data shard [OPTIONS] SRC DEST" in _help("sparknet", ("data", "shard"))
    assert "Usage: sparknet cluster up [OPTIONS] NAME" in _help("sparknet", ("cluster", "up"))


@pytest.mark.parametrize("program", PROGRAMS)
def test_version(program: str) -> None:
    from importlib.metadata import version

    done = CliRunner().invoke(PROGRAMS[program], ["--version"])
    assert (done.exit_code, done.stdout) == (0, f"sparknet {version('sparknet')}\n")


def test_endpoint_url_reads_the_same_in_every_command() -> None:
    texts = {
        " ".join(param.help.split())
        for _, _, command in every_command()
        for param in command.params
        if "--endpoint-url" in param.opts
    }
    assert len({t.split(" (default")[0] for t in texts}) == 1, texts


def test_the_top_help_says_what_the_program_does_not_how_it_is_built() -> None:
    shown = " ".join(_help("sparknet", ()).split())
    assert "`sparknet train` (the main job on one machine)" in shown, shown
    for developer in ("module", "typer", "sparknet.cli"):
        assert developer not in shown, shown


def test_help_words_defaults_one_way_and_types_readably_at_60_columns() -> None:
    """No `(default: no-debug)` (a flag's name where a value goes), no `default X` or `(default
    X)` beside `(default: X)`, no `[required]` after a default, no `<list[str]>` or `<int
    range> [x>=0]` widening the type column; the machine options say what they default to."""
    from sparknet.cluster.spec import ClusterSpec

    for program, path, _ in every_command():
        done = CliRunner().invoke(
            PROGRAMS[program], [*path, "--help"], prog_name=program, env={"COLUMNS": "60"}
        )
        panels = done.stdout.partition("╭")[2]  # the options, not the command's description
        shown = " ".join(re.sub(r"[│╭╰─╮╯]", " ", panels).split())
        where = f"{program} {' '.join(path)}"
        assert not re.search(r"\(default: no-|\[required\]|<list\[|range>|\[x>", shown), where
        assert not re.search(r"(?<!\()default(?!: |\)|s)", shown.replace("(default)", "")), (
            where,
            re.findall(r".{30}(?<!\()default(?!: |\)|s).{20}", shown),
        )
    blocks = _blocks(_help("sparknet-submit", ()), typer.main.get_command(submit_app))
    fields = ClusterSpec.model_fields
    assert f"else {fields['workers'].default})" in blocks["--workers"]
    assert "else on-demand)" in blocks["--spot"] and fields["spot"].default is False
    types = ", ".join(fields["instance_types"].get_default(call_default_factory=True))
    assert f"else those of {types} the region offers)" in blocks["--instance-type"]
    train = _help("sparknet", ("train",))
    assert (
        "tau_max" in " ".join(train.split())
        and "(default: on)" not in train.split("--debug")[1][:80]
    )


def test_a_set_key_in_capitals_names_the_setting_meant() -> None:
    done = CliRunner().invoke(app, ["train", "--set", "TAU=4"])
    assert done.exit_code == 2, done.output
    assert "unknown setting 'TAU' (did you mean tau?)" in done.stderr, done.stderr
