"""Stand-ins for ``torch_npu.npu_chunk_gated_delta_rule`` and
``torch_npu.npu_recurrent_gated_delta_rule`` (docs: ``torch_npu/_op_plugin_docs.py`` of the
torch-npu wheels; output shapes and dtypes: ``torch_npu/op_plugin/meta/_meta_registrations.py``).

Both take the packed TND layout: query/key ``[T, Nk, Dk]``, value ``[T, Nv, Dv]``, beta ``[T,
Nv]`` and the state ``[BlockNum, Nv, Dv, Dk]`` in bfloat16, g ``[T, Nv]`` float32 (the decay is
``e^g``; None means 0), ``actual_seq_lengths`` int32 ``[B]``, ``Nv`` a multiple of ``Nk``. Per
sequence and value head ``h`` (key head ``h // (Nv / Nk)``: UNVERIFIED, the docs only require
the multiple), with ``S`` ``[Dv, Dk]``, computed in float32:

    S = e^g_t * S;  S = S + beta_t * (v_t - S k_t) k_t^T;  o_t = scale * S q_t

The output is bfloat16 ``[T, Nv, Dv]``. Neither normalises q or k.
"""

from __future__ import annotations

import torch

from ascend_vlm.ops.kernel_constraints import (
    GATED_DELTA_DTYPE,
    chunk_gated_delta_rule_refusal,
    recurrent_gated_delta_rule_refusal,
)
from ascend_vlm.testing._checks import bad, check_dtype, refuse

GDR_DTYPES = (GATED_DELTA_DTYPE,)
GDR_G_DTYPES = (torch.float32,)
GDR_INDEX_DTYPES = (torch.int32,)


def _check_packed(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    beta: torch.Tensor | None,
    g: torch.Tensor | None,
    scale: float | None,
    actual_seq_lengths: torch.Tensor | None,
) -> list[int]:
    """The checks both kernels share; returns the sequence lengths."""
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        check_dtype(name, tensor, GDR_DTYPES)
        if tensor.dim() != 3:
            raise bad(name, "3-D [T, N, D]", f"shape {tuple(tensor.shape)}")
    tokens, key_heads, _ = query.shape
    value_heads = value.shape[1]
    if key.shape != query.shape:
        raise bad("key", f"shape {tuple(query.shape)} like query", f"shape {tuple(key.shape)}")
    if value.shape[0] != tokens or key_heads == 0 or value_heads % key_heads:
        raise bad("value", f"[T={tokens}, Nv, Dv], Nv a multiple of Nk={key_heads}", value.shape)
    if beta is None:
        raise bad("beta", f"a bfloat16 tensor [T={tokens}, Nv={value_heads}]", None)
    check_dtype("beta", beta, GDR_DTYPES)
    if g is not None:
        check_dtype("g", g, GDR_G_DTYPES)
    for name, tensor in (("beta", beta), ("g", g)):
        if tensor is not None and tuple(tensor.shape) != (tokens, value_heads):
            raise bad(name, f"shape {(tokens, value_heads)} [T, Nv]", tuple(tensor.shape))
    if not isinstance(scale, float):
        raise bad("scale", "a float (1/sqrt(Dk) in the docs)", scale)
    if actual_seq_lengths is None:
        raise bad("actual_seq_lengths", "an int32 tensor [B]", None)
    check_dtype("actual_seq_lengths", actual_seq_lengths, GDR_INDEX_DTYPES)
    lengths = actual_seq_lengths.tolist()
    if actual_seq_lengths.dim() != 1 or any(n < 0 for n in lengths) or sum(lengths) != tokens:
        raise bad("actual_seq_lengths", f"1-D [B] lengths summing to T={tokens}", lengths)
    return lengths


def _check_state(argument: str, state: torch.Tensor, query: torch.Tensor, value: torch.Tensor):
    check_dtype(argument, state, GDR_DTYPES)
    expected = (value.shape[1], value.shape[2], query.shape[2])
    if state.dim() != 4 or tuple(state.shape[1:]) != expected:
        raise bad(argument, f"[BlockNum, Nv, Dv, Dk] with (Nv, Dv, Dk) = {expected}", state.shape)


