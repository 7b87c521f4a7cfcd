"""The module adapters: what replaces a norm's, an MLP's and a RoPE attention's forward.

Each adapter takes one module a family spec entry names, and either rebinds its forward (through
`PatchState.rebind`, so `unpatch` reverts it) or records why it leaves the module alone.
``ADAPTERS`` maps each ``PartSpec`` field to its adapter; `patch` applies every entry of a part
through it, so a further kind of swap is one more field and one more entry here.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ascend_vlm import ops
from ascend_vlm._compat.decorators import rewrap, rope_problem
from ascend_vlm._compat.module_internals import (
    MLP_ACTIVATION,
    MLP_PROJECTIONS,
    NORM_EPS_ATTRIBUTES,
    SILU_ACTIVATIONS,
)
from ascend_vlm.models.family_spec import LeaveAlone, RmsNorm, Rope, SwigluMlp
from ascend_vlm.patching.state import PatchState


@dataclass
class Part:
    """What an adapter sees of the part (``name`` "text" or "vision") it patches: the part's
    modules and the options `patch` was called with."""

    name: str
    modules: list[nn.Module]
    options: dict[str, bool]

    def enabled(self, kind: str) -> bool:
        """Whether `patch`'s options ask for modules of `kind` ("norm", "mlp", "rope") here."""
        return (self.name == "text" or self.options["vision"]) and self.options[kind]

    @functools.cached_property
    def rope_table_scale(self) -> float:
        """A bound on |cos| and |sin| of the RoPE tables made in this part (`rope_table_scale`)."""
        return rope_table_scale(self.modules)


def disabled(kind: str) -> str:
    """The reason a module of `kind` is left alone when `patch`'s options turn it off."""
    return f"disabled by patch({kind}=False) or patch(vision=False)"


def _tagged_extra_repr(original: Callable[[], str], op_name: str) -> str:
    text = original()
    return f"{text}, fused=ascend_vlm.ops.{op_name}" if text else f"fused=ascend_vlm.ops.{op_name}"


def _tag(state: PatchState, module: nn.Module, op_name: str) -> None:
    """Make the module's ``extra_repr`` name the op its forward now runs."""
    tagged = functools.partial(_tagged_extra_repr, module.extra_repr, op_name)
    state.rebind(module, "extra_repr", tagged)


# --------------------------------------------------------------------------- norm


def rms_norm_forward(
    module: nn.Module, eps: float, offset: float, hidden_states: torch.Tensor
) -> torch.Tensor:
    """The norm module's forward through ``ops.rms_norm_promoting`` (the stock module's output
    dtype); the weight is the module's own Parameter, read at call time."""
    return ops.rms_norm_promoting(hidden_states, module.weight, eps, offset=offset)


def norm_eps(module: nn.Module) -> float | None:
    """The norm module's epsilon (the first of ``NORM_EPS_ATTRIBUTES`` it has, a number), or None."""
    eps = next((getattr(module, a) for a in NORM_EPS_ATTRIBUTES if hasattr(module, a)), None)
    return float(eps) if isinstance(eps, (int, float)) else None


def swap_norm(state: PatchState, module: nn.Module, eps: float, offset: float, note: str) -> None:
    """Rebind the norm's forward to `rms_norm_forward`; `note` ends the report's op text."""
    state.rebind(module, "forward", functools.partial(rms_norm_forward, module, eps, offset))
    _tag(state, module, "rms_norm")
    state.report.record_swapped(
        "norm", type(module).__name__, f"ops.rms_norm(offset={offset:g}){note}"
    )


def patch_norm(state: PatchState, module: nn.Module, norm: RmsNorm, part: Part) -> None:
    name = type(module).__name__
    eps = norm_eps(module)
    if not part.enabled("norm"):
        state.report.record_left_alone("norm", name, disabled("norm"))
    elif not isinstance(getattr(module, "weight", None), torch.Tensor) or eps is None:
        state.report.record_left_alone("norm", name, "no weight/eps attributes to hand to the op")
    else:
        swap_norm(state, module, eps, norm.offset, "")


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
        swap_mlp(state, module, "")


