"""The update's exchange in fewer bits (`sparknet.training.compress`): block quantization's
error bound, a sum over ranks that cannot wrap around, and the exchange itself on 3 real gloo
processes: the same bits on every rank and every run, within the bound of the exact mean, today's
all-reduce bit for bit under the float formats, and fewer bytes really sent, counted by the
kernel on the rank's own sockets."""

from __future__ import annotations

import os
import socket
import struct
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch

from sparknet.training import compress
from sparknet.training.compress import (
    BLOCK,
    FORMATS,
    dequantize,
    exchange_mean,
    max_error,
    quantize,
    wire_bytes,
)

QMAX = {"int8": 127, "int4": 7}
WORLD = 3
#: not a multiple of WORLD * BLOCK: the last chunk is padded
SIZE = 10_007
#: the buffer whose bytes on the wire are counted: ~1M floats
BIG = 1 << 20


def _mixed(seed: int, n: int = SIZE) -> torch.Tensor:
    """Values of many magnitudes: normal ones at several scales, huge and tiny ones, subnormals,
    a block of zeros, a block of all-equal values, and both signs."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    scales = torch.tensor([1e-3, 1.0, 1e3, 1e30, 1e-30, 1e-42, 1e-8, 50.0])
    x *= scales[torch.arange(n) // 700 % len(scales)]
    x[4 * BLOCK : 5 * BLOCK] = 0.0  # zeros on every rank: a block whose mean is 0 too
    x[6 * BLOCK : 7 * BLOCK] = 0.25 * (seed + 1)  # all equal
    x[7 * BLOCK + 5 : 9 * BLOCK] = 0.0  # zeros on one rank only, mixed with others'
    return x


def _dyadic(seed: int, n: int = SIZE) -> torch.Tensor:
    """Small multiples of 1/8: every float32 (and bf16) sum of 3 of them is exact."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-40, 41, (n,), generator=g).to(torch.float32) / 8


def _saturated(n: int = 1000) -> torch.Tensor:
    """Every value at its block's absmax, +-127 * 7 * 2**e (e per block): the scale (7 * 2**e
    under int8, 127 * 2**e under int4) and every code (+-qmax) exact, and their sum over 3 ranks
    wraps around a signed byte."""
    block = torch.arange(n) // BLOCK
    sign = torch.where(block % 2 == 0, 1.0, -1.0)
    return sign * 127 * 7 * torch.pow(2.0, (block % 9 - 4).to(torch.float32))


#: struct tcp_info's tcpi_bytes_sent (Linux 4.19 on): bytes of data the socket has sent
_TCPI_BYTES_SENT = 200


def _bytes_sent() -> dict[str, int] | None:
    """This process's TCP sockets -> the bytes each has sent so far, from the kernel's TCP_INFO
    (per socket, so per process: unlike /proc/net/dev's loopback, which counts the machine).
    None where the kernel does not say."""
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if not target.startswith("socket:["):
            continue
        try:
            with socket.socket(fileno=os.dup(int(fd))) as s:
                if s.type != socket.SOCK_STREAM or s.family not in (
                    socket.AF_INET,
                    socket.AF_INET6,
                ):
                    continue
                info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
        except OSError:
            continue
        if len(info) < _TCPI_BYTES_SENT + 8:
            return None
        out[target] = struct.unpack_from("=Q", info, _TCPI_BYTES_SENT)[0]
    return out


def _sent_during(run) -> int:
    """Bytes this process's sockets send while `run()` runs (fenced by barriers: the exchange
    is over on every rank, so all it sent has left; a barrier's few bytes count too)."""
    import torch.distributed as dist

    dist.barrier()
    before = _bytes_sent()
    run()
    dist.barrier()
    after = _bytes_sent()
    if before is None or after is None:
        return -1
    return sum(sent - before.get(sock, 0) for sock, sent in after.items())


