"""Run state on disk: checkpoints that a resumed run continues from bit for bit.

`checkpoints/round-NNNNN/` holds the state after N completed rounds: `weights.safetensors` (global
weights, the model's own keys), `outer.safetensors` (outer momentum, when there is one),
`inner/partition-KKKKK.pt` (each worker's optimizer state, written by the workers themselves),
`config.yaml` (the settings that produced it; a resume compares against these) and `state.json`.
A checkpoint is assembled in `.round-NNNNN.partial/` and renamed when complete, so a crash never
leaves a half checkpoint that `--resume` could pick up. The data position needs no saving: it is a
pure function of (seed, partition, round, step).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from sparknet.training.state import StateLayout

CHECKPOINTS = "checkpoints"
CONFIG = "config.yaml"
WEIGHTS = "weights.safetensors"
_NAME = re.compile(r"^round-(\d{5,})$")


@dataclass(frozen=True)
class Checkpoint:
    rounds: int
    theta: np.ndarray
    integers: dict[str, np.ndarray]
    outer_momentum: np.ndarray | None
    elapsed_s: float
    path: Path


def final_dir(run_dir: Path, rounds: int) -> Path:
    return run_dir / CHECKPOINTS / f"round-{rounds:05d}"


def staging_dir(run_dir: Path, rounds: int) -> Path:
    return run_dir / CHECKPOINTS / f".round-{rounds:05d}.partial"


def inner_dir(checkpoint_dir: Path) -> Path:
    """The workers' optimizer states in a checkpoint; each worker writes its own file."""
    return checkpoint_dir / "inner"


def inner_state_path(checkpoint_dir: Path, partition: int) -> Path:
    return inner_dir(checkpoint_dir) / f"partition-{partition:05d}.pt"


def write_inner(checkpoint_dir: str, partition: int, state: dict) -> None:
    """A worker's inner optimizer state into the checkpoint being assembled, written by the
    worker itself. The driver made the dir; it is never recreated here: once gone, the
    checkpoint was abandoned."""
    path = inner_state_path(Path(checkpoint_dir), partition)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def read_inner(run_dir: str, rounds: int, partition: int) -> dict | None:
    """A worker's inner optimizer state from the complete checkpoint after `rounds` rounds, or
    None when there is none (no checkpoint at that round, or a run with inner_state reset)."""
    path = inner_state_path(final_dir(Path(run_dir), rounds), partition)
    return torch.load(path, weights_only=True) if path.is_file() else None


def save_state_dict(state: dict[str, torch.Tensor], path: Path) -> None:
    """safetensors file with the given keys; written to a temp name and renamed. Its mode
    follows the umask like every other file of the run (safetensors itself writes 0600)."""
    tmp = path.with_name(f".{path.name}.tmp")
    save_file({k: v.detach().contiguous().clone() for k, v in state.items()}, tmp)
    os.chmod(tmp, 0o666 & ~_umask())
    os.replace(tmp, path)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write(
    run_dir: Path,
    rounds: int,
    layout: StateLayout,
    theta: np.ndarray,
    integers: dict[str, np.ndarray],
    outer_momentum: np.ndarray | None,
    elapsed_s: float,
    config_text: str,
) -> Path:
    """Complete the staged checkpoint for `rounds` and publish it atomically, with the settings
    that produced it: an interrupted `--allow-change` resume then leaves no changed settings
    behind that a later plain `--resume` would take as the run's own."""
    stage = staging_dir(run_dir, rounds)
    stage.mkdir(parents=True, exist_ok=True)
    (stage / CONFIG).write_text(config_text)
    save_state_dict(layout.unflatten(theta, integers), stage / WEIGHTS)
    if outer_momentum is not None:
        save_state_dict(
            {"momentum_buffer": torch.from_numpy(outer_momentum)}, stage / "outer.safetensors"
        )
    (stage / "state.json").write_text(json.dumps({"rounds": rounds, "elapsed_s": elapsed_s}))
    final = final_dir(run_dir, rounds)
    if final.exists():
        shutil.rmtree(final)
    os.replace(stage, final)
    return final


def rounds_of(path: Path) -> int:
    """How many rounds the complete checkpoint at `path` holds."""
    return int(json.loads((path / "state.json").read_text())["rounds"])


def latest(run_dir: Path) -> Path | None:
    """The newest complete checkpoint dir, or None."""
    root = run_dir / CHECKPOINTS
    if not root.is_dir():
        return None
    done = [
        (int(m.group(1)), p)
        for p in root.iterdir()
        if (m := _NAME.match(p.name)) and (p / "state.json").is_file()
    ]
    return max(done)[1] if done else None


def load(path: Path, layout: StateLayout) -> Checkpoint:
    state = json.loads((path / "state.json").read_text())
    weights = load_file(path / WEIGHTS)
    outer_path = path / "outer.safetensors"
    momentum = load_file(outer_path)["momentum_buffer"].numpy() if outer_path.is_file() else None
    return Checkpoint(
        rounds=int(state["rounds"]),
        theta=layout.flatten(weights),
        integers=layout.integers(weights),
        outer_momentum=momentum,
        elapsed_s=float(state["elapsed_s"]),
        path=path,
    )
