"""What every `sparknet cluster` command shares.

Its common options, the spec of the cluster it names (the registry's, the settings file's, the
flags), and how it fails (the exit code says whether the command or the cluster's state was
wrong).

Apart from the commands, which are grouped by what they do (life.py, inventory.py, ssh.py):
`sparknet-submit` resolves a cluster's spec the same way (`cluster_spec`).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import typer
from pydantic import ValidationError

from sparknet.cli.common import Caught, fail, signal_exit
from sparknet.config import find_config_file, read_section, validation_error
from sparknet.errors import SparknetError, first_line
from sparknet.say import command_line

# `# lazy: X` below: an import kept inside the command that needs it, X being slow to import
# (torch ~2 s; boto3, fabric, numpy ~0.2 s each; `+N ms`: what it adds, measured) while
# `sparknet cluster --help` and every other command import this module

RegionOption = typer.Option(None, help="AWS region (default: the cluster's, else us-east-1)")
#: the help of the machine options `cluster up` and `sparknet-submit` share: the defaults are
#: the cluster's entry's, else `ClusterSpec`'s (tests/cli/test_help.py holds them to it)
WORKERS_HELP = "worker instances (default: the cluster's workers:, else 2)"
INSTANCE_TYPE_HELP = (
    "worker type, repeatable: fallback order (default: the cluster's instance_types:, else "
    "those of g5.xlarge, g4dn.xlarge, g6.xlarge the region offers)"
)
SPOT_HELP = "workers on spot or on-demand (default: the cluster's spot:, else on-demand)"
AnyOwnerOption = typer.Option(
    False, "--any-owner", help="act on the cluster even if its sparknet:owner tag names another"
)


#: a valid name that stands in while a spec named by a tag is validated (`cluster_spec`)
_STAND_IN = "removal"


def cluster_spec(name: str, config: Path | None, flags: dict[str, Any], *, any_name: bool = False):
    """The spec of cluster `name`: the registry's, else `clusters:` in the settings file, plus
    flags; a one-line error when the result is invalid.

    `any_name`: `down` and `sweep` remove by tag, and a tag may carry a name sparknet no longer
    accepts (an older sparknet's, or a person's): everything else is validated, the name is not.
    """
    from sparknet.cluster import nodes, provider  # lazy: fabric, boto3
    from sparknet.cluster.registry import registered  # lazy: boto3
    from sparknet.cluster.spark import steps  # lazy: fabric
    from sparknet.cluster.spec import ClusterSpec  # lazy: boto3

    nodes.silence_s(), steps.reboot_wait_s()  # a bad SSH wait setting fails before any launch

    base: dict[str, Any] = {}
    known = registered().get(name)
    if known is not None:
        base = known.model_dump()
        if not provider.of(known).LAUNCHES:
            del base["workers"]  # counted from hosts, which the settings file may change
    path = find_config_file(config)
    if path is not None:
        entry = read_section(path, "clusters").get(name) or {}
        if "owner" in entry:
            raise SparknetError(
                f"cluster {name}: `owner` is set by `up` from your AWS identity (STS); remove it "
                f"from `clusters: {name}:` in {path}"
            )
        base.update(_resolved_paths(entry, path))
    given = {k: v for k, v in flags.items() if v not in (None, [])}
    base.update(given)
    _check_flags_fit_provider(name, base, given)
    if known is not None and base.get("provider", "aws") != known.provider:
        raise SparknetError(
            f"cluster {name} is registered here as {_PROVIDERS[known.provider]}, but "
            f"{path} says provider: {base.get('provider')}; "
            f"`{command_line('sparknet cluster down', name)}` first, or give the other one "
            "another name"
        )
    base["name"] = _STAND_IN if any_name else name
    try:
        spec = ClusterSpec.model_validate(base)
    except ValidationError as exc:
        raise validation_error(exc, ClusterSpec, where=f"cluster {name}: ") from exc
    return spec.model_copy(update={"name": name})


#: the command-line flag of a cluster setting, where it is not the setting's name with dashes
_FLAGS = {"instance_types": "--instance-type", "autostop_minutes": "--autostop"}


def _as_flag(setting: str, value: Any) -> str:
    if setting == "spot":
        return "--spot" if value else "--on-demand"
    return _FLAGS.get(setting, "--" + setting.replace("_", "-"))


def _check_flags_fit_provider(name: str, spec: dict[str, Any], given: dict[str, Any]) -> None:
    """A flag of the other provider's, given on the command line, is refused naming the flag
    to leave out (the spec's own refusal speaks of sparknet.yaml's keys, where it is not)."""
    from sparknet.cluster import provider  # lazy: boto3
    from sparknet.cluster.spec import AWS_ONLY, ClusterSpec  # lazy: boto3

    def default(key: str) -> Any:
        return ClusterSpec.model_fields[key].get_default(call_default_factory=True)

    if not provider.named(spec.get("provider")).LAUNCHES:
        # a value that is the setting's default is no EC2 choice (a job record's region, say),
        # as the spec's own check has it
        ec2 = [_as_flag(k, v) for k, v in given.items() if k in AWS_ONLY and v != default(k)]
        if ec2:  # worded as `preflight.check_cluster_options`'s
            raise SparknetError(
                f"{', '.join(ec2)}: EC2 flags, not for static cluster {name} (its machines are "
                f"its `hosts:`); leave {'it' if len(ec2) == 1 else 'them'} out"
            )
    elif (
        given.get("provider") in provider.PROVIDERS
        and provider.named(given["provider"]).LAUNCHES
        and (spec.get("hosts") or spec.get("known_hosts"))
    ):
        raise SparknetError(
            f"cluster {name}'s entry has hosts: (machines you have): --provider aws would "
            "launch EC2 instances in their place; leave --provider out"
        )


_PROVIDERS = {
    "aws": "an EC2 cluster (provider: aws)",
    "static": "a static cluster (provider: static)",
}


def _resolved_paths(entry: dict[str, Any], path: Path) -> dict[str, Any]:
    """`entry` with its key_file and known_hosts absolute: a relative path is relative to the
    settings file's folder (as the registry stores it, for commands run from anywhere)."""
    out = dict(entry)
    for key in ("key_file", "known_hosts"):
        value = out.get(key)
        if isinstance(value, str) and value:
            out[key] = str((path.parent / Path(value).expanduser()).resolve())
    return out


