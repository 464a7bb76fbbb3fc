"""Environment variables set for a while, for libraries that read them as they run.

Terraform's settings for its subprocess, MLflow's HTTP retries for one call: each is set around
the call and put back after as it was (unset where it was unset), so the user's own process
environment is what it was before.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping


@contextlib.contextmanager
def variables(settings: Mapping[str, str]) -> Iterator[None]:
    """`settings` in `os.environ` while the block runs, the earlier values back after."""
    saved = {key: os.environ.get(key) for key in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
