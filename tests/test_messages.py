"""No module below the front ends (`cli/`, `bench/`) names a command-line flag in a message.

The engine's messages name settings (`{@workers}`), which each front end spells its own way
(`--workers`, `workers=`, the YAML key); a literal `--workers` in the engine reads wrong from
`sparknet.fit`. Read with `ast`, the flags taken from the typer apps themselves (a new option is
covered the day it is added). A message is the text given to `raise X(...)`, to a sparknet error's
constructor (or its `super().__init__` call), or to `say`, `warn`, `print` or a logging call;
a local name in it stands for what is assigned to it, a call of the module's own function for
what that returns.

A flag inside a command line the message quotes is that command's, not a setting: a span in
backquotes (`` `sparknet cluster down NAME --region R` ``) or one that starts with a program's
name at the start of the text or of a parenthesis (`(aws ec2 describe-images --region R)`).
An error wrapped into another stays data too (`{cause}`), spelt by the front end that words it.
"""

from __future__ import annotations

import ast
import pickle
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import typer

from sparknet.errors import SettingError, SparknetError, as_keyword

PACKAGE = Path(__file__).resolve().parents[1] / "sparknet"
#: where settings are spelt as flags: the command line's own modules
FRONT_ENDS = ("cli", "bench")
#: functions whose text a user reads: say/warn lines, progress and log lines
MESSAGE_CALLS = frozenset(
    {"say", "warn", "warning", "on_warning", "on_status", "print"}
    | {"debug", "info", "error", "exception", "critical", "log"}
)
#: programs whose command lines a message may quote (their flags are theirs)
PROGRAMS = ("aws", "sparknet", "sparknet-submit", "spark-submit", "pip", "python", "ssh")
_FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
_COMMAND = re.compile(
    r"`[^`]*`|(?:^|(?<=\())\s*(?:" + "|".join(map(re.escape, PROGRAMS)) + r")\s[^)]*"
)
#: what a value interpolated into an f-string reads as here
_HOLE = "{}"


def cli_flags() -> frozenset[str]:
    """Every long option of `sparknet` and `sparknet-submit`, both sides of a switch."""
    from sparknet.cli.commands import app  # lazy: typer apps import every command
    from sparknet.cli.submit import submit_app  # lazy: as above

    found: set[str] = set()
    todo = [typer.main.get_command(app), typer.main.get_command(submit_app)]
    while todo:
        command = todo.pop()
        for param in command.params:
            found.update(o for o in [*param.opts, *param.secondary_opts] if o.startswith("--"))
        todo.extend(getattr(command, "commands", {}).values())
    return frozenset(found)


def error_classes(trees: list[ast.Module]) -> set[str]:
    """Names of the package's `SparknetError` subclasses (by their bases' names, to a fixed
    point: a class deriving from one of them is one too)."""
    found = {"SparknetError"}
    classes = [n for tree in trees for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
    while True:
        more = {
            c.name
            for c in classes
            if c.name not in found and any(_name(b) in found for b in c.bases)
        }
        if not more:
            return found
        found |= more


def _name(node: ast.expr) -> str:
    """`f` of a call to `f`, `x.f`, `x.y.f`; "" for anything else."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


class _Texts:
    """The literal texts a message's expression can read as, an f-string whole with its values
    as holes. A local name stands for what is assigned to it in the function, a call of one of
    the module's functions for what that function returns; the strings of a list or tuple
    literal are a program's arguments, not words."""

    def __init__(self, tree: ast.Module) -> None:
        self.functions = {
            f.name: f for f in tree.body if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
        }

    def of(
        self, node: ast.expr, scope: ast.AST, seen: frozenset[str] = frozenset()
    ) -> Iterator[str]:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.value
            return
        if isinstance(node, ast.List | ast.Tuple | ast.Set):
            return
        if isinstance(node, ast.JoinedStr):
            yield "".join(v.value if isinstance(v, ast.Constant) else _HOLE for v in node.values)
        if isinstance(node, ast.Name) and node.id not in seen:
            for value in _assigned(scope, node.id):
                yield from self.of(value, scope, seen | {node.id})
        if isinstance(node, ast.Call) and _name(node.func) in self.functions:
            name = _name(node.func)
            if isinstance(node.func, ast.Name) and name not in seen:
                function = self.functions[name]
                for ret in ast.walk(function):
                    if isinstance(ret, ast.Return) and ret.value is not None:
                        yield from self.of(ret.value, function, seen | {name})
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.expr) and not (
                isinstance(node, ast.JoinedStr) and isinstance(child, ast.Constant)
            ):
                yield from self.of(child, scope, seen)


def _assigned(scope: ast.AST, name: str) -> Iterator[ast.expr]:
    """The values assigned (`=`, `+=`, `: T =`) to `name` in `scope`."""
    for node in ast.walk(scope):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        else:
            continue
        if node.value is not None and any(
            isinstance(t, ast.Name) and t.id == name for t in targets
        ):
            yield node.value


