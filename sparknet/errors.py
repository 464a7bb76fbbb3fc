"""The one exception type users see: its message is a single line that says what to fix; and the
one place that tells a permanent fault (no retry can heal it) from a transient one."""

from __future__ import annotations

import errno
import re


class SparknetError(Exception):
    """A problem with the user's input or environment; the CLI prints it without a traceback."""


class PermanentTaskError(SparknetError):
    """Raised inside a Spark task for a fault that a retry cannot heal (a shard whose bytes differ
    from the manifest, a missing object): the task hands it back to the driver, which fails the run
    at once instead of letting Spark retry the task."""


class InputError(SparknetError):
    """A problem the user fixes in what they gave: an option, a setting, a file, a name or id
    that AWS would refuse or does not have. Commands that tell it apart from a failure on the
    way (AWS, a node, an interrupt) exit 2 for it, 1 for those."""


#: errnos no retry heals: the disk or the quota is full, the file system is read-only, access is
#: refused, the file is larger than the file system takes. A retried task or a restarted stage
#: meets the same answer (a full disk cost three stage restarts, ~90 s, before its error).
PERMANENT_ERRNOS = frozenset(
    {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG}
)

#: what a permanent fault's text looks like once it crossed a process as text (a Python worker's
#: traceback inside a Py4J error): sparknet's own errors, or an OSError with one of the errnos
_PERMANENT_TEXT = re.compile(
    r"\b(?:sparknet\.errors\.)?(?:PermanentTaskError|SparknetError|InputError|WriteRefused): "
    r"|\[Errno (?:" + "|".join(str(n) for n in sorted(PERMANENT_ERRNOS)) + r")\]"
)


class WriteRefused(PermanentTaskError):
    """A file the file system refused for good (`PERMANENT_ERRNOS`): one line naming the dir, the
    file and what to fix, raised on the driver and in tasks alike."""

    def __init__(self, where: str, name: str, exc: OSError) -> None:
        self.where, self.name, self.errno = where, name, exc.errno
        reason = exc.strerror or str(exc)
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            text = f"{where} is full ({reason}) writing {name}: free space or use another --out"
        elif exc.errno == errno.EROFS:
            text = f"{where} is on a read-only file system ({reason}) writing {name}: use a "
            text += "writable --out"
        elif exc.errno in (errno.EACCES, errno.EPERM):
            text = f"{where} is not writable ({reason}) writing {name}: give this user write "
            text += "access to it or use another --out"
        else:
            text = f"{where} refused {name} ({reason}): use another --out"
        super().__init__(text)


def is_permanent(exc: BaseException) -> bool:
    """Whether a retry of what raised `exc` meets the same fault: sparknet's permanent and input
    errors, and an OSError with a `PERMANENT_ERRNOS` errno (itself or what caused it). Everything
    else (a lost executor, a dropped connection, a throttled call) may pass when retried."""
    seen: set[int] = set()
    at: BaseException | None = exc
    while at is not None and id(at) not in seen:
        seen.add(id(at))
        if isinstance(at, PermanentTaskError | InputError):
            return True
        if isinstance(at, OSError) and at.errno in PERMANENT_ERRNOS:
            return True
        at = at.__cause__ or at.__context__
    return False


def is_permanent_text(text: str) -> bool:
    """`is_permanent` for a fault known only by its text: a task's traceback in a Py4J error."""
    return _PERMANENT_TEXT.search(text) is not None
