"""`make install` hands uv the package sources pip is configured with (uv reads no pip.conf)."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.conftest import REPO


def _uv_line(**pip_env: str) -> str:
    """The uv command `make install` would run, with only `pip_env` as pip's configuration."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "UV_"))}
    env.update(PIP_CONFIG_FILE=os.devnull, **pip_env)  # devnull: no pip.conf is read
    done = subprocess.run(
        ["make", "-n", "-B", "install"], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    [line] = [x for x in done.stdout.splitlines() if "/uv pip install" in x]
    return line


@pytest.fixture(autouse=True, scope="module")
def _pip_config_lists() -> None:
    done = subprocess.run(["python3", "-m", "pip", "config", "list"], capture_output=True)
    if done.returncode != 0:
        pytest.skip("python3 has no pip here: the Makefile has no pip sources to hand uv")


def test_uv_gets_pips_indexes_find_links_and_constraints():
    line = _uv_line(
        PIP_EXTRA_INDEX_URL="file:///a/simple  file:///b/simple",
        PIP_FIND_LINKS="/wheels",
        PIP_CONSTRAINT="/c.txt",
        PIP_DEFAULT_TIMEOUT="9",
    )
    flags = line.split("--compile-bytecode ")[1].split(" --python ")[0].split()
    pairs = sorted(zip(flags[::2], flags[1::2], strict=True))
    assert pairs == [
        ("--constraints", "/c.txt"),
        ("--extra-index-url", "file:///a/simple"),
        ("--extra-index-url", "file:///b/simple"),
        ("--find-links", "/wheels"),
        ("--index-strategy", "unsafe-best-match"),
    ], line
    assert "torch==2.14.1" in line and "-e '.[dev]'" in line


def test_without_a_pip_configuration_uv_uses_its_defaults():
    line = _uv_line()
    between = line.split("--index-strategy unsafe-best-match")[1].split("--python")[0]
    assert between.strip() == "", line
