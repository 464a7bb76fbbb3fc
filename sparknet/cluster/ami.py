"""Bake a node image (AMI) with the bootstrap's install steps done, for `cluster up` to launch.

A builder instance gets the install steps, is cleaned of keys, secrets, caches, logs and history
(ami/clean.sh), scanned for a credential or private key left behind (ami/scan.sh: one found
fails the bake), stopped and imaged; the image is tagged and its id recorded in an SSM parameter,
where `ami_for` finds it for `cluster up`.

The builder is a one-node throw-away cluster (`bake-<time>-<hex>`, role master): its network,
key pair, pinned host key and tags are made exactly as `cluster up` makes a cluster's, and
whatever the bake leaves after a crash is found by `sparknet cluster sweep` like any cluster's.
What the image holds is defined in the checkout's ``ami/image.toml`` (`load_image`), whose steps
are steps.py's own classes, by name: there is no second copy of an install step.
"""

from __future__ import annotations

import math
import re
import secrets
import shlex
import tempfile
import time
import tomllib
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

from sparknet import aws, interrupts
from sparknet.cluster import address, node_endpoints, nodes, registry, sshkeys
from sparknet.cluster.aws import instances, keys, launcher, preflight, userdata
from sparknet.cluster.aws.boto3_foundation import ensure_boto3
from sparknet.cluster.aws.boto3_teardown import destroy_boto3
from sparknet.cluster.aws.images import RECORD_PARAMETER, ROLE_AMI, check_parameter_name, record
from sparknet.cluster.aws.owner import caller_owner
from sparknet.cluster.remote import CommandFailed, run, run_script
from sparknet.cluster.spark import bootstrap
from sparknet.cluster.spark.plan import Node, Plan
from sparknet.cluster.spark.spark_conf import DEFAULT_PREFIX
from sparknet.cluster.spark.steps import PREPARE, Step
from sparknet.cluster.spark.wheel import Wheel, build_wheel, source_checkout
from sparknet.cluster.spec import (
    DEFAULT_AMI_PARAMETER,
    MAX_BACKSTOP_MINUTES,
    PACKAGE_INDEX_PYTORCH,
    TAG_ROLE,
    ClusterSpec,
    tag_value,
)
from sparknet.errors import InputError, SparknetError
from sparknet.node.command import node_command
from sparknet.say import Say, command_line, quiet

#: the image's definition, in the checkout (beside pyproject.toml)
IMAGE_FILE = Path("ami") / "image.toml"
#: steps that must not run on a builder: the secret and the daemons belong to one cluster
NOT_BAKED = frozenset({"spark-conf", "spark-master", "spark-worker"})
#: the scripts the builder runs, beside image.toml: the clean-up, then the scan for secrets
CLEAN_SCRIPT, SCAN_SCRIPT = "clean.sh", "scan.sh"
#: image.toml's lists of paths (Image's fields of the same names)
_PATH_KEYS = ("remove", "empty", "clear", "remove_files", "truncate", "scan")
#: what an entry of those may hold: absolute globs, or ones under {prefix} (or {prefix} itself)
_PATH = re.compile(r"^(/|\{prefix\}/|\{prefix\}$)[A-Za-z0-9_./*-]*$")
#: an entry of `home`: a glob relative to a home directory
_HOME_PATH = re.compile(r"^[A-Za-z0-9_.*-][A-Za-z0-9_./*-]*$")
#: an entry of `scan_skip`: a `find -path` pattern
_SKIP = re.compile(r"^[A-Za-z0-9_./*-]+$")
#: how many of the files the scan found its error names
_NAMED = 5
#: AWS's rule for an image name: 3-128 of letters, digits and ( ) [ ] space . / - ' @ _
_IMAGE_NAME = re.compile(r"^[A-Za-z0-9()\[\] ./'@_-]{3,128}$")


