"""A cluster's own SSH keys on this machine.

The key pair sparknet makes for it (`new_ed25519`, `write_private_key`), the private key its
nodes are logged in with (`access_for`, checked before any node is asked: `check_key_file`), and
the nodes' pinned host keys (`pin`).

Apart from nodes.py, which only uses an `Access` once it exists: keys are made, written, checked
and pinned before any connection is opened (by `up`, `ami bake`, a static cluster's
registration), and pinning is the one thing that writes a cluster's known_hosts.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import paramiko
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from sparknet.cluster import registry
from sparknet.cluster.nodes import Access, describe
from sparknet.errors import SparknetError

if TYPE_CHECKING:
    from sparknet.cluster.spec import ClusterSpec

# --- keys ------------------------------------------------------------------------------------


def new_ed25519() -> tuple[str, str]:
    """A fresh ed25519 key pair: (private key in OpenSSH format, public key line
    ``ssh-ed25519 AAAA...``). ed25519: small, fast, and accepted by EC2 and every OpenSSH."""
    key = Ed25519PrivateKey.generate()
    private = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.OpenSSH,
        serialization.NoEncryption(),
    ).decode("ascii")
    public = key.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    )
    return private, public.decode("ascii")


def write_private_key(path: Path, private: str) -> None:
    """Write a private key readable by its owner only (0600 from the start: never a moment in
    which another user could read it), replacing any file there."""
    _replace_file(path, private)


def _replace_file(path: Path, text: str) -> None:
    """Replace `path` with `text` at once: written to a temporary file of its own beside it
    (mkstemp: mode 0600, a unique name, so concurrent writers never share one), then renamed
    over `path`; a reader sees the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def pin(known_hosts: Path, pins: Mapping[str, str | Sequence[str]], *, only: bool = False) -> None:
    """Pin host keys: `pins` maps an address (`Endpoint.address`) to its public key line
    (``ssh-ed25519 AAAA...``), or several (a host with keys of several types). An address pinned
    before gets the new keys instead of its old ones (a replaced node at a reused address); every
    other line stays, unless `only` (the file then holds exactly `pins`: a cluster's current
    nodes)."""
    keep = []
    if known_hosts.is_file() and not only:
        for line in known_hosts.read_text().splitlines():
            hosts = line.split(" ", 1)[0].split(",")
            if line.strip() and not set(hosts) & set(pins):
                keep.append(line)
    lines = keep + [
        f"{address} {' '.join(key.split()[:2])}"
        for address, keys in pins.items()
        for key in ([keys] if isinstance(keys, str) else keys)
    ]
    _replace_file(known_hosts, "".join(f"{line}\n" for line in lines))


# --- the key a cluster is logged in with -----------------------------------------------------


def access_for(spec: ClusterSpec) -> Access:
    """How sparknet logs in to the cluster's nodes: the user's `key_file` when the spec names
    its own `key_name`, else the key pair sparknet made (``<registry>/<name>/id_ed25519``); the
    cluster's own known_hosts either way."""
    base = registry.cluster_dir(spec.name)
    key = Path(spec.key_file).expanduser() if spec.key_file else base / "id_ed25519"
    return Access(key, base / "known_hosts")


def check_key_file(access: Access) -> None:
    """The private key exists, only its owner can read it (OpenSSH refuses a key others can
    read, and so does this, before any node is asked), and it opens with no passphrase as an
    ed25519, ECDSA or RSA key (what paramiko logs in with): sparknet asks for no passphrase and
    uses no SSH agent, so a key it cannot open would fail at every node, later and less clearly."""
    try:
        mode = access.key_file.stat().st_mode & 0o777
    except OSError as exc:
        raise SparknetError(
            f"key file {access.key_file} cannot be read ({describe(exc)}); set key_file to the "
            "private key of key_name"
        ) from exc
    if mode & 0o077:
        raise SparknetError(
            f"key file {access.key_file} is readable by others (mode {mode:o}); "
            f"chmod 600 {access.key_file}"
        )
    _load_key(access.key_file)


#: the private key types sparknet logs in with (paramiko's; it has no DSA any more)
KEY_TYPES: tuple[type[paramiko.PKey], ...] = (
    paramiko.Ed25519Key,
    paramiko.ECDSAKey,
    paramiko.RSAKey,
)


def _load_key(path: Path) -> paramiko.PKey:
    """The private key in `path`, in OpenSSH or PEM format; a one-line error for one protected
    by a passphrase or a file that holds none."""
    for kind in KEY_TYPES:
        try:
            return kind.from_private_key_file(str(path))
        except paramiko.PasswordRequiredException:
            raise SparknetError(
                f"key file {path} is protected by a passphrase, and sparknet uses no SSH agent: "
                "give a key without a passphrase (e.g. one made for the cluster)"
            ) from None
        except OSError as exc:
            raise SparknetError(f"key file {path} cannot be read ({describe(exc)})") from exc
        except (paramiko.SSHException, ValueError):
            continue  # another type's file, or not a key at all
    raise SparknetError(
        f"key file {path} is not an ed25519, ECDSA or RSA private key; set key_file to the "
        "private key (not its .pub)"
    )
