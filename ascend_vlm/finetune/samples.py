"""The train and eval records of a run: JSONL files when given, else ShapesVQA splits."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ascend_vlm.data.vqa import JsonlVQA, VQASample

if TYPE_CHECKING:
    from ascend_vlm.finetune.config import TrainConfig


def build_samples(config: TrainConfig) -> tuple[Sequence[VQASample], Sequence[VQASample]]:
    """Train and eval samples: JSONL files when given, else ShapesVQA splits."""
    if config.train_data is not None:
        train = JsonlVQA(config.train_data, config.on_bad_record)
    else:
        train = config.shapes_dataset("train", config.train_size, config.question_types)
    if config.eval_data is not None:
        evaluation = JsonlVQA(config.eval_data, config.on_bad_record)
    else:
        evaluation = config.shapes_dataset("eval", config.eval_size, config.eval_question_types)
    return train, evaluation
