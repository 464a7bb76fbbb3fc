"""Resolve `package.module:attribute` references that users pass for models and datasets."""

from __future__ import annotations

import importlib
import re
from typing import Any

from sparknet.errors import SparknetError

_REF = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def is_reference(text: str) -> bool:
    """True for strings shaped like `package.module:factory`."""
    return bool(_REF.match(text))


def load_callable(ref: str, what: str) -> Any:
    """Import `package.module:factory` and return the callable, or say exactly what is wrong."""
    if not is_reference(ref):
        raise SparknetError(f"{what} {ref!r} is not of the form package.module:factory")
    module_name, attr_path = ref.split(":", 1)
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise SparknetError(
            f"{what} {ref!r}: cannot import module {exc.name!r}; is it installed or on PYTHONPATH?"
        ) from exc
    except Exception as exc:  # the user's module failed while importing
        raise SparknetError(
            f"{what} {ref!r}: importing {module_name} raised {type(exc).__name__}: {exc}"
        ) from exc
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise SparknetError(f"{what} {ref!r}: {module_name} has no attribute {attr_path!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise SparknetError(f"{what} {ref!r} is not callable")
    return obj
