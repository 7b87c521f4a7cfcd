"""The fine-tune's checkpoints: Trainer's ``checkpoint-<step>`` folders, with the RNG state as
tensors, a ``latest`` pointer, and the choice of which one a resumed run continues from.

Layout under ``<output_dir>/checkpoints``::

    checkpoint-50/
        adapter_model.safetensors  the trainable weights (model.safetensors for full training)
        optimizer.pt, scheduler.pt  Trainer's; plain tensors and numbers, which Trainer loads
                                   with ``torch.load(..., weights_only=True)``
        trainer_state.json         Trainer's step, log history and callback states
        rng-rank<r>.safetensors    python / numpy / torch RNG states of rank r as tensors
    latest                         text file naming the newest complete checkpoint folder

Trainer's own ``rng_state*.pth`` pickles numpy objects; :class:`TensorRngCheckpoints` replaces
it with ``rng-rank<r>.safetensors``, which holds tensors only and so cannot run code when
loaded, and restores it when the resumed run takes its first step.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from transformers import TrainerCallback

from ascend_vlm._files import atomic_write_text

logger = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
LATEST = "latest"
TRAINER_STATE = "trainer_state.json"
WEIGHT_FILES = ("adapter_model.safetensors", "model.safetensors")
_CHECKPOINT_FOLDER = re.compile(r"checkpoint-(\d+)")


def checkpoint_root(output_dir: str | os.PathLike) -> Path:
    return Path(output_dir) / CHECKPOINTS


def rng_file(checkpoint: Path, rank: int) -> Path:
    return checkpoint / f"rng-rank{rank}.safetensors"


def rng_state_tensors() -> dict[str, torch.Tensor]:
    """This process's python, numpy and torch (CPU) RNG states, as int64 / uint8 tensors."""
    version, python_state, gauss = random.getstate()
    _, keys, position, has_gauss, cached = np.random.get_state()
    return {
        "python_state": torch.tensor(python_state, dtype=torch.int64),
        "python_meta": torch.tensor([version, gauss is not None], dtype=torch.int64),
        "python_gauss": torch.tensor([0.0 if gauss is None else gauss], dtype=torch.float64),
        "numpy_keys": torch.from_numpy(keys.astype(np.int64)),
        "numpy_meta": torch.tensor([position, has_gauss], dtype=torch.int64),
        "numpy_gauss": torch.tensor([cached], dtype=torch.float64),
        "torch": torch.get_rng_state(),
    }


def set_rng_state_tensors(state: dict[str, torch.Tensor]) -> None:
    """Restore what :func:`rng_state_tensors` returned."""
    version, has_python_gauss = state["python_meta"].tolist()
    gauss = float(state["python_gauss"][0]) if has_python_gauss else None
    random.setstate((version, tuple(state["python_state"].tolist()), gauss))
    position, has_gauss = state["numpy_meta"].tolist()
    keys = state["numpy_keys"].numpy().astype(np.uint32)
    np.random.set_state(("MT19937", keys, position, has_gauss, float(state["numpy_gauss"][0])))
    torch.set_rng_state(state["torch"])


def step_of(path: Path) -> int | None:
    """The step of a checkpoint folder named ``checkpoint-<step>``, else None."""
    match = _CHECKPOINT_FOLDER.fullmatch(path.name)
    return int(match[1]) if match else None


def is_complete(path: Path) -> bool:
    """True when checkpoint folder ``path`` holds Trainer's state, rank 0's RNG state and a
    weights file whose safetensors header reads (a file cut short by a crash does not)."""
    from safetensors import safe_open

    # A named adapter's weights lie in a subfolder of its name.
    weights = [p for name in WEIGHT_FILES for p in sorted(path.rglob(name))]
    if not (path / TRAINER_STATE).is_file() or not rng_file(path, 0).is_file() or not weights:
        return False
    try:
        with safe_open(str(weights[0]), framework="pt"):
            return True
    except Exception:  # safetensors raises its own error types for a damaged file
        return False


