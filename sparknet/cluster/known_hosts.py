"""Reading OpenSSH known_hosts files as OpenSSH reads them, for hosts sparknet made no key for.

A static cluster's hosts are the user's: their keys are trusted from the user's own known_hosts
(static.py), so this parses what OpenSSH would accept and nothing more: comments and unreadable
lines skipped, `@cert-authority` lines left out, `@revoked` keys trusted for no host.
"""

from __future__ import annotations

from pathlib import Path

import paramiko

from sparknet.cluster import nodes
from sparknet.errors import SparknetError


def load_trusted(paths: list[Path], *, required: bool) -> paramiko.HostKeys:
    """The host keys in OpenSSH known_hosts files, read as OpenSSH reads them: comments and
    lines it cannot parse are skipped, `@cert-authority` lines are not host keys (certificates
    are not supported: such hosts need their own key line), and a key listed `@revoked` is
    trusted for no host. A file that cannot be read is an error when `required` (the spec
    named it), else skipped."""
    entries: list[paramiko.hostkeys.HostKeyEntry] = []
    revoked: set[tuple[str, str]] = set()
    for path in paths:
        try:
            text = path.read_text(errors="replace")
        except OSError as exc:
            if required:
                raise SparknetError(
                    f"cannot read the hosts' keys from {path} ({nodes.describe(exc)}); set "
                    "known_hosts to an OpenSSH known_hosts file with them"
                ) from exc
            continue
        for line in text.splitlines():
            line = line.strip()
            if not line or line.startswith("#") or line.startswith("@cert-authority"):
                continue
            marker = line.startswith("@revoked")
            entry = _entry(line.split(None, 1)[1] if marker else line)
            if entry is None:
                continue
            if marker:
                revoked.add((entry.key.get_name(), entry.key.get_base64()))
            else:
                entries.append(entry)
    trusted = paramiko.HostKeys()
    for entry in entries:
        if (entry.key.get_name(), entry.key.get_base64()) not in revoked:
            for host in entry.hostnames:
                trusted.add(host, entry.key.get_name(), entry.key)
    return trusted


def _entry(line: str) -> paramiko.hostkeys.HostKeyEntry | None:
    """One known_hosts line, or None for a line paramiko cannot read (OpenSSH skips those)."""
    try:
        return paramiko.hostkeys.HostKeyEntry.from_line(line)
    except Exception:  # InvalidHostKey, binascii errors, unknown key types: not a usable line
        return None
