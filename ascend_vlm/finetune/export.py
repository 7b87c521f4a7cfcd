"""What a finished run saves: the LoRA adapter or the whole model under ``<output_dir>``, and on
request a merged ``from_pretrained`` copy of base and adapter."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ascend_vlm.adapters.adapter_set import DEFAULT_ADAPTER_NAME
from ascend_vlm.adapters.visual_vocabulary import (
    VISUAL_TOKENS_FILE,
    VisualTokens,
    load_visual_tokens,
    save_visual_tokens,
)
from ascend_vlm.finetune.config import FINAL_ADAPTER, FINAL_MODEL, TrainConfig

if TYPE_CHECKING:
    from ascend_vlm.finetune.placement import ProcessPlacement


def save_merged(
    base_path: str | os.PathLike,
    adapter: str | os.PathLike,
    out_dir: str | os.PathLike,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Merge the LoRA ``adapter`` folder into the ``base_path`` checkpoint and save the result
    to ``out_dir`` as a plain ``from_pretrained`` checkpoint: ``model.safetensors`` (weights in
    ``dtype``), tokenizer and processor config of the base.

    The base loads in fp32 and PEFT's ``merge_and_unload`` adds ``scale * B @ A`` to each
    adapted weight once, in fp32, before the cast to ``dtype``; ``modules_to_save`` copies
    replace their originals. An adapter saved with new tokens (``visual_tokens.json``) gets
    them added to the base and its tokenizer first, so the merged checkpoint and its saved
    tokenizer hold the trained rows. Written to a staging sibling and renamed into place; returns
    ``out_dir``.
    """
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    from ascend_vlm.default_model import load_processor

    out_dir = Path(out_dir)
    base = AutoModelForImageTextToText.from_pretrained(base_path, dtype=torch.float32)
    processor = load_processor(base_path)
    if (Path(adapter) / VISUAL_TOKENS_FILE).is_file():
        load_visual_tokens(base, processor, adapter)
    merged = PeftModel.from_pretrained(base, adapter).merge_and_unload()
    staging = out_dir.parent / f".{out_dir.name}.staging"
    shutil.rmtree(staging, ignore_errors=True)
    merged.to(dtype).save_pretrained(staging, safe_serialization=True)
    processor.save_pretrained(staging)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(staging, out_dir)
    return out_dir


def save_final(
    model: Any,
    processor: Any,
    output_dir: Path,
    config: TrainConfig,
    placement: ProcessPlacement,
    visual: VisualTokens | None,
) -> Path:
    """Rank 0 writes the LoRA adapter to ``<output_dir>/adapter`` (PEFT format, with
    ``visual_tokens.json`` when the run added tokens) or, for full training, model + processor
    to ``<output_dir>/model``; via a staging dir + rename. Returns that folder.

    Every rank calls this: each builds the state dict, which for a model sharded while loading
    (``fsdp``) gathers every sharded tensor in a collective all ranks must join."""
    full = config.full_finetune
    final = output_dir / (FINAL_MODEL if full else FINAL_ADAPTER)
    staging = output_dir / f".{final.name}.staging"
    if placement.is_main:
        shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging, safe_serialization=True, is_main_process=placement.is_main)
    # PEFT makes the folder on every rank after its gather: rank 0 moves it once all have.
    placement.barrier()
    if placement.is_main:
        saved = staging
        if not full and config.adapter_name != DEFAULT_ADAPTER_NAME:
            # PEFT writes an adapter not named "default" into a subfolder of that name.
            saved = staging / config.adapter_name
        if full:
            processor.save_pretrained(staging)
        if visual is not None:
            save_visual_tokens(visual, processor, saved)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(saved, final)
        shutil.rmtree(staging, ignore_errors=True)
    placement.barrier()
    return final
