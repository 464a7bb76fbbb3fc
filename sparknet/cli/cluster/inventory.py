"""`sparknet cluster list|sweep`: every cluster with resources in a region, by its tags.

`sweep` takes down those nobody wants (neither registered here nor in `clusters:`).

Apart from life.py: these start from a region, not from a named cluster, and `sweep` acts on
many at once (a failure is reported and the next one taken).
"""

from __future__ import annotations

from pathlib import Path

import typer

from sparknet.cli.cluster.life import print_down
from sparknet.cli.cluster.options import cluster_spec, fail_cluster
from sparknet.cli.common import ConfigOption, DebugOption, EndpointOption, console, fail
from sparknet.config import find_config_file, read_section
from sparknet.errors import SparknetError, first_line

# `# lazy: X` below: an import kept inside the command that needs it, X being slow to import
# (torch ~2 s; boto3, fabric, numpy ~0.2 s each; `+N ms`: what it adds, measured) while
# `sparknet cluster --help` and every other command import this module


def cluster_list(
    region: str = typer.Option("us-east-1", help="AWS region to look in"),
    endpoint_url: str | None = EndpointOption,
    debug: bool = DebugOption,
) -> None:
    """Clusters with resources in the region (by tag), whether this machine knows them, and
    their owners (`-`: resources made before sparknet tagged owners)."""
    from sparknet import aws  # lazy: boto3
    from sparknet.cluster import ec2, inventory, provider, registry  # lazy: boto3, fabric

    specs = registry.registered()
    # static clusters first, whatever the region and whether AWS answers: nothing of them is
    # in AWS
    for name, spec in sorted(specs.items()):
        if not provider.of(spec).REGIONAL:
            print(f"{name}\tstatic, {len(spec.hosts)} hosts\t-\tregistered\towner -")
    try:
        found = inventory.tagged_clusters(aws.check_region(region), endpoint_url=endpoint_url)
    except SparknetError as exc:
        fail(exc, debug)
    known = {
        name for name, spec in specs.items() if spec.region == region and provider.of(spec).REGIONAL
    }
    static = [name for name, spec in specs.items() if not provider.of(spec).REGIONAL]
    if not found and not known and not static:  # a note on stderr: stdout stays the lines
        console.print(f"no clusters in {region} (none tagged there, none registered here)")
    for name in sorted(set(found) | known):
        cluster = found.get(name, inventory.TaggedCluster(name))
        live = sum(item.startswith("instance:") for item in cluster.items)
        where = "registered" if name in known else "not registered"
        owners = ", ".join(sorted(owner or "-" for owner in cluster.owners)) or "-"
        left = "" if live else f"\t{ec2.leftover_note(name, region)}"
        print(
            f"{name}\t{live} instances\t{len(cluster.items) - live} other resources\t{where}"
            f"\towner {owners}{left}"
        )


def _not_yours(cluster, caller: str) -> str:
    """Why `sweep` leaves a cluster alone: whose it is."""
    others = sorted(o for o in cluster.owners if o is not None and o != caller)
    if others:
        return f"owned by {', '.join(others)}"
    return "resources without an owner tag (made before sparknet tagged owners)"


def cluster_sweep(
    region: str = typer.Option("us-east-1", help="AWS region to look in"),
    yes: bool = typer.Option(False, "--yes", help="take them down (default: only list them)"),
    all_owners: bool = typer.Option(
        False, "--all-owners", help="also other principals' clusters, and untagged ones"
    ),
    endpoint_url: str | None = EndpointOption,
    config: Path | None = ConfigOption,
    debug: bool = DebugOption,
) -> None:
    """Tagged resources of your clusters (sparknet:owner = your AWS identity) that are neither
    registered here nor in `clusters:`; `--yes` deletes them (the bucket is kept)."""
    from sparknet import aws  # lazy: boto3
    from sparknet.cluster import ec2, inventory  # lazy: boto3, fabric
    from sparknet.cluster.aws import owner  # lazy: boto3

    try:
        region = aws.check_region(region)
        wanted = _wanted(region, config)
        caller = None if all_owners else owner.caller_owner(region, endpoint_url)
        found = inventory.orphans(region, wanted, endpoint_url=endpoint_url)
    except SparknetError as exc:
        fail_cluster(exc, debug)
    swept = skipped = 0
    failed = []
    for name, cluster in sorted(found.items()):
        if caller is not None and not cluster.owned_by(caller):
            print(f"skipped {name}: {_not_yours(cluster, caller)}")
            skipped += 1
            continue
        print(f"orphan {name}: {' '.join(cluster.items)}")
        swept += 1
        if yes:
            try:
                spec = cluster_spec(name, config, {"region": region}, any_name=True)
                # an orphan is tagged EC2 resources, whatever provider a settings entry names
                report = ec2.down(
                    spec, endpoint_url=endpoint_url, say=console.print, any_owner=all_owners
                )
            except Exception as exc:  # any failure (an AWS 500 too): report it, go on to the next
                print(f"failed {name}: {first_line(exc)}")
                failed.append(name)
                continue
            print_down(report)
            print(f"took {name} down")
    if skipped:
        print(f"{skipped} cluster(s) not yours were left alone; --all-owners includes them")
    if swept and not yes:
        print("run again with --yes to delete them")
    if failed:
        fail(SparknetError(f"could not take down {', '.join(failed)} (see above)"), debug, 1)


def _wanted(region: str, config: Path | None) -> set[str]:
    """The clusters of `region` that `sweep` leaves alone: registered here, or in `clusters:`
    of the settings file (whose region is us-east-1 unless it says otherwise)."""
    from sparknet.cluster import provider, registry  # lazy: boto3

    # a static cluster owns nothing in AWS: resources tagged with its name are another's
    wanted = {
        name
        for name, spec in registry.registered().items()
        if spec.region == region and provider.of(spec).REGIONAL
    }
    path = find_config_file(config)
    if path is not None:
        for name, entry in read_section(path, "clusters").items():
            entry = entry or {}
            here = entry.get("region", "us-east-1") == region
            if here and provider.named(entry.get("provider")).REGIONAL:
                wanted.add(name)
    return wanted
