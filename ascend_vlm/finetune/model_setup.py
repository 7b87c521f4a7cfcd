"""The model a run trains: the base loaded from its folder, optionally quantized, new tokens
added, then wrapped in LoRA (or unfrozen for full training). ascend_vlm's patch comes later,
when training begins (:class:`ascend_vlm.integrations.AscendVLMCallback`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ascend_vlm.adapters.visual_vocabulary import (
    VisualTokens,
    add_visual_tokens,
    trainable_token_indices,
)
from ascend_vlm.data.vqa import VQASample
from ascend_vlm.finetune.config import LANGUAGE_PROJECTIONS
from ascend_vlm.models.parts import model_part

if TYPE_CHECKING:
    from ascend_vlm.finetune.config import TrainConfig


# Training images whose mean projected visual feature initialises a new token's rows.
EXAMPLES_PER_NEW_TOKEN = 16


def lora_target_modules(
    model: torch.nn.Module,
    language_targets: Sequence[str] = LANGUAGE_PROJECTIONS,
    vision: bool = False,
    projector: bool = False,
) -> list[str]:
    """Full names of the ``nn.Linear`` modules LoRA should wrap.

    Language-model linears whose last name part is in ``language_targets``; with ``vision``
    every linear of the vision tower; with ``projector`` every linear of the projector. Parts
    are told apart by :func:`ascend_vlm.models.parts.model_part`.
    """
    names = []
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        part = model_part(name)
        if part == "projector":
            selected = projector
        elif part == "vision":
            selected = vision
        else:
            selected = name.split(".")[-1] in language_targets
        if selected:
            names.append(name)
    if not names:
        raise ValueError(
            f"lora_targets: expected names of linear layers in the model, got "
            f"{list(language_targets)} (vision={vision}, projector={projector}) matching none"
        )
    return names


def load_base_model(
    model_path: str, device: torch.device, dtype: torch.dtype = torch.float32, fsdp: bool = False
) -> tuple[Any, Any]:
    """``(model, processor)`` from a local ``from_pretrained`` folder, weights in ``dtype``;
    with ``fsdp`` sharded over the process group's ranks while loading (FSDP2, one unit per
    layer: :func:`ascend_vlm.integrations.fsdp.fsdp_distributed_config`). ValueError naming
    ``fsdp`` for one rank or a transformers without load-time FSDP."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from ascend_vlm.default_model import load_processor

    if not (Path(model_path) / "config.json").is_file():
        raise FileNotFoundError(
            f"model_path: expected a local checkpoint folder with config.json, got {model_path!r}"
        )
    loading: dict[str, Any] = {"dtype": dtype}
    if fsdp:
        from ascend_vlm.integrations.fsdp import fsdp_distributed_config

        try:
            sharding = fsdp_distributed_config(AutoConfig.from_pretrained(model_path))
        except (RuntimeError, ValueError) as error:  # a user's choice this setup cannot run
            raise ValueError(f"fsdp: {error} (launch 2 or more ranks with torchrun)") from None
        loading["distributed_config"] = sharding
    model = AutoModelForImageTextToText.from_pretrained(model_path, **loading)
    return model.to(device), load_processor(model_path)


def with_trainable_weights(
    model: Any, config: TrainConfig, visual: VisualTokens | None
) -> tuple[Any, int]:
    """``model`` ready to train: fully unfrozen, or wrapped in PEFT LoRA (adapter
    ``config.adapter_name``, plus the rows of ``visual``'s tokens as trainable tokens); plus
    the number of LoRA targets."""
    from peft import LoraConfig, get_peft_model

    if config.full_finetune:
        model.requires_grad_(True)
        return model, 0
    targets = lora_target_modules(
        model, config.lora_targets, config.lora_vision, config.lora_projector
    )
    token_indices = None if visual is None else trainable_token_indices(model, visual)
    lora = LoraConfig(
        r=config.lora_r,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        target_modules=targets,
        modules_to_save=list(config.modules_to_save) or None,
        trainable_token_indices=token_indices,
    )
    return get_peft_model(model, lora, adapter_name=config.adapter_name), len(targets)


def add_new_tokens(
    model: Any, processor: Any, tokens: Sequence[str], samples: Sequence[VQASample]
) -> VisualTokens:
    """Add ``tokens`` to ``processor`` and ``model`` (:func:`add_visual_tokens`), each row
    initialised from the mean projected visual feature of the images of the first
    ``EXAMPLES_PER_NEW_TOKEN`` training records whose question or answer holds the token.

    Raises ``ValueError`` naming the tokens no training record mentions."""
    examples: dict[str, list] = {token: [] for token in tokens}
    for index in range(len(samples)):
        open_tokens = [t for t in tokens if len(examples[t]) < EXAMPLES_PER_NEW_TOKEN]
        if not open_tokens:
            break
        sample = samples[index]
        for token in open_tokens:
            if token in sample.question or token in sample.answer:
                examples[token].append(sample.image)
    missing = [token for token, images in examples.items() if not images]
    if missing:
        raise ValueError(
            f"new_tokens: expected training records whose question or answer holds each new "
            f"token (their images initialise its rows), got none for {missing}"
        )
    return add_visual_tokens(model, processor, tokens, examples=examples)


def whole_table_bytes(model: Any, world_size: int) -> int:
    """Bytes DDP would hand over per step if the input embedding (and an untied output head)
    trained whole instead of only the new rows; 0 in a single process."""
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tables = [embedding] if head is None or head.weight is embedding else [embedding, head.weight]
    return sum(t.numel() * t.element_size() for t in tables) if world_size > 1 else 0
