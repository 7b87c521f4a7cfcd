"""``moe_experts``: the routed experts of a sparse mixture-of-experts block, after its router.

For tokens ``x[t]`` (``hidden``, (T, H)), the router's choices ``e = selected_experts[t, k]`` and
weights ``w = routing_weights[t, k]`` (both (T, K)) and the gated-SiLU experts
``E_e(v) = down_e(silu(gate_e(v)) * up_e(v))`` (``gate_e; up_e`` stacked in ``gate_up_proj``, the
gate first, as transformers' ``chunk(2)``)::

    routing_weights_on="output":  y[t] = sum_k w[t, k] * E_e(x[t])     (Qwen3-VL-MoE, Qwen3.5-MoE,
                                                                         GLM-4.5V: the experts'
                                                                         output is weighted)
    routing_weights_on="input":   y[t] = sum_k E_e(w[t, k] * x[t])     (Llama 4: the router score
                                                                         scales the expert's input)

Every (token, choice) pair is computed: no capacity, no token dropped, as transformers' "eager",
"grouped_mm" and "batched_mm" experts implementations (``transformers/integrations/moe.py``).
Weights: ``transposed=False`` is nn.Linear's (out, in) per expert, ``gate_up_proj`` (E, 2I, H) and
``down_proj`` (E, H, I) (the Qwen and GLM experts, transformers' ``is_transposed=False``);
``transposed=True`` is (in, out), (E, H, 2I) and (E, I, H) (``Llama4TextExperts``). Both weights
have ``hidden``'s dtype; the routing weights may be any float dtype (GLM's router gives fp32).
The weighted sum over the K choices is accumulated in fp32 (fp64 for fp64) and returned in
``hidden``'s dtype; with ``"input"`` the scaled input is rounded to ``hidden``'s dtype first.

Why the op starts after the router: the four families route differently and the routing is a
few small ops on a (T, E) tensor, while the experts are the bulk of the block's work. Qwen3-VL-MoE
and Qwen3.5-MoE take softmax, top-k, then renormalise the k weights to sum 1; GLM-4.5V takes
sigmoid, adds a correction bias for the choice only, keeps the best ``topk_group`` of ``n_group``
expert groups (scored by their top-2 sum), renormalises (``norm_topk_prob``, + 1e-20) and scales
by ``routed_scaling_factor``; Llama 4 takes top-k of the logits and the sigmoid of those, without
renormalising. One gating signature over these would be a union of flags; each family keeps its
router (and its shared expert) and passes the router's ``(weights, indices)`` here, so the op is
exactly transformers' experts module for all four. Routing weights are not renormalised here.
torch_npu's gating kernels each fit one router, so they are for the family wiring to call, not
part of this op: ``npu_moe_gating_top_k_softmax(x, finished=None, k=1)`` is softmax then top-k
without renormalisation (Qwen's router before its division by the sum);
``npu_moe_gating_top_k(x, k, *, bias, k_group, group_count, group_select_mode, renorm=0,
norm_type, routed_scaling_factor, eps=1e-20)`` with ``norm_type=1`` (sigmoid), the correction
bias, ``group_select_mode=1`` (groups scored by their top-2 sum) and GLM's scaling factor has
GLM's parameters (at most 2048 experts; the doc does not spell out y's formula). Both are
documented for inference only.

NPU: every kernel below is registered by torch-npu 2.6.0.post5 (the oldest supported release)
through 2.14.0 with the same parameters this op passes (``npu_grouped_matmul``'s schema changed
in 2.7.1.post11 only in arguments left at their defaults: ``output_dtype`` became an int and
``x_dtype``/``weight_dtype``/``scale_dtype``/``per_token_scale_dtype`` appeared). Docs:
``torch_npu/_op_plugin_docs.py`` of each wheel; output shapes as its meta registrations give them.

* ``npu_moe_token_permute(tokens (T, H), indices (T, K) int64) -> (permuted (T*K, H),
  sorted_indices (T*K,) int32)``: rows sorted by expert (deterministic), with
  ``permuted[sorted_indices[i]] = tokens[i // K]``; K <= 512, fewer than 16777215 indices.
  Chosen over ``npu_moe_init_routing(_v2)`` because it is documented for training as well as
  inference, keeps one schema across the supported releases (``_v2``'s ``quant_mode`` default
  and ``x_dtype`` changed in 2.7.1.post11) and needs no ``row_idx`` from
  ``npu_moe_gating_top_k_softmax``, whose routing (softmax top-k without renormalisation) fits
  none of the families as is.
* ``npu_grouped_matmul([x (M, K)], [weight (G, K, N)], group_list=cumsum of rows per group
  (int64, group_list_type=0), split_item=2, group_type=0) -> [y (M, N)]``: one GEMM per expert over
  its sorted rows ("单单单"); fp16/bf16/fp32 (fp32 only with single tensors, as here), at most
  1024 groups, K and N below 65536, a transposed weight view allowed (so (E, 2I, H) weights go in
  as ``.transpose(1, 2)`` views, without a copy). Activation fusion (``act_type``) is documented
  for per-token-quantized calls only, so the gated SiLU is ``npu_swiglu`` (first half gated).
* ``npu_moe_token_unpermute(permuted, sorted_indices, probs (T, K)) -> (T, H)``:
  ``y[t] = sum_k probs[t, k] * permuted[sorted_indices[t*K + k]]``; without ``probs`` it takes
  K = 1, so ``"input"`` passes ones. Chosen over ``npu_moe_finalize_routing`` (inference only, the
  index layout of ``npu_moe_init_routing``, ``k`` added in 2.7.1.post11).

The permute/unpermute docs of torch-npu 2.6.0.post5, 2.8.0.post5 and 2.9.1 allow bfloat16 only
(later releases' docs add fp16 and fp32), so those two kernels run for bfloat16 (the routing
weights then enter the unpermute's weighted sum rounded to bfloat16) and the same sort, gather
and fp32 weighted sum as the reference run in plain torch on the device for fp16/fp32. Atlas A2/A3 SoCs
(``Ascend910B*``/``Ascend910_93*``) run the kernels; other SoCs, fp64, K > 512 or shapes beyond
the limits above run the reference on the device.

Reference (CPU): the same plan in torch — stable sort of the T*K choices by expert, the gate/up
and down GEMMs of each expert over its rows, the gated SiLU, the weighted sum over the K choices
back in token order. The GEMMs are torch's CPU grouped GEMM (``grouped_mm``, two calls) where it
takes the call (fp32/bf16/fp16, H and I multiples of 16 bytes), a matmul pair per expert
otherwise. It reads the per-expert row counts on the host (one sync), which is also where
``selected_experts`` values outside [0, E) raise.

Autograd: backward recomputes the reference (``_registration``), so every floating-point input
(hidden, routing weights, both expert weights, e.g. LoRA-wrapped ones) gets its gradient; the
indices get none.
"""

