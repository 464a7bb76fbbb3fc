"""What travels between driver and workers: a model's state as one flat float32 buffer.

Every floating-point entry of the state_dict travels, parameters and buffers alike, so BatchNorm
running statistics are averaged with the weights (PyTorch's own model averagers skip buffers).
The layout knows which float entries are buffers: the outer optimizer steps only parameters and
gives buffers the workers' plain mean (Nesterov momentum would extrapolate a running variance
below zero).
Integer and bool buffers (e.g. `num_batches_tracked`) are not averaged: they travel beside the
flat buffer and the driver keeps worker 0's. Float64 entries travel as float32.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Entry:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int  # into the flat buffer; -1 for entries that travel beside it
    #: a float buffer (BatchNorm running statistics) rather than a parameter: averaged, not stepped
    buffer: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class StateLayout:
    """Where each state_dict entry lives in the flat buffer; small, pickled into every task."""

    entries: tuple[Entry, ...]
    size: int

    @classmethod
    def of(
        cls, state: Mapping[str, torch.Tensor], parameters: Collection[str] | None = None
    ) -> StateLayout:
        """The layout of `state`; `parameters` names its parameters (None: every float entry is
        one), so that the other float entries are known as buffers."""
        entries, offset = [], 0
        for name, t in state.items():
            if t.is_floating_point():
                buffer = parameters is not None and name not in parameters
                entries.append(Entry(name, tuple(t.shape), t.dtype, offset, buffer))
                offset += t.numel()
            else:
                entries.append(Entry(name, tuple(t.shape), t.dtype, -1))
        return cls(tuple(entries), offset)

    @classmethod
    def of_model(cls, model: torch.nn.Module) -> StateLayout:
        """The layout of `model.state_dict()`, its parameters told from its buffers."""
        names = {name for name, _ in model.named_parameters(remove_duplicate=False)}
        return cls.of(model.state_dict(), names)

    def bind(
        self, model: torch.nn.Module, flat: torch.Tensor | None = None, *, take: bool = True
    ) -> torch.Tensor | None:
        """One flat float32 host buffer holding the model's float entries in layout order, with
        every parameter and float buffer made a view of it (a Parameter keeps its identity, so
        an optimizer holding it goes on working). An all-reduce of the buffer then averages the
        model in place: no weights are loaded and no update is written, each a pass over the
        whole model. None where the state cannot be viewed so: an entry off the host, not
        float32, not contiguous (channels-last), or shared by two names (tied weights).

        With `flat`, a buffer the model was bound to: the entries that have left it are bound
        again (a forward() that reassigns a buffer, `self.ema = 0.9 * self.ema + ...`, leaves
        its new tensor outside), their values taken into it when `take` (after training, the
        model holds the truth) or dropped (before, the buffer holds the round's weights)."""
        state = model.state_dict(keep_vars=True)
        floats = [e for e in self.entries if e.offset >= 0]
        tensors = [state[e.name] for e in floats]
        if flat is None:
            if any(
                t.device.type != "cpu" or t.dtype != torch.float32 or not t.is_contiguous()
                for t in tensors
            ):
                return None
            held = [t.data_ptr() for t in tensors if t.numel()]
            if len(set(held)) != len(held):
                return None
            flat = torch.empty(self.size, dtype=torch.float32)
        for e, t in zip(floats, tensors, strict=True):
            view = flat[e.offset : e.offset + e.numel].view(e.shape)
            if t.data_ptr() == view.data_ptr() and t.shape == view.shape:
                continue  # still bound
            if take:
                view.copy_(t.detach())
            owner, _, leaf = e.name.rpartition(".")
            module = model.get_submodule(owner)
            if leaf in module._parameters:
                t.data = view
            else:
                setattr(module, leaf, view)
        return flat

    def buffer_mask(self) -> np.ndarray | None:
        """True where the flat buffer holds a float buffer's values; None when there are none."""
        spans = [e for e in self.entries if e.offset >= 0 and e.buffer]
        if not spans:
            return None
        mask = np.zeros(self.size, dtype=bool)
        for e in spans:
            mask[e.offset : e.offset + e.numel] = True
        return mask

    @property
    def nbytes(self) -> int:
        return self.size * 4

    def pseudo_gradient(
        self,
        theta: np.ndarray,
        state: Mapping[str, torch.Tensor],
        out: np.ndarray | None = None,
    ) -> np.ndarray:
        """theta - flatten(state), the worker's update, into `out` (a new array when None).
        On the host in one pass per entry, with no flat copy of the weights between (at 100 MB
        the copy alone cost 50 ms, most of it a fresh allocation's page faults); a state on a
        device crosses to the host in one copy first. The same bits either way."""
        floats = [e for e in self.entries if e.offset >= 0]
        if out is None:
            out = np.empty(self.size, dtype=np.float32)
        if any(state[e.name].device.type != "cpu" for e in floats):
            return np.subtract(theta, self.flatten(state), out=out)
        src, dst = torch.from_numpy(theta), torch.from_numpy(out)
        for e in floats:
            span = slice(e.offset, e.offset + e.numel)
            weights = state[e.name].detach().to(torch.float32)
            torch.sub(src[span].view(e.shape), weights, out=dst[span].view(e.shape))
        return out

    def flatten(self, state: Mapping[str, torch.Tensor]) -> np.ndarray:
        """The float entries of `state`, concatenated in layout order, as a new float32 array.

        Concatenated where the state lives, so a model on a GPU crosses to the host in one copy.
        Entries are read in their logical order whatever their memory format (channels-last)."""
        floats = [
            state[e.name].detach().reshape(-1).to(torch.float32)
            for e in self.entries
            if e.offset >= 0
        ]
        if not floats:
            return np.empty(0, dtype=np.float32)
        return torch.cat(floats).cpu().numpy()

    def integers(self, state: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray]:
        """The entries that do not travel in the flat buffer (integer and bool buffers)."""
        return {
            e.name: state[e.name].detach().cpu().numpy().copy()
            for e in self.entries
            if e.offset < 0
        }

    def unflatten(
        self,
        flat: np.ndarray,
        integers: Mapping[str, np.ndarray],
        device: torch.device | str | None = None,
    ) -> dict[str, torch.Tensor]:
        """A state_dict with the model's own keys, shapes and dtypes, on `device` (default: the
        host, as views into `flat` where float32). The flat buffer goes to the device in one copy
        and every entry is a view of that copy."""
        buf = torch.from_numpy(flat)
        if device is not None:
            buf = buf.to(device)
        out: dict[str, torch.Tensor] = {}
        for e in self.entries:
            if e.offset >= 0:
                out[e.name] = buf[e.offset : e.offset + e.numel].view(e.shape).to(e.dtype)
            else:
                ints = torch.from_numpy(np.asarray(integers[e.name])).view(e.shape)
                out[e.name] = ints if device is None else ints.to(device)
        return out
