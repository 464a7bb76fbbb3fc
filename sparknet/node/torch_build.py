"""Which torch this Python has and the CUDA version it was built for, read without importing it.

A baked image's name and tags carry both (`sparknet.cluster.ami`); importing torch takes
seconds and needs no GPU to say this, so they come from its metadata and `torch/version.py`."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path


def torch_build() -> tuple[str, str]:
    """(torch's version, the CUDA version it was built for: "none" for a CPU build). A
    `PackageNotFoundError` where torch is not installed."""
    dist = importlib.metadata.distribution("torch")
    lines = Path(str(dist.locate_file("torch/version.py"))).read_text().splitlines()
    found = [ln.split("=", 1)[1] for ln in lines if ln.startswith("cuda") and "=" in ln]
    cuda = found[0].strip().strip("\"'") if found else ""
    return dist.version, cuda if cuda not in ("", "None") else "none"