from __future__ import annotations

import importlib
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ascend_vlm._compat.torch_internals import cpu_grouped_mm
from ascend_vlm.ops._checks import check_dtype, check_rank, check_same_dtype, invalid
from ascend_vlm.ops._op_spec import load_spec
from ascend_vlm.ops._registration import define_op
from ascend_vlm.ops.kernel_constraints import (
    A2_A3_SOC_PREFIXES,
    NPU_DTYPES,
    grouped_matmul_refusal,
    moe_token_permute_refusal,
    moe_token_unpermute_refusal,
)

SPEC = load_spec("moe_experts")
_HIDDEN_DTYPES = SPEC.input_dtypes("hidden")
_ROUTING_DTYPES = SPEC.input_dtypes("routing_weights")
_INDEX_DTYPES = SPEC.input_dtypes("selected_experts")
ROUTING_WEIGHTS_ON = ("output", "input")
# npu_moe_token_permute / npu_moe_token_unpermute and npu_grouped_matmul (module docstring).
_PERMUTE_DTYPES = (torch.bfloat16,)
_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_GROUPED_MM_ALIGNMENT = 16


class Geometry(NamedTuple):
    """A call's sizes: T ``tokens``, K ``top_k``, E ``experts``, H ``hidden_size`` and I
    ``intermediate_size`` (each expert's gate and up width)."""

    tokens: int
    top_k: int
    experts: int
    hidden_size: int
    intermediate_size: int