# --- what the image is ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Image:
    """ami/image.toml: the bootstrap steps the builder runs, what is cleaned off it, and where
    the scan before the snapshot looks for a credential or private key left behind."""

    steps: tuple[type[Step], ...]
    #: removed, whatever they are
    remove: tuple[str, ...]
    #: directories whose files are deleted, the directories kept
    empty: tuple[str, ...]
    #: removed where a regular file; a symlink stays (Ubuntu links D-Bus's machine id to systemd's)
    remove_files: tuple[str, ...] = ()
    #: files emptied, kept (systemd writes a new machine id into an empty /etc/machine-id)
    truncate: tuple[str, ...] = ()
    #: directories whose whole contents go (dotfiles and subdirectories too), the directories kept
    clear: tuple[str, ...] = ()
    #: globs relative to a home directory, removed in every home: root's, each of /home/*, the
    #: login user's and each user's of /etc/passwd (never through a link below the home)
    home: tuple[str, ...] = ()
    #: directories the scan searches (besides every home)
    scan: tuple[str, ...] = ()
    #: `find -path` patterns the scan does not look into ("*" matches "/" too)
    scan_skip: tuple[str, ...] = ()


def load_image(path: Path | None = None) -> Image:
    """The image definition at `path` (default: the checkout's ami/image.toml); a one-line error
    naming a step steps.py does not have, one that must not be baked, or a bad path."""
    path = path or source_checkout() / IMAGE_FILE
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise InputError(f"{path}: {nodes.describe(exc)}") from exc
    by_name = {cls.name: cls for cls in PREPARE}
    steps = []
    for name in data.get("steps", []):
        if name in NOT_BAKED:
            raise InputError(f"{path}: step {name!r} belongs to a cluster, not to an image")
        if name not in by_name:
            raise InputError(
                f"{path}: no bootstrap step {name!r}; steps.py has {', '.join(by_name)}"
            )
        steps.append(by_name[name])
    lists = {key: tuple(data.get(key, [])) for key in (*_PATH_KEYS, "home", "scan_skip")}
    for key, entries in lists.items():
        pattern, what = {
            "home": (_HOME_PATH, "a path or glob relative to a home directory"),
            "scan_skip": (_SKIP, "a find -path pattern"),
        }.get(key, (_PATH, "an absolute path or glob (or one under {prefix}/)"))
        for entry in entries:
            if not isinstance(entry, str) or not pattern.fullmatch(entry) or ".." in entry:
                raise InputError(f"{path}: {key}: {entry!r} is not {what}")
    return Image(tuple(steps), **lists)


def _script(name: str) -> str:
    """The text of one of the builder's scripts (ami/clean.sh, ami/scan.sh) in the checkout."""
    path = source_checkout() / IMAGE_FILE.parent / name
    try:
        return path.read_text()
    except OSError as exc:
        raise InputError(f"{path}: {nodes.describe(exc)}") from exc


def _resolve(entry: str, prefix: str, top: str) -> tuple[str, str]:
    """An image.toml entry as (base, the rest) on the builder: {prefix} the install prefix,
    "/" `top` (the base is a path, the rest a glob)."""
    if entry.startswith("{prefix}"):
        return prefix.rstrip("/"), entry.removeprefix("{prefix}")
    return top, entry


def _script_command(
    name: str, root: str, login_home: str | None, args: list[tuple[str, ...]]
) -> str:
    """`sh -c SCRIPT` with its arguments: ROOT, the login user's home (None: the running shell's
    "$HOME", expanded before any sudo: the user the bake logs in as) and the lists' words."""
    home = '"$HOME"' if login_home is None else shlex.quote(login_home)
    words = [shlex.quote(w) for pair in args for w in pair]
    quoted_root = shlex.quote(root.rstrip("/"))
    return " ".join(["sh", "-c", shlex.quote(_script(name)), name, quoted_root, home, *words])


