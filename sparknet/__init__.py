"""sparknet: synchronized local SGD for PyTorch models on Apache Spark (SparkNet, DiLoCo)."""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"

if TYPE_CHECKING:
    from sparknet.api import fit
    from sparknet.training.saved_model import load_model

__all__ = ["fit", "load_model"]


def __getattr__(name: str):
    # `sparknet.fit` without importing torch and Spark on `import sparknet` (the CLI starts fast).
    # The function lives in `sparknet.api`: a submodule named `fit` would replace this attribute
    # with itself the moment it is imported.
    if name == "fit":
        from sparknet.api import fit  # lazy: torch, pyspark, boto3

        return fit
    if name == "load_model":
        from sparknet.training.saved_model import load_model  # lazy: torch, boto3

        return load_model
    raise AttributeError(f"module 'sparknet' has no attribute {name!r}")
