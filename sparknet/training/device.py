"""Which device a Spark task trains on, and how precise its arithmetic is.

A task trains on the GPU Spark assigned it (`TaskContext.resources()["gpu"].addresses`). Spark's
addresses index the GPUs the executor process can see; where `CUDA_VISIBLE_DEVICES` is set they
index that list, as in pyspark's TorchDistributor (`_get_gpus_owned`). Inside this process torch
numbers the visible GPUs 0..n-1 in that same order, so the address is the torch ordinal once it
is checked against the list. Without a Spark GPU (local mode) a task uses `cuda:0` when there is
one. `select_device` is pure so that it can be tested without GPUs; `task_device` feeds it.

Precision: `fp32` is plain; `bf16` runs the forward pass under autocast and needs no loss
scaling; `fp16` autocasts too and scales the loss with a `GradScaler` whose state is part of the
worker's inner state (so it is kept across rounds and saved in checkpoints).
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from sparknet.errors import PermanentTaskError

# `# lazy: pyspark`: the worker side imports this module without Spark too (TorchDistributor's
# ranks, the plain PyTorch benchmark), where no task has a GPU from Spark

#: what `torch.use_deterministic_algorithms` needs for cuBLAS on CUDA >= 10.2 (PyTorch's
#: reproducibility notes); read when a cuBLAS workspace is made
CUBLAS_WORKSPACE = ":4096:8"

_AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

#: Spark's GPU addresses, as TorchDistributor accepts them: integers without zero padding
_ADDRESS = re.compile(r"^(0|[1-9][0-9]*)$")


def select_device(
    requested: str,
    addresses: Sequence[str] | None,
    visible_gpus: int,
    cuda_visible_devices: str | None,
) -> torch.device:
    """The device of one task: `requested` is auto|cpu|cuda, `addresses` the task's Spark GPU
    addresses (None or empty: Spark assigned none), `visible_gpus` what torch counts."""
    if requested == "cpu":
        return torch.device("cpu")
    if addresses:
        ordinal = _spark_gpu_ordinal(addresses[0], cuda_visible_devices)
        if ordinal >= visible_gpus:
            raise PermanentTaskError(
                "Spark assigned this task GPU {address} but torch sees {visible} GPU(s) (torch "
                "{torch}): install a CUDA build of torch on the workers, or pass {@device=cpu}",
                address=addresses[0], visible=visible_gpus, torch=torch.__version__, cpu="cpu",
            )  # fmt: skip
        return torch.device("cuda", ordinal)
    if visible_gpus > 0:
        return torch.device("cuda", 0)
    if requested == "cuda":
        raise PermanentTaskError(
            "{@device=cuda}, but this task has no GPU (Spark assigned none and torch sees none): "
            "give the workers GPUs ({@gpus_per_worker}), or pass {@device=auto} or cpu",
            cuda="cuda",
            auto="auto",
        )
    return torch.device("cpu")


def _spark_gpu_ordinal(address: str, cuda_visible_devices: str | None) -> int:
    """The torch ordinal of a Spark GPU address (see the module docstring)."""
    if not _ADDRESS.match(address):
        raise PermanentTaskError(
            f"Spark GPU address {address!r} is not a GPU index (integers without zero padding): "
            "fix the workers' GPU discovery script"
        )
    index = int(address)
    if cuda_visible_devices is not None:
        listed = [d for d in cuda_visible_devices.split(",") if d.strip()]
        if index >= len(listed):
            raise PermanentTaskError(
                f"Spark assigned this task GPU {address} but CUDA_VISIBLE_DEVICES="
                f"{cuda_visible_devices!r} lists {len(listed)}: make the workers' GPU discovery "
                "report indices into CUDA_VISIBLE_DEVICES"
            )
    return index


def spark_gpu_addresses() -> list[str] | None:
    """The GPU addresses Spark assigned the running task; None outside a Spark task."""
    try:
        from pyspark import TaskContext  # lazy: pyspark
    except ImportError:
        return None
    ctx = TaskContext.get()
    if ctx is None:
        return None
    gpu = ctx.resources().get("gpu")
    return list(gpu.addresses) if gpu is not None else None


def task_device(requested: str) -> torch.device:
    """`select_device` for the running task, on this process's GPUs."""
    if requested == "cpu":
        return torch.device("cpu")
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = select_device(
        requested, spark_gpu_addresses(), visible, os.environ.get("CUDA_VISIBLE_DEVICES")
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def check_precision(device: torch.device, precision: str) -> None:
    """Refuse a precision the device cannot autocast to, before any step is taken."""
    dtype = _AUTOCAST_DTYPES.get(precision)
    if dtype is None:
        return
    if device.type == "cuda" and dtype is torch.bfloat16:
        if not torch.cuda.is_bf16_supported(including_emulation=False):
            name = torch.cuda.get_device_name(device)
            raise PermanentTaskError(
                "{@precision=bf16} needs a GPU of compute capability 8.0 or newer (A100, A10G, "
                "L4, H100); this task's is {name}: use {@precision=fp16}",
                bf16="bf16",
                name=name,
                fp16="fp16",
            )
        return
    with torch.autocast(device.type, dtype=dtype):
        works = torch.get_autocast_dtype(device.type) == dtype
    if not works:
        raise PermanentTaskError(
            "{@precision=asked}: torch {torch} cannot autocast to it on {device}: use "
            "{@precision=fp32}",
            asked=precision,
            torch=torch.__version__,
            device=device.type,
            fp32="fp32",
        )


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """The forward pass's precision: autocast for bf16 and fp16, nothing for fp32."""
    dtype = _AUTOCAST_DTYPES.get(precision)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def make_scaler(device: torch.device, precision: str) -> torch.amp.GradScaler | None:
    """fp16 gradients underflow without loss scaling; bf16 has fp32's range and needs none."""
    return torch.amp.GradScaler(device.type) if precision == "fp16" else None


@contextlib.contextmanager
def kernel_settings(device: torch.device, deterministic: bool) -> Iterator[None]:
    """The task's kernel choices, restored afterwards (Spark reuses the Python worker).

    `deterministic`: only deterministic kernels (what a resume on GPUs is bit-exact under).
    Otherwise on CUDA, cuDNN picks the fastest convolution algorithm per input shape."""
    algorithms = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    cudnn = (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic)
    workspace = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if deterministic and workspace is None:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE
    _use_deterministic_algorithms(deterministic, warn_only=False)
    torch.backends.cudnn.benchmark = device.type == "cuda" and not deterministic
    torch.backends.cudnn.deterministic = deterministic
    try:
        yield
    finally:
        _use_deterministic_algorithms(algorithms[0], warn_only=algorithms[1])
        torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = cudnn
        _restore_env("CUBLAS_WORKSPACE_CONFIG", workspace)


def _use_deterministic_algorithms(mode: bool, *, warn_only: bool) -> None:
    """`torch.use_deterministic_algorithms`, called only to change the setting: the call imports
    torch._inductor (and with it torch._dynamo), about 1.7 s of CPU in every Python worker that
    never compiles anything."""
    now = (torch.are_deterministic_algorithms_enabled(),
           torch.is_deterministic_algorithms_warn_only_enabled())  # fmt: skip
    if now != (mode, warn_only):
        torch.use_deterministic_algorithms(mode, warn_only=warn_only)


def _restore_env(name: str, value: str | None) -> None:
    """Put an environment variable back as it was (unset when it was unset).

    Caveat for CUBLAS_WORKSPACE_CONFIG: PyTorch reads it once per process, when cuBLAS first
    needs a workspace, and restoring it resizes nothing. A Python worker whose first cuBLAS call
    came in a --deterministic task keeps the small workspace (slightly slower, never wrong); one
    that used cuBLAS before its first --deterministic task keeps the default size, so for
    bit-exact GPU runs set it for the executors (spark.executorEnv.CUBLAS_WORKSPACE_CONFIG)."""
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def uses_channels_last(device: torch.device, model: nn.Module) -> bool:
    """Conv nets (models with `nn.Conv2d` layers) run faster channels-last on GPUs' tensor cores.
    Told by the layers, not by 4-D image batches: a model without convolutions that flattens
    its images with `.view` fails on a channels-last batch."""
    return device.type == "cuda" and any(isinstance(m, nn.Conv2d) for m in model.modules())


def to_device(x: torch.Tensor, device: torch.device, channels_last: bool = False) -> torch.Tensor:
    """A batch tensor on `device`: on CUDA copied from pinned memory without blocking the host."""
    if device.type == "cpu":
        return x
    fmt = torch.channels_last if channels_last and x.dim() == 4 else torch.preserve_format
    return x.pin_memory().to(device, non_blocking=True, memory_format=fmt)
