"""``chunk_gated_delta_rule``: the gated delta rule over whole sequences (prefill), computed
chunk by chunk; equal to ``recurrent_gated_delta_rule`` up to rounding.

Contract and formula: :mod:`ascend_vlm.ops._gated_delta`. Inputs in transformers' layout (what
``Qwen3_5GatedDeltaNet`` hands ``torch_chunk_gated_delta_rule``): q/k ``[B, T, Hk, K]``, v
``[B, T, Hv, V]``, g/beta ``[B, T, Hv]``, initial_state ``[B, Hv, K, V]`` or None (zeros).
Returns ``(out [B, T, Hv, V], final_state [B, Hv, K, V])``.

Chunked algorithm (the UT transform of Yang et al., as in transformers' and FLA's torch code):
within each chunk of ``CHUNK_SIZE`` tokens the ``C`` delta-rule writes are solved at once from
the lower unit-triangular system ``(I + tril(diag(beta) K K^T * D, -1)) [U | W] = [diag(beta)
V | diag(beta) K * exp(cumsum g)]``, ``D[i, j] = exp(G_i - G_j)``; then one state read and one
state update per chunk.

NPU: ``torch_npu.npu_chunk_gated_delta_rule(query, key, value, *, beta, initial_state,
actual_seq_lengths, scale, g) -> (out, final_state)`` (doc in ``torch_npu/_op_plugin_docs.py``;
functional: the final state is a new tensor of ``initial_state``'s shape and dtype, the output
bfloat16 ``[T, Nv, Dv]`` per the meta registration). In the wheels of torch-npu 2.7.1.post11,
2.9.0.post9 and 2.10.0.post7 onwards; absent from 2.6.0.post5, 2.8.0.post5 and 2.9.1, where
the reference runs. Documented limits
(:func:`~ascend_vlm.ops.kernel_constraints.chunk_gated_delta_rule_refusal`): bfloat16, ``Dk =
Dv = 128``, ``Nk, Nv <= 64``, Atlas A2/A3. The doc also lists ``L_i <= 8``, the recurrent
kernel's limit, which its own example (``seqlen = 100``) contradicts; we do not apply it. Head
dims below 128 are padded: q, k and v get zero columns up to 128 and the state zero rows and
columns, with ``scale`` still from the original ``Dk``, and the output and final state are
sliced back. That is exact: a zero key column never writes the state's padded columns, a zero
value column leaves its padded rows at zero, and a zero query column reads nothing. Other calls
outside the limits (head dims above 128, more than 64 heads, another dtype) run the reference.
The ``B`` sequences go in packed, ``actual_seq_lengths = [T] * B``.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

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
from ascend_vlm.ops.kernel_constraints import (
    CHUNK_GATED_DELTA_HEAD_DIM,
    chunk_gated_delta_rule_refusal,
)

SPEC = load_spec("chunk_gated_delta_rule")
CHUNK_SIZE = 64  # transformers' and FLA's default
NPU_KERNEL = "npu_chunk_gated_delta_rule"


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
    pad = -shape.tokens % CHUNK_SIZE
    q, k, v = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (torch.nn.functional.pad(x, (0, pad)) for x in (g, beta))
    # [B, H, chunks, C, D]: padded tokens have beta = 0 and g = 0, so they leave the state as is
    q, k, v = (x.unflatten(2, (-1, CHUNK_SIZE)) for x in (q, k, v))
    g, beta = (x.unflatten(2, (-1, CHUNK_SIZE)) for x in (g, beta))
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    cum = g.cumsum(dim=-1)
    future = torch.ones(CHUNK_SIZE, CHUNK_SIZE, dtype=torch.bool, device=q.device).triu(1)
    # exp(G_i - G_j) for j <= i; the masked entries would overflow, so they are set before exp
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(future, float("-inf")).exp()
    # I + strictly lower part: solve_triangular reads only that (unitriangular, lower)
    system = k_beta @ k.transpose(-1, -2) * decay
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    state_keys = torch.linalg.solve_triangular(
        system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True
    )
    attention = q @ k.transpose(-1, -2) * decay  # decay is 0 above the diagonal
    q_decayed = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]
    outputs = []
    for i in range(q.shape[2]):
        corrected = new_values[:, :, i] - state_keys[:, :, i] @ state
        outputs.append(q_decayed[:, :, i] @ state + attention[:, :, i] @ corrected)
        state = state * chunk_decay[:, :, i] + k_to_end[:, :, i].transpose(-1, -2) @ corrected
    out = torch.cat(outputs, dim=2)[:, :, : shape.tokens]
    return finished(out, query), state


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
    # head dims below the kernel's one size are zero-padded up to it (see the module docstring)
    padded = CHUNK_GATED_DELTA_HEAD_DIM
    refusal = chunk_gated_delta_rule_refusal(
        query.dtype,
        shape.key_heads,
        shape.value_heads,
        max(shape.key_dim, padded),
        max(shape.value_dim, padded),
    )
    if torch_npu is None or refusal is not None:
        return _reference(shape, query, key, value, g, beta, initial_state, scale, use_qk_l2norm)
    q, k, v, g, beta, state = npu_inputs(
        shape, query, key, value, g, beta, initial_state, use_qk_l2norm
    )
    key_pad, value_pad = padded - shape.key_dim, padded - shape.value_dim
    tokens = shape.batch * shape.tokens
    out, final_state = torch_npu.npu_chunk_gated_delta_rule(
        F.pad(q, (0, key_pad)).reshape(tokens, shape.key_heads, padded),
        F.pad(k, (0, key_pad)).reshape(tokens, shape.key_heads, padded),
        F.pad(v, (0, value_pad)).reshape(tokens, shape.value_heads, padded),
        beta=beta.reshape(tokens, shape.value_heads),
        initial_state=F.pad(state, (0, key_pad, 0, value_pad)),
        actual_seq_lengths=torch.full(
            (shape.batch,), shape.tokens, dtype=NPU_LENGTH_DTYPE, device=query.device
        ),
        scale=shape.scale,  # from the original Dk: the padding leaves q . k unchanged
        g=g.reshape(tokens, shape.value_heads),
    )
    out = out.view(shape.batch, shape.tokens, shape.value_heads, padded)[..., : shape.value_dim]
    final_state = final_state[..., : shape.value_dim, : shape.key_dim]
    return out.to(query.dtype), from_npu_state(final_state, query)


chunk_gated_delta_rule = define_op(
    SPEC,
    check=functools.partial(check_delta_inputs, SPEC),
    reference=_reference,
    npu=_npu,
    fake=fake_delta_outputs,
    doc="""The gated delta rule over whole sequences, computed in chunks (prefill).

    q/k ``[B, T, Hk, K]``, v ``[B, T, Hv, V]`` (``Hv % Hk == 0``; value head ``h`` reads key
    head ``h // (Hv / Hk)``), g (log decay) and beta ``[B, T, Hv]``, initial_state ``[B, Hv, K,
    V]`` or None (zeros). ``scale`` defaults to ``K ** -0.5``; ``use_qk_l2norm`` normalises q
    and k first (Qwen3.5 sets it). Returns ``(out, final_state)``: out ``[B, T, Hv, V]`` in the
    query's dtype, final_state ``[B, Hv, K, V]`` in float32 (float64 for float64 queries).
    Equal to :func:`recurrent_gated_delta_rule` up to rounding. Bad inputs raise
    ``ValueError`` naming the argument.
    """,
)
