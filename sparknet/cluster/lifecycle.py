"""A cluster's life: `up` (idempotent; tears down what it made on error or Ctrl-C), `down`,
`status`, `list`, `sweep`, and the local registry of clusters under `~/.sparknet/clusters/`.

The registry is a convenience, never the truth: `down`, `status` and `sweep` find everything by
the `sparknet:cluster` tag, so a lost laptop or a deleted registry still leaves no instance
running by accident. `up` and `down` of one cluster hold a lock in the registry dir, so two of
them on one machine never work on the same cluster at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import secrets
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from sparknet import aws
from sparknet.cluster import ami as images
from sparknet.cluster import autostop, foundation, instances, nodes
from sparknet.cluster import bootstrap as boot
from sparknet.cluster.autostop import Settings as AutostopSettings
from sparknet.cluster.health import ClusterHealth, Expected, cluster_health
from sparknet.cluster.instances import Hourly, Instance
from sparknet.cluster.plan import Node, Plan, laid_out
from sparknet.cluster.remote import run
from sparknet.cluster.spark_conf import Ports, load_or_create_secret
from sparknet.cluster.spec import TAG_CLUSTER, TAG_OWNER, TAG_ROLE, ClusterSpec, tag_value
from sparknet.cluster.wheel import Wheel, build_wheel, source_checkout
from sparknet.errors import SparknetError

#: where the registry lives; SPARKNET_HOME moves it (tests, several accounts)
HOME_ENV = "SPARKNET_HOME"

Say = Callable[[str], None]


class ClusterBusy(SparknetError):
    """Another `up` or `down` of the same cluster holds its lock on this machine."""


class LockUnavailable(SparknetError):
    """A lock file of this machine's could not be made (`held_lock`): the settings to fix."""


class ClusterNotFound(SparknetError):
    """`down` of a name with no tagged resources in the region and no registry entry."""


class Interrupted(SparknetError):
    """Ctrl-C or SIGTERM stopped `up` (after its clean-up) or `down`."""


class OtherRegion(SparknetError):
    """`up` of a name this machine has registered (or holds Terraform state of) in another
    region."""


class BootstrapIncomplete(SparknetError):
    """The instances run but their bootstrap failed or was interrupted: they stay (billed)
    and registered, for `cluster bootstrap` to finish or `cluster down` to end."""


class NotYours(SparknetError):
    """A tagged resource of the cluster carries another principal's `sparknet:owner`."""


def registry_dir() -> Path:
    return Path(os.environ.get(HOME_ENV) or Path.home() / ".sparknet") / "clusters"


@dataclass(frozen=True)
class ClusterInfo:
    name: str
    region: str
    master: Instance | None
    workers: list[Instance]
    #: what the instances cost per hour as they run (type, market, EBS, public IPv4)
    cost: Hourly

    @property
    def instances(self) -> list[Instance]:
        return ([self.master] if self.master else []) + self.workers

    @property
    def hourly_usd(self) -> float | None:
        return self.cost.total if self.instances else None


@dataclass(frozen=True)
class DownReport:
    name: str
    region: str
    terminated: list[str]
    deleted: list[str]
    #: the estimated cost of the instances' lives, where prices are known
    cost_usd: float | None


# --- the lock ----------------------------------------------------------------------------------


def _file_stem(name: str) -> str:
    """`name` as a file name in the registry dir. A valid cluster name is one already; a name
    read from a tag (`down`/`sweep` of clusters an older sparknet or a person named) may hold
    anything, so it is hashed rather than allowed to leave the dir."""
    if re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name):
        return name
    return "tag-" + hashlib.sha256(name.encode()).hexdigest()[:16]


def _lock_path(name: str) -> Path:
    return registry_dir() / f"{_file_stem(name)}.lock"


@contextlib.contextmanager
def cluster_lock(name: str) -> Iterator[None]:
    """Hold cluster `name`'s lock (`<registry>/<name>.lock`) for the block, or refuse at once.

    A second `up` or `down` of a cluster on this machine refuses rather than waits: it would
    otherwise start from a state the first is still changing, and a user who started it by
    mistake learns so in a second, not after the first ends. `flock` is released by the kernel
    when the holder exits however it exits (kill -9 too), so no stale lock is ever left. The
    file holds the holder's PID for the refusal's message. A holder may remove the file as it
    finishes (`remove_lock`): whoever locked the removed file meanwhile sees that it is no
    longer the one at the path and locks the new one instead.
    """

    def busy(holder: str) -> ClusterBusy:
        return ClusterBusy(
            f"cluster {name} is busy: another `sparknet cluster up/down` (PID {holder}) is "
            "working on it; wait for it to end, then run this again"
        )

    with held_lock(_lock_path(name), busy):
        yield


@contextlib.contextmanager
def held_lock(path: Path, busy: Callable[[str], SparknetError]) -> Iterator[None]:
    """Hold the lock file `path` for the block, or raise `busy(holder's PID)` at once
    (`cluster_lock`'s mechanics, for any lock of one cluster's: `sparknet-submit` holds one of
    its own for its whole life). A lock that cannot be made (its dir a file or not writable)
    is one line naming it (LockUnavailable), before anything is done."""
    while True:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise LockUnavailable(
                f"cannot take the lock {path}: {exc.strerror or exc}; make its directory "
                f"writable, or set {HOME_ENV} to a directory of yours"
            ) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
            os.close(fd)
            raise busy(holder) from None
        if _is_at(fd, path):
            break
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


def _is_at(fd: int, path: Path) -> bool:
    """The open file `fd` is still the file at `path` (not removed or replaced)."""
    try:
        at = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (at.st_dev, at.st_ino) == (mine.st_dev, mine.st_ino)


