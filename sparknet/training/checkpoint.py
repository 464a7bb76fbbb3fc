"""Checkpoints that a resumed run continues from bit for bit.

They are run state in a run dir (a local dir or an S3 prefix).

`checkpoints/round-NNNNN/` holds the state after N completed rounds: `weights.safetensors` (global
weights, the model's own keys), `outer.safetensors` (outer momentum, when there is one),
`inner/partition-KKKKK.pt` (each worker's optimizer state, written by the workers themselves),
`final.safetensors` (the model, where a run with fragments or overlap ended here),
`inner/partition-KKKKK.sync.safetensors` (under fragments or overlap, each worker's own weights
and progress, `sync.RankState`, written likewise),
`config.yaml` (the settings that produced it; a resume compares against these) and `state.json`,
the manifest. S3 has no rename, so local dirs and S3 share one rule instead of a staged dir
renamed into place: every file is written whole (a temp name and a rename locally, one PUT on
S3), the manifest last, and a checkpoint without its manifest does not exist for `latest`. A run
removes the incomplete checkpoints an interrupted one left before it writes its own. The data
position needs no saving: it is a pure function of (seed, partition, round, step).
"""

from __future__ import annotations

import io
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from sparknet.data.store import LocalStore, MissingObjectError, Store, open_store
from sparknet.errors import (
    PermanentTaskError,
    SparknetError,
    WriteRefused,
    first_line,
    is_permanent,
)
from sparknet.training.report import EARLY, STOPPED
from sparknet.training.state import StateLayout
from sparknet.training.sync import RankState
from sparknet.training.tau_choice import TauChooser

if TYPE_CHECKING:
    from sparknet.config import TrainConfig

CHECKPOINTS = "checkpoints"
CONFIG = "config.yaml"
WEIGHTS = "weights.safetensors"
OUTER = "outer.safetensors"
#: the model a run that ends here keeps, where it differs from the run's weights (`sync`'s final
#: weights: every worker's progress in, which a longer run would still have in flight)
FINAL = "final.safetensors"
#: the manifest: written last, so its presence means every other file is complete
MANIFEST = "state.json"
_NAME = re.compile(r"^round-(\d{5,})$")
#: what a checkpoint's write leaves under checkpoints/: its dir (or an older version's temp dir)
_LEFTOVER = re.compile(r"^(round-\d{5,}|\.round-\d{5,}\.partial)$")


@dataclass(frozen=True)
class Checkpoint:
    rounds: int
    theta: np.ndarray
    integers: dict[str, np.ndarray]
    outer_momentum: np.ndarray | None
    elapsed_s: float
    #: under tau auto, the chooser's state after this round (`TauChooser.state`)
    tau_state: dict | None = None
    #: the inner steps taken by then (the schedule's global step); None in older checkpoints
    steps: int | None = None


def due(every: int, done: int, last: int) -> bool:
    """Whether round `done` of `last` ends with a checkpoint (or an evaluation) when one is
    due every `every` rounds (0: only after the last)."""
    return done == last or (every > 0 and done % every == 0)


def published(cfg: TrainConfig, done: int, evaluates: bool) -> bool:
    """Whether round `done` ends with a checkpoint: every `checkpoint_every` rounds and after
    the last; under `stop_at` after every evaluated round too, since the run may end there."""
    if due(cfg.checkpoint_every, done, cfg.rounds):
        return True
    return cfg.stop_at is not None and evaluates and due(cfg.eval_every, done, cfg.rounds)


def reached(cfg: TrainConfig, row: dict[str, Any]) -> bool:
    """Whether a round's evaluation (in its metrics row) reached `stop_at`: the run ends there."""
    accuracy = row.get("eval_accuracy")
    return cfg.stop_at is not None and accuracy is not None and accuracy >= cfg.stop_at


def target_marker(cfg: TrainConfig, row: dict[str, Any], done: int) -> dict[str, Any]:
    """The fields round `done`'s row takes where its evaluation reached `stop_at`, which ends
    the run there: the target, and `stopped_early` where that is before the last round (the
    run stops); {} where it did not reach it."""
    if not reached(cfg, row):
        return {}
    return {STOPPED: cfg.stop_at, **({EARLY: True} if done < cfg.rounds else {})}


def name(rounds: int) -> str:
    """The checkpoint after `rounds` rounds, relative to the run dir."""
    return f"{CHECKPOINTS}/round-{rounds:05d}"


def _inner_name(partition: int) -> str:
    return f"inner/partition-{partition:05d}.pt"


def write_inner(
    checkpoint_dir: str, partition: int, state: dict, *, endpoint_url: str | None = None
) -> None:
    """A worker's inner optimizer state into the checkpoint being assembled (a local dir or an
    s3:// URI), written by the worker itself. A local dir is never recreated here: the driver
    made it, and once gone the checkpoint was abandoned. `endpoint_url` None: boto3's own
    (AWS_ENDPOINT_URL, which executors inherit)."""
    buf = io.BytesIO()
    torch.save(state, buf)
    store = open_store(checkpoint_dir, endpoint_url)
    store.write_bytes(_inner_name(partition), buf.getvalue(), parents=False)


