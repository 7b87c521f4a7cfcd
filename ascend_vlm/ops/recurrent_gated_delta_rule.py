"""``recurrent_gated_delta_rule``: the gated delta rule token by token (decode).

Contract and formula: :mod:`ascend_vlm.ops._gated_delta`; the same inputs and outputs as
``chunk_gated_delta_rule`` (what ``Qwen3_5GatedDeltaNet`` hands
``torch_recurrent_gated_delta_rule``, usually with ``T = 1`` and the cached state).

NPU: ``torch_npu.npu_recurrent_gated_delta_rule(query, key, value, state, *, beta, scale,
actual_seq_lengths, ssm_state_indices, num_accepted_tokens, g, gk) -> Tensor`` (doc in
``torch_npu/_op_plugin_docs.py``), in every supported torch-npu wheel (2.6.0.post5 onwards). It
writes ``state`` ``[BlockNum, Nv, Dv, Dk]`` in place; ``ssm_state_indices`` int32 ``[T]`` names
each token's state block; the output is bfloat16 ``[T, Nv, Dv]``. ``gk`` is "not supported in
this version" (None); ``num_accepted_tokens`` None means one accepted token per sequence.
Documented limits: bfloat16, ``L_i <= 8`` tokens per sequence, ``Nk, Nv, Dk, Dv <= 256``, Atlas
A2/A3. We call it once per time step with the ``B`` sequences' tokens (``L_i = 1``,
``ssm_state_indices = arange(B)``), so each token reads and writes its own sequence's state;
calls outside the limits
(:func:`~ascend_vlm.ops.kernel_constraints.recurrent_gated_delta_rule_refusal`) run the
reference.
"""

from __future__ import annotations

import functools

import torch

from ascend_vlm.ops._gated_delta import (
    NPU_LENGTH_DTYPE,
    DeltaShape,
    check_delta_inputs,
    fake_delta_outputs,
    finished,
    from_npu_state,
    npu_inputs,
    prepared_inputs,
    torch_npu_with,
)
from ascend_vlm.ops._op_spec import load_spec
from ascend_vlm.ops._registration import define_op
from ascend_vlm.ops.kernel_constraints import recurrent_gated_delta_rule_refusal

SPEC = load_spec("recurrent_gated_delta_rule")
NPU_KERNEL = "npu_recurrent_gated_delta_rule"


def _reference(
    shape: DeltaShape,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    _scale: float | None,
    use_qk_l2norm: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    q, k, v, g, beta, state = prepared_inputs(
        shape, query, key, value, g, beta, initial_state, use_qk_l2norm
    )
    decay = g.exp()
    outputs = []
    for t in range(shape.tokens):
        state = state * decay[:, :, t, None, None]
        k_t = k[:, :, t]
        # the delta rule: write beta * (v - what the state already predicts for k)
        delta = (v[:, :, t] - (state * k_t[..., None]).sum(dim=-2)) * beta[:, :, t, None]
        state = state + k_t[..., None] * delta[..., None, :]
        outputs.append((state * q[:, :, t, :, None]).sum(dim=-2))
    return finished(torch.stack(outputs, dim=2), query), state


def _npu(
    shape: DeltaShape,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    scale: float | None,
    use_qk_l2norm: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    torch_npu = torch_npu_with(NPU_KERNEL)
    sizes = (shape.key_heads, shape.value_heads, shape.key_dim, shape.value_dim)
    refusal = recurrent_gated_delta_rule_refusal(query.dtype, sizes, [1] * shape.batch)
    if torch_npu is None or refusal is not None:
        return _reference(shape, query, key, value, g, beta, initial_state, scale, use_qk_l2norm)
    *per_token, state = npu_inputs(shape, query, key, value, g, beta, initial_state, use_qk_l2norm)
    # time-major and contiguous, so each step's [B, ...] slice is a dense tensor
    q, k, v, g, beta = (t.transpose(0, 1).contiguous() for t in per_token)
    one_token_each = torch.ones(shape.batch, dtype=NPU_LENGTH_DTYPE, device=query.device)
    own_state = torch.arange(shape.batch, dtype=NPU_LENGTH_DTYPE, device=query.device)
    outputs = [
        torch_npu.npu_recurrent_gated_delta_rule(
            q[t],
            k[t],
            v[t],
            state,
            beta=beta[t],
            scale=shape.scale,
            actual_seq_lengths=one_token_each,
            ssm_state_indices=own_state,
            g=g[t],
        )
        for t in range(shape.tokens)
    ]
    out = torch.stack(outputs, dim=1).to(query.dtype)
    return out, from_npu_state(state, query)


recurrent_gated_delta_rule = define_op(
    SPEC,
    check=functools.partial(check_delta_inputs, SPEC),
    reference=_reference,
    npu=_npu,
    fake=fake_delta_outputs,
    doc="""The gated delta rule token by token (decode; any ``T``).

    The same arguments and results as :func:`chunk_gated_delta_rule`: q/k ``[B, T, Hk, K]``, v
    ``[B, T, Hv, V]``, g (log decay) and beta ``[B, T, Hv]``, initial_state ``[B, Hv, K, V]`` or
    None (zeros); returns ``(out [B, T, Hv, V], final_state [B, Hv, K, V])``, the state in
    float32 (float64 for float64 queries). Passing a prefill's final state continues it. Bad
    inputs raise ``ValueError`` naming the argument.
    """,
)
