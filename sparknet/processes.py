"""Whether a process still runs, as /proc tells it.

`os.kill(pid, 0)` succeeds for a zombie: a killed child its parent has not reaped yet still has
its pid, so a lock or a clean-up that asks it would wait on (or trust) a process that is gone.
"""

from __future__ import annotations

from pathlib import Path


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"