def _rank_name(partition: int) -> str:
    return f"inner/partition-{partition:05d}.sync.safetensors"


def write_rank(
    checkpoint_dir: str, partition: int, state: RankState, tag: str, *,
    endpoint_url: str | None = None,
) -> None:  # fmt: skip
    """A worker's own weights and progress (`sync.RankState`) into the checkpoint being
    assembled, as `write_inner` writes its optimizer state; `tag` says what settings made it."""
    tensors = {"local": torch.from_numpy(state.local), "unsent": torch.from_numpy(state.unsent)}
    meta = {"tag": tag}
    if state.sent is not None:
        tensors["sent"] = torch.from_numpy(state.sent)
        meta["fragment"] = str(state.fragment)
    store = open_store(checkpoint_dir, endpoint_url)
    data = save_safetensors(tensors, metadata=meta)
    store.write_bytes(_rank_name(partition), data, parents=False)


def read_rank(
    run_dir: str, rounds: int, partition: int, tag: str, *, endpoint_url: str | None = None
) -> RankState | None:
    """A worker's `RankState` from the checkpoint after `rounds`, or None where there is none or
    it was made under other settings (`tag`): the worker then starts from the global weights."""
    store = open_store(run_dir, endpoint_url)
    try:
        data = store.read_bytes(f"{name(rounds)}/{_rank_name(partition)}")
    except MissingObjectError:
        return None
    try:
        tensors, meta = load_safetensors(data), _metadata(data)
        if meta.get("tag") != tag:
            return None
        sent = tensors.get("sent")
        return RankState(
            tensors["local"].numpy(), tensors["unsent"].numpy(),
            None if sent is None else sent.numpy(),
            None if sent is None else int(meta["fragment"]),
        )  # fmt: skip
    except _DAMAGE as exc:
        raise _damaged(store, rounds, _rank_name(partition), exc) from exc


def _metadata(data: bytes) -> dict[str, str]:
    """A safetensors file's `__metadata__` (its header is 8 bytes of length, then JSON)."""
    length = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + length]).get("__metadata__") or {}


def rank_state_missing(run_dir: str, rounds: int, partition: int) -> PermanentTaskError:
    """The error for a checkpoint in which some workers' `RankState` files are and one is not:
    the ranks cannot go on from it together (what they have in flight would not match)."""
    return PermanentTaskError(
        f"checkpoint {run_dir}/{name(rounds)} is damaged ({_rank_name(partition)} is missing); "
        "delete that checkpoint dir to resume from the one before it"
    )


def read_inner(
    run_dir: str, rounds: int, partition: int, *, endpoint_url: str | None = None
) -> dict | None:
    """A worker's inner optimizer state from the checkpoint after `rounds` rounds (a local dir
    or an s3:// URI), or None when there is none (no checkpoint at that round, or a run with
    inner_state reset). Only complete checkpoints exist by then: the driver removed the rest."""
    store = open_store(run_dir, endpoint_url)
    try:
        data = store.read_bytes(f"{name(rounds)}/{_inner_name(partition)}")
    except MissingObjectError:
        return None
    return torch.load(io.BytesIO(data), weights_only=True)


def state_dict_bytes(state: dict[str, torch.Tensor]) -> bytes:
    """A safetensors file with the given keys, as bytes (loadable by plain PyTorch)."""
    return save_safetensors({k: v.detach().contiguous().clone() for k, v in state.items()})


def begin(store: Store, rounds: int) -> str:
    """Make the run dir ready for the checkpoint after `rounds`; returns its full location (dir
    or URI) for the workers' inner states. Locally the inner dir is made here (workers never
    make it); S3 has no dirs."""
    where = name(rounds)
    if isinstance(store, LocalStore):
        try:
            (Path(store.uri) / where / "inner").mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            if is_permanent(exc):  # a full disk, a read-only one: never retried
                raise WriteRefused(store.uri, f"{where}/inner", exc) from exc
            raise
    return f"{store.uri}/{where}"


def write(
    store: Store,
    rounds: int,
    layout: StateLayout,
    theta: np.ndarray,
    integers: dict[str, np.ndarray],
    outer_momentum: np.ndarray | None,
    elapsed_s: float,
    config_text: str,
    *,
    final: np.ndarray | None = None,
    tau_state: dict | None = None,
    steps: int | None = None,
) -> str:
    """Complete the checkpoint for `rounds` (the workers wrote their inner states) and publish it
    by writing its manifest last, with the settings that produced it: an interrupted
    `--allow-change` resume then leaves no changed settings behind that a later plain `--resume`
    would take as the run's own. Returns its name in the run dir."""
    where = name(rounds)
    store.write_bytes(f"{where}/{CONFIG}", config_text.encode())
    store.write_bytes(f"{where}/{WEIGHTS}", state_dict_bytes(layout.unflatten(theta, integers)))
    if final is not None:
        store.write_bytes(f"{where}/{FINAL}", state_dict_bytes(layout.unflatten(final, integers)))
    if outer_momentum is not None:
        momentum = {"momentum_buffer": torch.from_numpy(outer_momentum)}
        store.write_bytes(f"{where}/{OUTER}", state_dict_bytes(momentum))
    manifest: dict = {"rounds": rounds, "elapsed_s": elapsed_s}
    if tau_state is not None:
        manifest["tau_choice"] = tau_state
    if steps is not None:
        manifest["steps"] = steps
    store.write_bytes(f"{where}/{MANIFEST}", json.dumps(manifest).encode())
    return where


