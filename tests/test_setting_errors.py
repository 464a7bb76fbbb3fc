"""Every setting an engine message names reads as a `sparknet.fit` keyword and as a CLI flag.

The templates are read from the source with `ast` and spelt both ways; then `fit()` on a real
frame raises them, each of its own class.
"""

from __future__ import annotations

import ast
import functools
import pickle
import string
from collections.abc import Iterator
from pathlib import Path

import pytest

import sparknet
from sparknet.config import TrainConfig
from sparknet.errors import (
    COMMAND_ONLY,
    NO_VALUE,
    PLACES,
    Line,
    Placeholder,
    SettingError,
    SparknetError,
    as_flag,
    as_keyword,
    worded,
)
from tests.test_messages import cli_flags

PACKAGE = Path(sparknet.__file__).parent
#: the front ends, which word messages themselves
FRONT_ENDS = ("cli", "bench")


def _fit_keywords() -> set[str]:
    """The settings and `fit()`'s own keywords (read from its source: importing it takes torch)."""
    tree = _trees()[PACKAGE / "api.py"]
    fit = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "fit")
    return set(TrainConfig.model_fields) | {a.arg for a in fit.args.kwonlyargs}


@functools.cache
def _trees() -> dict[Path, ast.Module]:
    """Every module of the engine (not the front ends), parsed."""
    paths = sorted(PACKAGE.rglob("*.py"))
    return {
        p: ast.parse(p.read_text(), str(p))
        for p in paths
        if p.relative_to(PACKAGE).parts[0] not in FRONT_ENDS
    }


def _fields(template: str) -> list[tuple[str, str]]:
    """(name, format spec) of every field of `template`, `{@setting=name}` as `@setting=name`."""
    return [(f[1], f[2] or "") for f in string.Formatter().parse(template) if f[1] is not None]


def _templates() -> Iterator[tuple[str, int, str]]:
    """(module, line, text) of every string constant of the engine with a setting field: whole
    templates, and the pieces of one joined with `+` (not docstrings, an f-string's pieces, nor
    the text a test looks for, as in `"{@" in template`)."""
    for path, tree in _trees().items():
        parts = {
            id(c)
            for n in ast.walk(tree)
            if isinstance(n, ast.JoinedStr | ast.Compare)
            for c in ast.walk(n)
        }
        parts |= {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}  # docstrings
        for node in ast.walk(tree):
            text = node.value if isinstance(node, ast.Constant) else None
            if isinstance(text, str) and "{@" in text and id(node) not in parts:
                yield str(path.relative_to(PACKAGE)), node.lineno, text


def _dummy_values(template: str) -> dict[str, object]:
    """A value for every name `template` takes (an error where a field formats one: `:line`)."""
    values: dict[str, object] = {}
    for name, spec in _fields(template):
        if name.startswith("@"):
            ref = name.partition("=")[2]
            if ref and ref not in ("True", "False"):
                values[ref] = Placeholder("V")
        elif name and not name[0].isdigit():
            values[name.split(".")[0].split("[")[0]] = SparknetError("V") if spec else "V"
    return values


def test_engine_templates_spell_each_setting_as_a_fit_keyword_and_a_flag():
    fit = _fit_keywords() | PLACES.keys()  # a place has words of its own for `fit()`
    known = fit | COMMAND_ONLY
    #: a command's own options (a cluster's, `sparknet-submit`'s): named by the cluster's and
    #: the jobs' messages, which `fit()` never raises
    options = cli_flags()
    seen = 0
    for where, line, template in _templates():
        seen += 1
        error = SparknetError(template, **_dummy_values(template))
        settings = error.settings()
        assert settings, f"{where}:{line}: {template!r}"
        for setting in settings:
            assert setting in known or as_flag(setting) in options, f"{where}:{line}: {setting}"
        keyword, flag = error.worded(as_keyword), error.worded(as_flag)
        assert "{@" not in keyword and "{@" not in flag, f"{where}:{line}: {template!r}"
        if set(settings) <= fit:
            assert "--" not in keyword, f"{where}:{line}: {keyword!r}"
        for setting in set(settings) - PLACES.keys():
            assert as_flag(setting) in flag, f"{where}:{line}: {flag!r}"
    assert seen > 40  # the engine's messages were found


def test_every_value_a_template_names_is_given():
    """`worded` falls back to the bare template on a missing value: each call must give every
    value its first-argument template names (`{@device=cpu}` needs `cpu=`)."""
    for path, tree in _trees().items():
        for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
            if not call.args or not isinstance(call.args[0], ast.Constant):
                continue
            template = call.args[0].value
            if not isinstance(template, str) or "{@" not in template:
                continue
            if any(k.arg is None for k in call.keywords):  # **values: not known here
                continue
            given = {k.arg for k in call.keywords}
            wanted = set(_dummy_values(template))
            missing = wanted - given
            assert not missing, f"{path.relative_to(PACKAGE)}:{call.lineno}: {missing}"


