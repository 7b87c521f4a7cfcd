"""``attention_probabilities``: the softmax weights an attention call applies, for chosen queries.

Fused attention kernels never materialise their weights. Callers that need them for a few query
rows (token pruning's scorers, attention maps) compute exactly those rows here:
``softmax(q @ k^T * scale + mask)`` with transformers' eager-attention arithmetic (logits and mask
in the inputs' dtype, softmax in float32), on whatever device the inputs live (plain torch
operations, no host reads).
"""

from __future__ import annotations

import torch


def attention_probabilities(
    query: torch.Tensor,
    key: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention weights, float32 ``[B, Nq, Sq, Skv]``, of queries ``[B, Nq, Sq, D]`` over keys
    ``[B, Nkv, Skv, D]`` (BNSD; ``Nq`` a multiple of ``Nkv``: query head ``h`` reads key head
    ``h // (Nq / Nkv)``).

    ``w = softmax(q k^T * scale + mask)`` over the keys, with ``scale`` defaulting to ``D**-0.5``.
    ``attention_mask`` broadcasts to ``[B, Nq, Sq, Skv]``: bool (True = attend) or additive float
    (0 = attend, the dtype's min = masked). A bool mask becomes the additive one eager attention
    uses (0 / the dtype's min), so a row whose every key is masked gets uniform weights, as in
    eager. ``w.to(query.dtype)`` is transformers' eager weights bit for bit.
    """
    if query.dim() != 4 or key.dim() != 4:
        raise ValueError(
            f"query, key: expected 4-D BNSD tensors, got shapes {tuple(query.shape)}, "
            f"{tuple(key.shape)}"
        )
    if query.shape[1] % key.shape[1] or query.shape[-1] != key.shape[-1]:
        raise ValueError(
            f"query, key: expected query heads a multiple of key heads and equal head dims, got "
            f"shapes {tuple(query.shape)}, {tuple(key.shape)}"
        )
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    logits = torch.matmul(query, key.transpose(2, 3)) * scale
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            additive = torch.zeros(attention_mask.shape, dtype=query.dtype, device=query.device)
            attention_mask = additive.masked_fill_(~attention_mask, torch.finfo(query.dtype).min)
        logits = logits + attention_mask
    return torch.softmax(logits, dim=-1, dtype=torch.float32)
