"""The allreduce transport's own sockets (rank 0's TCPStore, gloo) listen on the node's cluster
address only: neither has authentication or encryption."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sparknet.errors import SparknetError
from sparknet.training import netbind
from tests.sockets import descendants, listeners

REPO = Path(__file__).resolve().parents[2]


def test_the_store_listens_on_the_address_it_is_given_only():
    store = netbind.store_server("127.0.0.1", 1)
    mine = [w for w in listeners(descendants(os.getpid())) if w.port == store.port]
    assert [(w.address, w.port) for w in mine] == [("127.0.0.1", store.port)]
    store.set("key", b"value")
    assert store.get("key") == b"value"


def test_an_address_no_interface_holds_is_refused_in_one_line():
    with pytest.raises(SparknetError, match=r"no network interface of this node holds 192\.0\."):
        netbind.interface_of("192.0.2.77")
    assert netbind.interface_of("127.0.0.2") == "lo"  # all of 127/8 is loopback's


#: one gloo rank (a group of one still opens gloo's listener) on the address in argv[1]
GLOO = """
import json, os, sys
import torch.distributed as dist
from sparknet.training import netbind
from tests.sockets import listeners
netbind.bind_collectives(sys.argv[1])
store = netbind.store_server(sys.argv[1], 1)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
print(json.dumps([[w.address, w.port] for w in listeners({os.getpid()})]))
dist.destroy_process_group()
"""


def test_gloo_listens_on_the_interface_of_the_nodes_address():
    """Off loopback where this machine has another address (gloo's default would take the
    address the hostname resolves to, loopback here)."""
    others = [str(ip) for _, ip in netbind._ipv4_interfaces() if not ip.is_loopback]
    address = others[0] if others else "127.0.0.1"
    out = subprocess.run(
        [sys.executable, "-c", GLOO, address], cwd=REPO, capture_output=True, text=True,
        timeout=120, check=True,
    ).stdout  # fmt: skip
    assert {a for a, _ in json.loads(out.splitlines()[-1])} == {address}