def fail_cluster(exc: SparknetError, debug: bool, caught: Caught | None = None) -> None:
    """`fail` with exit 1 where the command was right but the cluster's state says no (busy,
    not there, another's, in another region), 128 + the signal's number where a signal stopped
    it (130 Ctrl-C, 143 SIGTERM), and 2 for everything a user fixes in the command or settings."""
    # lazy: boto3, fabric
    from sparknet.cluster import inventory, records, registry, spark_nodes, static

    state = (
        registry.ClusterBusy, records.ClusterNotFound, inventory.NotYours,
        inventory.OtherRegion, spark_nodes.BootstrapIncomplete, static.StopIncomplete,
        static.HostsChanged,
    )  # fmt: skip
    if isinstance(exc, records.Interrupted) and (code := signal_exit(caught)):
        fail(exc, debug, code)
    if isinstance(exc, spark_nodes.BootstrapIncomplete) and not debug:
        # the error line, then each failed node's last output lines
        print("\n".join([f"error: {first_line(exc)}", *exc.details]), file=sys.stderr)
        raise typer.Exit(1)
    fail(exc, debug, 1 if isinstance(exc, state) else 2)


def on_cluster(
    action, name: str, region: str | None, config: Path | None, debug: bool, **kw
) -> Any:
    """`action(spec, **kw)` for the named cluster (any name a tag may carry); a one-line error on
    failure."""
    try:
        return action(cluster_spec(name, config, {"region": region}, any_name=True), **kw)
    except SparknetError as exc:
        fail_cluster(exc, debug)
