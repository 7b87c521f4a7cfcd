"""The module adapters: what replaces a norm's, an MLP's and a RoPE attention's forward (a
sparse MoE block's experts: `ascend_vlm.patching.moe`; a Gated DeltaNet's:
`ascend_vlm.patching.linear_attention`).

Each adapter takes one module a family spec entry names, and either rebinds its forward (through
`PatchState.rebind`, so `unpatch` reverts it) or records why it leaves the module alone.
``ADAPTERS`` maps each ``PartSpec`` field to its adapter; `patch` applies every entry of a part
through it, so a further kind of swap is one more field and one more entry here.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable

import torch
from torch import nn

from ascend_vlm import ops
from ascend_vlm._compat.decorators import rope_problem
from ascend_vlm._compat.module_internals import (
    FUSED_MLP_PROJECTIONS,
    MLP_ACTIVATIONS,
    MLP_PROJECTIONS,
    NORM_EPS_ATTRIBUTES,
    SILU_ACTIVATIONS,
    mlp_projections,
)
from ascend_vlm.models.family_spec import LeaveAlone, RmsNorm, Rope, SwigluMlp
from ascend_vlm.patching.linear_attention import patch_linear_attention
from ascend_vlm.patching.moe import patch_moe
from ascend_vlm.patching.part import Part
from ascend_vlm.patching.rebound_globals import ReboundForward, with_globals
from ascend_vlm.patching.state import PatchState, disabled_by

# --------------------------------------------------------------------------- norm


def rms_norm_forward(
    module: nn.Module, eps: float, norm: RmsNorm, hidden_states: torch.Tensor
) -> torch.Tensor:
    """The norm module's forward through an op: the module's own weight Parameter, read at
    call time, or 1 on a weightless instance (`norm.scale_switch` off); ``ops.rms_norm`` when
    ``norm.rounds_once``, else ``ops.rms_norm_promoting`` (the stock module's output dtype)."""
    weight = getattr(module, "weight", None)
    if weight is None:
        weight = hidden_states.new_ones(hidden_states.shape[-1])
    if norm.rounds_once:
        return ops.rms_norm(hidden_states, weight, eps, offset=norm.offset)
    return ops.rms_norm_promoting(hidden_states, weight, eps, offset=norm.offset)


def _weightless(module: nn.Module, norm: RmsNorm) -> bool:
    """Whether `module` is an instance its spec entry allows without a weight (switch off)."""
    return norm.scale_switch is not None and getattr(module, norm.scale_switch, True) is False


def norm_eps(module: nn.Module) -> float | None:
    """The norm module's epsilon (the first of ``NORM_EPS_ATTRIBUTES`` it has, a number), or None."""
    eps = next((getattr(module, a) for a in NORM_EPS_ATTRIBUTES if hasattr(module, a)), None)
    return float(eps) if isinstance(eps, (int, float)) else None


def swap_norm(state: PatchState, module: nn.Module, eps: float, norm: RmsNorm, note: str) -> None:
    """Rebind the norm's forward to `rms_norm_forward` as `norm` says; `note` ends the report's
    op text."""
    state.rebind(module, "forward", functools.partial(rms_norm_forward, module, eps, norm))
    state.tag(module, "rms_norm")
    state.report.record_swapped(
        "norm", type(module).__name__, f"ops.rms_norm(offset={norm.offset:g}){note}"
    )


def patch_norm(state: PatchState, module: nn.Module, norm: RmsNorm, part: Part) -> None:
    name = type(module).__name__
    eps = norm_eps(module)
    has_weight = isinstance(getattr(module, "weight", None), torch.Tensor)
    if not part.enabled("norm"):
        state.report.record_left_alone("norm", name, disabled_by("norm"))
    elif not (has_weight or _weightless(module, norm)) or eps is None:
        state.report.record_left_alone("norm", name, "no weight/eps attributes to hand to the op")
    else:
        swap_norm(state, module, eps, norm, "")


# --------------------------------------------------------------------------- mlp


_GATE, _UP, _DOWN = MLP_PROJECTIONS
_GATE_UP, _FUSED_DOWN = FUSED_MLP_PROJECTIONS


def swiglu_mlp_forward(module: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """The gated MLP's forward: ``down_proj(ops.swiglu_projections(x, gate_proj, up_proj))``."""
    gated = ops.swiglu_projections(hidden_states, getattr(module, _GATE), getattr(module, _UP))
    return getattr(module, _DOWN)(gated)


def fused_swiglu_mlp_forward(module: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """The forward of a gated MLP with one gate-and-up projection:
    ``down_proj(ops.swiglu(gate_up_proj(x)))`` (its output is cat(gate, up), gate first)."""
    gated = ops.swiglu(getattr(module, _GATE_UP)(hidden_states), -1)
    return getattr(module, _FUSED_DOWN)(gated)


def patch_mlp(state: PatchState, module: nn.Module, mlp: SwigluMlp, part: Part) -> None:
    name = type(module).__name__
    projections = mlp_projections(mlp.fused)
    activation = type(
        next((getattr(module, a) for a in MLP_ACTIVATIONS if hasattr(module, a)), None)
    ).__name__
    if not part.enabled("mlp"):
        state.report.record_left_alone("mlp", name, disabled_by("mlp"))
    elif not all(hasattr(module, p) for p in projections):
        state.report.record_left_alone("mlp", name, f"no {'/'.join(projections)}")
    elif activation not in SILU_ACTIVATIONS:
        why = f"activation is {activation}, ops.swiglu computes silu(gate) * up"
        state.report.record_left_alone("mlp", name, why)
    else:
        swap_mlp(state, module, "", fused=mlp.fused)


def swap_mlp(state: PatchState, module: nn.Module, note: str, *, fused: bool = False) -> None:
    """Rebind the gated MLP's forward to `swiglu_mlp_forward` (`fused_swiglu_mlp_forward` for
    one ``gate_up_proj``); `note` ends the report's op text."""
    forward = fused_swiglu_mlp_forward if fused else swiglu_mlp_forward
    state.rebind(module, "forward", functools.partial(forward, module))
    state.tag(module, "swiglu")
    state.report.record_swapped("mlp", type(module).__name__, f"ops.swiglu{note}")


# --------------------------------------------------------------------------- rope


def _rope_text(table_scale: float, q, k, cos, sin, unsqueeze_dim=1, *, interleaved=False):
    """Drop-in for transformers' `apply_rotary_pos_emb` (once ``table_scale``, a bound on the
    model's |cos| and |sin|, and ``interleaved``, GPT-J pairs instead of NeoX halves, are
    bound): q/k [B, N, S, D] with cos/sin [B, S, Dr] rotating the first Dr dims and
    ``unsqueeze_dim=1``, or cos/sin [S, Dr] and ``unsqueeze_dim=0`` (Pixtral's 2-D RoPE: one
    table broadcast over every row and head, which the op takes as a 2-D table)."""
    if unsqueeze_dim != 1 and not (unsqueeze_dim == 0 and cos.dim() == 2):
        raise ValueError(
            f"unsqueeze_dim: expected 1 (heads axis of [B, N, S, D]) or 0 with 2-D [S, D] "
            f"tables, got {unsqueeze_dim} with cos of shape {tuple(cos.shape)}"
        )
    return ops.rotary_embedding_pair(
        q, k, cos, sin, interleaved=interleaved, table_scale=table_scale
    )


def _rope_single(table_scale: float, x, cos, sin, unsqueeze_dim=1):
    """Drop-in for Gemma 4's one-tensor `apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim)`:
    x [B, N, S, D] (unsqueeze_dim 1) or [B, S, N, D] (unsqueeze_dim 2), cos/sin [B, S, D]."""
    if unsqueeze_dim not in (1, 2):
        raise ValueError(
            f"unsqueeze_dim: expected 1 ([B, N, S, D]) or 2 ([B, S, N, D]), got {unsqueeze_dim}"
        )
    if unsqueeze_dim == 1:
        return ops.rotary_embedding(x, cos, sin, table_scale=table_scale)
    rotated = ops.rotary_embedding(x.transpose(1, 2), cos, sin, table_scale=table_scale)
    return rotated.transpose(1, 2)


def _rope_axial(table_scale: float, x, cos, sin, position_ids, unsqueeze_dim=2):
    """Drop-in for Gemma 4's `apply_multidimensional_rope(x, cos, sin, position_ids,
    unsqueeze_dim=2)`: x [B, S, N, D] is cut into A = position_ids.shape[-1] chunks of
    2 * (D // (2 * A)) dims (which must fill D, as transformers' split requires), chunk i
    rotated by chunk i of cos/sin [B, S, D], the chunks joined again."""
    if unsqueeze_dim != 2:
        raise ValueError(
            f"unsqueeze_dim: expected 2 (heads axis of [B, S, N, D]), got {unsqueeze_dim}"
        )
    axes = position_ids.shape[-1]
    sizes = [2 * (x.shape[-1] // (2 * axes))] * axes
    chunks = zip(x.split(sizes, -1), cos.split(sizes, -1), sin.split(sizes, -1), strict=True)
    return torch.cat([_rope_single(table_scale, *chunk, 2) for chunk in chunks], dim=-1)


def _rope_vision(table_scale: float, q, k, cos, sin):
    """Drop-in for `apply_rotary_pos_emb_vision`: q/k [T, N, D], cos/sin [T, D], fp32 math."""
    return ops.rotary_embedding_pair_vision(q, k, cos, sin, table_scale=table_scale)


def _rope_complex(table_scale: float, xq, xk, freqs_cis):
    """Drop-in for Llama 4's text `apply_rotary_emb` (its parameter names, which callers pass
    by keyword): q/k [B, S, N, D], complex freqs_cis [B, S, D/2]."""
    return ops.rotary_embedding_pair_complex(xq, xk, freqs_cis, table_scale=table_scale)


def _rope_complex_vision(table_scale: float, query, key, freqs_ci):
    """Drop-in for Llama 4's `vision_apply_rotary_emb`: q/k [B, S, N, D], complex freqs_ci
    [S, 1, D/2] shared by the batch."""
    return ops.rotary_embedding_pair_complex(query, key, freqs_ci, table_scale=table_scale)


# Rope style (a key of ROPE_PARAMETERS) -> (its drop-in, taking the table bound first; the op
# it calls, for the report).
_ROPE_STYLES: dict[str, tuple[Callable, str]] = {
    "text": (_rope_text, "rotary_embedding_pair"),
    "text-interleaved": (
        functools.partial(_rope_text, interleaved=True),
        "rotary_embedding_pair(interleaved=True)",
    ),
    "vision": (_rope_vision, "rotary_embedding_pair"),
    "text-single": (_rope_single, "rotary_embedding"),
    "axial": (_rope_axial, "rotary_embedding"),
    "complex": (_rope_complex, "rotary_embedding_pair_complex"),
    "complex_vision": (_rope_complex_vision, "rotary_embedding_pair_complex"),
}


def rope_adapter(style: str, table_scale: float = 1.0) -> Callable:
    """The drop-in for the module-level rotary function of ``style`` (a key of
    ``ROPE_PARAMETERS``, see `family_spec.Rope`), for tables bounded by ``table_scale``
    (1.0: unit tables)."""
    return functools.partial(_ROPE_STYLES[style][0], table_scale)


def rope_drop_ins() -> frozenset[Callable]:
    """The drop-in functions `rope_adapter` binds, one per style (what a repro of a rotary call
    may name)."""
    return frozenset(rope_adapter(style).func for style in _ROPE_STYLES)


@functools.cache
def _forward_with_rope(
    forward: types.FunctionType, function_name: str, style: str, table_scale: float = 1.0
):
    """`forward` with the global `function_name` resolved to our RoPE adapter (`with_globals`),
    built once per (forward, function, style, scale)."""
    return with_globals(forward, {function_name: rope_adapter(style, table_scale)})


def rope_forward(
    module: nn.Module, function_name: str, style: str, table_scale: float = 1.0
) -> ReboundForward:
    """``module.forward`` with its class forward's `function_name` resolved to our adapter,
    which hands the op ``table_scale`` (a bound on the tables' |cos| and |sin|)."""
    clone = _forward_with_rope(type(module).forward, function_name, style, table_scale)
    forward = ReboundForward(clone, module)
    forward.recipe = (rope_forward, function_name, style, table_scale)
    return forward


def patch_rope(state: PatchState, module: nn.Module, rope: Rope, part: Part) -> None:
    name = type(module).__name__
    refusal = (
        rope_problem(type(module), rope.function, rope.style)
        if part.enabled("rope")
        else disabled_by("rope")
    )
    if refusal is not None:
        state.report.record_left_alone("rope", name, refusal)
        return
    swap_rope(state, module, rope, part.rope_table_scale, "")


def swap_rope(
    state: PatchState, module: nn.Module, rope: Rope, table_scale: float, note: str
) -> None:
    """Rebind the module's forward to `rope_forward` for `rope`'s function and style, with
    ``table_scale`` bounding the tables; `note` ends the report's op text."""
    forward = rope_forward(module, rope.function, rope.style, table_scale)
    state.rebind(module, "forward", forward)
    scaled = f", table_scale={table_scale:g}" if table_scale != 1.0 else ""
    op = f"ops.{_ROPE_STYLES[rope.style][1]} (via {rope.function}{scaled}){note}"
    state.report.record_swapped("rope", type(module).__name__, op)


# --------------------------------------------------------------------------- the table


def leave_alone(state: PatchState, module: nn.Module, entry: LeaveAlone, part: Part) -> None:
    """Record a module the family spec keeps on purpose, with its reason."""
    state.report.record_left_alone(entry.kind, type(module).__name__, entry.reason)


# PartSpec field -> the adapter applied to each module that field's entries name, in this order.
ADAPTERS: dict[str, Callable[[PatchState, nn.Module, object, Part], None]] = {
    "norms": patch_norm,
    "mlps": patch_mlp,
    "ropes": patch_rope,
    "moes": patch_moe,
    "linear_attention": patch_linear_attention,
    "left_alone": leave_alone,
}
