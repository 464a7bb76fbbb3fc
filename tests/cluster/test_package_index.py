"""`bootstrap: package_index` in `clusters:` reaches the nodes' plan, and a value that is no
index is one line naming the setting before anything runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from sparknet.cli.cluster.options import cluster_spec
from sparknet.cluster import spark_nodes
from sparknet.cluster.address import Endpoint
from sparknet.cluster.spark import bootstrap as boot
from sparknet.cluster.spark.plan import Node
from sparknet.cluster.spark.wheel import Wheel
from sparknet.errors import SparknetError


def settings_file(tmp_path: Path, index: str) -> Path:
    path = tmp_path / "sparknet.yaml"
    path.write_text(f"clusters:\n  exp1:\n    bootstrap:\n      package_index: {index}\n")
    return path


@pytest.mark.parametrize("index", ["node", "https://pypi.corp.example/simple"])
def test_the_setting_reaches_the_plan(tmp_path, monkeypatch, index) -> None:
    """The bootstrap itself is replaced (it would need nodes): this checks only that the
    setting read from the file is what the plan the bootstrap gets says."""
    monkeypatch.setenv("SPARKNET_HOME", str(tmp_path / "home"))
    spec = cluster_spec("exp1", settings_file(tmp_path, index), {})
    got = []
    monkeypatch.setattr(boot, "bootstrap", lambda plan, *a, **k: got.append(plan))
    carried = spark_nodes.BootstrapPayload(Wheel(tmp_path / "w.whl", "1", "d"), "ab" * 32)
    node = Node(Endpoint("master", "127.0.0.1"))
    spark_nodes.bootstrap_locked(spec, [node], None, lambda _line: None, carried)  # type: ignore[arg-type]
    assert [p.package_index for p in got] == [index]


def test_a_value_that_is_no_index_is_one_line(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SPARKNET_HOME", str(tmp_path / "home"))
    with pytest.raises(SparknetError) as caught:
        cluster_spec("exp1", settings_file(tmp_path, "pypi"), {})
    assert str(caught.value) == (
        "cluster exp1: invalid setting bootstrap.package_index: give pytorch, node, or an index "
        "URL such as https://pypi.example.com/simple (got 'pypi')"
    )


def test_a_plain_http_index_is_refused_in_one_line_that_says_why_and_what_to_do(
    tmp_path, monkeypatch
) -> None:
    """pip ignores an http:// index whose host it is not told to trust (`--trusted-host`), so
    every install on the nodes would fail; and what comes over plain http can be replaced on
    the way. Loopback http is trusted by pip, so no node test could show it: refused here."""
    monkeypatch.setenv("SPARKNET_HOME", str(tmp_path / "home"))
    with pytest.raises(SparknetError) as caught:
        cluster_spec("exp1", settings_file(tmp_path, "http://pypi.corp.example/simple"), {})
    assert str(caught.value) == (
        "cluster exp1: invalid setting bootstrap.package_index: a plain http:// index is refused "
        "(packages over plain http can be replaced in transit, and pip ignores such an index): "
        "serve the mirror over https://, or set package_index: node and trust it in the nodes' "
        "own pip.conf (got 'http://pypi.corp.example/simple')"
    )
    assert "\n" not in str(caught.value)
