"""The averaged update's exchange among a process group's ranks, in the bits `compress` asks for.

`exchange_mean` replaces each rank's float32 host buffer with its mean over the ranks. Under
"none", "bf16" and "fp16" it is the all-reduce the allreduce transport always ran: the float32
buffer (or a bf16/fp16 copy of it) summed by gloo (or NCCL when the update lives on a GPU) and
divided by the world. Under "int8" and "int4" the buffer travels block-quantized both ways, which
an all-reduce cannot do (it would sum the 8- or 4-bit codes on the wire, where K workers overflow
them, and every hop would need the scales of the others). So the exchange is a reduce-scatter and
an all-gather built by hand:

1. every rank cuts its buffer, padded with zeros, into `world` equal block-aligned chunks,
   quantizes them and sends chunk j to rank j (one `all_to_all_single`);
2. rank j dequantizes the `world` chunks it received and sums them in float32 in rank order (a
   wider type than the codes, so no count of workers can wrap around, and one fixed order of
   additions, so the same bits on every run), divides by the world and quantizes that mean;
3. the quantized mean chunks go round (one `all_gather_single`) and every rank dequantizes the
   same bytes into the same full mean: every rank ends with bit-identical buffers.

Each rank sends 2 * (world - 1) chunks of codes plus their scales: about 0.27x of float32's ring
all-reduce under int8 and 0.14x under int4, for any world (`wire_bytes`).

Quantization (`quantize`, `dequantize`) is symmetric round-to-nearest over blocks of `BLOCK`
values, each with its own float32 scale = absmax / qmax (at least float32's smallest normal;
qmax 127 for int8, 7 for int4, whose codes go two to a byte). Per element,
|x - dequantize(quantize(x))| <= scale / 2 of its block (times 1 + 2**-14 for float32's own
rounding; `max_error`).

The exchanged mean is quantized twice, the inputs and then their mean, so per element

    |result - mean_k x_k| <= (1 + 2**-14) * (mean_k s_k + s) / 2 + 2**-24 * sum_k |x_k|'

where s_k is the scale of the element's block in rank k's buffer, s that of its block of the
float32 mean before that is quantized (its absmax / qmax, at most about mean_k absmax_k / qmax),
and |x_k|' rank k's dequantized value: the last term is float32's sum, which only shows where
the ranks' values cancel. Roughly: one quantization step of the ranks'
average block absmax, absmax / 127 under int8, absmax / 7 under int4.

Inputs must be finite and below float32's max / world, as for the float all-reduce; a NaN or an
infinity in a block makes that block's mean NaN or infinite (a diverged update stays visible).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

#: the values of `compress`
FORMATS = ("none", "bf16", "fp16", "int8", "int4")

#: what the update travels as under the float formats (None: float32 as it is)
_WIRE = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}

#: the largest code of a quantized format; codes run from -qmax to qmax (symmetric: 0 is exact,
#: and a block's sign flips cost nothing)
_QMAX = {"int8": 127, "int4": 7}

#: values per quantization block. 64, not 128: a flat update runs through layers of very
#: different magnitudes, and a block's error is set by its largest value, so a smaller block
#: confines an outlier (or a layer boundary) to fewer neighbours; that matters at int4's 15
#: levels. Its cost is a float32 scale per 64 values, 0.0625 bytes a value (6% of int8's payload,
#: 12% of int4's; 128 would save half of that, 0.008x of float32's traffic).
BLOCK = 64

#: bytes of a block's scale. float32, not float16: an update's values span far more than
#: float16's range (6e-8 to 65504; a fine-tuning delta of 1e-9 would round its scale to 0 and
#: its whole block to 0, a huge one to infinity), and bf16's 8-bit mantissa would need the codes
#: computed against the rounded scale anyway. Two more bytes per 64 values is cheap for a bound
#: that holds at every magnitude.
_SCALE_BYTES = 4

#: the smallest scale: float32's smallest normal number. A block of zeros gets it (not 0, so
#: nothing divides by 0 and no NaN appears: its codes are 0 and it comes back as exact zeros), and
#: so does a block of subnormals, whose absmax / qmax would otherwise round to 0 or lose its
#: relative precision
_TINY = torch.finfo(torch.float32).tiny

#: a host buffer is all-reduced in up to this many pieces, each divided while gloo sums the
#: next, of at least `_PIECE_MIN` floats (below that a piece's fixed cost outweighs the overlap)
_PIECES, _PIECE_MIN = 4, 4 << 20


def exchange_mean(
    flat: torch.Tensor, world: int, fmt: str, on: torch.device, group=None
) -> torch.Tensor:
    """`flat` (float32, on the host, 1-D) <- its mean over the ranks of `group`, in place; on the
    wire as `fmt` says; returns `flat`. `world` is the group's size, the divisor. `on` is where
    the update lives: a CUDA device sends the float formats over NCCL from there; the quantized
    formats exchange on the host (over gloo) wherever the update lives, since the buffer is on
    the host already and quantizing is a few cheap passes over it."""
    if fmt in _QMAX:
        return _exchange_quantized(flat, world, fmt, group)
    if fmt not in _WIRE:
        raise ValueError(f"compress must be one of {', '.join(FORMATS)}, not {fmt!r}")
    return _exchange_float(flat, world, fmt, on, group)


def _exchange_float(
    flat: torch.Tensor, world: int, fmt: str, on: torch.device, group
) -> torch.Tensor:
    """The all-reduce of the float formats. A host buffer goes in pieces, each all-reduced on
    gloo's own threads, so dividing one overlaps summing the next (at 100 MB the division alone
    is a pass of ~4 ms)."""
    wire = _WIRE[fmt]
    if wire is None and on.type != "cuda":
        n = max(1, min(_PIECES, flat.numel() // _PIECE_MIN))
        pieces = [
            (piece, dist.all_reduce(piece, group=group, async_op=True)) for piece in flat.chunk(n)
        ]
        for piece, work in pieces:
            work.wait()
            piece.div_(world)
        return flat
    buf = flat.to(device=on, dtype=wire or flat.dtype)
    dist.all_reduce(buf, group=group)
    return flat.copy_(buf.to(device="cpu", dtype=flat.dtype)).div_(world)


def _exchange_quantized(flat: torch.Tensor, world: int, fmt: str, group) -> torch.Tensor:
    """The quantized reduce-scatter and all-gather of the module's docstring."""
    size = dist.get_world_size(group)
    if size != world:
        raise ValueError(f"the mean of {size} ranks cannot be divided by a world of {world}")
    n = flat.numel()
    if n == 0:  # every rank has the same size: all of them return here
        return flat
    chunk = _chunk(n, world)
    padded = flat.new_zeros(world * chunk)
    padded[:n] = flat
    rows = _pack(padded, fmt, world)
    received = torch.empty_like(rows)
    dist.all_to_all_single(received, rows, group=group)
    mine = _pack(_mean_of_rows(received, fmt, chunk), fmt, 1)
    gathered = torch.empty_like(rows)
    dist.all_gather_single(gathered, mine, group=group)
    return flat.copy_(_unpack(gathered, fmt, chunk)[:n])


