"""The shell scripts and configuration templates this package ships as files, read by name."""

from __future__ import annotations

from importlib import resources
from string import Template


def script(name: str) -> str:
    """The text of `scripts/<name>`: a step that runs before the wheel is on the node."""
    return resources.files(__package__).joinpath("scripts", name).read_text()


def template(name: str, **values: object) -> str:
    """`templates/<name>` filled with `values` (`string.Template`: `$name` fields, `$$` for a
    dollar sign), so a configuration file reads as the file it becomes."""
    text = resources.files(__package__).joinpath("templates", name).read_text()
    return Template(text).substitute({k: str(v) for k, v in values.items()})
