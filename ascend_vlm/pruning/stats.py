"""What the last pruned prefill saved: tokens per layer, KV-cache bytes, language-model FLOPs."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class PruningStats:
    """The last prefill of a pruned model.

    visual_tokens / kept_visual_tokens: per row, the prompt's visual tokens and those still
    attended after pruning. layer_tokens: prompt slots each decoder layer computed and cached
    (per KV head the same count). kv_bytes / kv_bytes_unpruned: bytes of the prompt's keys and
    values over all layers (in the activations' dtype), as cached and as they would be without
    pruning (a static cache keeps its allocation; this counts the slots in use; without a cache,
    the bytes one would hold). flops / flops_unpruned: estimated language-model
    prefill FLOPs, ``sum over layers of 2 n P + 2 n^2 H d`` (``n`` the layer's prompt tokens,
    ``P`` its linear weights, ``H d`` the query width; causal attention computes half the
    ``n x n`` scores, each a multiply-add in ``q k^T`` and in ``p v``). kept_positions: the
    prompt positions the pruned layers computed, ``[B, S']`` (on the model's device): a row's dead
    filler slots first (rows that drop more than others keep some), then its live positions
    ascending; None without token pruning.
    """

    prompt_tokens: int
    visual_tokens: tuple[int, ...]
    kept_visual_tokens: tuple[int, ...]
    layer_tokens: tuple[int, ...]
    kv_bytes: int
    kv_bytes_unpruned: int
    flops: int
    flops_unpruned: int
    kept_positions: torch.Tensor | None = field(default=None, compare=False, repr=False)

    @property
    def kv_ratio(self) -> float:
        """``kv_bytes / kv_bytes_unpruned``."""
        return self.kv_bytes / self.kv_bytes_unpruned if self.kv_bytes_unpruned else 1.0

    @property
    def flops_ratio(self) -> float:
        """``flops / flops_unpruned``."""
        return self.flops / self.flops_unpruned if self.flops_unpruned else 1.0

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: the fields (``kept_positions`` as nested lists) and both ratios."""
        fields = asdict(self)
        if self.kept_positions is not None:
            fields["kept_positions"] = self.kept_positions.tolist()
        return {**fields, "kv_ratio": self.kv_ratio, "flops_ratio": self.flops_ratio}


def _linear_weights(layer: nn.Module) -> int:
    # in * out, not weight.numel(): a quantized linear holds no float weight.
    return sum(
        module.in_features * module.out_features
        for module in layer.modules()
        if isinstance(module, nn.Linear)
    )


def _layer_flops(tokens: int, weights: int, query_width: int) -> int:
    return 2 * tokens * weights + 2 * tokens * tokens * query_width


def prefill_stats(
    layers: nn.ModuleList, prefill: Any, views: dict, token_layer: int
) -> PruningStats:
    """The :class:`PruningStats` of a finished prefill: ``prefill`` as the pruner recorded it,
    ``views`` the layer views it left, ``token_layer`` the first layer computing the pruned
    prompt (the depth when only the cache is compressed)."""
    batch, length = prefill.visual.shape
    cached = [views[index].length if index in views else length for index in range(len(layers))]
    kv_bytes = unpruned_bytes = flops = unpruned_flops = 0
    for index, layer in enumerate(layers):
        attention = layer.self_attn
        config = attention.config
        head_dim = getattr(attention, "head_dim", config.hidden_size // config.num_attention_heads)
        per_slot = 2 * batch * config.num_key_value_heads * head_dim * prefill.element_size
        kv_bytes += per_slot * cached[index]
        unpruned_bytes += per_slot * length
        weights = _linear_weights(layer)
        query_width = config.num_attention_heads * head_dim
        computed = prefill.length if index >= token_layer else length
        flops += batch * _layer_flops(computed, weights, query_width)
        unpruned_flops += batch * _layer_flops(length, weights, query_width)
    return PruningStats(
        prompt_tokens=length,
        visual_tokens=tuple(prefill.counts),
        kept_visual_tokens=tuple(prefill.live_counts),
        layer_tokens=tuple(cached),
        kv_bytes=kv_bytes,
        kv_bytes_unpruned=unpruned_bytes,
        flops=flops,
        flops_unpruned=unpruned_flops,
        kept_positions=prefill.kept_rows,
    )