def cleanup_command(
    image: Image, prefix: str, root: str = "/", login_home: str | None = None
) -> str:
    """The command that cleans the builder as `image` says (ami/clean.sh with image.toml's
    lists); a glob that matches nothing removes nothing. `root` is where the entries' "/" is
    (tests clean a directory, not the machine they run on); on the builder's own root,
    cloud-init's clean-up runs first where cloud-init is installed (its state and logs: the
    image's first boot is a first boot). `login_home`: see `_script_command`."""
    top = root.rstrip("/")
    lists = (
        ("remove", image.remove),
        ("empty", image.empty),
        ("clear", image.clear),
        ("remove-file", image.remove_files),
        ("truncate", image.truncate),
    )
    args = [(name, *_resolve(e, prefix, top)) for name, entries in lists for e in entries]
    args += [("home", "", e) for e in image.home]
    return _script_command(CLEAN_SCRIPT, root, login_home, args)


def scan_command(image: Image, prefix: str, root: str = "/", login_home: str | None = None) -> str:
    """The command that lists what on the builder looks like a credential or a private key
    (ami/scan.sh over image.toml's `scan` directories and every home, `scan_skip` not looked
    into): one "PATH<TAB>WHY" line each (`scan_found` reads them)."""
    top = root.rstrip("/")
    args = [("dir", "".join(_resolve(e, prefix, top))) for e in image.scan]
    args += [("skip", e) for e in image.scan_skip]
    return _script_command(SCAN_SCRIPT, root, login_home, args)


def scan_found(out: str) -> dict[str, str]:
    """The scan's output as path -> why, in its order (one reason a path: the first)."""
    found: dict[str, str] = {}
    for line in out.splitlines():
        path, _, why = line.partition("\t")
        if path.strip():
            found.setdefault(path, why.strip() or "found")
    return found


def scan_refusal(builder: str, found: dict[str, str]) -> SparknetError:
    """The one-line error of a bake whose builder still holds `found` after its clean-up."""
    named = [f"{path} ({why})" for path, why in list(found.items())[:_NAMED]]
    more = f" and {len(found) - _NAMED} more" if len(found) > _NAMED else ""
    return SparknetError(
        f"bake refused: after the clean-up the builder {builder} still holds what looks like a "
        f"credential or private key: {', '.join(named)}{more}; remove it in an install step or "
        f"list it in {IMAGE_FILE} (`remove`, or `scan_skip` if it is no secret)"
    )


# --- the bake ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BakeSettings:
    """What `sparknet ami bake` takes."""

    region: str = "us-east-1"
    #: the base AMI id; None: the value of `ami_parameter`
    base_ami: str | None = None
    ami_parameter: str = DEFAULT_AMI_PARAMETER
    #: the builder's; None: a cluster master's default (`preflight.in_region`: g5.xlarge, or
    #: where the region lacks it the first default worker type it offers)
    instance_type: str | None = None
    root_volume_gb: int = 100
    #: SSH source of the builder; None: the caller's /32
    allowed_cidr: str | None = None
    #: an env on the base AMI whose torch the image uses; None: the AMI's PyTorch env if it fits
    python_env: str | None = None
    #: where the builder's pip finds packages, as a cluster's `bootstrap: package_index`
    #: (`spec.check_package_index`): a builder that reaches only a company mirror needs `node`
    package_index: str = PACKAGE_INDEX_PYTORCH
    #: where sparknet installs on the builder (the clusters' nodes look there)
    prefix: str = DEFAULT_PREFIX
    #: the SSM parameter the new AMI id is recorded in
    record_parameter: str = RECORD_PARAMETER
    endpoint_url: str | None = None


@dataclass(frozen=True)
class Baked:
    """A finished bake: the image, its tags, and where its id is recorded; `left`: what its
    final clean-up could not remove and the command that does ('' when it removed everything).
    The image is good either way."""

    image_id: str
    name: str
    tags: dict[str, str]
    parameter: str
    left: str = ""


@dataclass
class _MadeByBake:
    """What one bake made so far: everything its clean-up removes (the image only on failure)."""

    name: str
    created: list[str] = field(default_factory=list)
    builder: str | None = None
    key_pair: str | None = None
    image: str | None = None


def bake_name() -> str:
    """The builder's throw-away cluster name: unique per bake, a valid cluster name."""
    return f"bake-{int(time.time())}-{secrets.token_hex(3)}"


