"""One decode step's forward: every running sequence's last token through the model, batched
over KV blocks (:func:`decode_in_blocks`) or one sequence at a time in its own cache
(:func:`decode_alone`, for pruned prompts and families whose KV the blocks do not hold)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ascend_vlm.batching.paged_cache import PagedCache
from ascend_vlm.batching.request import SequenceState
from ascend_vlm.ops import PAGED_KV_KWARG


def decode_positions(lengths: list[int], deltas: list[int], mrope: bool) -> torch.Tensor:
    """Position ids of the next token of rows holding ``lengths`` tokens: ``[rows, 1]``, or
    ``[3, rows, 1]`` for M-RoPE (each row's ``length + rope_delta`` on all three axes)."""
    positions = (torch.tensor(lengths) + torch.tensor(deltas))[:, None]
    return positions[None].expand(3, -1, -1) if mrope else positions


def decode_in_blocks(
    forward: Callable[..., Any], running: list[SequenceState], cache: PagedCache, cache_keyword: str,
    mrope: bool, device: torch.device,
) -> torch.Tensor:  # fmt: skip
    """Logits ``[rows, vocab]`` of one batched step over ``cache`` (set up for ``running``)
    through ``forward`` (the model's forward, or one routing rows to their adapters).
    Unless the cache gathers, the attention reads the blocks through the step's
    :class:`~ascend_vlm.ops.PagedKV`; RuntimeError when a decoder layer did not."""
    lengths = [sequence.cached_tokens for sequence in running]
    deltas = [sequence.rope_delta for sequence in running]
    paged = None if cache.gather else cache.paged_kv()
    with torch.no_grad():
        output = forward(
            input_ids=torch.tensor([[sequence.tokens[-1]] for sequence in running], device=device),
            attention_mask=cache.attention_mask().to(device),
            position_ids=decode_positions(lengths, deltas, mrope).to(device),
            cache_position=torch.tensor([cache.width - 1], device=device),
            use_cache=True,
            **{cache_keyword: cache},
            **({} if paged is None else {PAGED_KV_KWARG: paged}),
        )
    if paged is not None and len(paged.layers_read) != len(cache.layers):
        raise RuntimeError(
            f"model: {len(paged.layers_read)} of {len(cache.layers)} decoder layers read the "
            f"KV blocks through {PAGED_KV_KWARG!r}; its attention must pass keyword arguments "
            "on to the attention function"
        )
    return output.logits[:, -1]


def decode_alone(
    forward: Callable[..., Any], sequence: SequenceState, cache_keyword: str, mrope: bool,
    device: torch.device,
) -> torch.Tensor:  # fmt: skip
    """Logits ``[vocab]`` of one step of ``sequence`` in its own cache, through ``forward``."""
    length = sequence.size.prompt_tokens + len(sequence.tokens) - 1
    with torch.no_grad():
        output = forward(
            input_ids=torch.tensor([[sequence.tokens[-1]]], device=device),
            attention_mask=torch.ones(1, length + 1, dtype=torch.long, device=device),
            position_ids=decode_positions([length], [sequence.rope_delta], mrope).to(device),
            cache_position=torch.tensor([length], device=device),
            use_cache=True,
            **{cache_keyword: sequence.cache},
        )
    return output.logits[0, -1]
