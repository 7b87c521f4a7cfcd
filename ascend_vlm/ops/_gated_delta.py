"""What ``chunk_gated_delta_rule`` and ``recurrent_gated_delta_rule`` share: their one contract
(the checks, the fake outputs, the input preparation) and the torch_npu layout conversions.

The gated delta rule (Yang et al., "Gated Delta Networks"), per batch row and value head ``h``
(query/key head ``h // (Hv / Hk)``), with the state ``S`` a ``[K, V]`` matrix (transformers'
orientation; the paper's is its transpose):

    S_t = exp(g_t) * S_{t-1}
    S_t = S_t + k_t (beta_t * (v_t - S_t^T k_t))^T      (= exp(g_t) (I - beta_t k_t k_t^T) S_{t-1}
                                                             + beta_t k_t v_t^T)
    o_t = S_t^T (scale * q_t)

``g`` is the log of the decay (``<= 0`` in Qwen3.5: ``-exp(A_log) * softplus(a + dt_bias)``),
``beta`` the write strength (a sigmoid). With ``use_qk_l2norm`` q and k are first divided by
``sqrt(sum(x^2) + 1e-6)`` (the FLA library's l2norm); ``scale`` defaults to ``K ** -0.5``. The
math runs in float32 (float64 for float64 queries); the output has the query's dtype, the final
state the compute dtype.

torch_npu's kernels (``torch_npu/_op_plugin_docs.py``, ``_meta_registrations.py``; same text in
every wheel that has them) take the packed TND layout: q/k ``[T, Nk, Dk]``, v ``[T, Nv, Dv]``,
beta ``[T, Nv]`` bfloat16, g ``[T, Nv]`` float32 (``alpha = e^g``; None means 0), the state
``[BlockNum, Nv, Dv, Dk]`` bfloat16 (the transpose of ours), ``actual_seq_lengths`` int32 ``[B]``,
``scale`` a float, ``Nv`` a multiple of ``Nk``; the output is bfloat16 ``[T, Nv, Dv]``. Neither
kernel normalises q or k (the docs' examples call ``F.normalize`` first). How ``Nv / Nk`` value
heads share a key head is not documented; we assume transformers' (``h // (Nv / Nk)``).
"""

from __future__ import annotations

import importlib
import math
from types import ModuleType
from typing import NamedTuple

import torch

from ascend_vlm.ops._checks import check_dtype, check_rank, check_same_dtype, invalid
from ascend_vlm.ops._op_spec import OpSpec
from ascend_vlm.ops.kernel_constraints import GATED_DELTA_DTYPE

L2NORM_EPS = 1e-6  # the FLA library's (and transformers' l2norm)
NPU_G_DTYPE = torch.float32
NPU_LENGTH_DTYPE = torch.int32


class DeltaShape(NamedTuple):
    """Validated geometry of one call: ``[B, T, Hk, K]`` queries, ``[B, T, Hv, V]`` values."""

    batch: int
    tokens: int
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    scale: float


