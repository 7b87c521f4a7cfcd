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


def random_adapter_set(base: torch.nn.Module, folder: Path, seeds: dict[str, int]):
    """An ``AdapterSet`` over a copy of ``base`` holding one random adapter per name of
    ``seeds`` (saved under ``folder``; the second and later at rank 8), the base active."""
    from ascend_vlm.adapters import BASE_ADAPTER, AdapterSet

    adapters = AdapterSet(copy.deepcopy(base))
    for index, (name, seed) in enumerate(seeds.items()):
        adapters.load(name, save_random_adapter(base, folder / name, seed, rank=8 if index else 4))
    adapters.activate(BASE_ADAPTER)
    return adapters


def generate_with_adapter(adapters, processor, messages, name: str, max_new_tokens: int):
    """Greedy ``generate`` of the chat ``messages`` (images as ``{"type": "image", "image":
    PIL}`` parts) with adapter ``name`` of ``adapters`` active; the new token ids."""
    from ascend_vlm.adapters import BASE_ADAPTER

    prompt = processor.apply_chat_template(
        list(messages), tokenize=False, add_generation_prompt=True
    )
    images = [
        part["image"]
        for message in messages
        if isinstance(message["content"], list)
        for part in message["content"]
        if part.get("type") == "image"
    ]
    inputs = processor(text=[prompt], images=images or None, return_tensors="pt")
    adapters.activate(name)
    try:
        with torch.no_grad():
            output = adapters.model.generate(
                **inputs, max_new_tokens=max_new_tokens, do_sample=False
            )
    finally:
        adapters.activate(BASE_ADAPTER)
    return output[0, inputs["input_ids"].shape[1] :].tolist()