def _rank(rank: int, port: int, out: str) -> None:
    """One of the 3 gloo ranks: every exchange the tests check, saved to `out`/rank{rank}.npz."""
    import torch.distributed as dist

    compress._PIECE_MIN = 2048  # SIZE goes in 4 pieces under none
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=60),
    )
    cpu = torch.device("cpu")
    saved: dict[str, np.ndarray] = {}
    try:
        inputs = {"mixed": _mixed(rank), "dyadic": _dyadic(rank), "saturated": _saturated()}
        for name, x in inputs.items():
            saved[f"in/{name}"] = x.numpy()
            for fmt in FORMATS:
                for run in (0, 1):
                    flat = x.clone()
                    assert exchange_mean(flat, WORLD, fmt, cpu) is flat  # in place
                    saved[f"out/{name}/{fmt}/{run}"] = flat.numpy()
        pair = dist.new_group([0, 2])  # a group of its own, as fragments exchange on
        if rank in (0, 2):
            for fmt in ("int8", "int4"):
                flat = inputs["mixed"].clone()
                saved[f"pair/{fmt}"] = exchange_mean(flat, 2, fmt, cpu, group=pair).numpy()
        try:
            exchange_mean(inputs["mixed"].clone(), 2, "int8", cpu)
        except ValueError as exc:
            saved["refused"] = np.array(str(exc))
        big = torch.randn(BIG, generator=torch.Generator().manual_seed(rank))
        for fmt in ("none", "int8", "int4"):
            flat = big.clone()
            sent = _sent_during(lambda flat=flat, fmt=fmt: exchange_mean(flat, WORLD, fmt, cpu))
            saved[f"sent/{fmt}"] = np.array(sent)
    finally:
        dist.destroy_process_group()
    np.savez(Path(out) / f"rank{rank}.npz", **saved)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict[str, np.ndarray]]:
    """The 3 ranks' inputs and results, from one spawn of 3 plain gloo processes on loopback."""
    import torch.multiprocessing as mp

    from sparknet.bench.gloo import _free_port

    out = tmp_path_factory.mktemp("ranks")
    mp.start_processes(_rank, args=(_free_port(), str(out)), nprocs=WORLD, start_method="spawn")
    return [dict(np.load(out / f"rank{r}.npz")) for r in range(WORLD)]


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def _simulated(inputs: list[torch.Tensor], fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(the exchange's result, the float32 mean it quantized), worked out here in one process:
    the chunks are whole blocks, so chunking changes no block and no bit."""
    n = inputs[0].numel()
    total = dequantize(*quantize(inputs[0], fmt), fmt, n).clone()
    for x in inputs[1:]:
        total.add_(dequantize(*quantize(x, fmt), fmt, n))
    total.div_(len(inputs))
    return dequantize(*quantize(total, fmt), fmt, n), total


def _mean_bound(inputs: list[torch.Tensor], fmt: str) -> torch.Tensor:
    """The docstring's bound of the exchanged mean, per element (float64)."""
    n = inputs[0].numel()
    _, mean32 = _simulated(inputs, fmt)
    first = sum(max_error(x, fmt) for x in inputs) / len(inputs)
    dq = [dequantize(*quantize(x, fmt), fmt, n).double().abs() for x in inputs]
    return first + max_error(mean32, fmt) + 2**-24 * sum(dq)


# --- quantization, in one process ---------------------------------------------------------


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("n", [1, 63, 64, 65, 1000, SIZE])
def test_a_round_trip_is_within_half_a_step_of_its_block(fmt, n):
    """Every value comes back within scale / 2 of its block, scale = absmax / qmax (or float32's
    smallest normal for zeros and subnormals); zeros and all-equal blocks give no NaN."""
    for seed in range(3):
        x = _mixed(seed)[:n]
        payload, scales = quantize(x, fmt)
        back = dequantize(payload, scales, fmt, n)
        assert back.dtype == torch.float32 and back.shape == (n,)
        assert torch.isfinite(back).all()
        err = (x.double() - back.double()).abs()
        bound = max_error(x, fmt)
        assert (err <= bound).all(), float((err / bound).max())
        # the bound is the stated one: half of absmax / qmax of the block
        blocks = -(-n // BLOCK)
        padded = torch.nn.functional.pad(x.double(), (0, blocks * BLOCK - n))
        absmax = padded.view(blocks, BLOCK).abs().amax(dim=1)
        step = torch.clamp(absmax / QMAX[fmt], min=torch.finfo(torch.float32).tiny)
        assert (bound <= (step / 2 * (1 + 2**-13)).repeat_interleave(BLOCK)[:n]).all()


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_special_blocks_come_back_exactly(fmt):
    """A block of zeros comes back as zeros (not NaN), a block at +-qmax * 2**e exactly, and a
    huge value next to small ones costs only its own block (whose small values become 0)."""
    x = torch.zeros(4 * BLOCK)
    x[BLOCK : 2 * BLOCK] = QMAX[fmt] * 2.0**-20
    x[2 * BLOCK : 3 * BLOCK] = -QMAX[fmt] * 2.0**40
    x[3 * BLOCK :] = torch.linspace(-1, 1, BLOCK)
    x[3 * BLOCK] = 1e35
    back = dequantize(*quantize(x, fmt), fmt, x.numel())
    assert torch.equal(back[: 3 * BLOCK], x[: 3 * BLOCK])
    assert back[3 * BLOCK] == pytest.approx(1e35, rel=1e-6)


def test_the_payload_is_a_byte_or_a_nibble_a_value_and_a_float32_scale_a_block():
    x = torch.randn(1000)
    q8, s8 = quantize(x, "int8")
    q4, s4 = quantize(x, "int4")
    assert (q8.dtype, q8.numel(), q4.dtype, q4.numel()) == (torch.int8, 1024, torch.uint8, 512)
    assert s8.dtype == s4.dtype == torch.float32 and s8.numel() == s4.numel() == 16
    with pytest.raises(ValueError, match="int8, int4"):
        quantize(x, "bf16")


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("k", [3, 4, 200])
def test_the_sum_over_k_ranks_cannot_wrap_around(fmt, k):
    """K ranks' chunks, all codes at +-qmax (whose integer sum overflows a byte), sum in float32 to
    the exact mean; varied chunks give the bound's mean of the float64 one."""
    chunk = 10 * BLOCK
    same = _saturated(chunk)
    rows = torch.stack([compress._pack(same, fmt, 1)[0] for _ in range(k)])
    assert torch.equal(compress._mean_of_rows(rows, fmt, chunk), same)
    inputs = [_mixed(seed, chunk) for seed in range(k)]
    rows = torch.stack([compress._pack(x, fmt, 1)[0] for x in inputs])
    mean = compress._mean_of_rows(rows, fmt, chunk)
    result = dequantize(*quantize(mean, fmt), fmt, chunk)
    exact = torch.stack([x.double() for x in inputs]).mean(dim=0)
    assert ((result.double() - exact).abs() <= _mean_bound(inputs, fmt)).all()


def test_wire_bytes():
    n = BIG
    assert wire_bytes(n, 3, "none") == 2 * 2 * 4 * n // 3
    assert wire_bytes(n, 3, "bf16") == wire_bytes(n, 3, "fp16") == 2 * 2 * 2 * n // 3
    chunk = -(-n // (3 * BLOCK)) * BLOCK
    assert wire_bytes(n, 3, "int8") == 2 * 2 * (chunk + chunk // BLOCK * 4)
    assert wire_bytes(n, 3, "int4") == 2 * 2 * (chunk // 2 + chunk // BLOCK * 4)
    assert wire_bytes(n, 1, "int8") == wire_bytes(n, 1, "none") == 0
    for world in (2, 3, 8, 64):
        none = wire_bytes(n, world, "none")
        assert wire_bytes(n, world, "int8") < 0.28 * none
        assert wire_bytes(n, world, "int4") < 0.15 * none


# --- the exchange, on 3 gloo ranks ---------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", ["mixed", "dyadic", "saturated"])
def test_every_rank_ends_with_the_same_bits_on_every_run(ranks, fmt, case):
    first = _bits(ranks[0][f"out/{case}/{fmt}/0"])
    for r in range(WORLD):
        for run in (0, 1):
            assert np.array_equal(_bits(ranks[r][f"out/{case}/{fmt}/{run}"]), first), (r, run)


@pytest.mark.parametrize("fmt", ["none", "bf16"])
def test_none_is_the_exact_float32_sum_over_the_world(ranks, fmt):
    """Where float32 (and bf16) sums are exact, the result is the float64 mean rounded once; in
    4 pieces under none."""
    exact = sum(ranks[r]["in/dyadic"].astype(np.float64) for r in range(WORLD)) / WORLD
    assert np.array_equal(ranks[0][f"out/dyadic/{fmt}/0"], exact.astype(np.float32))


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("case", ["mixed", "dyadic"])
def test_the_quantized_mean_is_deterministic_and_within_its_bound(ranks, fmt, case):
    """The ranks' result is, bit for bit, the two quantizations worked out here (so the same
    bits in any process), and within the docstring's bound of the float64 mean."""
    inputs = [torch.from_numpy(ranks[r][f"in/{case}"]) for r in range(WORLD)]
    got = ranks[0][f"out/{case}/{fmt}/0"]
    expected, _ = _simulated(inputs, fmt)
    assert np.array_equal(_bits(got), _bits(expected.numpy()))
    exact = torch.stack([x.double() for x in inputs]).mean(dim=0)
    err = (torch.from_numpy(got).double() - exact).abs()
    assert (err <= _mean_bound(inputs, fmt)).all()
    assert torch.isfinite(torch.from_numpy(got)).all()


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_group_of_two_of_the_ranks_exchanges_among_itself(ranks, fmt):
    """Ranks 0 and 2 in a group of their own: chunks go by rank in the group, the mean of the
    two, the same bits on both."""
    inputs = [torch.from_numpy(ranks[r]["in/mixed"]) for r in (0, 2)]
    expected, _ = _simulated(inputs, fmt)
    for r in (0, 2):
        assert np.array_equal(_bits(ranks[r][f"pair/{fmt}"]), _bits(expected.numpy()))
    assert f"pair/{fmt}" not in ranks[1]


def test_a_world_that_is_not_the_group_size_is_refused(ranks):
    """A divisor other than the group's size would give a wrong mean: refused before any byte
    goes out (on every rank, so none waits for the others)."""
    for r in range(WORLD):
        assert str(ranks[r]["refused"]) == "the mean of 3 ranks cannot be divided by a world of 2"


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_ranks_at_their_absmax_give_the_exact_mean(ranks, fmt):
    """3 ranks' codes all at +-qmax: their sum (381) would wrap a signed byte; the mean is exact."""
    assert np.array_equal(ranks[0][f"out/saturated/{fmt}/0"], _saturated().numpy())


def test_a_rank_really_sends_fewer_bytes(ranks):
    """Bytes a rank's sockets sent in one exchange of 1M floats, counted by the kernel (TCP_INFO
    per socket): int8 under 0.35x of none, int4 under 0.2x, for every rank, and each near
    `wire_bytes`."""
    for r in range(WORLD):
        sent = {fmt: int(ranks[r][f"sent/{fmt}"]) for fmt in ("none", "int8", "int4")}
        if min(sent.values()) < 0:
            pytest.skip("the kernel gives no tcpi_bytes_sent")
        assert sent["int8"] < 0.35 * sent["none"], sent
        assert sent["int4"] < 0.2 * sent["none"], sent
        for fmt, got in sent.items():
            assert got == pytest.approx(wire_bytes(BIG, WORLD, fmt), rel=0.05), (fmt, sent)