def bake(
    settings: BakeSettings,
    *,
    say: Say = quiet,
    image: Image | None = None,
    wheel: Wheel | None = None,
    root: str = "/",
    timeout_s: float = 3600,
    delay_s: float = 15.0,
) -> Baked:
    """Bake an AMI (see the module's doc); whatever the bake made but the image is removed
    again at its end, and the image too on any failure or Ctrl-C. `wheel`: a sparknet wheel
    already built from this checkout; `root`: see `cleanup_command`."""
    image = image or load_image()
    ec2 = instances.ec2_client(settings.region, settings.endpoint_url)
    spec, base = _builder_spec(settings, ec2, say)
    preflight.check_ami(ec2, base, spec.root_volume_gb)
    check_parameter_name(settings.record_parameter)
    gpus = gpu_count(ec2, spec.master_type)
    with tempfile.TemporaryDirectory(prefix="sparknet-bake-") as tmp:
        wheel = wheel or build_wheel(source_checkout(), Path(tmp))
        made = _MadeByBake(spec.name)
        try:
            baked = _bake(spec, base, settings, image, wheel, gpus, ec2, made, say, root,
                          timeout_s, delay_s)  # fmt: skip
        except BaseException as exc:
            try:
                _clean_up(spec, ec2, made, settings.endpoint_url, say, keep_image=False,
                          delay_s=delay_s)  # fmt: skip
            except SparknetError as undo:
                why = "interrupted" if isinstance(exc, KeyboardInterrupt) else nodes.describe(exc)
                raise SparknetError(f"{why}; {undo}") from exc
            raise
        try:
            _clean_up(spec, ec2, made, settings.endpoint_url, say, keep_image=True,
                      delay_s=delay_s)  # fmt: skip
        except SparknetError as undo:  # the image is made and recorded: it stays good
            return replace(baked, left=str(undo))
        return baked


def _builder_spec(settings: BakeSettings, ec2: Any, say: Say) -> tuple[ClusterSpec, str]:
    """The builder's one-node cluster spec (a default type the region lacks is the first
    default type it offers: `preflight.in_region`), and the base AMI id (resolved from the
    parameter)."""
    ssm = instances.ssm_client(settings.region, settings.endpoint_url)
    chosen = {} if settings.instance_type is None else {"master_type": settings.instance_type}
    spec = ClusterSpec(
        name=bake_name(), region=settings.region, workers=0, **chosen,
        ami=settings.base_ami, ami_parameter=settings.ami_parameter,
        root_volume_gb=settings.root_volume_gb, allowed_cidr=settings.allowed_cidr,
    )  # fmt: skip
    spec = preflight.in_region(spec, ec2, say)  # the builder's type offered where it launches
    spec = spec.model_copy(update={"instance_types": [spec.master_type]})
    base = preflight.resolve_ami(spec, ssm)
    owner = caller_owner(settings.region, settings.endpoint_url)
    return spec.model_copy(update={"ami": base, "owner": owner}), base


def builder_backstop_minutes(spec: ClusterSpec, timeout_s: float) -> int:
    """The builder's backstop: twice the longest install the bake waits for, so it never ends a
    bake still under way. It is cancelled before the clean (`_versions_and_clean`), so neither
    it nor its script goes into the image."""
    return min(MAX_BACKSTOP_MINUTES, max(spec.backstop_minutes, math.ceil(2 * timeout_s / 60)))


def gpu_count(ec2: Any, instance_type: str) -> int:
    """The GPUs of `instance_type` (DescribeInstanceTypes' GpuInfo; 0 when it has none)."""
    with aws.aws_call("DescribeInstanceTypes", aws.region_of(ec2)):
        found = ec2.describe_instance_types(InstanceTypes=[instance_type])["InstanceTypes"]
    gpus = (found[0].get("GpuInfo") or {}).get("Gpus", []) if found else []
    return sum(int(g.get("Count", 0)) for g in gpus)


