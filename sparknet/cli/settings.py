"""The training settings as command options, each built from its one declaration in `TrainConfig`.

A setting marked with a `Flag` becomes an option named as the setting with dashes (the spelling
`errors.as_flag` gives every message), typed as the setting without its range, and with no
default of its own: an option not given leaves the setting to `--set`, the environment, the
settings file or the model's default, and a value out of range is refused by the model, in the
same line whichever source it came from. Commands take the settings as `**settings`: typer
reads the parameters from the signature `with_settings` gives the function.
"""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Callable, Collection, Mapping
from typing import Any, Literal, TypeVar

import typer
from pydantic.fields import FieldInfo

from sparknet.config import Flag, TrainConfig
from sparknet.errors import as_flag, worded

F = TypeVar("F", bound=Callable[..., Any])

SetOption = typer.Option([], "--set", help="key=value, repeatable")
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
    option = typer.Option(None, decls, help=text)
    return inspect.Parameter(
        name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=kind | None
    )


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
            placed.extend(p for p in own if after.get(p.name) == name)
        placed.extend(p for p in own if p.name in last)
        func.__signature__ = inspect.Signature(placed)
        return func

    return decorate