def remove_lock(name: str) -> None:
    """Remove the lock file of a cluster that is gone; only while holding its lock."""
    _lock_path(name).unlink(missing_ok=True)


#: the registry's own lock and its id, beside the entries (no cluster name begins with a dot)
_REGISTRY_LOCK, _REGISTRY_ID = ".registry.lock", ".registry-id"


@contextlib.contextmanager
def registry_lock() -> Iterator[None]:
    """Hold the whole registry's lock for the block (waiting for it): what checks the other
    clusters' entries and then writes one (a static cluster's hosts against every other
    static cluster's) holds it, so two `up`s of different names cannot both pass the check.
    Held for milliseconds; released by the kernel however the holder exits."""
    path = registry_dir() / _REGISTRY_LOCK
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def registry_id() -> str:
    """This registry's id: random, made on first use and kept in the registry dir (one per
    SPARKNET_HOME), so a static host's marker tells this registry's clusters from another
    machine's (or another SPARKNET_HOME's) of the same name. It is written whole before it is
    put in place (a link of a full temp file), so a crash never leaves a part of one; one that
    does not read is one line saying how to mend it: a new id would leave the hosts this
    registry holds to a registry that no longer exists."""
    path = registry_dir() / _REGISTRY_ID
    try:
        if not path.exists() and not path.is_symlink():
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=".registry-id.") as new:
                new.write(secrets.token_hex(8) + "\n")
                new.flush()
                with contextlib.suppress(FileExistsError):  # another process made it first
                    os.link(new.name, path)
        text = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise SparknetError(
            f"cannot read this registry's id {path}: {getattr(exc, 'strerror', None) or exc}; "
            "make it a readable file of yours again"
        ) from exc
    if not re.fullmatch(r"[0-9a-f]{16}", text):
        raise SparknetError(
            f"{path} does not hold a registry id (16 hex digits): write back the one this "
            "registry's static hosts name (`registry` in the owner.json of their install "
            "prefix), or remove it if no static cluster of this registry is up anywhere"
        )
    return text


# --- the registry ------------------------------------------------------------------------------


def _entry(name: str) -> Path:
    return registry_dir() / f"{_file_stem(name)}.json"


def save_entry(spec: ClusterSpec, endpoint_url: str | None) -> None:
    path = _entry(spec.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "spec": spec.model_dump(mode="json"),
        "endpoint_url": endpoint_url,
        "saved": datetime.now(timezone.utc).isoformat(),
    }
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, path)


def registered() -> dict[str, ClusterSpec]:
    """The clusters this machine brought up and has not taken down."""
    out = {}
    for path in sorted(registry_dir().glob("*.json")):
        try:
            out[path.stem] = ClusterSpec.model_validate(json.loads(path.read_text())["spec"])
        except (ValueError, KeyError):
            continue  # a damaged entry: `list` and `sweep` still see the cluster by its tags
    return out


def _registered_in(name: str, region: str) -> bool:
    """The registry holds cluster `name` in `region` (an entry of another region is another
    cluster as far as AWS is concerned)."""
    known = registered().get(name)
    return known is not None and known.region == region


def forget_entry(name: str, region: str) -> None:
    """Drop the registry entry of `name` in `region`; an entry of another region stays."""
    if _registered_in(name, region):
        _entry(name).unlink(missing_ok=True)


# --- the owner ---------------------------------------------------------------------------------


def caller_owner(region: str, endpoint_url: str | None = None) -> str:
    """The calling principal (STS GetCallerIdentity's ARN) as an owner tag value (`tag_value`:
    a role session name may hold a comma, which IAM refuses in tags); `sweep` compares owners
    in the same form."""
    sts = aws.client("sts", region, endpoint_url)
    with aws.aws_call("GetCallerIdentity", region):
        return tag_value(str(sts.get_caller_identity()["Arn"]))


def check_owner(spec: ClusterSpec, owner: str, endpoint_url: str | None = None) -> None:
    """Refuse to touch cluster `spec.name` in its region when any of its tagged resources carries
    another principal's owner tag: in a shared account a name is no proof of whose a cluster
    is, and `up` would rewrite the other's SSH rule and role policy, `down` delete their
    cluster. Resources without an owner tag (made before sparknet tagged owners) pass."""
    cluster = tagged_clusters(spec.region, endpoint_url=endpoint_url).get(spec.name)
    others = sorted(o for o in cluster.owners if o not in (None, owner)) if cluster else []
    if others:
        raise NotYours(
            f"cluster {spec.name} in {spec.region} belongs to {', '.join(others)} (its "
            f"{TAG_OWNER} tag), not to you ({owner}); choose another name, or pass --any-owner "
            "to act on it anyway"
        )


# --- up ----------------------------------------------------------------------------------------


def _by_role(found: list[Instance], role: str) -> list[Instance]:
    return [i for i in found if i.role == role]


def _foundation_exists(spec: ClusterSpec, ec2: Any) -> bool:
    with aws.aws_call("DescribeVpcs", spec.region):
        vpcs = ec2.describe_vpcs(
            Filters=[
                {"Name": f"tag:{TAG_CLUSTER}", "Values": [spec.name]},
                {"Name": f"tag:{TAG_ROLE}", "Values": ["foundation"]},
            ]
        )["Vpcs"]
    return bool(vpcs)