def _bake(
    spec: ClusterSpec,
    base: str,
    settings: BakeSettings,
    image: Image,
    wheel: Wheel,
    gpus: int,
    ec2: Any,
    made: _MadeByBake,
    say: Say,
    root: str,
    timeout_s: float,
    delay_s: float,
) -> Baked:
    """Launch the builder, install, clean, stop, image, tag and record."""
    cidr = spec.allowed_cidr or preflight.caller_cidr()
    say(f"builder {spec.name}: network and key pair")
    net = ensure_boto3(
        spec, allowed_cidr=cidr, endpoint_url=settings.endpoint_url, created=made.created
    )
    with interrupts.deferred():  # an imported key pair is known to the clean-up at once
        made.key_pair = keys.ensure_key_pair(ec2, spec, say)
    say(f"launching the builder ({spec.master_type}) from {base}")
    user_data = keys.host_key_user_data(builder_backstop_minutes(spec, timeout_s))[0]
    launched = launcher.launch(
        ec2, spec, role="master", count=1, spot=False, instance_types=[spec.master_type],
        subnet_by_az=net.subnet_by_az, security_group_id=net.security_group_id,
        instance_profile_arn=net.instance_profile_arn, ami=base,
        client_token_prefix=spec.name, key_name=keys.key_pair_name(spec.name),
        user_data=user_data,
    )  # fmt: skip
    made.builder = launched[0].id
    ready = instances.wait_ready(ec2, [made.builder], timeout_s, delay_s=delay_s)
    access = sshkeys.access_for(spec)
    keys.pin_cluster(ec2, spec.name, ready, access.known_hosts)
    (endpoint,) = node_endpoints.endpoints(spec.name, ready)
    node = Node(endpoint, prefix=settings.prefix, gpus=gpus)
    plan = Plan(
        (node,), wheel, "", python_env=settings.python_env, package_index=settings.package_index
    )
    _install(plan, access, image, made.builder, say, timeout_s)
    versions = _versions_and_clean(plan, access, image, root, made.builder, say)
    say(f"stopping the builder {made.builder}")
    with aws.aws_call("StopInstances", spec.region):
        ec2.stop_instances(InstanceIds=[made.builder])
    deadline = time.monotonic() + timeout_s
    instances.wait_instances(ec2, "instance_stopped", [made.builder], deadline, delay_s)
    tags = image_tags(spec, base, wheel.version, plan.pyspark_version, *versions)
    name = image_name(wheel.version, spec.name)
    made.image = _create_image(ec2, made.builder, name, tags)
    say(f"creating image {made.image} ({name})")
    # snapshots of a GPU image take minutes to tens of them
    deadline = time.monotonic() + timeout_s
    what = f"image {made.image}"
    instances.wait_for(ec2, "image_available", deadline, delay_s, what=what, ImageIds=[made.image])
    ssm = instances.ssm_client(spec.region, settings.endpoint_url)
    record(ssm, made.image, settings.record_parameter)
    return Baked(made.image, name, tags, settings.record_parameter)


def _install(
    plan: Plan,
    access: nodes.Access,
    image: Image,
    builder: str,
    say: Say,
    timeout_s: float,
) -> None:
    """The image's bootstrap steps on the builder; a failure is one line naming the step."""
    try:
        bootstrap.run_on_nodes(
            plan, access, plan.nodes, lambda ctx: [cls(ctx) for cls in image.steps], say,
            timeout_s,
        )  # fmt: skip
    except bootstrap.BootstrapFailed as exc:
        f = exc.failures[0]
        last = f": {f.tail[-1].strip()}" if f.tail else ""
        raise SparknetError(
            f"bake failed on the builder {builder}: step {f.step} failed ({f.what}){last}"
        ) from exc