def messages(tree: ast.Module, errors: set[str]) -> Iterator[tuple[int, str]]:
    """(line, text) of every message in a module."""
    texts = _Texts(tree)
    scopes: list[tuple[ast.AST, ast.ClassDef | None]] = [(tree, None)]
    seen: set[int] = set()
    while scopes:
        scope, klass = scopes.pop()
        for node in ast.iter_child_nodes(scope):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                scopes.append((node, node if isinstance(node, ast.ClassDef) else klass))
                continue
            raised = {id(n.exc) for n in ast.walk(node) if isinstance(n, ast.Raise)}
            for call in (n for n in ast.walk(node) if isinstance(n, ast.Call)):
                if id(call) in seen or not _is_message(call, id(call) in raised, klass, errors):
                    continue
                seen.add(id(call))
                for arg in [*call.args, *(k.value for k in call.keywords)]:
                    yield from ((call.lineno, text) for text in texts.of(arg, scope))


def _is_message(call: ast.Call, raised: bool, klass: ast.ClassDef | None, errors: set[str]) -> bool:
    name = _name(call.func)
    if raised or name in MESSAGE_CALLS or name in errors:
        return True
    # `super().__init__(text)` in a sparknet error class
    made = call.func.value if isinstance(call.func, ast.Attribute) else None
    is_super = isinstance(made, ast.Call) and _name(made.func) == "super"
    return is_super and klass is not None and klass.name in errors


def flags_named(text: str, flags: frozenset[str]) -> list[str]:
    """The sparknet flags a message's text names, leaving out quoted command lines."""
    return [f for f in _FLAG.findall(_COMMAND.sub(" ", text)) if f in flags]


def engine_modules() -> list[Path]:
    """Every module of the package but the front ends'."""
    return [
        p
        for p in sorted(PACKAGE.rglob("*.py"))
        if p.relative_to(PACKAGE).parts[0] not in FRONT_ENDS
    ]


def offences(paths: list[Path], flags: frozenset[str]) -> list[str]:
    """`path:line: flags in 'text'` for every message naming a flag."""
    trees = {path: ast.parse(path.read_text(), str(path)) for path in paths}
    errors = error_classes(list(trees.values()))
    found = []
    for path, tree in trees.items():
        for line, text in messages(tree, errors):
            named = flags_named(text, flags)
            if named:
                where = path.relative_to(PACKAGE.parent)
                found.append(f"{where}:{line}: {', '.join(named)} in {text!r}")
    return sorted(set(found))


def test_the_flags_come_from_both_commands():
    flags = cli_flags()
    assert {"--workers", "--no-resume", "--keep", "--cluster", "--region"} <= flags


@pytest.mark.parametrize(
    ("source", "named"),
    [
        ('raise ValueError(f"pass --workers {n}")', ["--workers"]),
        ('raise SettingError("lower --workers", setting="workers")', ["--workers"]),
        ('x = SettingError("lower --workers", setting="workers")', ["--workers"]),
        ('say("warning: no --keep given")', ["--keep"]),
        ('log.warning("use --keep")', ["--keep"]),
        (
            'text = "use --keep"\nif x:\n    text += " or --workers"\nsay(text)',
            ["--keep", "--workers"],
        ),
        (
            "class Odd(SparknetError):\n    def __init__(self):\n"
            '        super().__init__("--keep")',
            ["--keep"],
        ),
        ('if x:\n    raise Odd(f"{n}: use --keep")', ["--keep"]),
        ('def why():\n    return "pass --keep"\nsay(f"error: {why()}")', ["--keep"]),
        ('raise SparknetError("lower {@workers}")', []),
        (
            'cmd = ["spark-submit", "--workers", n]\n'
            'raise SparknetError(f"{shlex.join(cmd)} failed")',
            [],
        ),
        ('raise SparknetError(f"run `sparknet cluster down {n} --region {r}`")', []),
        ('raise SparknetError(f"choose one (aws ec2 describe-images --region {r})")', []),
        ('cmd = f"spark-submit --workers {n}"\nrun(cmd)', []),
        ('def f():\n    """Pass --workers."""', []),
    ],
)
def test_a_message_is_what_a_user_reads(source, named):
    flags = frozenset({"--workers", "--keep", "--region"})
    tree = ast.parse(source)
    errors = error_classes([tree]) | {"SettingError"}
    found = [f for _, text in messages(tree, errors) for f in flags_named(text, flags)]
    assert found == named


def test_no_engine_message_names_a_flag():
    """The engine's messages name settings as `{@setting}`; the front ends spell them."""
    assert offences(engine_modules(), cli_flags()) == []


def test_a_wrapped_error_keeps_its_settings_as_data():
    """An error given as a value (`{cause}`, or `{cause:line}`: its first line) is spelt by the
    front end that words the error around it, after a pickle too (a task's error)."""
    cause = SettingError("{@workers=value} is too many\nmore", setting="workers", value=9)
    wrapped = SparknetError("preflight: {cause:line}; or {@keep}", cause=cause)
    assert str(wrapped) == "preflight: --workers 9 is too many; or --keep"
    assert wrapped.worded(as_keyword) == "preflight: workers=9 is too many; or keep="
    assert pickle.loads(pickle.dumps(wrapped)).worded(as_keyword) == wrapped.worded(as_keyword)
    assert (
        SparknetError("{cause:line}", cause=OSError("\n disk full\nat /x")).worded(as_keyword)
        == "disk full"
    )