def check_delta_inputs(
    spec: OpSpec,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    scale: float | None,
    _use_qk_l2norm: bool,
) -> DeltaShape:
    """Every rule of both ops' contract (module docstring); ``ValueError`` naming the argument."""
    check_dtype("query", query, spec.input_dtypes("query"))
    check_same_dtype("key", key, "query", query.dtype)
    check_same_dtype("value", value, "query", query.dtype)
    check_rank("query", query, 4, "4-D [B, T, Hk, K]")
    batch, tokens, key_heads, key_dim = query.shape
    if key.shape != query.shape:
        raise invalid("key", f"shape {tuple(query.shape)} like query", f"shape {tuple(key.shape)}")
    check_rank("value", value, 4, "4-D [B, T, Hv, V]")
    value_heads, value_dim = value.shape[2], value.shape[3]
    if value.shape[:2] != query.shape[:2] or key_heads == 0 or value_heads % key_heads:
        raise invalid(
            "value",
            f"[B={batch}, T={tokens}, Hv, V] with Hv a multiple of Hk={key_heads}",
            f"shape {tuple(value.shape)}",
        )
    if tokens == 0:
        raise invalid("query", "at least one token (T >= 1)", f"shape {tuple(query.shape)}")
    for name, tensor in (("g", g), ("beta", beta)):
        check_dtype(name, tensor, spec.input_dtypes(name))
        if tensor.shape != (batch, tokens, value_heads):
            raise invalid(
                name, f"shape {(batch, tokens, value_heads)} [B, T, Hv]", tuple(tensor.shape)
            )
    state_shape = (batch, value_heads, key_dim, value_dim)
    if initial_state is not None:
        check_dtype("initial_state", initial_state, spec.input_dtypes("initial_state"))
        if initial_state.shape != state_shape:
            raise invalid(
                "initial_state", f"shape {state_shape} [B, Hv, K, V]", tuple(initial_state.shape)
            )
    if scale is not None and not math.isfinite(scale):
        raise invalid("scale", "a finite float or None (K ** -0.5)", scale)
    return DeltaShape(
        batch,
        tokens,
        key_heads,
        value_heads,
        key_dim,
        value_dim,
        key_dim**-0.5 if scale is None else scale,
    )


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; every other dtype computes in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """``x / sqrt(sum(x^2, -1) + 1e-6)``, the FLA library's l2norm."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2NORM_EPS)


def prepared_inputs(
    shape: DeltaShape,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    use_qk_l2norm: bool,
) -> tuple[torch.Tensor, ...]:
    """The inputs in the compute dtype as ``[B, Hv, T, ...]`` (q/k repeated to ``Hv`` heads, q
    normalised if asked and scaled, k normalised if asked), g and beta ``[B, Hv, T]``, and the
    state ``[B, Hv, K, V]`` (zeros when None)."""
    dtype = compute_dtype(query.dtype)
    group = shape.value_heads // shape.key_heads
    q, k, v = (t.to(dtype).transpose(1, 2) for t in (query, key, value))
    if group > 1:
        q, k = q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    state_shape = (shape.batch, shape.value_heads, shape.key_dim, shape.value_dim)
    state = (
        query.new_zeros(state_shape, dtype=dtype)
        if initial_state is None
        else initial_state.to(dtype).contiguous()  # the final state comes out contiguous
    )
    return (
        q * shape.scale,
        k,
        v,
        g.to(dtype).transpose(1, 2),
        beta.to(dtype).transpose(1, 2),
        state,
    )


def finished(out: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """``[B, Hv, T, V]`` compute-dtype output as the op returns it: ``[B, T, Hv, V]`` contiguous
    in the query's dtype."""
    return out.transpose(1, 2).to(query.dtype).contiguous()


def fake_delta_outputs(
    shape: DeltaShape, query: torch.Tensor, *_: object
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both ops' ``fake``: the output and the final state, empty."""
    out = query.new_empty((shape.batch, shape.tokens, shape.value_heads, shape.value_dim))
    state_shape = (shape.batch, shape.value_heads, shape.key_dim, shape.value_dim)
    return out, query.new_empty(state_shape, dtype=compute_dtype(query.dtype))


def torch_npu_with(kernel: str) -> ModuleType | None:
    """The ``torch_npu`` module when it has ``kernel``, else None (the releases that lack one
    are recorded in ``testing/torch_npu_schemas.json``; callers then run their reference)."""
    torch_npu = importlib.import_module("torch_npu")
    return torch_npu if hasattr(torch_npu, kernel) else None


def npu_inputs(
    shape: DeltaShape,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    use_qk_l2norm: bool,
) -> tuple[torch.Tensor, ...]:
    """The kernels' inputs: q/k (normalised here if asked: the kernels do not) and v still
    ``[B, T, H, D]`` bfloat16, g ``[B, T, Hv]`` float32, beta ``[B, T, Hv]`` bfloat16 and the
    state ``[B, Hv, V, K]`` bfloat16 in a fresh contiguous buffer (the recurrent kernel writes
    it in place)."""
    if use_qk_l2norm:
        query = l2norm(query.float()).to(GATED_DELTA_DTYPE)
        key = l2norm(key.float()).to(GATED_DELTA_DTYPE)
    state_shape = (shape.batch, shape.value_heads, shape.value_dim, shape.key_dim)
    state = (
        query.new_zeros(state_shape, dtype=GATED_DELTA_DTYPE)
        if initial_state is None
        else initial_state.transpose(-1, -2)
        .to(GATED_DELTA_DTYPE)
        .clone(memory_format=torch.contiguous_format)
    )
    return query, key, value, g.to(NPU_G_DTYPE), beta.to(GATED_DELTA_DTYPE), state


def from_npu_state(state: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """The kernels' ``[B, Hv, V, K]`` state as ours: ``[B, Hv, K, V]`` in the compute dtype."""
    return state.transpose(-1, -2).to(compute_dtype(query.dtype)).contiguous()