def _versions_and_clean(
    plan: Plan, access: nodes.Access, image: Image, root: str, builder: str, say: Say
) -> tuple[str, str]:
    """(torch version, CUDA version) of the builder's venv, read before its keys, secrets,
    caches, logs and history are removed (over the same connection: the login key goes in that
    command); then the scan: a file left that looks like a credential or a private key fails
    the bake (`scan_refusal`), before anything is imaged."""
    node = plan.master

    def one(_endpoint: address.Endpoint, conn: Any) -> tuple[str, str, dict[str, str]]:
        run_script(conn, userdata.BACKSTOP_TOOL, "cancel", userdata.BACKSTOP_SCRIPT)
        out = run(conn, node_command(node.python, "torch-build"))  # node.torch_build
        torch, cuda = [*out.split(), "none", "none"][:2]
        sudo = "" if run(conn, "id -u").strip() == "0" else "sudo -n "  # the login user's
        run(conn, sudo + cleanup_command(image, node.prefix, root), timeout=300)
        found = scan_found(run(conn, sudo + scan_command(image, node.prefix, root), timeout=900))
        return torch, cuda, found

    say("cleaning the builder, then scanning it for credentials and private keys left")
    try:
        torch, cuda, found = nodes.run_all([node.endpoint], access, one, timeout=1500)[node.name]
    except nodes.NodesFailed as exc:
        # run_all's line says only the exit code: the script's last line says what it could not
        # remove (or sudo that it asks for a password)
        why = exc.failures.get(node.name)
        last = f": {why.tail[-1].strip()}" if isinstance(why, CommandFailed) and why.tail else ""
        raise SparknetError(
            "bake failed cleaning the builder: {cause}{last}", cause=exc, last=last
        ) from exc
    if found:
        raise scan_refusal(builder, found)
    return torch, cuda


def image_tags(
    spec: ClusterSpec, base: str, version: str, spark: str, torch: str, cuda: str
) -> dict[str, str]:
    """The image's tags: what it holds (sparknet, Spark, torch, CUDA), what it was made from,
    and the role and owner tags every sparknet resource carries."""
    tags = {
        "Name": f"sparknet-{version}",
        TAG_ROLE: ROLE_AMI,
        "sparknet:version": version,
        "sparknet:spark": spark,
        "sparknet:torch": torch,
        "sparknet:cuda": cuda,
        "sparknet:source-ami": base,
        "sparknet:builder": spec.name,
    }
    if spec.owner:
        tags["sparknet:owner"] = spec.owner
    return {k: tag_value(v) for k, v in tags.items()}


def image_name(version: str, bake: str) -> str:
    """A unique image name (AWS: 3-128 characters of a restricted set, unique per account and
    region): sparknet's version and the bake's name (time and random bits)."""
    name = f"sparknet-{version}-{bake}"
    if not _IMAGE_NAME.fullmatch(name):
        name = re.sub(r"[^A-Za-z0-9()\[\] ./'@_-]", "_", name)[:128]
    return name


def _create_image(ec2: Any, builder: str, name: str, tags: dict[str, str]) -> str:
    """CreateImage of the stopped builder, the image and its snapshots tagged at birth (a bake
    cut off before its end leaves nothing untagged: the clean-up, `baked_ami` and a person find
    both by their tags); the id is returned inside a deferred section, so a Ctrl-C cannot lose
    it before the clean-up knows."""
    pairs = [{"Key": k, "Value": v} for k, v in tags.items()]
    with interrupts.deferred(), aws.aws_call("CreateImage", aws.region_of(ec2)):
        return str(
            ec2.create_image(
                InstanceId=builder,
                Name=name,
                Description=f"sparknet node image ({tags['sparknet:version']})",
                TagSpecifications=[
                    {"ResourceType": "image", "Tags": pairs},
                    {"ResourceType": "snapshot", "Tags": pairs},
                ],
            )["ImageId"]
        )


