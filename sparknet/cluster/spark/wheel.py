"""The sparknet wheel every node installs, built from the submitter's checkout.

So the nodes run exactly the submitter's code."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from sparknet.cluster.remote import tail_lines
from sparknet.errors import SparknetError


@dataclass(frozen=True)
class Wheel:
    """The sparknet wheel every node installs: built from the submitter's checkout."""

    path: Path
    version: str
    #: sha256 of the wheel's RECORD (every file's own hash): the same sources give the same
    #: digest whatever the zip's timestamps, so an unchanged checkout is not reinstalled
    digest: str


# --- the wheel -----------------------------------------------------------------------------------


def source_checkout() -> Path:
    """The checkout this sparknet runs from (pyproject.toml beside the package): what the nodes
    install, so they run exactly the submitter's code."""
    root = Path(__file__).resolve().parents[3]  # sparknet/cluster/spark/wheel.py
    if not (root / "pyproject.toml").is_file():
        raise SparknetError(
            f"sparknet runs from {root}, not from a source checkout: install it with "
            "`pip install -e <checkout>` so the nodes can be given the same version"
        )
    return root


#: what a wheel is built from (the package, and the files its build reads)
WHEEL_SOURCES = ("pyproject.toml", "README.md", "sparknet", "infra")


def build_wheel(checkout: Path, out_dir: Path) -> Wheel:
    """`pip wheel --no-deps` of a copy of `checkout`'s sources (a build in the checkout would
    leave build/ there), into `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="sparknet-wheel-") as tmp:
        src = Path(tmp) / "src"
        src.mkdir()
        for name in WHEEL_SOURCES:
            source = checkout / name
            if source.is_dir():
                shutil.copytree(
                    source, src / name, symlinks=True,
                    ignore=shutil.ignore_patterns("__pycache__", ".terraform", "*.tfstate*"),
                )  # fmt: skip
            elif source.exists():
                shutil.copy(source, src / name)
        dist = Path(tmp) / "dist"
        pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", "wheel"]
        done = subprocess.run(
            [*pip, "--no-deps", "--no-build-isolation", str(src), "-w", str(dist)],
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        if done.returncode != 0:
            last = tail_lines(done.stdout, done.stderr)
            raise SparknetError(
                f"could not build the sparknet wheel from {checkout}: "
                + (last[-1] if last else f"pip exited {done.returncode}")
            )
        (built,) = dist.glob("sparknet-*.whl")
        target = out_dir / built.name
        shutil.copy(built, target)
    return wheel_info(target)


def wheel_info(path: Path) -> Wheel:
    """A built wheel's version (from its name) and digest (of its RECORD)."""
    version = path.name.split("-")[1]
    with zipfile.ZipFile(path) as zf:
        record = next(n for n in zf.namelist() if n.endswith(".dist-info/RECORD"))
        digest = hashlib.sha256(zf.read(record)).hexdigest()
    return Wheel(path, version, digest)
