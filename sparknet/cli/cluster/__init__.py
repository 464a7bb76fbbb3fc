"""`sparknet cluster ...`: EC2 GPU clusters, or a static cluster's hosts, and their nodes.

Up, down, status, bootstrap, list and sweep, and ssh or a tunnel to a node. One module per group
of commands: life.py (one cluster's life), inventory.py (a region's clusters by tag), ssh.py (a
node through OpenSSH); options.py holds what they share."""

from __future__ import annotations

import typer

from sparknet.cli.cluster import inventory, life, ssh

cluster_app = typer.Typer(
    no_args_is_help=True,
    help="EC2 GPU clusters, or a static cluster's hosts: up, down, status, bootstrap, list, "
    "sweep, ssh, tunnel.",
)
cluster_app.command("up")(life.cluster_up)
cluster_app.command("down")(life.cluster_down)
cluster_app.command("status")(life.cluster_status)
cluster_app.command("bootstrap")(life.cluster_bootstrap)
cluster_app.command("list")(inventory.cluster_list)
cluster_app.command("sweep")(inventory.cluster_sweep)
cluster_app.command("ssh", context_settings=ssh.SSH_CONTEXT)(ssh.cluster_ssh)
cluster_app.command("tunnel")(ssh.cluster_tunnel)