def snapshots_of(ec2: Any, image_id: str, builder: str | None = None) -> list[str]:
    """The EBS snapshots behind an image: those its block device mappings name, and with
    `builder` those tagged `sparknet:builder=<builder>` (a pending image may list none yet)."""
    region = aws.region_of(ec2)
    with aws.aws_call("DescribeImages", region):
        found = ec2.describe_images(Filters=[{"Name": "image-id", "Values": [image_id]}])
    ids = {
        m["Ebs"]["SnapshotId"]
        for i in found["Images"]
        for m in i.get("BlockDeviceMappings", [])
        if m.get("Ebs", {}).get("SnapshotId")
    }
    if builder:
        by_tag = [{"Name": "tag:sparknet:builder", "Values": [builder]}]
        with aws.aws_call("DescribeSnapshots", region):
            pages = ec2.get_paginator("describe_snapshots").paginate(
                OwnerIds=["self"], Filters=by_tag
            )
            ids |= {snap["SnapshotId"] for page in pages for snap in page["Snapshots"]}
    return sorted(ids)


def _clean_up(
    spec: ClusterSpec,
    ec2: Any,
    made: _MadeByBake,
    endpoint_url: str | None,
    say: Say,
    *,
    keep_image: bool,
    delay_s: float,
) -> None:
    """Remove the builder and everything made for it, and the image too unless `keep_image`:
    each part whatever became of the others; one error at the end naming what is left and the
    command that removes it."""
    region = spec.region
    # (what is said as it starts, what stays if it fails, the step)
    undo: list[tuple[str, str, partial[Any]]] = []
    if made.image and not keep_image:
        what = f"image {made.image} and its snapshots"
        step = partial(deregister, ec2, made.image, spec.name)
        undo.append((f"deregistering the unfinished {what}", what, step))
    builder = f"the builder {made.builder}" if made.builder else "the builder"
    step = partial(_terminate_builder, ec2, spec.name, made.builder, say, delay_s)
    undo.append(("", builder, step))
    if made.key_pair:
        what = f"key pair {made.key_pair}"
        step = partial(ec2.delete_key_pair, KeyName=made.key_pair)
        undo.append((f"deleting {what}", what, step))
    if made.created:
        what = f"the builder's network ({len(made.created)} resources)"
        destroy = partial(destroy_boto3, spec, endpoint_url=endpoint_url, only=made.created)
        undo.append((f"removing {what}", what, destroy))
    what = f"the builder's key files in {registry.cluster_dir(spec.name)}"
    undo.append(("", what, partial(registry.forget_local, spec.name)))
    failed = []
    for line, what, step in undo:  # each one whatever the others did: leave as little as possible
        if line:
            say(line)
        try:
            step()
        except Exception as exc:  # said below with what it left; the next step still runs
            failed.append((what, nodes.describe(exc)))
    if failed:
        left = "; ".join(f"{what} ({why})" for what, why in failed)
        ends = [
            f"`{command_line('sparknet cluster down', spec.name, region=region)}` removes the rest"
        ]
        if made.image and not keep_image and failed[0][0].startswith("image "):
            deregister_it = (
                f"`aws ec2 deregister-image --region {region} --image-id {made.image} "
                "--delete-associated-snapshots` removes the image"
            )
            ends.insert(0, deregister_it)
        raise SparknetError(f"the bake left {left}; {'; '.join(ends)}")


def _terminate_builder(ec2: Any, bake: str, builder: str | None, say: Say, delay_s: float) -> None:
    """Terminate the builder, and any instance launched under the bake's ClientToken (a launch
    whose answer a Ctrl-C cut off), and wait until they are gone."""
    ids = {i.id for i in launcher.launched_with(ec2, bake, bake)}
    ids |= {builder} if builder else set()
    if ids:
        say(f"terminating the builder {', '.join(sorted(ids))}")
        instances.terminate(ec2, sorted(ids), wait=True, delay_s=delay_s)


def deregister(ec2: Any, image_id: str, builder: str | None = None) -> None:
    """Deregister the image and delete its snapshots (`snapshots_of`: a deregistered image's
    snapshots stay, and bill, otherwise)."""
    region = aws.region_of(ec2)
    snapshots = snapshots_of(ec2, image_id, builder)
    with aws.aws_call("DeregisterImage", region):
        ec2.deregister_image(ImageId=image_id)
    for snapshot in snapshots:
        with aws.aws_call("DeleteSnapshot", region):
            ec2.delete_snapshot(SnapshotId=snapshot)
