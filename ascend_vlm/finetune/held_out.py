"""Held-out accuracy of a run: exact-match accuracy of greedy answers sharded across ranks, and
per ShapesVQA question type before and after training."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from ascend_vlm.data.vqa import (
    EncodedDataset,
    VQASample,
    collate,
    normalise_answer,
    pad_token_id_of,
)

if TYPE_CHECKING:
    from ascend_vlm.finetune.config import TrainConfig
    from ascend_vlm.finetune.placement import ProcessPlacement


def model_inputs(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """The tensors of a collated ``batch`` the model's forward takes (all but ``labels``), on
    ``device``."""
    return {key: value.to(device) for key, value in batch.items() if key != "labels"}


def evaluate(
    model: Any,
    processor: Any,
    samples: Sequence[VQASample],
    placement: ProcessPlacement,
    batch_size: int,
    max_new_tokens: int,
) -> float:
    """Exact-match accuracy of greedy answers over ``samples``, sharded across ranks.

    Rank r answers samples r, r + world, ...; correct and total counts are summed over ranks.
    """
    encoded = EncodedDataset(samples, processor, with_answer=False)
    pad_id = pad_token_id_of(processor)
    indices = list(range(placement.rank, len(samples), placement.world_size))
    correct = 0
    model.eval()
    with torch.no_grad(), placement.autocast():
        for start in range(0, len(indices), batch_size):
            chunk = indices[start : start + batch_size]
            batch = collate([encoded[i] for i in chunk], pad_id, padding_side="left")
            inputs = model_inputs(batch, placement.device)
            output = model.generate(
                **inputs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad_id
            )
            answers = processor.batch_decode(
                output[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True
            )
            correct += sum(
                normalise_answer(answer) == normalise_answer(samples[i].answer)
                for answer, i in zip(answers, chunk, strict=True)
            )
    total_correct, total = placement.all_reduce_sum([correct, len(indices)])
    return total_correct / total


def accuracy_per_type(
    model: Any,
    processor: Any,
    config: TrainConfig,
    placement: ProcessPlacement,
    question_types: Sequence[str],
) -> dict[str, float]:
    """Held-out accuracy per ShapesVQA question type: :func:`evaluate` on ``config.eval_size``
    records of the eval split asking only that type (``data_seed``, ``image_size``,
    ``shapes_binding`` of ``config``)."""
    return {
        question_type: evaluate(
            model,
            processor,
            config.shapes_dataset("eval", config.eval_size, (question_type,)),
            placement,
            config.eval_batch_size,
            config.max_new_tokens,
        )
        for question_type in question_types
    }


def accuracy_table(before: dict[str, float] | None, after: dict[str, float]) -> str:
    """Held-out accuracy per question type before and after training, one row per type."""
    lines = ["held-out accuracy   before    after"]
    for question_type, value in after.items():
        old = f"{before[question_type]:.4f}" if before and question_type in before else "   n/a"
        lines.append(f"{question_type:<18}  {old}   {value:.4f}")
    return "\n".join(lines)