def _check(
    hidden: torch.Tensor,
    routing_weights: torch.Tensor,
    selected_experts: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    transposed: bool,
    routing_weights_on: str,
) -> Geometry:
    check_dtype("hidden", hidden, _HIDDEN_DTYPES)
    check_rank("hidden", hidden, 2, "2-D (T, H)")
    tokens, hidden_size = hidden.shape
    check_dtype("routing_weights", routing_weights, _ROUTING_DTYPES)
    if (
        routing_weights.dim() != 2
        or routing_weights.shape[0] != tokens
        or not routing_weights.shape[1]
    ):
        raise invalid(
            "routing_weights",
            f"2-D (T={tokens}, K) with K >= 1",
            f"shape {tuple(routing_weights.shape)}",
        )
    check_dtype("selected_experts", selected_experts, _INDEX_DTYPES)
    if selected_experts.shape != routing_weights.shape:
        raise invalid(
            "selected_experts",
            f"shape {tuple(routing_weights.shape)} like routing_weights",
            f"shape {tuple(selected_experts.shape)}",
        )
    layout = "(E, H, 2I)" if transposed else "(E, 2I, H)"
    check_same_dtype("gate_up_proj", gate_up_proj, "hidden", hidden.dtype)
    check_rank("gate_up_proj", gate_up_proj, 3, f"3-D {layout} for transposed={transposed}")
    experts = gate_up_proj.shape[0]
    inner, doubled = gate_up_proj.shape[1:] if transposed else reversed(gate_up_proj.shape[1:])
    if not experts or inner != hidden_size or not doubled or doubled % 2:
        raise invalid(
            "gate_up_proj",
            f"shape {layout} with E >= 1, H={hidden_size} and an even 2I >= 2 for "
            f"transposed={transposed}",
            f"shape {tuple(gate_up_proj.shape)}",
        )
    intermediate = doubled // 2
    down_shape = (
        (experts, intermediate, hidden_size) if transposed else (experts, hidden_size, intermediate)
    )
    check_same_dtype("down_proj", down_proj, "hidden", hidden.dtype)
    if down_proj.shape != down_shape:
        raise invalid(
            "down_proj",
            f"shape {down_shape} for transposed={transposed} and gate_up_proj "
            f"{tuple(gate_up_proj.shape)}",
            f"shape {tuple(down_proj.shape)}",
        )
    if routing_weights_on not in ROUTING_WEIGHTS_ON:
        raise invalid(
            "routing_weights_on", f"one of {ROUTING_WEIGHTS_ON}", repr(routing_weights_on)
        )
    return Geometry(tokens, routing_weights.shape[1], experts, hidden_size, intermediate)


def _rows_per_expert(flat_experts: torch.Tensor, experts: int) -> list[int]:
    """How many of the T*K choices go to each expert, read on the host; raises for a choice
    outside [0, E)."""
    if flat_experts.numel():
        low, high = (int(v) for v in flat_experts.aminmax())
        if low < 0 or high >= experts:
            raise invalid(
                "selected_experts",
                f"expert indices in [0, {experts - 1}] (E={experts} experts in gate_up_proj)",
                f"values in [{low}, {high}]",
            )
    return torch.bincount(flat_experts, minlength=experts).tolist()


