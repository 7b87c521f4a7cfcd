"""The module adapters: what replaces a norm's, an MLP's and a RoPE attention's forward (a
Gated DeltaNet's: `ascend_vlm.patching.linear_attention`).

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
    MLP_ACTIVATION,
    MLP_PROJECTIONS,
    NORM_EPS_ATTRIBUTES,
    SILU_ACTIVATIONS,
)
from ascend_vlm.models.family_spec import LeaveAlone, RmsNorm, Rope, SwigluMlp
from ascend_vlm.patching.linear_attention import patch_linear_attention
from ascend_vlm.patching.part import Part, disabled, tag
from ascend_vlm.patching.rebound_globals import ReboundForward, with_globals
from ascend_vlm.patching.state import PatchState

# --------------------------------------------------------------------------- norm


def rms_norm_forward(
    module: nn.Module, eps: float, offset: float, hidden_states: torch.Tensor
) -> torch.Tensor:
    """The norm module's forward through ``ops.rms_norm_promoting`` (the stock module's output
    dtype); the weight is the module's own Parameter, read at call time."""
    return ops.rms_norm_promoting(hidden_states, module.weight, eps, offset=offset)


def patch_norm(state: PatchState, module: nn.Module, norm: RmsNorm, part: Part) -> None:
    name = type(module).__name__
    eps = next((getattr(module, a) for a in NORM_EPS_ATTRIBUTES if hasattr(module, a)), None)
    if not part.enabled("norm"):
        state.report.record_left_alone("norm", name, disabled("norm"))
    elif not isinstance(getattr(module, "weight", None), torch.Tensor) or eps is None:
        state.report.record_left_alone("norm", name, "no weight/eps attributes to hand to the op")
    else:
        forward = functools.partial(rms_norm_forward, module, float(eps), norm.offset)
        state.rebind(module, "forward", forward)
        tag(state, module, "rms_norm")
        state.report.record_swapped("norm", name, f"ops.rms_norm(offset={norm.offset:g})")


# --------------------------------------------------------------------------- mlp


_GATE, _UP, _DOWN = MLP_PROJECTIONS


def swiglu_mlp_forward(module: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """The gated MLP's forward: ``down_proj(ops.swiglu_projections(x, gate_proj, up_proj))``."""
    gated = ops.swiglu_projections(hidden_states, getattr(module, _GATE), getattr(module, _UP))
    return getattr(module, _DOWN)(gated)


def patch_mlp(state: PatchState, module: nn.Module, mlp: SwigluMlp, part: Part) -> None:
    name = type(module).__name__
    activation = type(getattr(module, MLP_ACTIVATION, None)).__name__
    if not part.enabled("mlp"):
        state.report.record_left_alone("mlp", name, disabled("mlp"))
    elif not all(hasattr(module, p) for p in MLP_PROJECTIONS):
        state.report.record_left_alone("mlp", name, f"no {'/'.join(MLP_PROJECTIONS)}")
    elif activation not in SILU_ACTIVATIONS:
        why = f"activation is {activation}, ops.swiglu computes silu(gate) * up"
        state.report.record_left_alone("mlp", name, why)
    else:
        state.rebind(module, "forward", functools.partial(swiglu_mlp_forward, module))
        tag(state, module, "swiglu")
        state.report.record_swapped("mlp", name, "ops.swiglu")


# --------------------------------------------------------------------------- rope


def _rope_text(table_scale: float, q, k, cos, sin, unsqueeze_dim=1):
    """Drop-in for transformers' `apply_rotary_pos_emb` (once ``table_scale``, a bound on the
    model's |cos| and |sin|, is bound): q/k [B, N, S, D], cos/sin [B, S, D]."""
    if unsqueeze_dim != 1:
        raise ValueError(
            f"unsqueeze_dim: expected 1 (heads axis of [B, N, S, D]), got {unsqueeze_dim}"
        )
    return ops.rotary_embedding_pair(q, k, cos, sin, table_scale=table_scale)


def rope_adapter(style: str, table_scale: float = 1.0) -> Callable:
    """The drop-in for the module-level rotary function of ``style`` ("text":
    `apply_rotary_pos_emb`, "vision": `apply_rotary_pos_emb_vision`), for tables bounded by
    ``table_scale`` (1.0: unit tables)."""
    if style == "vision":
        return functools.partial(ops.rotary_embedding_pair_vision, table_scale=table_scale)
    return functools.partial(_rope_text, table_scale)


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
        else disabled("rope")
    )
    if refusal is not None:
        state.report.record_left_alone("rope", name, refusal)
        return
    table_scale = part.rope_table_scale
    state.rebind(module, "forward", rope_forward(module, rope.function, rope.style, table_scale))
    scaled = f", table_scale={table_scale:g}" if table_scale != 1.0 else ""
    op = f"ops.rotary_embedding_pair (via {rope.function}{scaled})"
    state.report.record_swapped("rope", name, op)


# --------------------------------------------------------------------------- the table


def leave_alone(state: PatchState, module: nn.Module, entry: LeaveAlone, part: Part) -> None:
    """Record a module the family spec keeps on purpose, with its reason."""
    state.report.record_left_alone(entry.kind, type(module).__name__, entry.reason)


# PartSpec field -> the adapter applied to each module that field's entries name, in this order.
ADAPTERS: dict[str, Callable[[PatchState, nn.Module, object, Part], None]] = {
    "norms": patch_norm,
    "mlps": patch_mlp,
    "ropes": patch_rope,
    "linear_attention": patch_linear_attention,
    "left_alone": leave_alone,
}
