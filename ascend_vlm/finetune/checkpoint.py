"""Atomic training checkpoints: LoRA adapter (safetensors), optimizer, RNG, data position.

Layout under ``<output_dir>/checkpoints``::

    step-00000050/
        trainable.safetensors  every trainable parameter by name (the LoRA adapter, plus any
                               modules trained in full; the whole model for full training)
        trainer_state.pt     the optimizer state dict and the loop state (step, epoch...)
        rng-rank<r>.pt       python / numpy / torch RNG states of rank r
    latest                   text file naming the newest complete checkpoint directory

All ranks write into a hidden staging directory; once every rank is done, rank 0 renames it to
``step-<n>`` with ``os.replace`` and then rewrites ``latest`` the same way (temp file + rename).
A crash at any moment leaves either the previous checkpoint set or the new one, never a half
written one, and never touches earlier checkpoints.
"""

from __future__ import annotations

import logging
import os
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
_STEP_FOLDER = re.compile(r"step-(\d{8})")
LATEST = "latest"
TRAINER_STATE = "trainer_state.pt"
TRAINABLE_WEIGHTS = "trainable.safetensors"


def checkpoint_root(output_dir: str | os.PathLike) -> Path:
    return Path(output_dir) / CHECKPOINTS


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary sibling and ``os.replace``."""
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with temporary.open("w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def atomic_torch_save(obj: Any, path: Path) -> None:
    """``torch.save`` to a temporary sibling, fsync, then ``os.replace`` onto ``path``."""
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with temporary.open("wb") as handle:
        torch.save(obj, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def rng_state() -> dict[str, Any]:
    """The python, numpy and torch (CPU) RNG states of this process."""
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def save_checkpoint(
    output_dir: str | os.PathLike,
    step: int,
    *,
    model: Any,
    optimizer: torch.optim.Optimizer,
    loop_state: dict[str, Any],
    rank: int,
    barrier: Callable[[], None],
) -> Path:
    """Write checkpoint ``step`` collectively (every rank calls it) and return its directory.

    Rank 0 saves ``model``'s trainable parameters; ``loop_state`` is whatever the loop
    needs to continue (step, epoch, batch position). ``barrier`` synchronises the ranks (a
    no-op for a single process).
    """
    root = checkpoint_root(output_dir)
    final = root / f"step-{step:08d}"
    staging = root / f".step-{step:08d}.staging"
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    barrier()
    atomic_torch_save(rng_state(), staging / f"rng-rank{rank}.pt")
    if rank == 0:
        from safetensors.torch import save_file

        weights = {
            name: parameter.detach().cpu().contiguous()
            for name, parameter in model.named_parameters()
            if parameter.requires_grad
        }
        save_file(weights, staging / TRAINABLE_WEIGHTS)
        _fsync_file(staging / TRAINABLE_WEIGHTS)
        trainer_state = {"optimizer": optimizer.state_dict(), "loop": dict(loop_state, step=step)}
        atomic_torch_save(trainer_state, staging / TRAINER_STATE)
    barrier()
    if rank == 0:
        if final.exists():
            shutil.rmtree(final)
        _fsync_directory(staging)
        os.replace(staging, final)
        _fsync_directory(root)  # the rename is durable before latest names it
        atomic_write_text(root / LATEST, final.name)
    barrier()
    return final


def _fsync_file(path: Path) -> None:
    with path.open("rb") as handle:
        os.fsync(handle.fileno())


def _fsync_directory(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _step_of(name: str) -> int | None:
    """The step of a checkpoint folder name ``step-<8 digits>``, else None."""
    match = _STEP_FOLDER.fullmatch(name)
    return int(match[1]) if match else None


def is_complete(path: Path) -> bool:
    """True when checkpoint directory ``path`` holds its trainer state and a trainable-weights
    file whose safetensors header reads (a file cut short by a crash does not)."""
    from safetensors import safe_open

    if not (path / TRAINER_STATE).is_file() or not (path / TRAINABLE_WEIGHTS).is_file():
        return False
    try:
        with safe_open(str(path / TRAINABLE_WEIGHTS), framework="pt"):
            return True
    except Exception:  # safetensors raises its own error types for a damaged file
        return False


def resolve_checkpoint(output_dir: str | os.PathLike, resume: str) -> Path:
    """The checkpoint directory ``resume`` names: ``"latest"`` (from ``output_dir``) or a path.

    ``"latest"`` is the directory the ``latest`` file names; if that one is not complete
    (:func:`is_complete`: the disk lost part of it), the newest complete ``step-<n>`` directory
    of an earlier step, with a warning. Staging directories of an interrupted save are never
    candidates. Raises ``FileNotFoundError`` naming ``resume`` when there is no complete checkpoint.
    """
    if resume == "latest":
        root = checkpoint_root(output_dir)
        pointer = root / LATEST
        if not pointer.is_file():
            raise FileNotFoundError(
                f"resume: expected a checkpoint under {str(root)!r} for 'latest', found none"
            )
        path = root / pointer.read_text(encoding="utf-8").strip()
        if not is_complete(path):
            # Only steps before the one latest names: later folders can be left from a run
            # that was resumed from an earlier checkpoint, and belong to another history.
            limit = _step_of(path.name)
            steps = {p: _step_of(p.name) for p in root.iterdir()}
            older = [p for p, n in steps.items() if n is not None and (limit is None or n < limit)]
            older.sort(key=steps.get, reverse=True)
            complete = [p for p in older if is_complete(p)]
            if not complete:
                raise FileNotFoundError(
                    f"resume: expected a complete checkpoint under {str(root)!r}; 'latest' "
                    f"names {path.name}, which is incomplete, and no other is complete"
                )
            logger.warning(
                "resume: %s (named by latest) is incomplete; resuming from %s", path, complete[0]
            )
            path = complete[0]
    else:
        path = Path(resume)
    if not (path / TRAINER_STATE).is_file():
        raise FileNotFoundError(
            f"resume: expected a checkpoint directory holding {TRAINER_STATE}, got {str(path)!r}"
        )
    return path


def load_training_state(
    path: Path,
    *,
    model: Any,
    optimizer: torch.optim.Optimizer,
    rank: int,
) -> dict[str, Any]:
    """Restore trainable weights, optimizer and this rank's RNG from ``path``.

    Returns the saved loop state. Raises ``ValueError`` when ``path`` has no RNG state for
    ``rank`` (the run was saved with fewer ranks, so it cannot continue exactly), or when the
    saved parameter names or shapes differ from ``model``'s trainable ones (a different
    configuration), naming the first differing parameter; nothing is restored then.
    """
    from safetensors.torch import load_file

    rng_file = path / f"rng-rank{rank}.pt"
    if not rng_file.is_file():
        saved = sorted(p.name for p in path.glob("rng-rank*.pt"))
        raise ValueError(
            f"resume: expected RNG state for rank {rank} in {str(path)!r} (same world size as "
            f"the saved run), found {saved}"
        )
    weights = load_file(path / TRAINABLE_WEIGHTS)
    trainable = {name: p for name, p in model.named_parameters() if p.requires_grad}
    if set(weights) != set(trainable):
        differing = sorted(set(weights) ^ set(trainable))[:4]
        raise ValueError(
            f"resume: expected the checkpoint to hold this run's {len(trainable)} trainable "
            f"parameters, got {len(weights)} (differing names include {differing})"
        )
    for name, parameter in trainable.items():
        if weights[name].shape != parameter.shape:
            raise ValueError(
                f"resume: expected {name} of shape {tuple(parameter.shape)} as this run builds "
                f"it, the checkpoint {str(path)!r} holds {tuple(weights[name].shape)}"
            )
    with torch.no_grad():
        for name, parameter in trainable.items():
            parameter.copy_(weights[name])
    trainer_state = torch.load(path / TRAINER_STATE, weights_only=False)
    optimizer.load_state_dict(trainer_state["optimizer"])
    set_rng_state(torch.load(rng_file, weights_only=False))
    return trainer_state["loop"]


def saved_step(path: Path) -> int:
    """The optimizer steps the checkpoint at ``path`` had completed (tensors are not read)."""
    trainer_state = torch.load(path / TRAINER_STATE, weights_only=False, mmap=True)
    return int(trainer_state["loop"]["step"])
