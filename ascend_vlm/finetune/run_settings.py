"""A run's settings in its output folder: refused when the folder holds another run, checked
against the saved ones when resuming (:func:`~ascend_vlm.finetune.resume.check_resume`), then
saved as ``train_config.json``."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from ascend_vlm.finetune import checkpoint
from ascend_vlm.finetune.restarts import RUN_MARKER, torchrun_job_id
from ascend_vlm.finetune.resume import CONFIG_FILE, ResumeError, check_resume

if TYPE_CHECKING:
    from ascend_vlm.finetune.config import TrainConfig
    from ascend_vlm.finetune.placement import ProcessPlacement

logger = logging.getLogger(__name__)


def settle_run_config(config: TrainConfig, placement: ProcessPlacement) -> None:
    """Check ``config`` against the saved settings of the run it continues; then save it."""
    output_dir = Path(config.output_dir)
    path = output_dir / CONFIG_FILE
    requested = json.loads(json.dumps(dataclasses.asdict(config), default=list))
    if path.is_file() and config.resume is None:
        raise ResumeError(
            f"output_dir: expected a folder without a saved run, {str(output_dir)!r} holds one "
            f"({CONFIG_FILE}); continue it with --resume latest, or choose another --output-dir"
        )
    saved_path = path
    if not path.is_file() and config.resume not in (None, "latest"):
        # A checkpoint of another run folder (<run>/checkpoints/step-N): that run's settings.
        saved_path = Path(config.resume).parent.parent / CONFIG_FILE
    if config.resume is not None and saved_path.is_file():
        saved = json.loads(saved_path.read_text(encoding="utf-8"))
        notes = check_resume(saved, requested, _trained_steps(config), str(saved_path))
        if placement.is_main:
            for note in notes:
                logger.info(note)
    placement.barrier()  # every rank has read the saved settings before rank 0 replaces them
    if placement.is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
        checkpoint.atomic_write_text(path, json.dumps(requested, indent=2))
        if (run_id := torchrun_job_id()) is not None:
            checkpoint.atomic_write_text(output_dir / RUN_MARKER, run_id)


def _trained_steps(config: TrainConfig) -> dict[str, int | None]:
    """Steps the saved run has trained."""
    return {"max_steps": _checkpoint_step(config.output_dir, config.resume)}


def _checkpoint_step(output_dir: str | Path, resume: str) -> int:
    try:
        return checkpoint.saved_step(checkpoint.resolve_checkpoint(output_dir, resume))
    except FileNotFoundError:  # no checkpoint yet: nothing trained
        return 0


def without_missing_latest(config: TrainConfig) -> TrainConfig:
    latest = checkpoint.checkpoint_root(config.output_dir) / checkpoint.LATEST
    if config.resume != "latest" or latest.is_file():
        return config
    logger.warning("resume=latest: no checkpoint under %s yet; starting fresh", config.output_dir)
    return dataclasses.replace(config, resume=None)
