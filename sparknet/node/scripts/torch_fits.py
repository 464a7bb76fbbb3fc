"""Exit with one line saying why unless this Python's torch fits the node.

Run by the Python a node's venv is made from, before the sparknet wheel is there, as
`python - FLOOR [--quick] [--gpus]` with this file as its standard input (sparknet.cluster.spark.
steps). FLOOR is the oldest torch the nodes run ("2.8": the allreduce rendezvous needs it); the
version is read from torch's metadata, no import (seconds on every check). Unless --quick on a
node without GPUs, torch is imported too (with --gpus it must see them) and its version printed.
"""

import importlib.metadata
import re
import sys


def main(argv: list[str]) -> None:
    floor, quick, gpus = argv[0], "--quick" in argv, "--gpus" in argv
    try:
        version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        sys.exit("no torch")
    have = tuple(int(x) for x in re.findall(r"\d+", version)[:2])
    if have < tuple(int(x) for x in floor.split(".")):
        sys.exit(f"torch {version} is older than {floor}, which the allreduce rendezvous needs")
    if quick and not gpus:
        return
    import torch  # lazy: seconds, and only where the check must see it import

    if gpus and not torch.cuda.is_available():
        raise AssertionError("no GPU")
    print(torch.__version__)


main(sys.argv[1:])
