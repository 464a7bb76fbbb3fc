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
    from sparknet.api import as_fit_arguments
    from sparknet.errors import SparknetError

    with pytest.raises(SparknetError) as exc:
        sparknet.fit(None, wrkers=3)
    assert str(exc.value) == "unknown setting 'wrkers'; see help(sparknet.fit) for the settings"
    with pytest.raises(SparknetError, match=r"^invalid settings: outer 'average' has no lr"):
        sparknet.fit(None, outer="average", outer_lr=0.5)
    with pytest.raises(SparknetError) as exc:
        sparknet.fit([(1.0, 0)], model="mlp")
    assert str(exc.value) == (
        "fit() needs a pyspark DataFrame as df, got builtins.list; convert it with "
        "spark.createDataFrame(...) first"
    )
    assert as_fit_arguments("--out afile: afile is a file; choose a directory for the run") == (
        "out='afile': afile is a file; choose a directory for the run"
    )
    assert as_fit_arguments("--out s3://b: a run needs its own prefix") == (
        "out='s3://b': a run needs its own prefix"
    )
    assert as_fit_arguments(
        "the allreduce transport (--transport allreduce) cannot run here; use --compress none"
    ) == ("the allreduce transport (transport='allreduce') cannot run here; use compress='none'")
