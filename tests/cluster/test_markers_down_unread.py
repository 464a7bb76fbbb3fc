"""`down` of a static cluster where a host's marker does not read (emptied by a crash, edited
by hand, another tool's file), or names this cluster under its registry's former id (the id's
file was lost and made anew): the host is neither stopped nor given up as another cluster's;
the cluster stays registered, and the one line names the marker to look at, or the id to
write back."""

from __future__ import annotations

import invoke
import pytest

from sparknet.cluster import markers, nodes, registry, spark_nodes, static
from sparknet.errors import SparknetError
from tests.cluster.test_markers import _fake_worker, _node, _spec, hosts  # noqa: F401


def test_down_keeps_the_cluster_where_a_marker_does_not_read(hosts, monkeypatch) -> None:  # noqa: F811
    def run_all(endpoints, access, fn, timeout, **kw):  # a local shell per host, failures kept
        out, failures = {}, {}
        for e in endpoints:
            try:
                out[e.name] = fn(e, invoke.Context())
            except Exception as exc:
                failures[e.name] = exc
        if failures:
            raise nodes.NodesFailed(nodes._failed_line(endpoints, failures), failures)
        return out

    monkeypatch.setattr(nodes, "run_all", run_all)
    registry.save_entry(_spec(hosts), None)
    me = static.holder("lab")
    conn = invoke.Context()
    for name in ("master", "worker-1"):
        assert markers.take(conn, _node(hosts, name), me)[0] == markers.TAKEN
    (hosts / "worker-1" / markers.MARKER).write_text('{"holder": "hand-edited"\n')
    mine = _fake_worker(hosts, "worker-1")
    try:
        with pytest.raises(static.StopIncomplete) as err:
            static.down(_spec(hosts))
        line = str(err.value)
        assert "\n" not in line
        assert f"its marker {hosts / 'worker-1' / markers.MARKER} does not read" in line
        assert "lab" in registry.registered()  # still there to be stopped
        assert mine.poll() is None
    finally:
        mine.kill()
        mine.wait()


def test_a_remade_registry_id_is_not_another_cluster(hosts, monkeypatch) -> None:  # noqa: F811
    """The registry's id file was lost and made anew: its hosts' markers name the former id.
    `down` neither leaves them running as another cluster's nor forgets the cluster, and both
    `down` and `up` name the id to write back."""
    registry.save_entry(_spec(hosts), None)
    before = static.holder("lab")
    conn = invoke.Context()
    assert markers.take(conn, _node(hosts, "master"), before)[0] == markers.TAKEN
    (registry.registry_dir() / ".registry-id").unlink()
    assert static.holder("lab").registry != before.registry
    with pytest.raises(SparknetError) as err:
        static.down(_spec(hosts))
    assert f"write {before.registry} back into .registry-id of {registry.registry_dir()}" in str(
        err.value
    )
    assert "lab" in registry.registered()
    assert markers.Holder.parse((hosts / "master" / markers.MARKER).read_text()) == before
    monkeypatch.setattr(spark_nodes, "carry", lambda spec, wheel_dir: None)
    with pytest.raises(markers.HostHeld) as held:
        static.up(_spec(hosts))
    assert "\n" not in str(held.value)
    assert f"write {before.registry} back into .registry-id" in str(held.value)
