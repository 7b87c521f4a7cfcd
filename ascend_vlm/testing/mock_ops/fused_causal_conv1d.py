"""Stand-in for ``torch_npu.npu_fused_causal_conv1d`` (doc: ``torch_npu/_op_plugin_docs.py`` of
the torch-npu wheels; output: ``torch_npu/op_plugin/meta/_meta_registrations.py``, empty_like x).

x ``[batch, seq_len, dim]`` or packed ``[cu_seq_len, dim]`` (then ``query_start_loc`` ``[batch
+ 1]`` is required) in float16/bfloat16, weight ``[K, dim]`` with K fixed at 3, ``dim % 128 ==
0``, conv_states ``[..., K - 1, dim]`` (the 2.8.0.post5 doc's shape; newer docs say
``state_len``): each sequence is padded in front with its cached steps
(``conv_states[cache_indices[b]]``, ``cache_indices`` ``[batch]``, default the identity:
UNVERIFIED) and its last steps are written back in place. ``residual_connection=1`` adds x.
The docs list one SoC (the Ascend 950); the mock does not model the SoC.
"""

from __future__ import annotations

import itertools

import torch

from ascend_vlm.ops.kernel_constraints import (
    CAUSAL_CONV1D_DTYPES,
    CAUSAL_CONV1D_WIDTH,
    fused_causal_conv1d_refusal,
)
from ascend_vlm.testing._checks import bad, check_dtype, refuse


def _check_conv(x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor) -> None:
    check_dtype("x", x, CAUSAL_CONV1D_DTYPES)
    if x.dim() not in (2, 3):
        raise bad("x", "2-D [cu_seq_len, dim] or 3-D [batch, seq_len, dim]", x.shape)
    dim, width = x.shape[-1], CAUSAL_CONV1D_WIDTH
    check_dtype("weight", weight, CAUSAL_CONV1D_DTYPES)
    if tuple(weight.shape) != (width, dim):
        raise bad("weight", f"shape {(width, dim)} [K=3, dim]", tuple(weight.shape))
    refusal = fused_causal_conv1d_refusal(x.dtype, weight.shape[0], dim)
    if refusal is not None:
        raise refuse("npu_fused_causal_conv1d", refusal)
    check_dtype("conv_states", conv_states, CAUSAL_CONV1D_DTYPES)
    if conv_states.dim() != 3 or tuple(conv_states.shape[1:]) != (width - 1, dim):
        raise bad("conv_states", f"[..., state_len={width - 1}, dim={dim}]", conv_states.shape)


def _sequences(x: torch.Tensor, query_start_loc: torch.Tensor | None) -> list[torch.Tensor]:
    """Each sequence's ``[L, dim]`` rows."""
    if x.dim() == 3:
        return list(x)
    if query_start_loc is None:
        raise bad("query_start_loc", "a tensor [batch + 1] for a 2-D x", None)
    bounds = query_start_loc.tolist()
    ordered = all(a <= b for a, b in itertools.pairwise(bounds))
    if query_start_loc.dim() != 1 or not bounds or bounds[0] != 0 or bounds[-1] != x.shape[0]:
        ordered = False
    if not ordered:
        raise bad("query_start_loc", f"offsets from 0 to {x.shape[0]}", bounds)
    return [x[a:b] for a, b in itertools.pairwise(bounds)]


def npu_fused_causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_states: torch.Tensor,
    *,
    query_start_loc: torch.Tensor | None = None,
    cache_indices: torch.Tensor | None = None,
    initial_state_mode: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    activation: str | None = "None",
    pad_slot_id: int | None = -1,
    run_mode: int | None = 0,
    residual_connection: int | None = 0,
    max_query_len: int | None = -1,
    num_computed_tokens: torch.Tensor | None = None,
    block_idx_first_scheduled_token: torch.Tensor | None = None,
    block_idx_last_scheduled_token: torch.Tensor | None = None,
    initial_state_idx: torch.Tensor | None = None,
    block_size: int | None = 128,
    conv_mode: str | None = "default",
) -> torch.Tensor:
    """Stand-in for ``torch_npu.npu_fused_causal_conv1d``: ``y[t] = sum_j weight[j] * xs[t +
    j]`` over ``xs = cat(cached K - 1 steps, sequence)``, computed in float32, returned in x's
    dtype. What the doc marks unsupported (``initial_state_mode``, ``bias``, ``activation``,
    ``run_mode``) raises ValueError; what the mock does not model (speculative decoding, APC,
    the "pangu" mode, padded slots) raises NotImplementedError."""
    _check_conv(x, weight, conv_states)
    unsupported = {"initial_state_mode": initial_state_mode, "bias": bias}
    for name, given in unsupported.items():
        if given is not None:
            raise bad(name, "None (documented as not supported yet)", type(given).__name__)
    if activation not in ("None", None) or run_mode not in (0, None):
        raise bad("activation/run_mode", "'None'/0 (not supported yet)", (activation, run_mode))
    unmodelled = (num_accepted_tokens, num_computed_tokens, block_idx_first_scheduled_token)
    unmodelled += (block_idx_last_scheduled_token, initial_state_idx)
    if any(t is not None for t in unmodelled) or conv_mode != "default":
        raise NotImplementedError(
            "mock npu_fused_causal_conv1d: speculative decoding, APC and the pangu mode are "
            "not implemented"
        )
    if residual_connection not in (0, 1, None):
        raise bad("residual_connection", "0 or 1", residual_connection)
    sequences = _sequences(x, query_start_loc)
    slots = list(range(len(sequences))) if cache_indices is None else cache_indices.tolist()
    if cache_indices is not None and (cache_indices.dim() != 1 or len(slots) != len(sequences)):
        raise NotImplementedError(
            "mock npu_fused_causal_conv1d: cache_indices other than 1-D [batch] (APC) are "
            "not implemented"
        )
    if any(slot == pad_slot_id or not 0 <= slot < conv_states.shape[0] for slot in slots):
        raise NotImplementedError(
            f"mock npu_fused_causal_conv1d: padded or out-of-range slots {slots} are not "
            "implemented"
        )
    w = weight.float()
    outputs = []
    for rows, slot in zip(sequences, slots, strict=True):
        xs = torch.cat((conv_states[slot].float(), rows.float()))
        y = sum(w[j] * xs[j : j + rows.shape[0]] for j in range(CAUSAL_CONV1D_WIDTH))
        outputs.append(y + rows.float() if residual_connection == 1 else y)
        conv_states[slot] = xs[-(CAUSAL_CONV1D_WIDTH - 1) :].to(conv_states.dtype)
    out = torch.stack(outputs) if x.dim() == 3 else torch.cat(outputs)
    return out.to(x.dtype)
