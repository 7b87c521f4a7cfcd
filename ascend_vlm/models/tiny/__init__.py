"""Tiny (and small) random configs and matching inputs for every supported family.

Used by the tests (patched vs unpatched equivalence) and by `scripts/bench_patch.py`. One module
per family group declares its `TinyFamily` rows (`TINY_FAMILIES`); `sizes` holds the sizes and
special token ids. `build_model` builds a family at a size, `make_inputs` feeds it text and
images.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ascend_vlm.models.tiny import (
    deepseek_ocr2,
    gemma,
    glm,
    idefics3,
    internvl,
    llama,
    llava,
    mistral3,
    paddleocr_vl,
    qwen,
)
from ascend_vlm.models.tiny.family import TinyFamily
from ascend_vlm.models.tiny.qwen import left_padded_qwen_batch, qwen_images, qwen_prompt
from ascend_vlm.models.tiny.sizes import (
    BOS,
    IMAGE_TOKEN,
    PAD,
    SIZES,
    TEXT_VOCAB,
    TINY,
    TINY_TEXT_CONFIG,
    VIDEO_TOKEN,
    VISION_END,
    VISION_START,
    VOCAB,
    ModelSize,
    generator,
)

__all__ = [
    "BOS",
    "FAMILIES",
    "IMAGE_TOKEN",
    "PAD",
    "SIZES",
    "TEXT_VOCAB",
    "TINY",
    "TINY_TEXT_CONFIG",
    "VIDEO_TOKEN",
    "VISION_END",
    "VISION_START",
    "VOCAB",
    "ModelSize",
    "TinyFamily",
    "build_model",
    "left_padded_qwen_batch",
    "make_inputs",
    "qwen_images",
    "qwen_prompt",
]

FAMILIES: dict[str, TinyFamily] = {
    family.name: family
    for group in (
        qwen,
        llava,
        idefics3,
        gemma,
        internvl,
        glm,
        llama,
        mistral3,
        paddleocr_vl,
        deepseek_ocr2,
    )
    for family in group.TINY_FAMILIES
}


def build_model(
    name: str,
    *,
    seed: int = 0,
    attn_implementation: str = "eager",
    size: str = "tiny",
    layers: int | None = None,
):
    """A freshly initialised model of family `name` at `size` (a key of SIZES; fp32, eval), with
    `layers` decoder layers instead of the size's when given."""
    import transformers

    if size not in SIZES:
        raise ValueError(f"size: expected one of {tuple(SIZES)}, got {size!r}")
    family = FAMILIES[name]
    torch.manual_seed(seed)
    shape = SIZES[size] if layers is None else replace(SIZES[size], layers=layers)
    config = family.config(shape)
    config._attn_implementation = attn_implementation
    model = getattr(transformers, family.model_class)(config)
    return model.eval()


def make_inputs(
    name: str, model, *, n_images: int = 0, batch: int = 1, text_len: int = 6, padding: str = "none"
) -> dict:
    """Model kwargs: `batch` rows of random text, row 0 carrying `n_images` images.

    padding "left"/"right": row 1 onwards is shortened by 3 tokens and padded on that side (the
    attention_mask marks the pads). Token ids of text stay below TEXT_VOCAB.
    """
    if padding not in ("none", "left", "right"):
        raise ValueError(f"padding: expected 'none', 'left' or 'right', got {padding!r}")
    if n_images and batch > 1:
        # every row needs its own images for models that group pixels per sample
        raise ValueError("make_inputs: images are only placed in row 0; use batch=1 with images")
    family = FAMILIES[name]
    rows_generator = generator(batch * 10 + n_images)
    image_kwargs, tokens_per_image = family.images(model, n_images) if n_images else ({}, [])
    rows = []
    for row in range(batch):
        text = torch.randint(3, TEXT_VOCAB, (text_len,), generator=rows_generator).tolist()
        images = tokens_per_image if row == 0 else []
        ids = [BOS] + [t for count in images for t in [VISION_START] + [IMAGE_TOKEN] * count] + text
        rows.append(ids)
    width = max(len(r) for r in rows)
    input_ids = torch.full((batch, width), PAD)
    attention_mask = torch.zeros((batch, width), dtype=torch.long)
    for index, ids in enumerate(rows):
        ids = ids[:-3] if index > 0 and padding != "none" else ids
        start = width - len(ids) if padding == "left" else 0
        input_ids[index, start : start + len(ids)] = torch.tensor(ids)
        attention_mask[index, start : start + len(ids)] = 1
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask, **image_kwargs}
    if family.image_batch_axis and n_images:
        inputs["pixel_values"] = inputs["pixel_values"].unsqueeze(0)
    if family.token_inputs is not None:
        inputs.update(family.token_inputs(input_ids, n_images))
    return inputs