def terraform_state_dir(spec: ClusterSpec) -> Path:
    """Where a cluster's Terraform state lives, unless `terraform_backend` names another:
    ``<registry>/<name>/<region>/terraform``. Keyed by region too: two regions' clusters of one
    name are two clusters (IAM names carry the region), and `down --region` of the wrong one
    must find no state to destroy. The dir of an older sparknet (``<name>/terraform``) is used
    for the region its saved variables name."""
    base = registry_dir() / _file_stem(spec.name)
    legacy = base / "terraform"
    if _state_region(legacy) == spec.region:
        return legacy
    return base / spec.region / "terraform"


def _state_region(state_dir: Path) -> str | None:
    """The region a local Terraform state dir was applied for (its saved variables); None when
    it holds no resources (never applied, or destroyed)."""
    try:
        state = json.loads((state_dir / "terraform.tfstate").read_text())
        region = json.loads((state_dir / "variables.tfvars.json").read_text())["region"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return str(region) if state.get("resources") else None


def _known_regions(name: str) -> set[str]:
    """The regions where this machine knows cluster `name`: its registry entry and any local
    Terraform state that still holds resources."""
    out = {spec.region for spec in [registered().get(name)] if spec is not None}
    base = registry_dir() / _file_stem(name)
    for state_dir in [base / "terraform", *base.glob("*/terraform")]:
        region = _state_region(state_dir)
        if region is not None:
            out.add(region)
    return out


def _check_region(spec: ClusterSpec) -> None:
    """Refuse `up` of a name this machine knows in another region: the registry, the lock and
    `down` would confuse the two clusters, and the second would inherit the first's settings."""
    elsewhere = sorted(_known_regions(spec.name) - {spec.region})
    if elsewhere:
        raise OtherRegion(
            f"cluster {spec.name} already runs in {', '.join(elsewhere)} (registered here); "
            f"take it down there first (`sparknet cluster down {spec.name} --region "
            f"{elsewhere[0]}`) or choose another name"
        )


def _ensure_foundation(
    spec: ClusterSpec, cidr: str, endpoint_url: str | None, created: list[str]
) -> foundation.Foundation:
    """The foundation, found or made; boto3 appends "kind:id" of what it makes to `created` as
    it goes, so a failure half-way still knows what to remove."""
    if spec.foundation == "terraform":
        return foundation.ensure_terraform(
            spec, allowed_cidr=cidr, state_dir=terraform_state_dir(spec), endpoint_url=endpoint_url
        )
    return foundation.ensure_boto3(
        spec, allowed_cidr=cidr, endpoint_url=endpoint_url, created=created
    )


def _has_terraform_state(spec: ClusterSpec) -> bool:
    """Terraform holds this cluster's foundation: a backend of the user's, or local state of
    this region."""
    state = terraform_state_dir(spec) / "terraform.tfstate"
    return spec.foundation == "terraform" and (
        spec.terraform_backend is not None or state.is_file()
    )


def _destroy_foundation(spec: ClusterSpec, endpoint_url: str | None) -> list[str]:
    """Terraform's destroy where its state is known; else by tag with boto3 (a lost state dir,
    or a foundation another backend made)."""
    if _has_terraform_state(spec):
        return foundation.destroy_terraform(
            spec, state_dir=terraform_state_dir(spec), endpoint_url=endpoint_url
        )
    return foundation.destroy_boto3(spec, endpoint_url=endpoint_url)


def launch_prefix(name: str) -> str:
    """The ClientToken prefix of one `up`: unique to it (time and 24 random bits), so the
    instances carrying it are exactly the ones this `up` launched, and never another's."""
    return f"{name}-{int(time.time())}-{secrets.token_hex(3)}"


@dataclass
class _Made:
    """What one `up` made so far: the only things its clean-up may remove."""

    prefix: str
    had_foundation: bool
    had_entry: bool
    launched: list[str] = field(default_factory=list)
    #: "kind:id" of the foundation resources the boto3 foundation made, as it makes them
    created: list[str] = field(default_factory=list)
    #: the EC2 key pair this `up` imported (None: it existed, or the user's own)
    key_pair: str | None = None


def check_before_up(spec: ClusterSpec, ec2: Any, ssm: Any) -> str:
    """What `up` checks before it writes or launches anything (region, zones, instance types,
    key pair and file, the AMI and its root volume); the AMI to launch. `sparknet-submit`'s
    preflight runs it too, before it says it brings a cluster up."""
    _check_region(spec)
    instances.check_zones(ec2, spec.availability_zones)
    instances.check_offered(
        ec2, [spec.master_type, *spec.instance_types], spec.availability_zones or None
    )
    instances.check_key_pair(ec2, spec.key_name)
    if spec.key_name:
        nodes.check_key_file(nodes.access_for(spec))
    ami = images.ami_for(spec, ec2, ssm)
    instances.check_ami(ec2, ami, spec.root_volume_gb)
    return ami


def up(
    spec: ClusterSpec,
    *,
    endpoint_url: str | None = None,
    say: Say = lambda _: None,
    wait_timeout_s: float = 900.0,
    wait_delay_s: float = 15.0,
    any_owner: bool = False,
    bootstrap: bool = False,
) -> ClusterInfo:
    """Bring the cluster to its spec: foundation, master, workers, all running and checked;
    with `bootstrap`, then Spark on them (`bootstrap_nodes`, its lines through `say`).

    Idempotent: what already runs (found by tag) is kept and only what is missing is launched.
    On any error, or Ctrl-C, before the bootstrap, what this call created (and only that) is
    removed again before it re-raises. A failed or interrupted bootstrap removes nothing: the
    instances run, and the error (`BootstrapIncomplete`) says they are billed and how to go on.
    The AMI is `ami.ami_for`'s: the spec's, else its own parameter's, else the region's baked
    image, else the default Deep Learning AMI. Holds the cluster's lock throughout; every
    resource it makes is tagged with the caller's identity (`sparknet:owner`), and it refuses
    (`NotYours`) a cluster of that name tagged with another owner unless `any_owner`.
    """
    ec2 = instances.ec2_client(spec.region, endpoint_url)
    ssm = instances.ssm_client(spec.region, endpoint_url)
    # everything that can fail without cost fails first, and before the lock, whose file is the
    # first thing `up` writes
    ami = check_before_up(spec, ec2, ssm)
    cidr = spec.allowed_cidr or instances.caller_cidr()
    spec = spec.model_copy(update={"owner": caller_owner(spec.region, endpoint_url)})
    if not any_owner:
        check_owner(spec, str(spec.owner), endpoint_url)
    with cluster_lock(spec.name), tempfile.TemporaryDirectory(prefix="sparknet-wheel-") as tmp:
        # what the bootstrap brings from here is ready before anything is launched: a broken
        # checkout or a secret others can read fails before any money is spent
        carried = carry_or_unlock(spec, Path(tmp)) if bootstrap else None
        info = _build(spec, ec2, ami, cidr, endpoint_url, say, wait_timeout_s, wait_delay_s)
        if carried is not None:
            _bootstrap_after_up(spec, ec2, info, say, carried)
        return info


def _bootstrap_after_up(
    spec: ClusterSpec, ec2: Any, info: ClusterInfo, say: Say, carried: Carried
) -> None:
    """The bootstrap as the last part of `up`. Its failure or Ctrl-C leaves the instances as
    they are (a step fails far more often for a reason the user fixes, such as a package
    mirror, than for one a fresh instance cures, and relaunching costs minutes each time): the
    one-line error says they run and are billed, and what finishes or ends them."""
    where = f"{spec.name} --region {spec.region}"
    stay = (
        f"the cluster's {len(info.instances)} instances stay up and registered (and are "
        f"billed): `sparknet cluster bootstrap {where}` finishes it, `sparknet cluster down "
        f"{where}` ends them"
    )
    try:
        report = _bootstrap_locked(spec, ec2, info.instances, say, carried)
    except KeyboardInterrupt as exc:
        raise Interrupted(f"interrupted during the bootstrap; {stay}") from exc
    except boot.JobRunning:
        raise  # refused before anything changed: nothing is incomplete
    except SparknetError as exc:
        first, *rest = str(exc).splitlines() or [type(exc).__name__]
        raise BootstrapIncomplete("\n".join([f"{first}; {stay}", *rest])) from exc
    say_report(report, say)


def _build(
    spec: ClusterSpec,
    ec2: Any,
    ami: str,
    cidr: str,
    endpoint_url: str | None,
    say: Say,
    wait_timeout_s: float,
    wait_delay_s: float,
) -> ClusterInfo:
    """`up` once the checks passed, under the cluster's lock."""
    made = _Made(
        prefix=launch_prefix(spec.name),
        had_foundation=_foundation_exists(spec, ec2),
        had_entry=_entry(spec.name).exists(),
    )
    try:
        base = _ensure_foundation(spec, cidr, endpoint_url, made.created)
        save_entry(spec, endpoint_url)
        say(f"foundation ready: {base.vpc_id}, security group {base.security_group_id}")
        # a shutting-down instance is going away: it is no member, and one is launched for it
        running = [i for i in instances.find(ec2, spec.name) if i.state != "shutting-down"]
        running = _shrink(ec2, spec, running, say, wait_delay_s)
        started = instances.start_stopped(ec2, running, delay_s=wait_delay_s)
        if started:
            say(f"starting {len(started)} stopped instances: {', '.join(started)}")
        made.key_pair = nodes.ensure_key_pair(ec2, spec, say)
        common = dict(
            subnet_by_az=base.subnet_by_az, security_group_id=base.security_group_id,
            instance_profile_arn=base.instance_profile_arn, ami=ami,
            client_token_prefix=made.prefix,
            key_name=spec.key_name or nodes.key_pair_name(spec.name),
        )  # fmt: skip
        if not _by_role(running, "master"):
            say(f"launching the master ({spec.master_type})")
            master = instances.launch(
                ec2, spec, role="master", count=1, spot=False,
                instance_types=[spec.master_type], user_data=nodes.host_key_user_data()[0],
                **common,
            )  # fmt: skip
            made.launched += [i.id for i in master]
        missing = spec.workers - len(_by_role(running, "worker"))
        if missing > 0:
            market = "spot" if spec.spot else "on-demand"
            say(f"launching {missing} {market} workers ({', '.join(spec.instance_types)})")
            # one host key for the workers of one launch request: RunInstances gives all of them
            # the same user data, and a launch stays all-or-nothing (see `instances.launch`)
            workers = instances.launch(
                ec2, spec, role="worker", count=missing, spot=spec.spot,
                instance_types=list(spec.instance_types),
                user_data=nodes.host_key_user_data()[0], **common,
            )  # fmt: skip
            made.launched += [i.id for i in workers]
        ids = [i.id for i in instances.find(ec2, spec.name) if i.state != "shutting-down"]
        ready = instances.wait_ready(ec2, ids, wait_timeout_s, delay_s=wait_delay_s)
        _pin(spec, ec2, ready, say)
    except BaseException as exc:
        try:
            _undo(spec, ec2, made, endpoint_url, say)
        except Exception as undo_exc:
            # the one case where something may be left running: say so, and what ends it
            interrupted = isinstance(exc, KeyboardInterrupt)
            why = "interrupted" if interrupted else str(exc)
            raise (Interrupted if interrupted else SparknetError)(
                f"{why}; removing what this `up` made then failed too ({undo_exc}); run "
                f"`sparknet cluster down {spec.name} --region {spec.region}` to remove the rest"
            ) from exc
        if isinstance(exc, KeyboardInterrupt):
            raise Interrupted(
                "interrupted; everything this `up` created was removed again"
            ) from exc
        raise
    masters = _by_role(ready, "master")
    return ClusterInfo(
        spec.name, spec.region, masters[0] if masters else None, _by_role(ready, "worker"),
        instances.hourly_cost(ec2, ready),
    )  # fmt: skip


def _pin(spec: ClusterSpec, ec2: Any, ready: list[Instance], say: Say) -> None:
    """Pin the nodes' host keys (from their user data) in the cluster's known_hosts, before
    anything connects to them; say which nodes have none (they will be refused)."""
    known_hosts = nodes.access_for(spec).known_hosts
    unpinned = nodes.pin_cluster(ec2, spec.name, ready, known_hosts)
    if unpinned:
        say(
            f"no host key to pin for {', '.join(unpinned)} (launched without sparknet's host "
            "key): SSH to them is refused; terminate them and run `up` again to replace them"
        )


def _shrink(
    ec2: Any, spec: ClusterSpec, running: list[Instance], say: Say, delay_s: float
) -> list[Instance]:
    """Terminate the workers beyond `spec.workers`, newest first, and return what is left.

    `up --workers 1` of a cluster with 4 workers means 1 worker: the spec is what the user pays
    for, and the registry records it. The newest go first: the oldest have the warmest caches
    and the settled host keys."""
    workers = _by_role(running, "worker")
    extra = len(workers) - spec.workers
    if extra <= 0:
        return running
    newest = sorted(workers, key=lambda i: (i.launched_at, i.id), reverse=True)[:extra]
    ids = [i.id for i in newest]
    say(f"terminating {extra} surplus workers (newest first): {', '.join(ids)}")
    instances.terminate(ec2, ids, wait=True, delay_s=delay_s)
    return [i for i in running if i.id not in ids]


def _undo(spec: ClusterSpec, ec2: Any, made: _Made, endpoint_url: str | None, say: Say) -> None:
    """Remove what one `up` made, and nothing else: the instances it launched (the ids
    `launch` returned, and any carrying its unique ClientToken prefix: a launch whose answer a
    Ctrl-C cut off), the foundation resources it created, and the registry entry it wrote.
    Another `up` of the same cluster from another machine may have launched instances or made
    the foundation meanwhile; those stay."""
    ours = set(made.launched)
    ours |= {i.id for i in instances.launched_with(ec2, spec.name, made.prefix)}
    if ours:
        say(f"removing the {len(ours)} instances this run launched")
        instances.terminate(ec2, sorted(ours), wait=True, delay_s=1.0)
    if made.key_pair:
        with aws.aws_call("DeleteKeyPair", spec.region):
            ec2.delete_key_pair(KeyName=made.key_pair)
    if spec.foundation == "terraform":
        if not made.had_foundation:
            # the lock keeps other `up`s on this machine out of the state this run applied
            _destroy_foundation(spec, endpoint_url)
    elif made.created:
        foundation.destroy_boto3(spec, endpoint_url=endpoint_url, only=made.created)
    if not made.had_entry:
        forget_entry(spec.name, spec.region)
        nodes.forget_local(spec.name)
        remove_lock(spec.name)


# --- down and status ---------------------------------------------------------------------------


def _check_exists(spec: ClusterSpec, endpoint_url: str | None) -> None:
    """Refuse `down` of a name that has nothing to take down in the region: no registry entry,
    no Terraform state and no tagged resource there. A typo or a wrong region must not read as
    success while the real cluster runs on, so the error names the clusters that do exist, and
    the region where this machine knows the name."""
    if spec.region in _known_regions(spec.name):
        return
    found = tagged_clusters(spec.region, endpoint_url=endpoint_url)
    if spec.name in found:
        return
    raise ClusterNotFound(_not_found(spec, sorted(found)))


def _not_found(spec: ClusterSpec, there: list[str]) -> str:
    """One line: no cluster `spec.name` in its region, where it is instead, what is there."""
    elsewhere = sorted(_known_regions(spec.name) - {spec.region})
    if elsewhere:
        return (
            f"no cluster {spec.name} in {spec.region}; it is in {', '.join(elsewhere)} "
            f"(registered here): pass --region {elsewhere[0]}"
        )
    listed = (
        f"clusters there: {', '.join(there)}"
        if there
        else f"there are no sparknet clusters in {spec.region}"
    )
    return (
        f"no cluster {spec.name} in {spec.region} (no tagged resources, not registered here); "
        f"{listed}; check the name and --region"
    )


def down(
    spec: ClusterSpec,
    *,
    endpoint_url: str | None = None,
    say: Say = lambda _: None,
    any_owner: bool = False,
) -> DownReport:
    """Terminate the cluster's instances (waiting until they are gone), delete its foundation,
    and estimate what its instances cost as they ran. Works from tags alone; holds the cluster's
    lock; `ClusterNotFound` when there is nothing of that name to take down, `NotYours` when
    another principal's owner tag is on it (unless `any_owner`)."""
    ec2 = instances.ec2_client(spec.region, endpoint_url)
    if not instances.find(ec2, spec.name):
        _check_exists(spec, endpoint_url)  # before the lock: a typo leaves no file behind
    if not any_owner:
        check_owner(spec, caller_owner(spec.region, endpoint_url), endpoint_url)
    with cluster_lock(spec.name):
        found = instances.find(ec2, spec.name)
        cost = lifetime_cost(ec2, found, datetime.now(timezone.utc))
        _stop_spark(spec, ec2, found, say)
        say(f"terminating {len(found)} instances")
        terminated = instances.terminate_cluster(ec2, spec.name, wait=True, delay_s=1.0)
        deleted = nodes.delete_key_pairs(ec2, spec.name)
        deleted += _destroy_foundation(spec, endpoint_url)
        if spec.name not in registered() or _registered_in(spec.name, spec.region):
            nodes.forget_local(spec.name)  # not the key of the name's cluster in another region
        forget_entry(spec.name, spec.region)
        remove_lock(spec.name)
    return DownReport(spec.name, spec.region, terminated, deleted, cost)


def lifetime_cost(ec2: Any, found: list[Instance], now: datetime) -> float | None:
    """USD the instances cost from launch to `now` at their current hourly price (type, market,
    EBS, public IPv4); None when any price is unknown."""
    hourly_of = instances.hourly_costs(ec2, found)
    total = 0.0
    for inst in found:
        hourly = hourly_of[inst.id].total
        if hourly is None:
            return None
        total += hourly * max(0.0, (now - inst.launched_at).total_seconds()) / 3600
    return total


def status(spec: ClusterSpec, *, endpoint_url: str | None = None) -> ClusterInfo:
    """The cluster's live instances and what they cost per hour; `ClusterNotFound` (naming the
    clusters that exist) when the region has nothing of that name at all."""
    ec2 = instances.ec2_client(spec.region, endpoint_url)
    found = instances.find(ec2, spec.name)
    if not found:
        _check_exists(spec, endpoint_url)
    masters = _by_role(found, "master")
    return ClusterInfo(
        spec.name, spec.region, masters[0] if masters else None, _by_role(found, "worker"),
        instances.hourly_cost(ec2, found),
    )  # fmt: skip


def leftover_note(name: str) -> str:
    """What `cluster status` and `list` say of a cluster with no live instance whose registry
    entry, Terraform state or tagged resources are still there: the autostop timer (or a hand)
    terminates instances only, and `down` removes the rest (key pair, security group, node
    role, network, entry)."""
    return f"terminated (autostop?); `sparknet cluster down {name}` cleans up"


# --- list and sweep ----------------------------------------------------------------------------

#: (describe call, response key, id key, kind) of each tagged EC2 resource type of a foundation
_TAGGED_EC2 = (
    ("describe_vpcs", "Vpcs", "VpcId", "vpc"),
    ("describe_subnets", "Subnets", "SubnetId", "subnet"),
    ("describe_security_groups", "SecurityGroups", "GroupId", "security-group"),
    ("describe_internet_gateways", "InternetGateways", "InternetGatewayId", "internet-gateway"),
    ("describe_route_tables", "RouteTables", "RouteTableId", "route-table"),
    ("describe_vpc_endpoints", "VpcEndpoints", "VpcEndpointId", "vpc-endpoint"),
)
#: states of a resource that is gone or going (EC2 lists deleted VPC endpoints for a while)
_GONE_STATES = frozenset({"deleted", "deleting"})


@dataclass
class TaggedCluster:
    """A cluster as its tags show it: "kind:id" of each resource, and the owner tag values
    seen on them (None for a resource without one: made before sparknet tagged owners)."""

    name: str
    items: list[str] = field(default_factory=list)
    owners: set[str | None] = field(default_factory=set)

    def owned_by(self, owner: str) -> bool:
        """Every resource carries `owner`'s tag (none lacks one, none has another's)."""
        return self.owners == {owner}


def tagged_clusters(region: str, *, endpoint_url: str | None = None) -> dict[str, TaggedCluster]:
    """Every cluster with resources in `region`: live instances, the foundation's network and
    security group (by the `sparknet:cluster` tag), and its IAM role and instance profile (IAM
    is global: by the name that carries the region, then the tag). The bucket is not listed:
    it outlives clusters."""
    ec2 = instances.ec2_client(region, endpoint_url)
    out: dict[str, TaggedCluster] = {}

    def add(tags: list[dict[str, str]], item: str) -> None:
        by_key = {t["Key"]: t["Value"] for t in tags}
        name = by_key.get(TAG_CLUSTER)
        if name is not None:
            cluster = out.setdefault(name, TaggedCluster(name))
            cluster.items.append(item)
            cluster.owners.add(by_key.get(TAG_OWNER))

    tag_key = {"Name": "tag-key", "Values": [TAG_CLUSTER]}
    live = {"Name": "instance-state-name", "Values": list(instances.LIVE_STATES)}
    with aws.aws_call("DescribeInstances", region):
        for page in ec2.get_paginator("describe_instances").paginate(Filters=[tag_key, live]):
            for reservation in page["Reservations"]:
                for raw in reservation["Instances"]:
                    add(raw.get("Tags", []), f"instance:{raw['InstanceId']}")
    for pair in nodes.tagged_key_pairs(ec2):
        add(pair.get("Tags", []), f"key-pair:{pair['KeyName']}")
    for call, key, id_key, kind in _TAGGED_EC2:
        with aws.aws_call(call, region):
            for page in ec2.get_paginator(call).paginate(Filters=[tag_key]):
                for item in page[key]:
                    if str(item.get("State", "")).lower() not in _GONE_STATES:
                        add(item.get("Tags", []), f"{kind}:{item[id_key]}")
    _add_iam(region, endpoint_url, add)
    return out


def _add_iam(region: str, endpoint_url: str | None, add: Callable[[list, str], None]) -> None:
    """The node roles and instance profiles of the region's clusters (IAM is global: by the
    name, which carries the region, then the tag). Profiles are listed on their own: one whose
    role is gone still names the cluster and must still be found and deleted."""
    iam = aws.client("iam", region, endpoint_url)

    def ours(name: str) -> bool:
        return name.startswith("sparknet-") and name.endswith(f"-{region}")

    with aws.aws_call("ListRoles", region):
        for page in iam.get_paginator("list_roles").paginate():
            for role in page["Roles"]:
                if ours(role["RoleName"]):
                    with contextlib.suppress(iam.exceptions.NoSuchEntityException):  # going
                        tags = iam.list_role_tags(RoleName=role["RoleName"])["Tags"]
                        add(tags, f"iam-role:{role['RoleName']}")
    with aws.aws_call("ListInstanceProfiles", region):
        for page in iam.get_paginator("list_instance_profiles").paginate():
            for profile in page["InstanceProfiles"]:
                name = profile["InstanceProfileName"]
                if ours(name):
                    with contextlib.suppress(iam.exceptions.NoSuchEntityException):  # going
                        found = iam.get_instance_profile(InstanceProfileName=name)
                        tags = found["InstanceProfile"].get("Tags", [])
                        add(tags, f"instance-profile:{name}")


def orphans(
    region: str, wanted: set[str], *, endpoint_url: str | None = None
) -> dict[str, TaggedCluster]:
    """Clusters with resources in `region` that nobody wants (not in `wanted`)."""
    return {
        name: cluster
        for name, cluster in tagged_clusters(region, endpoint_url=endpoint_url).items()
        if name not in wanted
    }


# --- Spark on the nodes ------------------------------------------------------------------------


def secret_file(name: str) -> Path:
    """The cluster's Spark secret: 0600 in its registry dir (removed by `down`), never in user
    data or logs."""
    return nodes.cluster_dir(name) / nodes.SPARK_SECRET


def instance_gpus(ec2: Any, types: list[str]) -> dict[str, int]:
    """GPUs per instance type (DescribeInstanceTypes' GpuInfo; 0 for a type without)."""
    wanted = sorted(set(types))
    if not wanted:
        return {}
    with aws.aws_call("DescribeInstanceTypes", aws.region_of(ec2)):
        found = ec2.describe_instance_types(InstanceTypes=wanted)["InstanceTypes"]
    gpus = {t: 0 for t in wanted}
    for info in found:
        gpus[info["InstanceType"]] = sum(
            int(g.get("Count", 0)) for g in (info.get("GpuInfo") or {}).get("Gpus", [])
        )
    return gpus


def plan_nodes(spec: ClusterSpec, ec2: Any, found: list[Instance]) -> list[Node]:
    """The cluster's instances as the bootstrap's nodes, master first: each reached at its
    seam endpoint, its daemons bound to its private address, its GPUs those of its instance
    type unless `bootstrap.gpus_per_node` says otherwise."""
    named = nodes.node_names(found)
    if not named or named[0][0] != "master":
        raise SparknetError(
            f"cluster {spec.name} has no running master; `sparknet cluster up {spec.name}` "
            "launches one"
        )
    override = spec.bootstrap.gpus_per_node
    gpus = {} if override is not None else instance_gpus(ec2, [i.type for _, i in named])
    return [
        laid_out(
            spec.name,
            nodes.endpoint_of(spec.name, name, inst),
            inst.private_ip,
            override if override is not None else gpus[inst.type],
        )
        for name, inst in named
    ]


def ports_of(spec: ClusterSpec) -> Ports:
    s = spec.bootstrap
    return Ports(master=s.master_port, master_ui=s.master_ui_port, worker_ui=s.worker_ui_port)


def _live(ec2: Any, spec: ClusterSpec) -> list[Instance]:
    """The cluster's running instances; `ClusterNotFound` when it has none."""
    found = [i for i in instances.find(ec2, spec.name) if i.state == "running"]
    if not found:
        raise ClusterNotFound(
            f"cluster {spec.name} has no running instances in {spec.region}; "
            f"`sparknet cluster up {spec.name}` starts it"
        )
    return found


def _reach(spec: ClusterSpec, ec2: Any, found: list[Instance]) -> nodes.Access:
    """The cluster's access with its nodes' host keys pinned afresh from their user data."""
    access = nodes.access_for(spec)
    nodes.check_key_file(access)
    nodes.pin_cluster(ec2, spec.name, found, access.known_hosts)
    return access


def reach(spec: ClusterSpec, ec2: Any, found: list[Instance]) -> nodes.Access:
    """`_reach` for sparknet-submit, which connects to the master of a running cluster."""
    return _reach(spec, ec2, found)


@dataclass(frozen=True)
class Carried:
    """What the bootstrap brings to the nodes from this machine."""

    #: the sparknet wheel of this checkout (in a directory that lives as long as the bootstrap)
    wheel: Wheel
    #: the cluster's Spark secret (`secret_file`)
    secret: str = field(repr=False)


def carry(spec: ClusterSpec, wheel_dir: Path) -> Carried:
    """The wheel of this checkout, built into `wheel_dir`, then the cluster's secret (made
    0600 on first use; one others can read is refused): the wheel first, so a checkout that
    does not build leaves no secret behind."""
    wheel = build_wheel(source_checkout(), wheel_dir)
    return Carried(wheel, load_or_create_secret(secret_file(spec.name)))


def carry_or_unlock(spec: ClusterSpec, wheel_dir: Path) -> Carried:
    """`carry` as `up`'s first step under the lock; when it fails, a cluster this machine
    has no entry for is left without the lock file just made (nothing else was written)."""
    had_entry = _entry(spec.name).exists()
    try:
        return carry(spec, wheel_dir)
    except BaseException:
        if not had_entry:
            remove_lock(spec.name)
        raise


def _bootstrap_locked(
    spec: ClusterSpec,
    ec2: Any,
    found: list[Instance],
    say: Say,
    carried: Carried | None = None,
    force: bool = False,
) -> boot.BootstrapReport:
    """The bootstrap of the cluster's `found` instances, under its lock."""
    access = _reach(spec, ec2, found)
    return bootstrap_locked(spec, plan_nodes(spec, ec2, found), access, say, carried, force)


def bootstrap_locked(
    spec: ClusterSpec,
    planned: list[Node],
    access: nodes.Access,
    say: Say,
    carried: Carried | None = None,
    force: bool = False,
) -> boot.BootstrapReport:
    """The bootstrap of the cluster's `planned` nodes (any provider's), under its lock:
    `carried` (else the wheel of this checkout and the cluster's secret, made on first use),
    the spec's settings; `BootstrapIncomplete` when it fails. Unless `force`, `JobRunning`
    (before anything changes) where it would restart the master under a running job."""
    settings = spec.bootstrap
    with tempfile.TemporaryDirectory(prefix="sparknet-wheel-") as wheel_dir:
        carried = carried or carry(spec, Path(wheel_dir))
        plan = Plan(
            tuple(planned), carried.wheel, carried.secret,
            ports=ports_of(spec), python_env=settings.python_env,
            worker_cores=settings.worker_cores, worker_memory_mb=settings.worker_memory_mb,
            install_drivers=spec.provider == "aws", autostop=autostop_settings(spec),
        )  # fmt: skip
        say(f"bootstrapping {len(plan.nodes)} nodes (sparknet {plan.wheel.version})")
        try:
            return boot.bootstrap(plan, access, say=say, force=force)
        except boot.JobRunning as exc:
            raise boot.JobRunning(f"cluster {spec.name}: {exc}") from None
        except SparknetError as exc:  # a step failed, a node is unreachable, or not healthy
            raise BootstrapIncomplete(str(exc)) from exc


def autostop_settings(spec: ClusterSpec) -> AutostopSettings | None:
    """The master's autostop timer of an EC2 cluster; none on a static one (its machines are
    the user's: nothing to terminate)."""
    if spec.provider != "aws":
        return None
    return AutostopSettings(spec.name, spec.region, spec.autostop_minutes)


def autostop_status(
    spec: ClusterSpec, found: list[Instance], *, endpoint_url: str | None = None
) -> str:
    """`cluster status`'s autostop line, from the deadline file on the master (over SSH);
    ``autostop: unknown: <why>`` when the master does not answer."""
    ec2 = instances.ec2_client(spec.region, endpoint_url)
    running = [i for i in found if i.state == "running"]
    if not _by_role(running, "master"):
        return "autostop: unknown: the master is not running"
    try:
        access = _reach(spec, ec2, running)
        master = plan_nodes(spec, ec2, running)[0]
        conn = nodes.connect(master.endpoint, access, 5)
        try:
            text = run(conn, autostop.read_command(master.prefix), timeout=30)
        finally:
            conn.close()
    except SparknetError as exc:
        return f"autostop: unknown: {next(iter(str(exc).splitlines()), 'no answer')}"
    return autostop.status_line(text or None, time.time())


def bootstrap_nodes(
    spec: ClusterSpec,
    *,
    endpoint_url: str | None = None,
    say: Say = lambda _: None,
    force: bool = False,
) -> boot.BootstrapReport:
    """`sparknet cluster bootstrap`: the bootstrap again on the cluster's running instances
    (idempotent: what is done is skipped), under the cluster's lock; `JobRunning` where it
    would restart the master under a running job, unless `force`."""
    ec2 = instances.ec2_client(spec.region, endpoint_url)
    found = _live(ec2, spec)
    with cluster_lock(spec.name):
        report = _bootstrap_locked(spec, ec2, found, say, force=force)
    say_report(report, say)
    return report


def say_report(report: boot.BootstrapReport, say: Say) -> None:
    """Per node what the bootstrap applied (or that there was nothing to do), then the
    cluster's health."""
    for line in report.lines() + report.health.lines():
        say(line)


def spark_health(
    spec: ClusterSpec, found: list[Instance], *, endpoint_url: str | None = None
) -> ClusterHealth:
    """The Spark cluster's health as its master tells it (workers registered, cores, GPUs);
    a SparknetError when the master node takes no SSH connection within 5 s."""
    ec2 = instances.ec2_client(spec.region, endpoint_url)
    running = [i for i in found if i.state == "running"]
    access = _reach(spec, ec2, running)
    plan = plan_nodes(spec, ec2, running)
    expected = [Expected(n.name, n.rpc_host, spec.bootstrap.worker_cores, n.gpus) for n in plan]
    return cluster_health(plan[0], ports_of(spec), expected, access, connect_timeout=5)


def _stop_spark(spec: ClusterSpec, ec2: Any, found: list[Instance], say: Say) -> None:
    """Stop the Spark daemons before the instances go, where this machine bootstrapped them
    (the cluster's secret is here): a daemon outlives nothing on EC2, but on a node that is not
    terminated (the seam's, a test's) it would. Best effort: nodes that cannot be reached are
    said and skipped, as terminating ends their daemons anyway."""
    running = [i for i in found if i.state == "running"]
    if not running or not secret_file(spec.name).is_file():
        return
    try:
        access = _reach(spec, ec2, running)
        boot.stop_daemons(plan_nodes(spec, ec2, running), access, timeout=60)
    except SparknetError as exc:
        first = next(iter(str(exc).splitlines()), "")
        say(f"could not stop the Spark daemons first ({first}); terminating ends them")
    else:
        say(f"stopped the Spark daemons on {len(running)} nodes")
