"""The registry's id (what a static host's marker names): made once, whole, by whichever of
many processes comes first; one that does not read is one line saying how to mend it, never a
traceback, and never the advice to make a new one (the hosts it holds would be lost to it)."""

from __future__ import annotations

import threading

import pytest

from sparknet.cluster import registry
from sparknet.errors import SparknetError


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv(registry.HOME_ENV, str(tmp_path / "home"))
    return registry.registry_dir()


def test_many_at_once_get_one_id_and_leave_no_temp_file(home) -> None:
    got: list[str] = []
    threads = [
        threading.Thread(target=lambda: got.append(registry.registry_id())) for _ in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(got) == 8 and len(set(got)) == 1
    assert (home / ".registry-id").read_text() == got[0] + "\n"
    assert sorted(p.name for p in home.iterdir()) == [".registry-id"]


@pytest.mark.parametrize("damage", ["directory", "binary"])
def test_an_id_that_cannot_be_read_is_one_line(home, damage) -> None:
    path = home / ".registry-id"
    home.mkdir(parents=True)
    if damage == "directory":
        path.mkdir()
    else:
        path.write_bytes(b"\xff\xfe\x00id")
    with pytest.raises(SparknetError) as err:
        registry.registry_id()
    assert str(err.value).startswith(f"cannot read this registry's id {path}: ")
    assert "\n" not in str(err.value)


def test_a_damaged_id_says_to_write_back_the_hosts_id(home) -> None:
    home.mkdir(parents=True)
    (home / ".registry-id").write_text("edited by hand\n")
    with pytest.raises(SparknetError) as err:
        registry.registry_id()
    line = str(err.value)
    assert "write back the one this registry's static hosts name" in line
    assert "remove it and run this again" not in line
