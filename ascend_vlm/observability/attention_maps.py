"""Where an answer's tokens looked: attention rows of chosen decoder layers, on demand.

One teacher-forced forward over prompt + answer taps the chosen layers' attention
(:class:`~ascend_vlm.patching.attention_tap.AttentionTap`, through the edit ledger) and keeps,
per layer, only the rows of the positions that produced the answer tokens: answer token ``i`` comes from the logits at position
``prompt_length - 1 + i``, so that position's attention is what the model looked at when it
chose the token. Rows are ``softmax(q k^T * scale + mask)`` averaged over heads
(``ops.attention_probabilities``), whatever attention implementation the model runs (a patched
model's fused kernel included): nothing switches to eager attention.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ascend_vlm import ops
from ascend_vlm._base_model import base_model
from ascend_vlm.models.decoder_parts import decoder_parts
from ascend_vlm.patching.attention_tap import AttentionTap
from ascend_vlm.patching.ledger import applied_features, apply_feature, remove_feature


@dataclass(frozen=True)
class AnswerAttention:
    """Attention of the positions that produced ``T`` answer tokens over the ``S`` positions
    of prompt + answer.

    ``weights`` float32 ``[L, T, S]``: for each layer of ``layers`` and each answer token, the
    head-averaged attention row of the position that produced it (rows sum to 1 over the
    positions it may attend). ``hidden_norms`` ``[T]``: L2 norm of the last decoder layer's
    output at those positions. ``visual`` bool ``[S]``: the positions holding visual tokens.
    ``query_positions``: the producing positions, ``prompt_length - 1 + i``.
    """

    layers: tuple[int, ...]
    query_positions: tuple[int, ...]
    weights: torch.Tensor
    hidden_norms: torch.Tensor
    visual: torch.Tensor

    def layer_mean(self) -> torch.Tensor:
        """``[T, S]``: the rows averaged over the layers."""
        return self.weights.mean(dim=0)

    def visual_weights(self) -> torch.Tensor:
        """``[T, V]``: the layer-mean rows at the visual positions, in prompt order."""
        return self.layer_mean()[:, self.visual]


def _rows_mask(mask: torch.Tensor | None, positions: torch.Tensor, keys: int) -> torch.Tensor:
    """The mask rows of ``positions`` over ``keys`` key columns; causal when ``mask`` is None
    (an implementation called with ``is_causal`` gets no mask)."""
    if mask is None or mask.dim() != 4:
        columns = torch.arange(keys, device=positions.device)
        return (columns[None, :] <= positions[:, None])[None, None]
    return mask[..., positions, :keys]


def _layer_output(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


def answer_attention(
    model: nn.Module,
    inputs: Mapping[str, Any],
    prompt_length: int,
    *,
    layers: Sequence[int] | None = None,
) -> AnswerAttention:
    """Attention rows of the answer in ``inputs`` (the processor's output for ONE prompt with
    its images, ``input_ids`` ``[1, S]`` extended by the answer's token ids; other tensors as
    the processor made them) at ``layers`` (indices into the language model's decoder layers,
    default all). ``prompt_length`` is the prompt's token count; the answer is the rest.

    ``model`` is a VLM of a family whose descriptor supports the attention overlay (its decoder
    layers and visual token ids are found there); runs under ``torch.no_grad`` with ``use_cache=False``.
    """
    input_ids = inputs["input_ids"]
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(
            f"inputs['input_ids']: expected one row [1, S], got shape {tuple(input_ids.shape)}"
        )
    length = input_ids.shape[1]
    if not 1 <= prompt_length < length:
        raise ValueError(
            f"prompt_length: expected 1 <= prompt_length < {length} (the answer follows the "
            f"prompt in input_ids), got {prompt_length}"
        )
    base = base_model(model)
    if applied_features(base, "token_pruning"):
        raise ValueError(
            "model: attention maps read the whole prompt at every layer; disable token pruning "
            "first (ascend_vlm.pruning.disable_token_pruning(model))"
        )
    target = decoder_parts(base, "attention_overlay")
    depth = len(target.layers)
    chosen = tuple(range(depth)) if layers is None else tuple(layers)
    if not chosen or any(not 0 <= layer < depth for layer in chosen):
        raise ValueError(f"layers: expected indices in [0, {depth}), got {list(chosen)}")
    device = input_ids.device
    positions = torch.arange(prompt_length - 1, length - 1, device=device)
    rows: dict[int, torch.Tensor] = {}
    hidden: list[torch.Tensor] = []

    def take(module: nn.Module, query, key, mask, scaling) -> None:
        mask_rows = _rows_mask(mask, positions, key.shape[2])
        probabilities = ops.attention_probabilities(
            query[:, :, positions], key, mask_rows, scale=scaling
        )
        rows[layer_of[id(module)]] = probabilities[0].mean(dim=0)

    def keep_hidden(module: nn.Module, args: tuple, output: Any) -> None:
        hidden.append(_layer_output(output)[0, positions].float().norm(dim=-1))

    attentions = [target.layers[layer].self_attn for layer in chosen]
    layer_of = {id(attention): layer for attention, layer in zip(attentions, chosen, strict=True)}
    handle = target.layers[-1].register_forward_hook(keep_hidden)
    tap = AttentionTap(attentions, take)
    apply_feature(model, tap)
    try:
        with torch.no_grad():
            model(**inputs, use_cache=False)
    finally:
        handle.remove()
        remove_feature(model, tap)
    ids = torch.tensor(target.visual_token_ids, device=device)
    return AnswerAttention(
        layers=chosen,
        query_positions=tuple(positions.tolist()),
        weights=torch.stack([rows[layer] for layer in chosen]).cpu(),
        hidden_norms=hidden[-1].cpu(),
        visual=torch.isin(input_ids[0], ids).cpu(),
    )
