"""`down` of a static cluster where a host's marker does not read (emptied by a crash, edited
by hand, another tool's file): the host is neither stopped nor given up for lost; the cluster
stays registered, and the one line names the marker to look at."""

from __future__ import annotations

import invoke
import pytest

from sparknet.cluster import lifecycle, markers, nodes, static
from tests.unit.test_markers import _fake_worker, _node, _spec, hosts  # noqa: F401


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
    lifecycle.save_entry(_spec(hosts), None)
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
        assert "lab" in lifecycle.registered()  # still there to be stopped
        assert mine.poll() is None
    finally:
        mine.kill()
        mine.wait()
