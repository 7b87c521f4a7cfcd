"""How a pruned or compressed decoder layer sees the prompt, and the inputs it is handed.

transformers builds one attention mask per forward, in the prompt's original coordinates: key
column ``j`` is prompt position ``j`` (layer 0's cache, which is never pruned), later columns are
the tokens generated since. A layer whose cache holds a subset of the prompt gets that mask
re-indexed: :class:`LayerView` says which prompt position each of its cache slots holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ascend_vlm.ops.fused_attention import MASKED_ADDITIVE_BELOW


@dataclass
class LayerView:
    """Cache slot ``s < L`` of a layer holds prompt position ``columns[b, h, s]`` (``h`` a KV head,
    or one row for all heads); ``live[b, h, s]`` False marks a dead slot no query may attend to.
    Slots from ``L`` on hold the generated tokens in order. ``prompt_length`` is ``S``."""

    columns: torch.Tensor
    live: torch.Tensor
    prompt_length: int

    @property
    def length(self) -> int:
        return self.columns.shape[-1]

    def narrowed(self, slots: torch.Tensor, live: torch.Tensor) -> LayerView:
        """The view of a cache keeping slots ``slots`` ``[B, H', L']`` of this one, those with
        ``live`` False (same shape) dead from now on."""
        heads = max(self.columns.shape[1], slots.shape[1])
        shape = (slots.shape[0], heads, self.length)
        index = slots.expand(-1, heads, -1)
        columns = self.columns.expand(shape).gather(2, index)
        still_live = self.live.expand(shape).gather(2, index) & live.expand(-1, heads, -1)
        return LayerView(columns, still_live, self.prompt_length)


def identity_view(batch: int, length: int, device: torch.device) -> LayerView:
    """Every prompt position, in order, all live."""
    columns = torch.arange(length, device=device).expand(batch, 1, length)
    live = torch.ones((batch, 1, length), dtype=torch.bool, device=device)
    return LayerView(columns, live, length)


def attended(mask: torch.Tensor) -> torch.Tensor:
    """``mask`` (bool True = attend, or additive float) as bool, with ``ops.fused_attention``'s
    rule for additive masks: entries at or below ``MASKED_ADDITIVE_BELOW`` are masked."""
    if mask.dtype == torch.bool:
        return mask
    return mask > MASKED_ADDITIVE_BELOW


def causal_mask(queries: int, keys: int, device: torch.device) -> torch.Tensor:
    """``[1, 1, queries, keys]`` bool: the queries are the last ``queries`` of ``keys`` positions."""
    key_positions = torch.arange(keys, device=device)
    query_positions = torch.arange(keys - queries, keys, device=device)
    return (key_positions[None, :] <= query_positions[:, None])[None, None]


def remapped_mask(
    mask: torch.Tensor,
    view: LayerView,
    width: int,
    *,
    rows: torch.Tensor | None = None,
    query_heads: int = 1,
) -> torch.Tensor:
    """transformers' ``mask`` ``[B|1, 1, Q, W]`` (bool True = attend, or additive float), in
    original coordinates, re-indexed for a layer seen through ``view``: key columns become the
    layer's slots (prompt slots then generated tokens, padded with masked columns up to ``width``,
    the layer's key length), dead slots masked; ``rows`` ``[B, S']`` picks the query rows (the
    pruned prompt, at prefill). Per-head views give ``[B, query_heads, Q', width]``
    (each KV head's slots repeated for its query group). Same dtype convention as ``mask``."""
    keep = attended(mask)
    batch = view.columns.shape[0]
    if rows is not None:
        keep = keep.expand(batch, keep.shape[1], -1, -1)
        index = rows[:, None, :, None].expand(-1, keep.shape[1], -1, keep.shape[-1])
        keep = keep.gather(2, index)
    heads = view.columns.shape[1]
    generated = torch.arange(view.prompt_length, keep.shape[-1], device=keep.device)
    columns = torch.cat([view.columns, generated.expand(batch, heads, -1)], dim=-1)
    keep = keep.expand(batch, heads, -1, -1)
    keep = keep.gather(3, columns[:, :, None, :].expand(-1, -1, keep.shape[2], -1))
    prompt = keep[..., : view.length] & view.live[:, :, None, :]
    keep = torch.cat([prompt, keep[..., view.length :]], dim=-1)
    if width > keep.shape[-1]:
        keep = torch.nn.functional.pad(keep, (0, width - keep.shape[-1]), value=False)
    if heads > 1 and query_heads != heads:
        keep = keep.repeat_interleave(query_heads // heads, dim=1)
    if mask.dtype == torch.bool:
        return keep
    additive = torch.zeros(keep.shape, dtype=mask.dtype, device=keep.device)
    return additive.masked_fill_(~keep, torch.finfo(mask.dtype).min)


def gathered_positions(tensor: torch.Tensor, rows: torch.Tensor, dim: int) -> torch.Tensor:
    """``tensor`` with its sequence axis ``dim`` (batch axis just before it, possibly of size 1)
    restricted to ``rows`` ``[B, S']``; leading axes before the batch are kept."""
    dim = dim % tensor.dim()
    batch, kept = rows.shape
    shape = list(tensor.shape)
    shape[dim - 1] = batch
    tensor = tensor.expand(shape)
    index_shape = [1] * tensor.dim()
    index_shape[dim - 1], index_shape[dim] = batch, kept
    index = rows.reshape(index_shape)
    target = list(shape)
    target[dim] = kept
    return tensor.gather(dim, index.expand(target))