def _scan(
    state: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One sequence from ``state`` ``[Nv, Dv, Dk]`` (float32): its output ``[L, Nv, Dv]`` and the
    state after each token."""
    group = value.shape[1] // query.shape[1]
    q = query.float().repeat_interleave(group, dim=1)
    k = key.float().repeat_interleave(group, dim=1)
    v, b = value.float(), beta.float()
    decay = torch.ones_like(b) if g is None else g.float().exp()
    outputs, states = [], []
    for t in range(q.shape[0]):
        state = state * decay[t, :, None, None]
        predicted = torch.einsum("nvk,nk->nv", state, k[t])
        state = state + torch.einsum("nv,nk->nvk", b[t, :, None] * (v[t] - predicted), k[t])
        outputs.append(scale * torch.einsum("nvk,nk->nv", state, q[t]))
        states.append(state)
    return torch.stack(outputs), states


def npu_chunk_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    beta: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    actual_seq_lengths: torch.Tensor | None = None,
    scale: float | None = None,
    g: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stand-in for ``torch_npu.npu_chunk_gated_delta_rule``: sequence ``b`` starts from
    ``initial_state[b]`` ``[B, Nv, Dv, Dk]`` (required, documented "input & output"; the meta
    registration returns a new final state of its shape and dtype, as here). Limits: ``Dk = Dv
    = 128``, ``Nk, Nv <= 64``. The doc's ``L_i <= 8`` contradicts its own example (100 tokens) and
    is not applied."""
    lengths = _check_packed(query, key, value, beta, g, scale, actual_seq_lengths)
    refusal = chunk_gated_delta_rule_refusal(
        query.dtype, query.shape[1], value.shape[1], query.shape[2], value.shape[2]
    )
    if refusal is not None:
        raise refuse("npu_chunk_gated_delta_rule", refusal)
    if initial_state is None:
        raise bad("initial_state", "a bfloat16 tensor [B, Nv, Dv, Dk]", None)
    _check_state("initial_state", initial_state, query, value)
    if initial_state.shape[0] != len(lengths):
        raise bad(
            "initial_state", f"one state per sequence (B={len(lengths)})", initial_state.shape
        )
    outputs, finals, start = [], [], 0
    for b, length in enumerate(lengths):
        end = start + length
        parts = (query[start:end], key[start:end], value[start:end], beta[start:end])
        out, states = _scan(
            initial_state[b].float(), *parts, None if g is None else g[start:end], scale
        )
        outputs.append(out)
        finals.append(states[-1] if states else initial_state[b].float())
        start = end
    out = torch.cat(outputs).to(torch.bfloat16)
    return out, torch.stack(finals).to(initial_state.dtype)


def npu_recurrent_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    state: torch.Tensor,
    *,
    beta: torch.Tensor | None = None,
    scale: float | None = None,
    actual_seq_lengths: torch.Tensor | None = None,
    ssm_state_indices: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    g: torch.Tensor | None = None,
    gk: torch.Tensor | None = None,
) -> torch.Tensor:
    """Stand-in for ``torch_npu.npu_recurrent_gated_delta_rule``: ``state`` ``[BlockNum, Nv, Dv,
    Dk]`` is written in place; token ``i``'s state is ``state[ssm_state_indices[i]]`` (int32
    ``[T]``). A sequence starts from its first token's block and each token writes its own
    block (UNVERIFIED for ``L_i > 1``: the doc states only the mapping). Limits: ``L_i <= 8``,
    ``Nk, Nv, Dk, Dv <= 256``. ``num_accepted_tokens`` (speculative decoding) and ``gk`` (not
    supported by the kernel yet) raise NotImplementedError."""
    lengths = _check_packed(query, key, value, beta, g, scale, actual_seq_lengths)
    if num_accepted_tokens is not None or gk is not None:
        raise NotImplementedError(
            "mock npu_recurrent_gated_delta_rule: num_accepted_tokens and gk are not implemented"
        )
    sizes = (query.shape[1], value.shape[1], query.shape[2], value.shape[2])
    refusal = recurrent_gated_delta_rule_refusal(query.dtype, sizes, lengths)
    if refusal is not None:
        raise refuse("npu_recurrent_gated_delta_rule", refusal)
    _check_state("state", state, query, value)
    if ssm_state_indices is None:
        raise bad("ssm_state_indices", f"an int32 tensor [T={query.shape[0]}]", None)
    check_dtype("ssm_state_indices", ssm_state_indices, GDR_INDEX_DTYPES)
    blocks = ssm_state_indices.tolist()
    if ssm_state_indices.shape != (query.shape[0],) or not all(
        0 <= i < state.shape[0] for i in blocks
    ):
        raise bad("ssm_state_indices", f"[T] block indices below {state.shape[0]}", blocks)
    outputs, start = [], 0
    for length in lengths:
        end = start + length
        parts = (query[start:end], key[start:end], value[start:end], beta[start:end])
        if length:
            out, states = _scan(
                state[blocks[start]].float(), *parts, None if g is None else g[start:end], scale
            )
            for block, after in zip(blocks[start:end], states, strict=True):
                state[block] = after.to(state.dtype)
            outputs.append(out)
        start = end
    return torch.cat(outputs).to(torch.bfloat16)
