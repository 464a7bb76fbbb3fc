"""The Spark master's state, read on the master node from its web UI's JSON.

The UI binds the node's loopback address (only an SSH tunnel reaches it from outside), so the
submitter asks the node to read it: `python -m sparknet.node master-json HOST PORT`."""

from __future__ import annotations

import urllib.request

#: how long the master's UI has to answer one read
READ_TIMEOUT_S = 5.0


def master_json(host: str, port: int, timeout_s: float = READ_TIMEOUT_S) -> str:
    """The text of the master's `/json/` page at `host:port` (its workers, their states, cores
    and GPUs, its applications). An `OSError` (`urllib.error.URLError`) when nothing answers."""
    with urllib.request.urlopen(f"http://{host}:{port}/json/", timeout=timeout_s) as page:
        return page.read().decode()
