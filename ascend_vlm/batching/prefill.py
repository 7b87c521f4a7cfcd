"""Prefilling a prompt whose first tokens' KV blocks the prefix cache already holds.

The cached prefix (``start`` tokens, whole blocks) is copied out of its blocks into a fresh
``DynamicCache`` and the model runs on the remaining tokens only, as ``generate`` continues a
cache: the suffix's tokens at positions ``start ..`` (for M-RoPE families, the columns of the
whole prompt's 3-D rope index, so text after an image keeps its offset), the attention mask
covering the whole prompt. The prompt's images are encoded only when some image token lies in
the suffix: :func:`reusable_tokens` keeps either every image token in the reused prefix or
none of them, since the image tensors cannot be split per image without knowing the family's
layout.
"""

from __future__ import annotations

from typing import Any

import torch

from ascend_vlm._compat.cache import replace_cached_states
from ascend_vlm.batching.block_pool import BlockPool
from ascend_vlm.ops import gather_blocks


def reusable_tokens(
    cached_blocks: int, prompt_tokens: int, block_size: int, image_positions: list[int]
) -> int:
    """How many leading tokens of a prompt to take from ``cached_blocks`` cached blocks: whole
    blocks, at least one token left to prefill (its logits give the first new token), and with
    images, either past the last image token or before the first one (module docstring)."""
    start = min(cached_blocks * block_size, (prompt_tokens - 1) // block_size * block_size)
    if image_positions and start <= image_positions[-1]:
        start = min(start, image_positions[0] // block_size * block_size)
    return start


def seeded_cache(pool: BlockPool, blocks: list[int], length: int, config: Any) -> Any:
    """A ``DynamicCache`` holding the first ``length`` tokens of ``blocks`` (a copy)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    table = torch.tensor([blocks], dtype=torch.int32, device=pool.keys[0].device)
    for layer in range(len(pool.keys)):
        keys = gather_blocks(pool.keys[layer], table)[:, :, :length]
        values = gather_blocks(pool.values[layer], table)[:, :, :length]
        # The gathered tensors are fresh: hand them over rather than let update() copy them.
        cache.update(keys[:, :, :0], values[:, :, :0], layer)
        replace_cached_states(cache, layer, keys, values)
    return cache


def suffix_inputs(
    inputs: dict[str, torch.Tensor], start: int, image_token: int | None, positions: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The model keywords that prefill ``inputs``' tokens from ``start`` on, after a cache
    holding the ones before: ``positions`` are the whole prompt's position ids (``[1, L]``, or
    ``[3, 1, L]`` for M-RoPE)."""
    ids = inputs["input_ids"]
    length = ids.shape[1]
    suffix = ids[:, start:]
    has_images = image_token is not None and bool((suffix == image_token).any())
    kept: dict[str, torch.Tensor] = {}
    for name, tensor in inputs.items():
        if name == "attention_mask":
            kept[name] = tensor
        elif tensor.dim() == 2 and tensor.shape == ids.shape:
            kept[name] = tensor[:, start:]  # per-token inputs: ids, token types
        elif has_images:
            kept[name] = tensor
    kept["position_ids"] = positions[..., start:]
    kept["cache_position"] = torch.arange(start, length, device=ids.device)
    return kept


def store_prompt(pool: BlockPool, blocks: list[int], cache: Any, start: int) -> None:
    """Write a prefilled one-row ``cache``'s tokens from ``start`` (a block boundary) on into
    ``blocks`` (the prompt's blocks from ``start // block_size`` on)."""
    for layer in range(len(pool.keys)):
        cached = cache.layers[layer]
        pool.write(layer, blocks, cached.keys[0, :, start:], cached.values[0, :, start:])
