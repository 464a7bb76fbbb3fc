"""The one exception type users see, its words kept as data until a front end spells them.

An error's message names settings, never a front end's spelling of them: the template `lower
{@workers} or add executors` reads `lower --workers ...` on the command line, `lower workers=
...` from `sparknet.fit`. (A `sparknet.yaml` key is read by the command line, which spells it; a
bad value there reads `invalid setting workers: ...` for every front end.) This module is also
the one place that tells a permanent fault (no retry can heal it) from a transient one.
"""

from __future__ import annotations

import errno
import re
import string
from collections.abc import Callable, Iterable
from pathlib import PurePath
from typing import Any, Self

#: how a front end spells a setting named in a message: `(setting, value)` -> text; the value is
#: `NO_VALUE` where the message names the setting alone
Spelling = Callable[[str, Any], str]
#: the message told where a setting goes, not what value it takes (`lower {@workers}`)
NO_VALUE: Any = type(
    "NoValue",
    (),
    {"__repr__": lambda self: "NO_VALUE", "__reduce__": lambda self: "NO_VALUE"},
)()  # pickled by name: a `SettingError` with no value crosses from a task as the one NO_VALUE


def _plain(value: Any) -> Any:
    return str(value) if isinstance(value, PurePath) else value


#: what a message names that is no setting of `sparknet.fit`: the options of other commands
#: (`sparknet data shard --shard-mb`) and the command line's own `--set` and `--conf`; every
#: spelling writes them as the command line does, the one place they are given
COMMAND_ONLY = frozenset(
    {"set", "conf", "shard_mb", "max_side", "quality", "classes", "shards", "val_fraction"}
    | {"create_bucket"}
)

#: places a message points to, each front end's own words for them: the list of the training
#: settings, and how the `workers` setting is given to each command
PLACES: dict[str, dict[str, str]] = {
    "help": {"flag": "`sparknet train --help`", "keyword": "help(sparknet.fit)"},
    "workers_setting": {
        "flag": "the `workers` setting: train's --workers, sparknet-submit's --set workers=N",
        "keyword": "the workers= keyword",
    },
}


def _place(setting: str, value: Any, front_end: str) -> str | None:
    """A place's words in `front_end` (the command line's where it has no others); None for a
    setting."""
    words = PLACES.get(setting) if value is NO_VALUE else None
    return None if words is None else words.get(front_end, words["flag"])


def as_flag(setting: str, value: Any = NO_VALUE) -> str:
    """The command line's spelling: `--workers`, `--workers 5`, `--resume`, `--no-deterministic`
    (every CLI option is its setting's name with dashes)."""
    place = _place(setting, value, "flag")
    if place is not None:
        return place
    flag = "--" + setting.replace("_", "-")
    if value is NO_VALUE or value is True:
        return flag
    if value is False:
        return "--no-" + setting.replace("_", "-")
    return f"{flag} {_plain(value)}"


def as_keyword(setting: str, value: Any = NO_VALUE) -> str:
    """`sparknet.fit`'s spelling: `workers=`, `workers=5`, `out='runs/a'`, `resume=True`; a Spark
    setting (the command line's `--conf`) is the caller's own SparkSession's."""
    if setting == "conf":
        return "the SparkSession's " + ("conf" if value is NO_VALUE else str(_plain(value)))
    if setting in COMMAND_ONLY:
        return as_flag(setting, value)
    place = _place(setting, value, "keyword")
    if place is not None:
        return place
    return f"{setting}=" if value is NO_VALUE else f"{setting}={_plain(value)!r}"


class _Words(string.Formatter):
    """`str.format` with two more kinds of field: `{@setting}` and `{@setting=name}` (the setting
    with the value `name`, or the literal `True` / `False` for a switch), both spelt by the front
    end; a `SparknetError` given as a value is spelt the same way, and `{cause:line}` is an
    error's first line (a one-line report of it)."""

    def __init__(self, spelling: Spelling) -> None:
        self.spelling = spelling

    def get_field(self, field_name: str, args: Any, kwargs: Any) -> tuple[Any, str]:
        if not field_name.startswith("@"):
            return super().get_field(field_name, args, kwargs)
        setting, _, name = field_name[1:].partition("=")
        if not name:
            value = NO_VALUE
        elif name in ("True", "False"):
            value = name == "True"
        else:
            value = kwargs[name]
        return _Spelt(self.spelling(setting, value)), field_name

    def format_field(self, value: Any, format_spec: str) -> str:
        if isinstance(value, _Spelt):
            return str(value)
        if format_spec == "line" and isinstance(value, BaseException):
            return first_line(value, self.spelling)
        if isinstance(value, SparknetError):
            return format(value.worded(self.spelling), format_spec)
        return super().format_field(value, format_spec)


