"""The train and eval records of a run: JSONL files when given, else ShapesVQA splits."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ascend_vlm.data.shapes_vqa import KINDS, ShapesVQA, new_kind_names
from ascend_vlm.data.vqa import JsonlVQA, VQASample

if TYPE_CHECKING:
    from ascend_vlm.finetune.config import TrainConfig


def build_samples(config: TrainConfig) -> tuple[Sequence[VQASample], Sequence[VQASample]]:
    """Train and eval samples: JSONL files when given, else ShapesVQA splits."""
    if config.train_data is not None:
        train = JsonlVQA(config.train_data, config.on_bad_record)
    else:
        train = shapes_dataset(config, "train", config.train_size, config.question_types)
    if config.eval_data is not None:
        evaluation = JsonlVQA(config.eval_data, config.on_bad_record)
    else:
        evaluation = shapes_dataset(config, "eval", config.eval_size, config.eval_question_types)
    return train, evaluation


def shapes_dataset(
    config: TrainConfig, split: str, size: int, question_types: Sequence[str]
) -> ShapesVQA:
    """``size`` ShapesVQA records of ``split`` asking ``question_types``, drawn as ``config``
    says (``data_seed``, ``image_size``, ``shapes_binding``).

    With ``shapes_new_kinds`` the new kinds are the first K of ``NEW_SHAPE_KINDS``, named by
    the K ``new_tokens`` in order (all four by their own names without tokens). Training
    scenes draw from the base kinds and the new ones together, so the base's kind words stay
    in use while the new ones are learnt; eval scenes show only the new kinds, the ones taught.
    """
    kinds, kind_names = KINDS, None
    if config.shapes_new_kinds:
        kind_names = new_kind_names(config.new_tokens)
        kinds = (*KINDS, *kind_names) if split == "train" else tuple(kind_names)
    return ShapesVQA(
        split,
        size,
        config.data_seed,
        config.image_size,
        config.shapes_binding,
        question_types,
        kinds,
        kind_names,
    )