def resolve_checkpoint(output_dir: str | os.PathLike, resume: str) -> Path:
    """The checkpoint folder ``resume`` names: ``"latest"`` (from ``output_dir``) or a path.

    ``"latest"`` is the folder the ``latest`` file names; if that one is not complete
    (:func:`is_complete`: the disk lost part of it), the newest complete ``checkpoint-<n>`` of an
    earlier step, with a warning. Raises ``FileNotFoundError`` naming ``resume`` when there is
    no complete checkpoint.
    """
    if resume != "latest":
        path = Path(resume)
        if not (path / TRAINER_STATE).is_file():
            raise FileNotFoundError(
                f"resume: expected a checkpoint folder holding {TRAINER_STATE}, got {str(path)!r}"
            )
        return path
    root = checkpoint_root(output_dir)
    pointer = root / LATEST
    if not pointer.is_file():
        raise FileNotFoundError(
            f"resume: expected a checkpoint under {str(root)!r} for 'latest', found none"
        )
    path = root / pointer.read_text(encoding="utf-8").strip()
    if is_complete(path):
        return path
    # Only steps before the one latest names: later folders can be left from a run that was
    # resumed from an earlier checkpoint, and belong to another history.
    limit = step_of(path)
    steps = {p: step_of(p) for p in root.iterdir()}
    older = [p for p, n in steps.items() if n is not None and (limit is None or n < limit)]
    complete = sorted((p for p in older if is_complete(p)), key=steps.get, reverse=True)
    if not complete:
        raise FileNotFoundError(
            f"resume: expected a complete checkpoint under {str(root)!r}; 'latest' names "
            f"{path.name}, which is incomplete, and no other is complete"
        )
    logger.warning(
        "resume: %s (named by latest) is incomplete; resuming from %s", path, complete[0]
    )
    return complete[0]


def saved_step(path: Path) -> int:
    """The optimizer steps the checkpoint at ``path`` had completed."""
    return int(json.loads((path / TRAINER_STATE).read_text(encoding="utf-8"))["global_step"])


class TensorRngCheckpoints(TrainerCallback):
    """Keeps each checkpoint's RNG state as tensors and moves ``latest`` to it.

    ``on_save`` (every rank): writes ``rng-rank<r>.safetensors``, removes Trainer's pickled
    ``rng_state*.pth`` (so resuming never unpickles), and, once every rank has written, rank 0
    points ``latest`` at the folder. ``resume_from`` (a checkpoint folder, None: a new run):
    its RNG state of this rank is restored when the first resumed step begins, where Trainer
    would restore its own. ``ValueError`` when the folder has no state for this rank (it was
    saved by fewer ranks, so the run cannot continue exactly).
    """

    def __init__(self, output_dir: Path, rank: int, resume_from: Path | None) -> None:
        self.root = checkpoint_root(output_dir)
        self.rank = rank
        self.resume_from = resume_from
        if resume_from is not None and not rng_file(resume_from, rank).is_file():
            saved = sorted(p.name for p in resume_from.glob("rng-rank*.safetensors"))
            raise ValueError(
                f"resume: expected RNG state for rank {rank} in {str(resume_from)!r} (same "
                f"world size as the saved run), found {saved}"
            )

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.resume_from is not None:
            from safetensors.torch import load_file

            set_rng_state_tensors(load_file(rng_file(self.resume_from, self.rank)))
            self.resume_from = None

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        from safetensors.torch import save_file

        folder = self.root / f"checkpoint-{state.global_step}"
        save_file(rng_state_tensors(), rng_file(folder, self.rank))
        (folder / f"rng_state_{self.rank}.pth").unlink(missing_ok=True)
        if self.rank == 0:
            (folder / "rng_state.pth").unlink(missing_ok=True)  # a one-process run's name
        if dist.is_initialized():
            dist.barrier()
        if self.rank == 0:
            atomic_write_text(self.root / LATEST, folder.name)
