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