def _chunk(numel: int, world: int) -> int:
    """Values per rank's chunk: `numel` over the ranks, rounded up to whole blocks."""
    return -(-numel // (world * BLOCK)) * BLOCK


def _mean_of_rows(rows: torch.Tensor, fmt: str, chunk: int) -> torch.Tensor:
    """The mean of the K chunks that `rows` (K, row bytes) hold, each dequantized to float32 and
    added in row (rank) order, one fixed sequence of float32 additions: the same bits on every
    run, and no wraparound for any K (float32 holds K * 127 * scale with room to spare)."""
    parts = _unpack(rows, fmt, chunk).view(rows.shape[0], chunk)
    total = parts[0].clone()
    for part in parts[1:]:
        total.add_(part)
    return total.div_(rows.shape[0])


def _payload_bytes(numel: int, fmt: str) -> int:
    """Bytes of the codes of `numel` values (a whole number of blocks)."""
    return numel if fmt == "int8" else numel // 2


def _pack(values: torch.Tensor, fmt: str, count: int) -> torch.Tensor:
    """`values` (`count` equal block-aligned chunks) quantized, as `count` rows of bytes: each a
    chunk's codes then its blocks' scales, so that a chunk travels as one message."""
    payload, scales = quantize(values, fmt)
    return torch.cat(
        [payload.view(torch.uint8).view(count, -1), scales.view(torch.uint8).view(count, -1)],
        dim=1,
    )


def _unpack(rows: torch.Tensor, fmt: str, chunk: int) -> torch.Tensor:
    """The float32 values of `_pack`'s rows (K, row bytes) of `chunk` values each, in row order."""
    count, cut = rows.shape[0], _payload_bytes(chunk, fmt)
    payload = rows[:, :cut].reshape(-1)
    scales = rows[:, cut:].contiguous().view(torch.float32).reshape(-1)
    return dequantize(payload, scales, fmt, count * chunk)


def quantize(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of `x`'s values in blocks of `BLOCK` (the last one padded with zeros):
    symmetric round-to-nearest (ties to even) against scale = max(absmax / qmax, float32's
    smallest normal) per block. int8: one int8 code a value; int4: uint8 bytes, each two codes
    (the first value in the low nibble), stored as code + 8 in 1..15. Scales are float32, one per
    block. Pure: the same bits for the same `x` on every machine (IEEE division, rounding and
    products only)."""
    qmax = _qmax(fmt)
    x = x.reshape(-1).to(torch.float32)
    blocks = -(-x.numel() // BLOCK)
    if x.numel() != blocks * BLOCK:
        x = torch.nn.functional.pad(x, (0, blocks * BLOCK - x.numel()))
    grid = x.view(blocks, BLOCK)
    scales = grid.abs().amax(dim=1).div_(qmax).clamp_(min=_TINY)
    codes = grid.div(scales[:, None]).round_().clamp_(-qmax, qmax).to(torch.int8).view(-1)
    if fmt == "int8":
        return codes, scales
    nibbles = codes.add_(8).view(torch.uint8).view(-1, 2)
    return nibbles[:, 0] | (nibbles[:, 1] << 4), scales


def dequantize(payload: torch.Tensor, scales: torch.Tensor, fmt: str, numel: int) -> torch.Tensor:
    """The first `numel` float32 values of `quantize`'s (codes, scales): code * scale, one
    rounding of a product."""
    _qmax(fmt)
    raw = payload.reshape(-1)
    if fmt == "int8":
        codes = raw.view(torch.int8).to(torch.float32)
    else:
        raw = raw.view(torch.uint8)
        codes = torch.stack([raw & 15, raw >> 4], dim=1).view(-1).to(torch.float32).sub_(8)
    return codes.view(-1, BLOCK).mul_(scales.view(-1, 1)).view(-1)[:numel]


def max_error(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """The bound on |x - dequantize(quantize(x))| per element (float64): half its block's
    scale, times 1 + 2**-14 for float32's rounding of x / scale and of code * scale (each within
    2**-24 relatively, on values up to qmax * scale: at most qmax * 2**-22 <= 2**-15 of scale /
    2 together)."""
    _, scales = quantize(x, fmt)
    half = scales.to(torch.float64) / 2 * (1 + 2**-14)
    return half.repeat_interleave(BLOCK)[: x.numel()]


def wire_bytes(numel: int, world: int, fmt: str) -> int:
    """Payload bytes each rank sends in one exchange of `numel` values among `world` ranks (for
    reports; framing and acknowledgements not counted). Float formats: a ring all-reduce, 2 *
    (world - 1) / world of the buffer at 4 or 2 bytes a value. Quantized: 2 * (world - 1)
    chunks of codes and scales (the reduce-scatter's and the all-gather's), the chunks padded to
    whole blocks."""
    if fmt in _WIRE:
        width = 4 if _WIRE[fmt] is None else 2
        return 2 * (world - 1) * width * numel // world
    _qmax(fmt)
    chunk = _chunk(numel, world) if numel else 0
    row = _payload_bytes(chunk, fmt) + chunk // BLOCK * _SCALE_BYTES
    return 2 * (world - 1) * row


def _qmax(fmt: str) -> int:
    if fmt not in _QMAX:
        raise ValueError(f"quantized formats are {', '.join(_QMAX)}, not {fmt!r}")
    return _QMAX[fmt]