def swap_mlp(state: PatchState, module: nn.Module, note: str) -> None:
    """Rebind the gated MLP's forward to `swiglu_mlp_forward`; `note` ends the report's op text."""
    state.rebind(module, "forward", functools.partial(swiglu_mlp_forward, module))
    _tag(state, module, "swiglu")
    state.report.record_swapped("mlp", type(module).__name__, f"ops.swiglu{note}")


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


def rope_table_scale(modules: list[nn.Module]) -> float:
    """A bound on |cos| and |sin| of the RoPE tables made in one part of a model: the largest
    ``attention_scaling`` (or per-layer-type ``<type>_attention_scaling``, Gemma3) that its
    rotary embedding modules multiply their tables by, and at least 1.0 (unit tables).

    Read once at patch time; the factor is fixed at the module's construction (dynamic and
    longrope updates change the frequencies, not the factor). Any bound gives the same result
    (ops.rotary_embedding's ``table_scale``), so one bound serves every rotary module.
    """
    scales = [
        value
        for module in modules
        for name, value in vars(module).items()
        if name.endswith("attention_scaling") and type(value) in (float, int)
    ]
    return float(max([1.0, *scales]))


@functools.cache
def _forward_with_rope(
    forward: types.FunctionType, function_name: str, style: str, table_scale: float = 1.0
):
    """`forward`'s own code with the global `function_name` resolved to our RoPE adapter.

    One globals snapshot per (forward, function, style, scale); the original module is not
    modified. A decorated forward is rebuilt around the rebound function it decorates (`rewrap`).
    The snapshot drops ``__name__``: Dynamo resolves the globals of a function it inlines
    through the module of that name when there is one, and would then guard on the module's own
    `function_name` (transformers' function) instead of our adapter; without it, Dynamo reads
    and guards on this dict, so torch.compile and torch.export see the adapter.
    """
    if hasattr(forward, "__wrapped__"):
        return rewrap(
            forward,
            _forward_with_rope(forward.__wrapped__, function_name, style, table_scale),
        )
    rebound_globals = dict(forward.__globals__)
    rebound_globals[function_name] = rope_adapter(style, table_scale)
    del rebound_globals["__name__"]
    clone = types.FunctionType(
        forward.__code__,
        rebound_globals,
        forward.__name__,
        forward.__defaults__,
        forward.__closure__,
    )
    clone.__kwdefaults__ = forward.__kwdefaults__
    clone.__qualname__ = forward.__qualname__
    return clone


class RopeForward(functools.partial):
    """A module's ``forward`` rebound by `_forward_with_rope`, bound to the module (called like
    the bound method). Pickles as its recipe, `rope_forward`'s arguments: the rebound function
    has no importable name."""

    recipe: tuple[str, str, float]  # (function_name, style, table_scale)

    def __reduce__(self):
        return rope_forward, (self.args[0], *self.recipe)


def rope_forward(
    module: nn.Module, function_name: str, style: str, table_scale: float = 1.0
) -> RopeForward:
    """``module.forward`` with its class forward's `function_name` resolved to our adapter,
    which hands the op ``table_scale`` (a bound on the tables' |cos| and |sin|)."""
    clone = _forward_with_rope(type(module).forward, function_name, style, table_scale)
    forward = RopeForward(clone, module)
    forward.recipe = (function_name, style, table_scale)
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
    swap_rope(state, module, rope, part.rope_table_scale, "")


def swap_rope(
    state: PatchState, module: nn.Module, rope: Rope, table_scale: float, note: str
) -> None:
    """Rebind the module's forward to `rope_forward` for `rope`'s function and style, with
    ``table_scale`` bounding the tables; `note` ends the report's op text."""
    forward = rope_forward(module, rope.function, rope.style, table_scale)
    state.rebind(module, "forward", forward)
    scaled = f", table_scale={table_scale:g}" if table_scale != 1.0 else ""
    op = f"ops.rotary_embedding_pair (via {rope.function}{scaled}){note}"
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
    "left_alone": leave_alone,
}
