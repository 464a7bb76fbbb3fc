"""The OpenSSH command line that reaches a node as sparknet does (`cluster ssh`, `tunnel`).

The cluster's key only, its pinned host keys only, and the silence deadline of sparknet's own
connections, said in OpenSSH's options.

Apart from nodes.py, whose connections are paramiko's, inside this process: this hands the
node to the user's own `ssh`, which reads none of nodes.py's settings unless told each one.
"""

from __future__ import annotations

import math

from sparknet.cluster.address import Endpoint
from sparknet.cluster.nodes import Access, silence_s


def ssh_command(endpoint: Endpoint, access: Access, *extra: str) -> list[str]:
    """The `ssh` command line that reaches `endpoint` as sparknet does: the cluster's key only
    (`IdentitiesOnly`, no agent), its known_hosts only, and a host whose key is not pinned
    there refused (`StrictHostKeyChecking=yes`). `-F none`: no ssh_config of the user's can
    rename the node or add a proxy. `extra` goes before the destination (`-N`, `-L ...`).
    A node that goes silent ends it as it ends sparknet's own calls (`nodes._Keepalive`): keepalives
    every third of `silence_s()`, the third unanswered one closes it; a connection not made
    within `silence_s()` (a listener that never sends the banner) fails too."""
    silence = silence_s()
    return [
        "ssh",
        "-F",
        "none",
        "-o",
        f"ServerAliveInterval={max(1, math.ceil(silence / 3))}",
        "-o",
        "ServerAliveCountMax=3",
        "-o",
        f"ConnectTimeout={max(1, math.ceil(silence))}",
        "-i",
        str(access.key_file),
        "-o",
        "IdentitiesOnly=yes",
        "-o",
        "IdentityAgent=none",
        "-o",
        "StrictHostKeyChecking=yes",
        "-o",
        # quoted: OpenSSH splits an option's value on whitespace (a registry under "My Files")
        f'UserKnownHostsFile="{access.known_hosts}"',
        "-o",
        "GlobalKnownHostsFile=/dev/null",
        "-p",
        str(endpoint.port),
        *extra,
        f"{endpoint.user}@{endpoint.host}",
    ]
