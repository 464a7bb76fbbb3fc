"""How a rank of the `allreduce` transport syncs its weights in fragments, or behind compute.

Two options of slow links, each a rank's own bookkeeping around one exchange primitive (the mean
of a flat buffer over the ranks):

- **Fragments** (Streaming DiLoCo, Douillard et al. 2025): the model's layers are split into N
  fragments and after round r only fragment r mod N is exchanged and stepped, so a round moves
  1/N of the bytes. Each fragment keeps its own outer optimizer and syncs every N rounds,
  staggered by one round: with rounds of tau steps this is the paper's schedule for a sync
  period of H = N * tau steps. The other fragments go on training locally; a worker's weights
  are its own between syncs.
- **Overlap** (the one-round-delayed outer step): round r's exchange runs on a thread of its
  own while round r + 1 computes, and lands at round r + 1's end. Meanwhile each worker goes on
  from its own weights; when the mean arrives, the worker swaps its own sent progress for it
  (the outer step on the mean, with the progress made since kept on top: the local
  correction). Chosen over the eager update (Kale, Douillard et al. 2025), which steps each
  worker's outer optimizer on its own estimate of the mean: that needs K outer states, all
  different, checkpointed and kept apart; here every rank holds one global state, the same on
  every rank, as without overlap. With one worker and `average` it is blocking DiLoCo (up to
  float rounding).

The bookkeeping, per fragment q: G_q the global weights (the same on every rank), w_q the rank's
weights, P_q its progress not yet sent (a round's update, start minus end, is added to it). A sync
sends u = P_q and zeroes P_q; blocking, it lands at once: G_q <- outer_q(G_q, mean u), w_q = G_q.
Under overlap it lands a round later, and the progress made since goes on top of the new global:
w_q <- G_q - P_q. With one fragment and no overlap this is exactly the blocking round (P = the
round's update, bit for bit).

The final weights hold every worker's progress: what is in flight and every fragment's unsent
progress are exchanged and stepped (`final_weights`), on copies: the run's own state is left as
a longer run would have it, so a run resumed from its last checkpoint with more rounds goes on
exactly as one that never stopped. A checkpoint needs, besides G and the outer momentum, each
rank's w and P and, under overlap, the progress in flight (`RankState`): the in-flight exchange
is simply run again on resume.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import torch

from sparknet.training.outer import OuterOptimizer
from sparknet.training.state import StateLayout

#: exchange(buffer) -> the buffer's mean over the ranks, in place (a float32 host tensor)
Exchange = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Fragment:
    """Where a fragment's values sit in the flat buffer: (start, stop) spans, in order."""

    spans: tuple[tuple[int, int], ...]

    @property
    def size(self) -> int:
        return sum(stop - start for start, stop in self.spans)

    def take(self, flat: np.ndarray) -> np.ndarray:
        """The fragment's values of `flat`, contiguous (a view when it is one span)."""
        if len(self.spans) == 1:
            start, stop = self.spans[0]
            return flat[start:stop]
        return np.concatenate([flat[a:b] for a, b in self.spans])

    def gather(self, flat: np.ndarray) -> np.ndarray:
        """The fragment's values of `flat`, in a new array of its own (one copy)."""
        if len(self.spans) == 1:
            return self.take(flat).copy()
        return self.take(flat)  # concatenated: already a new array

    def zero(self, flat: np.ndarray) -> None:
        """`flat`'s fragment <- 0, in place."""
        for start, stop in self.spans:
            flat[start:stop] = 0.0

    def put(self, flat: np.ndarray, values: np.ndarray) -> None:
        """`flat`'s fragment <- `values` (as `take` laid them out)."""
        at = 0
        for start, stop in self.spans:
            flat[start:stop] = values[at : at + stop - start]
            at += stop - start


def fragments_of(layout: StateLayout, n: int) -> list[Fragment]:
    """The model's float entries in `n` fragments of whole layers (the entries of one module
    sync together), in network order, each layer to the fragment with the fewest values so
    far: layers of one size go round-robin (layer i to fragment i mod n, the paper's strided
    pattern, so every fragment spans the network's depth), and unequal layers still balance
    the bytes a round moves. Raises ValueError when the model has fewer layers than `n`."""
    if n < 1:
        raise ValueError(f"fragments must be >= 1, got {n}")
    layers: dict[str, list[tuple[int, int]]] = {}
    for e in layout.entries:
        if e.offset >= 0 and e.numel:
            layers.setdefault(e.name.rpartition(".")[0], []).append((e.offset, e.offset + e.numel))
    if len(layers) < n:
        raise ValueError(f"the model has {len(layers)} layer(s) with weights; fragments <= that")
    spans: list[list[tuple[int, int]]] = [[] for _ in range(n)]
    sizes = [0] * n
    for layer in layers.values():
        q = sizes.index(min(sizes))
        spans[q].extend(layer)
        sizes[q] += sum(b - a for a, b in layer)
    return [Fragment(_merged(sorted(s))) for s in spans]


