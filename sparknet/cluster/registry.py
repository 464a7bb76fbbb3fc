"""The local registry of clusters under `~/.sparknet/clusters/` (`SPARKNET_HOME` moves it).

An entry per cluster this machine brought up, each cluster's dir (its key, known_hosts, Spark
secret), and the locks that keep two commands on one machine from working on one cluster at once.

The registry is a convenience, never the truth: `down`, `status` and `sweep` find everything by
the `sparknet:cluster` tag, so a lost laptop or a deleted registry still leaves no instance
running by accident.
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
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

from sparknet.cluster.spec import ClusterSpec
from sparknet.errors import SparknetError

#: where the registry lives; SPARKNET_HOME moves it (tests, several accounts)
HOME_ENV = "SPARKNET_HOME"


class ClusterBusy(SparknetError):
    """Another `up` or `down` of the same cluster holds its lock on this machine."""


class LockUnavailable(SparknetError):
    """A lock file of this machine's could not be made (`held_lock`): the settings to fix."""


def registry_dir() -> Path:
    return Path(os.environ.get(HOME_ENV) or Path.home() / ".sparknet") / "clusters"


def cluster_dir(cluster: str) -> Path:
    """The cluster's registry dir (``<registry>/<name>/``): its key, its known_hosts."""
    return registry_dir() / file_stem(cluster)


#: the cluster's Spark secret in its registry dir (mode 0600; `spark_conf.load_or_create_secret`)
SPARK_SECRET = "spark-secret"


def forget_local(cluster: str) -> None:
    """Remove the cluster's key, known_hosts and Spark secret from its registry dir (after
    `down`: the nodes they reached are gone), and the dir when nothing else is left in it."""
    base = cluster_dir(cluster)
    for name in ("id_ed25519", "id_ed25519.pub", "known_hosts", SPARK_SECRET):
        (base / name).unlink(missing_ok=True)
    with contextlib.suppress(OSError):  # Terraform state or other files stay
        base.rmdir()


def secret_file(name: str) -> Path:
    """The cluster's Spark secret: 0600 in its registry dir (removed by `down`), never in user
    data or logs."""
    return cluster_dir(name) / SPARK_SECRET


# --- the lock ----------------------------------------------------------------------------------


def file_stem(name: str) -> str:
    """`name` as a file name in the registry dir. A valid cluster name is one already; a name
    read from a tag (`down`/`sweep` of clusters an older sparknet or a person named) may hold
    anything, so it is hashed rather than allowed to leave the dir."""
    if re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name):
        return name
    return "tag-" + hashlib.sha256(name.encode()).hexdigest()[:16]


def _lock_path(name: str) -> Path:
    return registry_dir() / f"{file_stem(name)}.lock"


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


def entry_path(name: str) -> Path:
    return registry_dir() / f"{file_stem(name)}.json"


def save_entry(spec: ClusterSpec, endpoint_url: str | None) -> None:
    path = entry_path(spec.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "spec": spec.model_dump(mode="json"),
        "endpoint_url": endpoint_url,
        "saved": datetime.now(UTC).isoformat(),
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


def registered_in(name: str, region: str) -> bool:
    """The registry holds cluster `name` in `region` (an entry of another region is another
    cluster as far as AWS is concerned)."""
    known = registered().get(name)
    return known is not None and known.region == region


def forget_entry(name: str, region: str) -> None:
    """Drop the registry entry of `name` in `region`; an entry of another region stays."""
    if registered_in(name, region):
        entry_path(name).unlink(missing_ok=True)