def test_a_setting_error_crosses_a_process_whole():
    """Tasks hand their faults back pickled: the template, the values and the setting."""
    exc = SettingError(
        "pass {@rounds=n} with N > {done}", setting="rounds", n=Placeholder("N"), done=3
    )
    back = pickle.loads(pickle.dumps(exc))
    assert (back.setting, back.value is NO_VALUE) == ("rounds", True)
    assert back.worded(as_keyword) == "pass rounds=N with N > 3"
    assert str(back) == "pass --rounds N with N > 3"
    line = pickle.loads(pickle.dumps(Line("lower {@lr} or use {@precision=p}", p="bf16")))
    assert line == "lower --lr or use --precision bf16"
    assert worded(line, as_keyword) == "lower lr= or use precision='bf16'"
    assert worded("plain text", as_keyword) == "plain text"


def test_a_rank_fault_crosses_the_allreduce_channel_whole():
    """The `allreduce` stage's rank 0 tells the driver of a permanent fault as JSON: the error
    crosses whole (its class and template: `fit()` spells it in keywords); an error that does
    not pickle crosses as its text."""
    import json

    from sparknet.errors import PermanentTaskError
    from sparknet.training.transport import TaskFault

    exc = PermanentTaskError(
        "{@device=cuda}, but this task has no GPU: give the workers GPUs ({@gpus_per_worker})",
        cuda="cuda",
    )
    back = TaskFault.raised(json.loads(json.dumps(TaskFault.of(1, exc).said())))
    assert type(back) is PermanentTaskError
    assert back.worded(as_keyword) == (
        "device='cuda', but this task has no GPU: give the workers GPUs (gpus_per_worker=)"
    )
    assert (
        str(back)
        == "--device cuda, but this task has no GPU: give the workers GPUs (--gpus-per-worker)"
    )
    unpicklable = PermanentTaskError("bad {what}", what=lambda: None)
    said = TaskFault.of(0, unpicklable).said()
    assert "error" not in said
    assert str(TaskFault.raised(said)) == str(unpicklable)


def test_places_and_command_options_read_in_each_front_end():
    exc = SparknetError("see {@help}; run at most 3 ({@workers_setting}); smaller {@shard_mb}")
    assert str(exc) == (
        "see `sparknet train --help`; run at most 3 (the `workers` setting: train's --workers, "
        "sparknet-submit's --set workers=N); smaller --shard-mb"
    )
    assert exc.worded(as_keyword) == (
        "see help(sparknet.fit); run at most 3 (the workers= keyword); smaller --shard-mb"
    )
    spark = SparknetError("ship it ({@conf=files})", files=Placeholder("spark.submit.pyFiles=F"))
    assert str(spark) == "ship it (--conf spark.submit.pyFiles=F)"
    assert spark.worded(as_keyword) == "ship it (the SparkSession's spark.submit.pyFiles=F)"


ROWS = [([float(i % 3), 1.0, 0.5, float(i % 2)], i % 2) for i in range(6)]
SMALL = {"model": "mlp", "workers": 2, "tau": 1, "batch_size": 4, "rounds": 1}


@pytest.mark.integration
def test_fit_errors_name_keywords_and_keep_their_class(spark, tmp_path):
    df = spark.createDataFrame(ROWS, "features array<float>, label int")
    afile = tmp_path / "afile"
    afile.write_text("")
    cases = [
        ({"tau": 0}, SettingError, "invalid setting tau: a whole number of steps (at least 1) or "
         "auto (got 0)"),
        ({"workers": 9}, SettingError, "the DataFrame has 6 rows, fewer than workers=9"),
        ({"out": afile}, SettingError, f"out={str(afile)!r}: {afile} is a file; choose a "
         "directory for the run"),
        ({"num_classes": 2, "label_col": "nope"}, SettingError, "the DataFrame has no column "
         "'nope' (it has: features, label); set label_col="),
    ]  # fmt: skip
    for given, kind, message in cases:
        with pytest.raises(SparknetError) as exc:
            sparknet.fit(df, **{**SMALL, "out": tmp_path / "run", **given})
        assert type(exc.value) is kind, exc.value
        assert str(exc.value) == message
    assert exc.value.setting == "label_col"
    assert exc.value.__traceback__ is not None and exc.value.__traceback__.tb_next is not None
