"""The driver's Spark files (cached and spilled blocks, the files a job ships) sit in a dir only
its user may enter, not in /tmp's world-readable blockmgr-* and spark-* dirs (another local user
of the host read them there)."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def test_the_driver_s_spark_files_sit_in_a_dir_only_its_user_enters(sc):
    """On the suite's one session (`conftest.spark`, made by `start_session`)."""
    local = Path(sc.getConf().get("spark.local.dir", "/tmp"))
    assert local != Path("/tmp")
    assert stat.S_IMODE(local.stat().st_mode) == 0o700
    assert list(local.glob("blockmgr-*")), sorted(p.name for p in local.iterdir())
