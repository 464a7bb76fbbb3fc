"""Which distributions an installed one requires that this Python lacks (the wheel's check).

The bootstrap installs the sparknet wheel with `--no-deps` over an env that usually has its
dependencies already (the AMI's, a test venv); this says which are missing, by name only:
importing them all would take seconds on every bootstrap, and the versions are the env's."""

from __future__ import annotations

import importlib.metadata
import re


def missing(distribution: str = "sparknet") -> list[str]:
    """The names of `distribution`'s requirements (no extras) that are not installed."""
    absent = []
    for requirement in importlib.metadata.requires(distribution) or []:
        if "extra ==" in requirement:
            continue
        name = re.split(r"[ ;<>=!~\[(]", requirement, maxsplit=1)[0]
        try:
            importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            absent.append(name)
    return absent
