"""`sparknet cluster ssh|tunnel`: one node of a cluster through the OpenSSH client.

With the cluster's key and pinned host keys: a shell, a command, or the Spark UIs forwarded to
localhost.

Apart from life.py: these hand the terminal to `ssh` (exec), and `ssh` reads its own words after
NAME (`_split_command`), not click.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path

import typer

from sparknet.cli.cluster.options import RegionOption, fail_cluster, on_cluster
from sparknet.cli.common import ConfigOption, DebugOption, EndpointOption, console
from sparknet.errors import SparknetError

# `# lazy: X` below: an import kept inside the command that needs it, X being slow to import
# (torch ~2 s; boto3, fabric, numpy ~0.2 s each; `+N ms`: what it adds, measured) while
# `sparknet cluster --help` and every other command import this module


def _reach(
    name: str, node: str, region: str | None, endpoint_url: str | None, config: Path | None,
    debug: bool,
):  # fmt: skip
    """The endpoint of `node` of cluster `name` and the cluster's access, its host keys pinned
    afresh from EC2 (the instances' user data: right even after a lost registry or a new public
    address); a one-line error (exit 2) for an unknown node, exit 1 for a cluster not there."""
    from sparknet.cluster import provider  # lazy: boto3, fabric

    spec = on_cluster(lambda spec: spec, name, region, config, debug)
    try:
        if shutil.which("ssh") is None:
            raise SparknetError("the OpenSSH client `ssh` is not on PATH; install openssh-client")
        return provider.of(spec).reach_node(spec, node, endpoint_url=endpoint_url)
    except SparknetError as exc:
        fail_cluster(exc, debug)


#: the options of `cluster ssh` that may also follow NAME (click reads none there: the command
#: takes no interspersed options, so the remote command's own stay its own), and whether each
#: takes a value
_SSH_OPTIONS = {"--region": True, "--endpoint-url": True, "--config": True, "--debug": False}
#: how click parses `cluster ssh`: nothing after NAME is taken for an option, and an unknown
#: option stays a word (`_split_command` sorts them out)
SSH_CONTEXT = {"allow_interspersed_args": False, "ignore_unknown_options": True}


def _split_command(words: list[str]) -> tuple[str, list[str], dict[str, str]]:
    """(node, command, options) of `cluster ssh NAME [NODE] [OPTIONS] [-- CMD...]`: the command
    is what follows the first `--` (click keeps the `--`, as the command takes no interspersed
    options); `_SSH_OPTIONS` before it are taken out (``--debug`` maps to "")."""
    cut = words.index("--") if "--" in words else len(words)
    before, options = _late_options(words[:cut])
    command = words[cut + 1 :]
    if len(before) > 1:
        raise SparknetError(
            f"put the command after `--`: sparknet cluster ssh NAME {before[0]} -- "
            f"{shlex.join(before[1:])}"
        )
    return (before[0] if before else "master"), command, options


def _late_options(words: list[str]) -> tuple[list[str], dict[str, str]]:
    """`words` without the `_SSH_OPTIONS` in them (``--opt VALUE`` or ``--opt=VALUE``), and
    those options; a one-line error for any other word beginning with ``-``."""
    rest: list[str] = []
    options: dict[str, str] = {}
    items = iter(words)
    for word in items:
        if not word.startswith("-"):
            rest.append(word)
            continue
        flag, eq, value = word.partition("=")
        if flag not in _SSH_OPTIONS:
            raise SparknetError(
                f"no option {flag} of `cluster ssh` (its options: {', '.join(_SSH_OPTIONS)}); "
                "put a command and its options after `--`"
            )
        if _SSH_OPTIONS[flag] and not eq:
            value = next(items, "")
        if _SSH_OPTIONS[flag] and not value:
            raise SparknetError(f"{flag} needs a value")
        options[flag] = value
    return rest, options


def cluster_ssh(
    name: str = typer.Argument(...),
    words: list[str] = typer.Argument(
        None, metavar="[NODE] [-- CMD...]", help="master (default) or worker-N; then a command"
    ),
    region: str | None = RegionOption,
    endpoint_url: str | None = EndpointOption,
    config: Path | None = ConfigOption,
    debug: bool = DebugOption,
) -> None:
    """A shell on a node, or with `-- CMD` a command there (the exit code is the command's);
    through `ssh` with the cluster's key and pinned host keys (an unknown or changed host key
    is refused)."""
    from sparknet.cluster import openssh  # lazy: fabric

    try:
        node, command, late = _split_command(list(words or []))
    except SparknetError as exc:
        fail_cluster(exc, debug)
    region = late.get("--region", region)
    endpoint_url = late.get("--endpoint-url", endpoint_url)
    config = Path(late["--config"]) if "--config" in late else config
    debug = debug or "--debug" in late
    endpoint, access, _spec = _reach(name, node, region, endpoint_url, config, debug)
    argv = openssh.ssh_command(endpoint, access, *([] if command else ["-t"]))
    sys.stdout.flush()
    os.execvp(argv[0], [*argv, *(["--", *command] if command else [])])


def cluster_tunnel(
    name: str = typer.Argument(...),
    master_ui_port: int = typer.Option(8080, help="local port of the Spark master's UI"),
    app_ui_port: int = typer.Option(4040, help="local port of the running application's UI"),
    remote_master_ui_port: int | None = typer.Option(
        None, help="the master UI's port on the master (default: the cluster's master_ui_port)"
    ),
    remote_app_ui_port: int = typer.Option(
        4040, help="the application UI's port on the master (4041, ... for a second application)"
    ),
    region: str | None = RegionOption,
    endpoint_url: str | None = EndpointOption,
    config: Path | None = ConfigOption,
    debug: bool = DebugOption,
) -> None:
    """Forward the master's Spark UIs (master 8080, application 4040: reachable only on the
    node itself) to ports on localhost until Ctrl-C."""
    from sparknet.cluster import openssh  # lazy: fabric

    ports = {
        "--master-ui-port": master_ui_port, "--app-ui-port": app_ui_port,
        "--remote-master-ui-port": remote_master_ui_port,
        "--remote-app-ui-port": remote_app_ui_port,
    }  # fmt: skip
    for option, port in ports.items():
        if port is not None and not 0 < port < 65536:
            fail_cluster(SparknetError(f"{option} {port} is not a port (1-65535)"), debug)
    endpoint, access, spec = _reach(name, "master", region, endpoint_url, config, debug)
    remote_master_ui_port = remote_master_ui_port or spec.bootstrap.master_ui_port
    # the UIs bind 127.0.0.1 on the node (not `localhost`, which may be ::1 there)
    forwards = [
        "-N", "-o", "ExitOnForwardFailure=yes",
        "-L", f"127.0.0.1:{master_ui_port}:127.0.0.1:{remote_master_ui_port}",
        "-L", f"127.0.0.1:{app_ui_port}:127.0.0.1:{remote_app_ui_port}",
    ]  # fmt: skip
    console.print(
        f"Spark master UI: http://localhost:{master_ui_port}  application UI: "
        f"http://localhost:{app_ui_port}  (tunnel to {endpoint}; Ctrl-C ends it)"
    )
    argv = openssh.ssh_command(endpoint, access, *forwards)
    os.execvp(argv[0], argv)
