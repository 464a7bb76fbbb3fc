"""`sparknet.fit` stays the function however it is reached (issue: a submodule replaced it)."""

import subprocess
import sys

PROBE = """
import types
import sparknet
first = sparknet.fit
second = sparknet.fit
from sparknet import fit
assert not isinstance(second, types.ModuleType), second
assert first is second is fit and callable(fit), (first, second, fit)
print("ok")
"""


def test_fit_is_the_function_on_every_access():
    """A fresh interpreter: the lazy export must survive its own first access."""
    proc = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


def test_fit_errors_name_fit_arguments_and_help():
    import pytest

    import sparknet
    from sparknet.errors import SparknetError

    with pytest.raises(SparknetError) as exc:
        sparknet.fit(None, wrkers=3)
    assert str(exc.value) == (
        "unknown setting 'wrkers' (did you mean workers=?); see help(sparknet.fit) for the settings"
    )
    with pytest.raises(SparknetError, match=r"^invalid settings: outer 'average' has no lr"):
        sparknet.fit(None, outer="average", outer_lr=0.5)
    with pytest.raises(SparknetError) as exc:
        sparknet.fit([(1.0, 0)], model="mlp")
    assert str(exc.value) == (
        "fit() needs a pyspark DataFrame as df, got builtins.list; convert it with "
        "spark.createDataFrame(...) first"
    )


def test_an_unknown_fit_keyword_is_named_with_the_one_it_likely_meant():
    """Before any Spark work: the closest setting or `fit()` argument, as a keyword; none
    where nothing is close."""
    import pytest

    import sparknet
    from sparknet.errors import SparknetError

    for given, meant in (("batchsize", "batch_size="), ("eval_frame", "eval_df=")):
        with pytest.raises(SparknetError) as exc:
            sparknet.fit(None, **{given: 1})
        assert str(exc.value).startswith(f"unknown setting '{given}' (did you mean {meant}?); ")
    with pytest.raises(SparknetError) as exc:
        sparknet.fit(None, zzzz=1)
    assert str(exc.value) == "unknown setting 'zzzz'; see help(sparknet.fit) for the settings"
