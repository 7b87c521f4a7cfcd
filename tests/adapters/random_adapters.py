"""LoRA adapter folders with random weights for the adapter tests: non-zero B, so every
adapter changes the model's output, saved with PEFT's ``save_pretrained``."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path

import torch

LANGUAGE_TARGETS = ("q_proj", "v_proj", "down_proj")


def save_random_adapter(
    base: torch.nn.Module,
    folder: Path,
    seed: int,
    rank: int = 4,
    targets: Sequence[str] = LANGUAGE_TARGETS,
    **config: object,
) -> Path:
    """A rank-``rank`` LoRA adapter of ``base`` on ``targets`` (seeded by ``seed``; extra
    ``LoraConfig`` fields in ``config``), saved to ``folder``; returns ``folder``."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    lora = LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        target_modules=list(targets),
        init_lora_weights=False,
        **config,
    )
    peft_model = get_peft_model(copy.deepcopy(base), lora)
    for name, parameter in peft_model.named_parameters():
        if "lora_B" in name:  # non-zero B: the adapter changes the output
            torch.nn.init.normal_(parameter, std=0.5)
    peft_model.save_pretrained(folder)
    return folder
