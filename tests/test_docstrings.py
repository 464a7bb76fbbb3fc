"""Every module of the package opens with a one-line summary, read from the source with `ast`.

A reader (and `help()`, and an editor's hover) sees a module's first line alone: it is a whole
sentence, and anything more follows after a blank line.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "sparknet"

#: how a one-sentence summary may end: a statement, a lead-in to what follows, a question
ENDS = (".", ":", "?")


def summary_fault(docstring: str | None) -> str | None:
    """What is wrong with a module docstring's opening (None: nothing, or no docstring)."""
    if docstring is None:
        return None
    lines = docstring.splitlines() or [""]
    if not lines[0].strip().endswith(ENDS):
        return "its first line is not a whole sentence"
    if len(lines) > 1 and lines[1].strip():
        return "its second line is not blank"
    return None


def test_a_module_docstring_opens_with_a_one_line_sentence():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        fault = summary_fault(ast.get_docstring(tree, clean=False))
        if fault:
            found.append(f"{path.relative_to(PACKAGE.parent)}: {fault}")
    assert not found, "module docstrings to mend:\n" + "\n".join(found)


def test_the_check_tells_a_summary_from_a_run_on_sentence():
    assert summary_fault("What it is for.") is None
    assert summary_fault("What it is for.\n\nWhy, at length.\n") is None
    assert summary_fault("Two kinds:\n\n- one\n- two\n") is None
    assert summary_fault(None) is None
    assert summary_fault("What it is for, and a sentence that\nruns on.") is not None
    assert summary_fault("What it is for.\nMore at once.") is not None
    assert summary_fault("") is not None
