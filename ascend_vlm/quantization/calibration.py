"""Calibration batches for activation-aware quantization: the model-input dicts AWQ runs the
model over to measure its activations. The default is the reference ShapesVQA training split
(question, image and answer, as the fine-tune script encodes them)."""

from __future__ import annotations

from typing import Any

import torch

from ascend_vlm.data.shapes_vqa import ShapesVQA
from ascend_vlm.data.vqa import collate, encode_sample, pad_token_id_of


def shapes_calibration(
    processor: Any, samples: int = 32, batch_size: int = 8, seed: int = 0, image_size: int = 112
) -> list[dict[str, torch.Tensor]]:
    """``samples`` ShapesVQA training records encoded by ``processor`` (prompt, image and
    answer), in right-padded batches of ``batch_size`` (``labels`` left out)."""
    if not isinstance(samples, int) or samples < 1:
        raise ValueError(f"samples: expected an int >= 1, got {samples!r}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size: expected an int >= 1, got {batch_size!r}")
    dataset = ShapesVQA("train", size=samples, seed=seed, image_size=image_size)
    encoded = [encode_sample(processor, dataset[index]) for index in range(samples)]
    pad = pad_token_id_of(processor)
    batches = []
    for start in range(0, samples, batch_size):
        batch = collate(encoded[start : start + batch_size], pad)
        batch.pop("labels")
        batches.append(batch)
    return batches
