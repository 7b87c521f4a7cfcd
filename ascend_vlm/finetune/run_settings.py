"""A run's settings in its output folder: refused when the folder holds another run (unless
``overwrite_output_dir``), checked against the saved ones when resuming
(:func:`~ascend_vlm.finetune.resume.check_resume`), and saved as ``train_config.json`` only once
the run has started: a run that fails at start-up leaves the folder as it found it."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from ascend_vlm._files import atomic_write_text
from ascend_vlm.finetune import checkpoint
from ascend_vlm.finetune.config import FINAL_ADAPTER, FINAL_MODEL
from ascend_vlm.finetune.metrics_log import METRICS_FILE
from ascend_vlm.finetune.restarts import RUN_MARKER, torchrun_job_id
from ascend_vlm.finetune.resume import CONFIG_FILE, ResumeError, check_resume

if TYPE_CHECKING:
    from ascend_vlm.finetune.config import TrainConfig
    from ascend_vlm.finetune.placement import ProcessPlacement

logger = logging.getLogger(__name__)

# What a run writes into its output folder, removed by overwrite_output_dir.
RUN_FILES = (
    CONFIG_FILE,
    METRICS_FILE,
    RUN_MARKER,
    checkpoint.CHECKPOINTS,
    FINAL_ADAPTER,
    FINAL_MODEL,
)


def _requested(config: TrainConfig) -> dict:
    return json.loads(json.dumps(dataclasses.asdict(config), default=list))


def check_run_folder(config: TrainConfig, placement: ProcessPlacement) -> None:
    """Check ``config`` against its output folder without writing to it: a new run needs a
    folder without a saved run (or ``overwrite_output_dir``); a resumed one settings its saved
    run can continue with (:class:`ResumeError` naming each refused setting)."""
    output_dir = Path(config.output_dir)
    path = output_dir / CONFIG_FILE
    if path.is_file() and config.resume is None and not config.overwrite_output_dir:
        raise ResumeError(
            f"output_dir: expected a folder without a saved run, {str(output_dir)!r} holds one "
            f"({CONFIG_FILE}); continue it with --resume latest, start over with "
            "--overwrite-output-dir, or choose another --output-dir"
        )
    saved_path = path
    if not path.is_file() and config.resume not in (None, "latest"):
        # A checkpoint of another run folder (<run>/checkpoints/checkpoint-N): its settings.
        saved_path = Path(config.resume).parent.parent / CONFIG_FILE
    if config.resume is not None and saved_path.is_file():
        saved = json.loads(saved_path.read_text(encoding="utf-8"))
        trained = {"max_steps": _checkpoint_step(config.output_dir, config.resume)}
        notes = check_resume(saved, _requested(config), trained, str(saved_path))
        if placement.is_main:
            for note in notes:
                logger.info(note)


def record_run_config(config: TrainConfig, placement: ProcessPlacement) -> None:
    """Save ``config`` as the folder's run (after removing the saved run's files when
    ``overwrite_output_dir``), with the torchrun job that runs it."""
    output_dir = Path(config.output_dir)
    placement.barrier()  # every rank has read the saved settings before rank 0 replaces them
    if placement.is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
        if config.overwrite_output_dir:
            for name in RUN_FILES:
                target = output_dir / name
                if target.is_dir():
                    shutil.rmtree(target)
                else:
                    target.unlink(missing_ok=True)
        requested = json.dumps(_requested(config), indent=2)
        atomic_write_text(output_dir / CONFIG_FILE, requested)
        if (run_id := torchrun_job_id()) is not None:
            atomic_write_text(output_dir / RUN_MARKER, run_id)
    placement.barrier()


def _checkpoint_step(output_dir: str | Path, resume: str) -> int:
    """Steps the saved run has trained (0 when it has no checkpoint yet)."""
    try:
        return checkpoint.saved_step(checkpoint.resolve_checkpoint(output_dir, resume))
    except FileNotFoundError:
        return 0


def without_missing_latest(config: TrainConfig) -> TrainConfig:
    latest = checkpoint.checkpoint_root(config.output_dir) / checkpoint.LATEST
    if config.resume != "latest" or latest.is_file():
        return config
    logger.warning("resume=latest: no checkpoint under %s yet; starting fresh", config.output_dir)
    return dataclasses.replace(config, resume=None)
