"""The training settings' options are built from their declaration in `TrainConfig`: each is
named as its setting with dashes (the spelling every message gives, `errors.as_flag`),
`sparknet train` and `sparknet-submit` offer every setting declared with a flag, and the
training page shows every option."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

import click
import pytest
import typer.main

from sparknet.cli.settings import flag_of, option_type
from sparknet.config import TrainConfig
from sparknet.errors import as_flag

FLAGGED = {name for name, field in TrainConfig.model_fields.items() if flag_of(field)}


def _train() -> click.Command:
    from sparknet.cli import app

    return typer.main.get_command(app).commands["train"]  # type: ignore[attr-defined]


def _submit() -> click.Command:
    from sparknet.cli.submit import submit_app

    return typer.main.get_command(submit_app)


@pytest.mark.parametrize("command", [_train, _submit], ids=["train", "submit"])
def test_every_option_of_a_setting_is_named_as_the_setting(command) -> None:
    options = [p for p in command().params if p.name in TrainConfig.model_fields]
    for option in options:
        assert option.opts == [as_flag(option.name)], option.name
        assert option.secondary_opts in ([], [as_flag(option.name, False)]), option.name


def test_train_and_submit_offer_every_setting_declared_with_a_flag() -> None:
    from sparknet.cli.submit import NOT_SHARED

    train = {p.name for p in _train().params}
    submit = {p.name for p in _submit().params}
    assert train & set(TrainConfig.model_fields) == FLAGGED
    own = {"workers", "endpoint_url"}  # submit's own: worker instances, the AWS endpoint
    assert submit & set(TrainConfig.model_fields) == (FLAGGED - NOT_SHARED) | own
    assert {"spark_conf", "progress_timeout_s", "fail_once"}.isdisjoint(FLAGGED)


def test_an_option_reads_its_settings_type_without_none_and_choices_as_text() -> None:
    assert option_type(int | None) is int
    assert option_type(Literal["sgd", "adamw"]) is str
    assert option_type(bool) is bool


def test_the_training_page_shows_every_option_of_train() -> None:
    """docs/training.md's usage block lists every option `sparknet train` takes."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "training.md").read_text()
    usage = page.split("## Usage", 1)[1].split("```")[1]
    shown = set(re.findall(r"--[a-z][a-z-]*", usage))
    assert {p.opts[0] for p in _train().params if p.opts} - shown == set()