def _sort_by_expert(flat_experts: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(source, position)`` of the T*K choices stably sorted by expert: sorted row r is choice
    ``source[r]`` (token ``source[r] // K``) and choice i lands in row ``position[i]``
    (``npu_moe_token_permute``'s ``sorted_indices``)."""
    source = torch.argsort(flat_experts, stable=True)
    return source, torch.argsort(source)


def _combine(
    expert_rows: torch.Tensor,
    position: torch.Tensor,
    weights: torch.Tensor | None,
    geometry: Geometry,
    dtype: torch.dtype,
) -> torch.Tensor:
    """``y[t] = sum_k weights[t, k] * expert_rows[position[t*K + k]]`` (no weights: a plain sum),
    accumulated in fp32 (fp64 for fp64) and returned in ``dtype``."""
    accumulate = torch.float64 if dtype == torch.float64 else torch.float32
    per_choice = expert_rows[position].view(geometry.tokens, geometry.top_k, -1).to(accumulate)
    if weights is not None:
        per_choice = per_choice * weights.to(accumulate).unsqueeze(-1)
    return per_choice.sum(dim=1).to(dtype)


def _scaled_rows(rows: torch.Tensor, row_weights: torch.Tensor) -> torch.Tensor:
    """``"input"`` routing: each sorted row times its choice's weight, in the rows' dtype."""
    return (rows * row_weights.unsqueeze(-1)).to(rows.dtype)


def _gated_silu(projected: torch.Tensor) -> torch.Tensor:
    gate, up = projected.chunk(2, dim=-1)
    return F.silu(gate) * up


def _experts_looped(
    rows: torch.Tensor,
    counts: list[int],
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    transposed: bool,
) -> torch.Tensor:
    """Rows sorted by expert through their experts, one matmul pair per expert with rows."""
    outputs = []
    for expert, expert_rows in enumerate(rows.split(counts)):
        if not counts[expert]:
            continue
        gate_up, down = gate_up_proj[expert], down_proj[expert]
        projected = expert_rows @ gate_up if transposed else F.linear(expert_rows, gate_up)
        activated = _gated_silu(projected)
        outputs.append(activated @ down if transposed else F.linear(activated, down))
    return torch.cat(outputs)


def _experts_grouped(
    rows: torch.Tensor,
    counts: list[int],
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    transposed: bool,
) -> torch.Tensor:
    """:func:`_experts_looped` as two grouped GEMMs (torch's CPU kernel, one call each)."""
    ends = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    first = gate_up_proj if transposed else gate_up_proj.transpose(1, 2)
    second = down_proj if transposed else down_proj.transpose(1, 2)
    activated = _gated_silu(cpu_grouped_mm()(rows, first, offs=ends))
    return cpu_grouped_mm()(activated, second, offs=ends)


def _cpu_grouped_mm_takes(
    rows: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor
) -> bool:
    """Whether torch's CPU grouped GEMM takes this call, forward and backward: its dtypes, and
    every row stride (H, 2I and I elements) and the weights' addresses multiples of 16 bytes."""
    if (
        cpu_grouped_mm() is None
        or rows.device.type != "cpu"
        or rows.dtype not in _GROUPED_MM_DTYPES
    ):
        return False
    size = rows.element_size()
    return all(
        extent * size % _GROUPED_MM_ALIGNMENT == 0
        for extent in (rows.shape[1], down_proj.shape[1], down_proj.shape[2])
    ) and all(t.data_ptr() % _GROUPED_MM_ALIGNMENT == 0 for t in (rows, gate_up_proj, down_proj))


def _reference(
    geometry: Geometry,
    hidden: torch.Tensor,
    routing_weights: torch.Tensor,
    selected_experts: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    transposed: bool,
    routing_weights_on: str,
) -> torch.Tensor:
    flat_experts = selected_experts.reshape(-1)
    counts = _rows_per_expert(flat_experts, geometry.experts)
    source, position = _sort_by_expert(flat_experts, geometry.top_k)
    rows = hidden[source // geometry.top_k]
    if routing_weights_on == "input":
        rows = _scaled_rows(rows, routing_weights.reshape(-1)[source])
    if not rows.shape[0]:  # no tokens
        return hidden.new_zeros(hidden.shape)
    if _cpu_grouped_mm_takes(rows, gate_up_proj, down_proj):
        expert_rows = _experts_grouped(rows, counts, gate_up_proj, down_proj, transposed)
    else:
        expert_rows = _experts_looped(rows, counts, gate_up_proj, down_proj, transposed)
    weights = routing_weights if routing_weights_on == "output" else None
    return _combine(expert_rows, position, weights, geometry, hidden.dtype)


def _kernels_take(geometry: Geometry, hidden: torch.Tensor, torch_npu) -> bool:
    """Whether npu_grouped_matmul (and npu_swiglu) take this call (module docstring)."""
    return (
        hidden.dtype in NPU_DTYPES
        and geometry.tokens > 0
        # the gate/up GEMM (K = hidden, N = 2 * intermediate); the down GEMM is its transpose
        and grouped_matmul_refusal(
            geometry.experts, geometry.hidden_size, 2 * geometry.intermediate_size
        )
        is None
        and torch_npu.npu.get_device_name().startswith(A2_A3_SOC_PREFIXES)
    )


def _grouped_matmul(
    torch_npu, rows: torch.Tensor, weight: torch.Tensor, group_list: torch.Tensor
) -> torch.Tensor:
    """``rows`` (M, K) sorted by group times ``weight`` (G, K, N): group g's rows, ending at
    ``group_list[g]``, by ``weight[g]``."""
    return torch_npu.npu_grouped_matmul(
        [rows], [weight], group_list=group_list, split_item=2, group_type=0, group_list_type=0
    )[0]


def _npu(
    geometry: Geometry,
    hidden: torch.Tensor,
    routing_weights: torch.Tensor,
    selected_experts: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    transposed: bool,
    routing_weights_on: str,
) -> torch.Tensor:
    torch_npu = importlib.import_module("torch_npu")
    if not _kernels_take(geometry, hidden, torch_npu):
        return _reference(
            geometry,
            hidden,
            routing_weights,
            selected_experts,
            gate_up_proj,
            down_proj,
            transposed,
            routing_weights_on,
        )
    flat_experts = selected_experts.reshape(-1).to(torch.int64)
    permute_kernel = (
        hidden.dtype in _PERMUTE_DTYPES
        and moe_token_permute_refusal(geometry.top_k, flat_experts.numel()) is None
        and moe_token_unpermute_refusal(geometry.top_k) is None
    )
    if permute_kernel:
        rows, position = torch_npu.npu_moe_token_permute(
            hidden, flat_experts.view(geometry.tokens, geometry.top_k)
        )
    else:
        source, position = _sort_by_expert(flat_experts, geometry.top_k)
        rows = hidden[source // geometry.top_k]
    if routing_weights_on == "input":
        flat_weights = routing_weights.reshape(-1)
        rows = _scaled_rows(
            rows, torch.empty_like(flat_weights).index_copy_(0, position.long(), flat_weights)
        )
    group_list = torch.cumsum(torch.bincount(flat_experts, minlength=geometry.experts), dim=0)
    # (E, K, N) per expert: the (out, in) layout goes in as transposed views, which the kernel takes.
    first = gate_up_proj if transposed else gate_up_proj.transpose(1, 2)
    second = down_proj if transposed else down_proj.transpose(1, 2)
    projected = _grouped_matmul(torch_npu, rows, first, group_list)
    activated = torch_npu.npu_swiglu(projected, dim=-1)
    expert_rows = _grouped_matmul(torch_npu, activated, second, group_list)
    weights = routing_weights if routing_weights_on == "output" else None
    if not permute_kernel:
        return _combine(expert_rows, position, weights, geometry, hidden.dtype)
    probs = torch.ones_like(routing_weights, dtype=hidden.dtype) if weights is None else weights
    return torch_npu.npu_moe_token_unpermute(expert_rows, position, probs=probs.to(hidden.dtype))


def _fake(geometry: Geometry, hidden: torch.Tensor, *_: object) -> torch.Tensor:
    return hidden.new_empty(hidden.shape)


moe_experts = define_op(
    SPEC,
    check=_check,
    reference=_reference,
    npu=_npu,
    fake=_fake,
    doc="""The routed experts of a sparse MoE block, fed with its router's choices.

    ``y[t] = sum_k w[t, k] * E_e(x[t])`` (``routing_weights_on="output"``) or
    ``sum_k E_e(w[t, k] * x[t])`` (``"input"``, Llama 4), with ``e = selected_experts[t, k]``,
    ``w = routing_weights`` and ``E_e(v) = down_e(silu(gate_e(v)) * up_e(v))``; no token dropped.
    ``hidden`` is (T, H); ``routing_weights`` (T, K) of any float dtype and ``selected_experts``
    (T, K) int32/int64 in [0, E); ``gate_up_proj`` (E, 2I, H) and ``down_proj`` (E, H, I) in
    ``hidden``'s dtype, or (E, H, 2I) and (E, I, H) with ``transposed=True``. Returns (T, H) in
    ``hidden``'s dtype, the sum over the K choices accumulated in fp32.

    Raises ``ValueError`` naming the argument for bad shapes or dtypes, an unknown
    ``routing_weights_on`` or (where values are read: the reference path) expert indices outside
    [0, E).
    """,
)
