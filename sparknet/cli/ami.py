"""`sparknet ami bake`: a node image (AMI) with the bootstrap's install steps done.

A cluster launched from it skips them."""

from __future__ import annotations

import typer

from sparknet.cli.common import (
    Caught,
    DebugOption,
    EndpointOption,
    console,
    fail,
    interrupts,
    signal_exit,
)
from sparknet.errors import InputError, SparknetError
from sparknet.say import command_line

# `# lazy: X` below: an import kept inside the command that needs it, X being slow to import
# (torch ~2 s; boto3, fabric, numpy ~0.2 s each; `+N ms`: what it adds, measured) while
# `sparknet --help` and every other command import this module

ami_app = typer.Typer(no_args_is_help=True, help="Node images (AMIs): bake.")


@ami_app.command("bake")
def ami_bake(
    region: str = typer.Option("us-east-1", help="AWS region of the builder and the image"),
    base_ami: str | None = typer.Option(None, help="base AMI id (default: --ami-parameter's)"),
    ami_parameter: str | None = typer.Option(
        None, help="SSM parameter holding the base AMI id (default: the Deep Learning AMI's)"
    ),
    instance_type: str | None = typer.Option(
        None,
        help="the builder's type (a GPU one checks CUDA) (default: g5.xlarge, or where the "
        "region lacks it the first of g4dn.xlarge, g6.xlarge it offers)",
    ),
    root_volume_gb: int = typer.Option(100, min=8, max=16384, help="the image's root volume"),
    allowed_cidr: str | None = typer.Option(None, help="SSH source (default: your /32)"),
    python_env: str | None = typer.Option(
        None, help="an env on the base AMI whose torch to use (default: its PyTorch env if it fits)"
    ),
    package_index: str | None = typer.Option(
        None,
        help="where the builder's pip finds packages, as bootstrap: package_index: pytorch "
        "(default), node (its own pip configuration) or an https:// index URL",
    ),
    record_parameter: str | None = typer.Option(
        None, help="SSM parameter the new AMI id is recorded in (`cluster up` reads it)"
    ),
    prefix: str | None = typer.Option(None, hidden=True, help="install dir on the builder"),
    endpoint_url: str | None = EndpointOption,
    debug: bool = DebugOption,
) -> None:
    """Launch a builder from the base AMI, run the install steps of ami/image.toml, clean it,
    image it, tag and record the image; the builder is terminated in every case (and the image
    removed again on failure or Ctrl-C)."""
    from sparknet.cluster import ami  # lazy: boto3, fabric

    try:
        settings = _settings(
            region=region, base_ami=base_ami, ami_parameter=ami_parameter,
            instance_type=instance_type, root_volume_gb=root_volume_gb,
            allowed_cidr=allowed_cidr, python_env=python_env, package_index=package_index,
            record_parameter=record_parameter, prefix=prefix, endpoint_url=endpoint_url,
        )  # fmt: skip
    except SparknetError as exc:
        fail(exc, debug, 2)
    caught = Caught()
    sweep = command_line("sparknet cluster sweep", region=settings.region)
    note = f"still removing the builder; `{sweep}` finds anything left"
    try:
        with interrupts(caught, stop_at=1, note=note):
            try:
                baked = ami.bake(settings, say=console.print)
            except KeyboardInterrupt as exc:
                raise SparknetError("interrupted; the builder and the image were removed") from exc
    except SparknetError as exc:
        fail(exc, debug, _exit_code(exc, caught))
    for key, value in baked.tags.items():
        print(f"{key}\t{value}")
    print(
        f"baked {baked.image_id} ({baked.name}); recorded in SSM parameter {baked.parameter}: "
        f"`{command_line('sparknet cluster up', 'NAME', region=settings.region)}` launches it"
    )
    if baked.left:  # the image is good; what the builder left still costs
        fail(SparknetError(baked.left), debug, 1)


def _exit_code(exc: SparknetError, caught: Caught) -> int:
    """128 + the signal's number when one stopped the bake (130 Ctrl-C, 143 SIGTERM), 2 for bad
    input (an option, ami/image.toml, a base AMI or type the region lacks), 1 for a failure on
    the way (AWS, a failed step on the builder)."""
    return signal_exit(caught) or (2 if isinstance(exc, InputError) else 1)


def _settings(**given):
    """BakeSettings from the options given (None: the default); a one-line error for a value
    AWS would refuse."""
    from sparknet import aws  # lazy: boto3
    from sparknet.cluster import ami, nodes  # lazy: boto3, fabric
    from sparknet.cluster.spec import check_package_index, check_ssh_cidr  # lazy: boto3

    nodes.silence_s()  # a bad SSH wait setting fails before the builder is launched
    values = {k: v for k, v in given.items() if v is not None}
    aws.check_region(values["region"])
    if values.get("base_ami") and values.get("ami_parameter"):
        raise SparknetError("give --base-ami or --ami-parameter, not both")
    if "allowed_cidr" in values:
        try:
            values["allowed_cidr"] = check_ssh_cidr(values["allowed_cidr"])
        except ValueError as exc:
            raise SparknetError(f"--allowed-cidr: {exc}") from exc
    if "package_index" in values:
        try:
            check_package_index(values["package_index"])
        except ValueError as exc:
            raise SparknetError(
                f"--package-index: {exc} (got {values['package_index']!r})"
            ) from exc
    if "endpoint_url" in values:
        aws.check_endpoint_url(values["endpoint_url"], "--endpoint-url")
    return ami.BakeSettings(**values)
