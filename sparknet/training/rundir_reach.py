"""Whether a cluster's executors see the driver's local run dir, proved before round 1.

Tasks write files of the run into the run dir: under either transport each worker writes its
inner optimizer state into a checkpoint, and under allreduce rank 0, a task on whichever
executor Spark picks, writes the checkpoints and the last weights, which the driver reads back
on its own machine. A local `--out` on a cluster whose executors run on other machines (no
NFS) would be written to *their* disks, and the run fail late (after its last round under
allreduce, and only when rank 0 lands elsewhere). Host names cannot tell (a node may mount the
dir, a worker on this machine may not: another mount namespace, a container), so the driver
writes a random token into the run dir and one small job reads it back on the executors.
"""

from __future__ import annotations

import contextlib
import uuid

from pyspark import SparkContext

from sparknet.errors import InputError
from sparknet.training.rundir import REACH_TOKEN, RunDir
from sparknet.training.transport import executor_hosts


def unseen_hosts(sc: SparkContext, run: RunDir, workers: int) -> list[str]:
    """The hosts of the executors that do not read the token the driver put in `run` (a local
    run dir), sorted; empty when every one does. The token is removed again either way.

    One job of max(`workers`, executors) tasks: Spark hands a stage's tasks out one per executor
    in each pass over its offers, so every idle executor gets one, and with `workers` tasks the
    Python workers the run starts anyway are reused rather than more started."""
    token = uuid.uuid4().hex
    name = f"{REACH_TOKEN}{token}"
    path = f"{run.store.uri}/{name}"

    def read(_):
        # defined here, so pickled by value: the executor's Python needs nothing of sparknet
        import socket

        try:
            with open(path, encoding="ascii") as f:
                found = f.read()
        except (OSError, UnicodeDecodeError):
            found = ""
        return socket.gethostname(), found

    tasks = max(workers, len(executor_hosts(sc)), 1)
    run.store.write_bytes(name, token.encode())
    try:
        found = sc.parallelize(range(tasks), tasks).map(read).collect()
    finally:
        with contextlib.suppress(OSError):
            run.store.delete([name])
    return sorted({host for host, text in found if text != token})


def refusal(run: RunDir, hosts: list[str]) -> InputError:
    """The one line for a run whose executors on `hosts` do not see its local run dir."""
    return InputError(
        "{@out=run} is a path on the driver's machine, but the executors on {hosts} do not see "
        "it (Spark's tasks write checkpoint files into it): give an s3:// {@out} or a path "
        "every node mounts at the same place (NFS, EFS)",
        run=str(run),
        hosts=", ".join(hosts),
    )
