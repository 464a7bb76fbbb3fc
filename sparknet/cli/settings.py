"""The training settings as command options, each built from its one declaration in `TrainConfig`.

A setting marked with a `Flag` becomes an option named as the setting with dashes (the spelling
`errors.as_flag` gives every message), typed as the setting without its range, and with no
default of its own: an option not given leaves the setting to `--set`, the environment, the
settings file or the model's default, and a value out of range is refused by the model, in the
same line whichever source it came from. Commands take the settings as `**settings`: typer
reads the parameters from the signature `with_settings` gives the function.
"""

from __future__ import annotations

import copy
import difflib
import inspect
import re
import types
import typing
from collections.abc import Callable, Collection, Mapping
from typing import Any, Literal, TypeVar

import typer
from pydantic.fields import FieldInfo
from typer.models import OptionInfo

from sparknet.cli.common import ENDPOINT_HELP
from sparknet.config import Flag, TrainConfig
from sparknet.errors import SparknetError, as_flag, worded

F = TypeVar("F", bound=Callable[..., Any])


def known_sets(items: list[str]) -> list[str]:
    """`--set`'s values, each key a training setting: a misspelt one is refused naming the
    setting it is likeliest to mean (`tua=3`: did you mean tau?)."""
    for item in items:
        key, sep, _ = item.partition("=")
        key = key.strip().removeprefix("train.")
        if not sep or not key or key in TrainConfig.model_fields:
            continue  # a malformed item is the settings loader's to word
        close = difflib.get_close_matches(key.lower(), list(TrainConfig.model_fields), n=1)
        raise SparknetError(
            "unknown setting '{key}'{meant}; see {@help} for the settings",
            key=key, meant=f" (did you mean {close[0]}?)" if close else "",
        )  # fmt: skip
    return items


SetOption = typer.Option(
    [],
    "--set",
    help="a training setting as key=value, repeatable; also those with no option of their own "
    "(tau_share, tau_max, pack_workers, progress_timeout_s, ...: docs/how-it-works.md)",
)
#: the command line's way to `spark_conf`, one Spark setting at a time
ConfOption = typer.Option([], "--conf", help="Spark setting key=value, repeatable")


def flag_of(field: FieldInfo) -> Flag | None:
    """The `Flag` a setting is declared with; None for a setting with no option of its own."""
    return next((m for m in field.metadata if isinstance(m, Flag)), None)


def option_type(annotation: Any) -> type:
    """The type the command line reads a setting's value as: the setting's own, less `None`;
    a choice (`Literal`), or a number or a word (`tau`: 10 or auto), is read as text, so the
    model names the choices when one is wrong."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        kinds = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(kinds) > 1:
            return str
        annotation = kinds[0]
    if typing.get_origin(annotation) is Literal:
        return type(typing.get_args(annotation)[0])
    return annotation


def setting_option(name: str, field: FieldInfo, flag: Flag) -> inspect.Parameter:
    """The keyword parameter typer makes the setting's option of: `--name` (and `--no-name`
    for a negatable switch), its help the flag's own or else the setting's description."""
    kind = option_type(field.annotation)
    decls = as_flag(name)
    if kind is bool and flag.negatable:
        decls += "/" + as_flag(name, False)
    text = worded(flag.help, as_flag) if flag.help else field.description
    if name == "endpoint_url":  # worded as every command's `--endpoint-url`
        text = ENDPOINT_HELP
    text = default_worded(text)
    shown = shown_default(name, field, kind, negatable=flag.negatable)
    if shown is not None and "default" not in (text or ""):
        text = f"{text} (default: {shown})" if text else f"(default: {shown})"
    option = typer.Option(None, decls, help=text, rich_help_panel=panel_of(name))
    return inspect.Parameter(
        name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=kind | None
    )


def default_worded(text: str | None) -> str | None:
    """A setting's help with its default worded as every option's is, `(default: X)` at the end:
    not `(default X)`, `; default X`, `default: X` or a choice marked `constant (default)`."""
    if not text:
        return text
    text = re.sub(r"\(default (?!:)([^)]*)\)", r"(default: \1)", text)
    if (choice := re.search(r"([\w-]+) \(default\)", text)) is not None:
        text = text.replace(choice.group(0), choice.group(1)) + f" (default: {choice.group(1)})"
    if (tail := re.search(r"(?:^|; )default:? (.+)$", text)) is not None:
        head = text[: tail.start()]
        text = f"{head} (default: {tail.group(1)})" if head else f"(default: {tail.group(1)})"
    return text


def shown_default(name: str, field: FieldInfo, kind: type, *, negatable: bool) -> str | None:
    """The model's default as `--help` shows it (`30`, `auto`, `on`), the option
    itself having none (an option not given leaves the setting to the other sources); None
    where there is none to show: no default, or a switch that is off unless given."""
    if field.is_required() or field.default is None:
        return None
    default = field.default
    if kind is bool:  # a switch: on, or nothing where it is off unless given
        return "on" if negatable and default else None
    return str(default)


#: the panels `--help` groups the training settings in, each named at the first setting it holds
#: (in the model's order); a setting added later joins the panel of the settings before it
PANELS = {
    "model": "Model and data",
    "workers": "Training",
    "out": "Run dir and tracking",
    "master": "Spark and devices",
    "transport": "Exchange between workers",
}


def panel_of(name: str) -> str:
    """The `--help` panel of training setting `name` (`PANELS`)."""
    panel = "Training settings"
    for setting in TrainConfig.model_fields:
        panel = PANELS.get(setting, panel)
        if setting == name:
            return panel
    raise ValueError(f"no such training setting: {name}")


def with_settings(
    *,
    after: Mapping[str, str] | None = None,
    last: Collection[str] = (),
    leave_out: Collection[str] = (),
) -> Callable[[F], F]:
    """A command's own parameters, then an option per training setting with a `Flag` (but those
    in `leave_out`: settings the command sets itself), in the model's order. An own parameter
    named in `after` comes right after that setting instead (`--conf` where `spark_conf` is),
    and those in `last` after every setting; `--help` lists them in this order."""
    after = after or {}
    unknown = {*after.values(), *leave_out} - set(TrainConfig.model_fields)
    if unknown:  # a misspelt name would drop an option or keep one, silently
        raise ValueError(f"no such training setting: {sorted(unknown)}")

    def decorate(func: F) -> F:
        own = [
            p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
            for p in inspect.signature(func, eval_str=True).parameters.values()
            if p.kind is not inspect.Parameter.VAR_KEYWORD
        ]
        placed = [p for p in own if p.name not in after and p.name not in last]
        for name, field in TrainConfig.model_fields.items():
            flag = flag_of(field)
            if flag is not None and name not in leave_out:
                placed.append(setting_option(name, field, flag))
            placed.extend(_in_panel(p, panel_of(name)) for p in own if after.get(p.name) == name)
        placed.extend(p for p in own if p.name in last)
        func.__signature__ = inspect.Signature(placed)
        return func

    return decorate


def _in_panel(param: inspect.Parameter, panel: str) -> inspect.Parameter:
    """`param` shown in `panel` of `--help` (that of the setting it comes after), unless its
    option names one of its own; the option is copied, as one may serve several commands."""
    option = param.default
    if not isinstance(option, OptionInfo) or option.rich_help_panel is not None:
        return param
    option = copy.copy(option)
    option.rich_help_panel = panel
    return param.replace(default=option)
