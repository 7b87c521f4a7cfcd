"""The tiny fine-tune settings that fine-tune, eval and cluster tests share: an in-process
config, and the command line of a few steps of ``scripts/finetune_lora.py``."""

from __future__ import annotations

from pathlib import Path

from ascend_vlm.default_model import default_model_path
from ascend_vlm.finetune.config import TrainConfig

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "finetune_lora.py"
# A few steps on a small ShapesVQA slice; global batch 4 = 2 ranks x 2 = 1 rank x 4.
COMMON = [
    "--train-size=32",
    "--eval-size=4",
    "--max-steps=4",
    "--warmup-steps=1",
    "--save-every=2",
    "--learning-rate=5e-3",
    "--batch-size=2",
    "--no-progress",
    "--no-patch",
    "--image-size=56",
    "--report-question-types=",
]


def tiny_config(output_dir: Path, **overrides) -> TrainConfig:
    """An in-process LoRA run of a few steps of the random tiny model on a small ShapesVQA
    slice, without the per-type report."""
    settings = {
        "output_dir": str(output_dir),
        "model_path": str(default_model_path()),
        "image_size": 56,
        "report_question_types": (),
        "train_size": 16,
        "eval_size": 4,
        "max_steps": 3,
        "warmup_steps": 1,
        "batch_size": 4,
        "learning_rate": 5e-3,
        "patch": False,
        "progress": False,
    }
    return TrainConfig(**{**settings, **overrides})