class _Spelt(str):
    """A setting already spelt: printed as it is."""


class SparknetError(Exception):
    """A problem with the user's input or environment; the CLI prints it without a traceback.

    `SparknetError(template, **values)`: a template with values is `str.format`-ed, settings in
    it written `{@workers}` or `{@workers=value}` (never `--workers`); user text (a path, a name)
    goes in as a value, never into the template itself, so its braces stay text. A template
    without values is plain text. `str()` spells settings as the command line does (the default
    front end); `worded(as_keyword)` for another, `respell` to change what `str()` gives.
    """

    spelling: Spelling = staticmethod(as_flag)
    #: lines shown under the message (a failed node's last output): no part of the one line
    #: that says what to fix, so a front end shows them apart (`with_details`)
    details: tuple[str, ...] = ()

    def __init__(self, template: str = "", /, **values: Any) -> None:
        super().__init__(template)
        self.template = template
        self.values = values

    def worded(self, spelling: Spelling) -> str:
        """The message with every setting spelt by `spelling`."""
        if not self.values and "{@" not in self.template:
            return self.template
        try:
            return _Words(spelling).format(self.template, **self.values)
        except (KeyError, IndexError, ValueError, AttributeError):  # a bad template still says it
            return self.template

    def respell(self, spelling: Spelling) -> SparknetError:
        """This error, spelling its settings (and those of errors among its values) with
        `spelling` from now on; the class, the cause and the traceback stay."""
        self.spelling = spelling
        for value in self.values.values():
            if isinstance(value, SparknetError):
                value.respell(spelling)
        return self

    def with_details(self, lines: Iterable[str]) -> Self:
        """This error with `lines` shown under its message (`str` ends with them)."""
        self.details = tuple(lines)
        return self

    def settings(self) -> list[str]:
        """The settings the message names, in order."""
        names = (f[1] for f in string.Formatter().parse(self.template) if f[1])
        try:
            return [n[1:].partition("=")[0] for n in names if n.startswith("@")]
        except ValueError:
            return []

    def __str__(self) -> str:
        return "\n".join([self.worded(self.spelling), *self.details])

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as template and values (a task's error reaches the driver still as data),
        whatever the subclass's own `__init__` takes."""
        return _rebuild, (type(self), self.template, self.values, dict(self.__dict__))


def _rebuild(cls: type[SparknetError], template: str, values: dict, state: dict) -> SparknetError:
    exc = cls.__new__(cls)
    SparknetError.__init__(exc, template, **values)
    exc.__dict__.update(state)
    return exc


class SettingError(SparknetError):
    """A setting's value that cannot work: `setting` and `value` say which, the template says why
    and what to set instead (`SettingError("{@workers=value} is more than ...; lower {@workers}",
    setting="workers", value=5000)`)."""

    def __init__(self, template: str, /, *, setting: str, value: Any = NO_VALUE, **values: Any):
        super().__init__(template, value=value, **values)
        self.setting, self.value = setting, value


class Placeholder(str):
    """A value the user fills in (`N`, `PATH`): written as it is in every spelling (`--rounds N`,
    `rounds=N`), never quoted as text."""

    def __repr__(self) -> str:
        return str(self)


class Line(str):
    """A line for the user that is no error (a warning, a status), kept as template and values as
    an error's message is: it reads as the command line spells it, so every callback that takes
    text takes it; `worded` spells it for another front end."""

    template: str
    values: dict[str, Any]

    def __new__(cls, template: str, /, **values: Any) -> Line:
        line = super().__new__(cls, SparknetError(template, **values).worded(as_flag))
        line.template, line.values = template, values
        return line

    def worded(self, spelling: Spelling) -> str:
        return SparknetError(self.template, **self.values).worded(spelling)

    def __reduce__(self) -> tuple[Any, ...]:
        return _line, (self.template, self.values)


def _line(template: str, values: dict[str, Any]) -> Line:
    return Line(template, **values)


def worded(text: str, spelling: Spelling) -> str:
    """`text` spelt by `spelling` where it is a `Line`; any other text as it is."""
    return text.worded(spelling) if isinstance(text, Line) else text


class PermanentTaskError(SparknetError):
    """Raised inside a Spark task for a fault that a retry cannot heal (a shard whose bytes differ
    from the manifest, a missing object): the task hands it back to the driver, which fails the run
    at once instead of letting Spark retry the task."""


class InputError(SparknetError):
    """A problem the user fixes in what they gave: an option, a setting, a file, a name or id
    that AWS would refuse or does not have. Commands that tell it apart from a failure on the
    way (AWS, a node, an interrupt) exit 2 for it, 1 for those."""


#: errnos no retry heals: the disk or the quota is full, the file system is read-only, access is
#: refused, the file is larger than the file system takes. A retried task or a restarted stage
#: meets the same answer (a full disk cost three stage restarts, ~90 s, before its error).
PERMANENT_ERRNOS = frozenset(
    {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG}
)

#: what a permanent fault's text looks like once it crossed a process as text (a Python worker's
#: traceback inside a Py4J error): sparknet's own errors, or an OSError with one of the errnos
_PERMANENT_TEXT = re.compile(
    r"\b(?:sparknet\.errors\.)?"
    r"(?:PermanentTaskError|SparknetError|SettingError|InputError|WriteRefused): "
    r"|\[Errno (?:" + "|".join(str(n) for n in sorted(PERMANENT_ERRNOS)) + r")\]"
)


class WriteRefused(PermanentTaskError):
    """A file the file system refused for good (`PERMANENT_ERRNOS`): one line naming the dir, the
    file and what to fix, raised on the driver and in tasks alike."""

    def __init__(self, where: str, name: str, exc: OSError) -> None:
        self.where, self.name, self.errno = where, name, exc.errno
        reason = exc.strerror or str(exc)
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            text = "{where} is full ({reason}) writing {name}: free space or use another {@out}"
        elif exc.errno == errno.EROFS:
            text = "{where} is on a read-only file system ({reason}) writing {name}: use a "
            text += "writable {@out}"
        elif exc.errno in (errno.EACCES, errno.EPERM):
            text = "{where} is not writable ({reason}) writing {name}: give this user write "
            text += "access to it or use another {@out}"
        else:
            text = "{where} refused {name} ({reason}): use another {@out}"
        super().__init__(text, where=where, name=name, reason=reason)


def first_line(exc: BaseException, spelling: Spelling | None = None) -> str:
    """The first non-empty line of an error's message (some begin with a newline), else its
    type's name: what a one-line report of it shows (a template's `{cause:line}`), its settings
    spelt by `spelling` (as `str` does, without one)."""
    try:
        text = exc.worded(spelling) if spelling and isinstance(exc, SparknetError) else str(exc)
    except Exception:  # a Py4J error's str asks the JVM, which may be gone: the type says enough
        text = ""
    return next((ln.strip() for ln in text.splitlines() if ln.strip()), type(exc).__name__)


def is_permanent(exc: BaseException) -> bool:
    """Whether a retry of what raised `exc` meets the same fault: sparknet's permanent and input
    errors, and an OSError with a `PERMANENT_ERRNOS` errno (itself or what caused it). Everything
    else (a lost executor, a dropped connection, a throttled call) may pass when retried."""
    seen: set[int] = set()
    at: BaseException | None = exc
    while at is not None and id(at) not in seen:
        seen.add(id(at))
        if isinstance(at, PermanentTaskError | InputError):
            return True
        if isinstance(at, OSError) and at.errno in PERMANENT_ERRNOS:
            return True
        at = at.__cause__ or at.__context__
    return False


def is_permanent_text(text: str) -> bool:
    """`is_permanent` for a fault known only by its text: a task's traceback in a Py4J error."""
    return _PERMANENT_TEXT.search(text) is not None


def no_such_directory(path: str | PurePath) -> SparknetError:
    """The one wording, in every command, for a directory that is not there (a dataset, a
    source to shard): `no such directory: PATH`, PATH as the user wrote it."""
    return SparknetError("no such directory: {path}", path=str(path))