def layers_of(layout: StateLayout) -> dict[str, list[tuple[int, int]]]:
    """The model's layers with float values, in network order: module name -> its spans."""
    layers: dict[str, list[tuple[int, int]]] = {}
    for e in layout.entries:
        if e.offset >= 0 and e.numel:
            layers.setdefault(e.name.rpartition(".")[0], []).append((e.offset, e.offset + e.numel))
    return layers


def _merged(spans: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    out: list[tuple[int, int]] = []
    for a, b in spans:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return tuple(out)


def due(rnd: int, n: int) -> int:
    """The fragment that syncs after round `rnd` (0-based): round-robin from the first."""
    return rnd % n


@dataclass
class RankState:
    """What a rank alone holds at a round's end, for a checkpoint: its weights, its progress
    not yet sent, and under overlap the progress it sent for the fragment whose exchange is
    still in flight."""

    local: np.ndarray
    unsent: np.ndarray
    sent: np.ndarray | None = None
    fragment: int | None = None


class Synchronizer:
    """One rank's fragments, overlap and outer optimizers; see the module docstring.

    Args:
        layout: the model's flat layout (which values are float buffers: averaged, not stepped).
        fragments: from `fragments_of`; one fragment covering everything is plain DiLoCo.
        theta: the global weights G to start from (copied).
        lr, momentum: the outer optimizer's (`average`: 1 and 0).
        momentum_buffer: the outer momentum to go on with (a checkpoint's), or None.
        overlap: whether an exchange lands a round after it is sent.
        exchange: the mean over the ranks of a buffer, in place.
        rank_state: this rank's own state from the checkpoint it starts at (None: a fresh start,
            its weights the global ones, nothing in flight).
    """

    def __init__(
        self,
        layout: StateLayout,
        fragments: Sequence[Fragment],
        theta: np.ndarray,
        *,
        lr: float,
        momentum: float,
        momentum_buffer: np.ndarray | None,
        overlap: bool,
        exchange: Exchange,
        rank_state: RankState | None = None,
    ) -> None:
        self.fragments = list(fragments)
        self.overlap = overlap
        self._exchange = exchange
        self.G = np.array(theta, dtype=np.float32, copy=True)
        mask = layout.buffer_mask()
        self._outers = [
            OuterOptimizer(f.take(self.G), lr, momentum, None if mask is None else f.take(mask))
            for f in self.fragments
        ]
        if momentum_buffer is not None:
            for f, outer in zip(self.fragments, self._outers, strict=True):
                outer.load_momentum_buffer(f.take(momentum_buffer).copy())
        state = rank_state or RankState(self.G.copy(), np.zeros_like(self.G))
        self.w = np.array(state.local, dtype=np.float32, copy=True)
        self.P = np.array(state.unsent, dtype=np.float32, copy=True)
        self._thread = _Courier()
        self._pending: tuple[int, np.ndarray, Future] | None = None
        #: the fragment sent after the last round (none yet: every fragment has progress unsent)
        self._last_sent: int | None = None
        if state.sent is not None:
            if state.fragment is None:
                raise ValueError("a rank state with progress in flight names its fragment")
            self._send(state.fragment, np.array(state.sent, dtype=np.float32, copy=True))
            self._last_sent = state.fragment

    @property
    def start(self) -> np.ndarray:
        """The weights this rank starts its next round from: its own."""
        return self.w

    @property
    def theta(self) -> np.ndarray:
        """The global weights, the same on every rank: what is evaluated and checkpointed."""
        return self.G

    # -- a round's end ------------------------------------------------------------------------

    def end_round(self, rnd: int, delta: np.ndarray) -> float:
        """Round `rnd` moved this rank's weights by -`delta` (its start minus its end): land what
        is in flight and sync the fragment due. Returns the seconds this rank waited for
        exchanges (under overlap, only what compute did not hide)."""
        self.w -= delta
        self.P += delta
        waited = self._land()
        q = due(rnd, len(self.fragments))
        self._last_sent = q
        self._send(q, self._take_unsent(q))
        return waited if self.overlap else waited + self._land()

    def set_outer_lr(self, lr: float) -> None:
        """The rate of the outer steps to come (a schedule's), every fragment's."""
        for outer in self._outers:
            outer.lr = lr

    def final_weights(self) -> np.ndarray:
        """The global weights with every worker's progress in, after the run's last round: the
        exchange in flight stepped in, and every other fragment's unsent progress exchanged and
        stepped, on copies of the outer optimizers (see the module docstring)."""
        final = self.G.copy()
        for q, (f, outer) in enumerate(zip(self.fragments, self._outers, strict=True)):
            if self._pending is not None and self._pending[0] == q:
                f.put(final, outer.trial(self._pending[2].result().numpy()))
            elif q != self._last_sent:  # the fragment synced last has nothing unsent
                unsent = torch.from_numpy(f.gather(self.P))
                mean = self._thread.submit(self._exchange, unsent).result()
                f.put(final, outer.trial(mean.numpy()))
        return final

    def _take_unsent(self, q: int) -> np.ndarray:
        """Fragment `q`'s progress not yet sent (a copy), zeroed: from now it is in flight."""
        f = self.fragments[q]
        sent = f.gather(self.P)
        f.zero(self.P)
        return sent

    def _send(self, q: int, sent: np.ndarray) -> None:
        """Start the exchange of fragment `q`'s progress on the exchange thread. Under overlap
        what was sent is kept as sent, for a checkpoint taken while it is in flight (the
        exchange averages its buffer in place); blocking, it lands before any checkpoint."""
        assert self._pending is None, "one exchange in flight at a time"
        buffer = torch.from_numpy(sent.copy() if self.overlap else sent)
        self._pending = (q, sent, self._thread.submit(self._exchange, buffer))

    def _land(self) -> float:
        """The exchange in flight, if any, stepped into the global weights and this rank's own
        (its progress since sending kept on top); returns the seconds waited for it."""
        if self._pending is None:
            return 0.0
        q, _, future = self._pending
        t0 = time.perf_counter()
        mean = future.result().numpy()
        waited = time.perf_counter() - t0
        self._pending = None
        f = self.fragments[q]
        stepped = self._outers[q].step(mean)
        f.put(self.G, stepped)
        f.put(self.w, stepped - f.take(self.P))  # blocking: P is zero, w = G exactly
        return waited

    # -- what a checkpoint holds --------------------------------------------------------------

    @property
    def momentum_buffer(self) -> np.ndarray | None:
        """The outer momentum over the whole buffer (zeros where a fragment has not stepped:
        the same first step as none), or None when no fragment has any."""
        buffers = [outer.momentum_buffer for outer in self._outers]
        if all(b is None for b in buffers):
            return None
        full = np.zeros_like(self.G)
        for f, b in zip(self.fragments, buffers, strict=True):
            if b is not None:
                f.put(full, b)
        return full

    def rank_state(self) -> RankState:
        """This rank's weights and the progress in flight (copies)."""
        if self._pending is None:
            return RankState(self.w.copy(), self.P.copy())
        q, sent, _ = self._pending
        return RankState(self.w.copy(), self.P.copy(), sent.copy(), q)

    def close(self, *, failed: bool = False) -> None:
        """Stop the exchange thread once the exchange in flight, if any, is done (a collective
        cannot be abandoned half-way on one rank); after a failure, without waiting for it: the
        peer it waits on may be gone, and the thread must not keep the process alive."""
        self._thread.close(wait=not failed)


class _Courier:
    """One daemon thread that runs the exchanges in order: unlike a `ThreadPoolExecutor`'s
    thread, it never holds up the process's exit while a collective waits on a dead peer."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="sparknet-exchange", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[torch.Tensor], torch.Tensor], arg: torch.Tensor) -> Future:
        future: Future = Future()
        self._jobs.put((future, fn, arg))
        return future

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn, arg = job
            try:
                future.set_result(fn(arg))
            except BaseException as exc:  # handed to whoever waits on it
                future.set_exception(exc)

    def close(self, *, wait: bool) -> None:
        self._jobs.put(None)
        if wait:
            self._thread.join()
