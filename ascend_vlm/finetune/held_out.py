"""Held-out accuracy of a run: exact-match accuracy of greedy answers sharded across ranks, and
per ShapesVQA question type before and after training."""

from __future__ import annotations

import contextlib
import math
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
from ascend_vlm.integrations.fsdp import roots_unsharded

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
    sharded: bool = False,
) -> float:
    """Exact-match accuracy of greedy answers over ``samples``, sharded across ranks.

    Rank r answers samples r, r + world, ...; correct and total counts are summed over ranks.
    ``sharded``: the model's parameters are sharded over the ranks (FSDP2), so every forward
    is a collective: every rank runs the same number of ``generate`` calls (a rank short of
    samples answers its first batch again and does not count it) and each call runs until
    every rank's answers end (``synced_gpus``).
    """
    encoded = EncodedDataset(samples, processor, with_answer=False)
    pad_id = pad_token_id_of(processor)
    indices = list(range(placement.rank, len(samples), placement.world_size))
    starts = list(range(0, len(indices), batch_size))
    if sharded:
        most = math.ceil(math.ceil(len(samples) / placement.world_size) / batch_size)
        starts += [0] * (most - len(starts))
    correct = 0
    model.eval()
    gathered = roots_unsharded(model) if sharded else contextlib.nullcontext()
    with torch.no_grad(), placement.autocast(), gathered:
        for call, start in enumerate(starts):
            chunk = indices[start : start + batch_size]
            batch = collate([encoded[i] for i in chunk], pad_id, padding_side="left")
            inputs = model_inputs(batch, placement.device)
            output = model.generate(
                **inputs,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=pad_id,
                synced_gpus=sharded,
            )
            answers = processor.batch_decode(
                output[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True
            )
            if call * batch_size < len(indices):  # not a repeat to keep the ranks in step
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
            sharded=config.fsdp,
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