def discard(store: Store, rounds: int) -> None:
    """Remove the checkpoint after `rounds`: its manifest first, so it is never half there."""
    store.delete([f"{name(rounds)}/{MANIFEST}"])
    store.delete_prefix(f"{name(rounds)}/")


def discard_incomplete(store: Store) -> list[str]:
    """Remove every checkpoint under `checkpoints/` that is not complete (one an interrupted
    run was writing, or an older version's `.round-N.partial`); returns the names removed.
    Anything else there (a user's file) is not a checkpoint, and is left alone."""
    whole = {name(r).split("/")[1] for r in complete(store)}
    entries = store.entries(f"{CHECKPOINTS}/")
    gone = sorted(e for e in entries if _LEFTOVER.match(e) and e not in whole)
    for entry in gone:
        store.delete_prefix(f"{CHECKPOINTS}/{entry}/")
        store.delete([f"{CHECKPOINTS}/{entry}"])  # a stray file rather than a dir
    return gone


def complete(store: Store) -> list[int]:
    """The rounds of every checkpoint whose manifest is there."""
    out = []
    for key in store.walk(f"{CHECKPOINTS}/"):
        parts = key.split("/")
        if len(parts) == 3 and parts[2] == MANIFEST and (m := _NAME.match(parts[1])):
            out.append(int(m.group(1)))
    return out


def latest(store: Store) -> int | None:
    """How many rounds the newest complete checkpoint holds, or None when there is none."""
    return max(complete(store), default=None)


#: what a damaged checkpoint file raises when parsed
_DAMAGE = (ValueError, KeyError, TypeError, RuntimeError, SafetensorError)


def _damaged(store: Store, rounds: int, file: str, exc: Exception) -> SparknetError:
    detail = first_line(exc)
    return SparknetError(
        f"checkpoint {store.uri}/{name(rounds)} is damaged ({file}: {detail}); delete that "
        "checkpoint dir to resume from the one before it"
    )


def read_weights(store: Store, rounds: int) -> bytes:
    """The model a run that ended at the checkpoint after `rounds` keeps: its final weights
    where it has them, else its weights; checked to parse as safetensors (never handed on
    unread: a damaged file would become a damaged model.safetensors)."""
    file = FINAL if store.size(f"{name(rounds)}/{FINAL}") is not None else WEIGHTS
    if file == WEIGHTS and store.size(f"{name(rounds)}/{_rank_name(0)}") is not None:
        raise SparknetError(
            f"checkpoint {store.uri}/{name(rounds)} holds no model of its own ({FINAL}): its "
            "weights lack what the workers had not yet exchanged (fragments, overlap); resume "
            "with more rounds, which makes one"
        )
    data = store.read_bytes(f"{name(rounds)}/{file}")
    try:
        load_safetensors(data)
    except _DAMAGE as exc:
        raise _damaged(store, rounds, file, exc) from exc
    return data


def load(store: Store, rounds: int, layout: StateLayout) -> Checkpoint:
    """The checkpoint after `rounds`; a file that does not parse is one error naming it."""
    where = name(rounds)
    file = MANIFEST
    try:
        state = json.loads(store.read_bytes(f"{where}/{MANIFEST}"))
        stored_rounds, elapsed_s = int(state["rounds"]), float(state["elapsed_s"])
        tau_state = state.get("tau_choice")
        steps = None if state.get("steps") is None else int(state["steps"])
        if tau_state is not None:
            TauChooser.from_state(tau_state)  # a damaged one is said here, naming its file
        file = WEIGHTS
        weights = load_safetensors(store.read_bytes(f"{where}/{WEIGHTS}"))
        theta, integers = layout.flatten(weights), layout.integers(weights)
        file = OUTER
        if store.size(f"{where}/{OUTER}") is None:
            momentum = None
        else:
            momentum = load_safetensors(store.read_bytes(f"{where}/{OUTER}"))["momentum_buffer"]
    except _DAMAGE as exc:
        raise _damaged(store, rounds, file, exc) from exc
    return Checkpoint(
        rounds=stored_rounds,
        theta=theta,
        integers=integers,
        outer_momentum=None if momentum is None else momentum.numpy(),
        elapsed_s=elapsed_s,
        tau_state=tau_state,
        steps=steps,
    )
