"""The floor a synchronization round is measured against.

A gloo all_reduce of the same bytes between plain processes on this machine, no Spark anywhere."""

from __future__ import annotations

import socket
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sparknet.training.netbind import bind_collectives, store_server


def _free_port() -> int:
    """A port free on loopback now (for tests that start their own plain gloo processes)."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


#: the ranks meet and talk on loopback only (gloo and the store have no authentication)
HOST = "127.0.0.1"


def _gloo_rank(
    rank: int, port: int, world: int, size: int, warmup: int, reps: int, queue: Any
) -> None:
    torch.set_num_threads(1)
    bind_collectives(HOST)
    store = dist.TCPStore(HOST, port, world, False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        tensor = torch.full((size,), 0.5, dtype=torch.float32)
        times = []
        for i in range(warmup + reps):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(tensor)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        queue.put((rank, times))
    finally:
        dist.destroy_process_group()


def gloo_all_reduce(size: int, warmup: int, reps: int, world: int = 2) -> list[float]:
    """Seconds per all_reduce of `size` float32 among `world` processes: the slowest rank's
    time, per repetition."""
    queue = mp.get_context("spawn").SimpleQueue()
    store = store_server(HOST, world)  # here, so no rank races another for a free port
    ranks = mp.start_processes(
        _gloo_rank, args=(store.port, world, size, warmup, reps, queue), nprocs=world,
        join=False, start_method="spawn",
    )  # fmt: skip
    try:
        while not ranks.join(timeout=0.5):
            pass
    except KeyboardInterrupt:
        for proc in ranks.processes:  # before they trip over the queue this process takes away
            proc.terminate()
        for proc in ranks.processes:
            proc.join(5)
        raise
    per_rank = dict(queue.get() for _ in range(world))
    return [max(ts) for ts in zip(*per_rank.values(), strict=True)]
