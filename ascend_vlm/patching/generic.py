"""The generic path of ``patch(model, strict=False)``: what a model no family describes gets.

A family spec says by class name what to swap; for a model without one, `discover` finds the
candidates by structure, in every module the spec (a known text backbone, or nothing) does not
name, once per `patch` (the ledger may install the patch again; the plan is kept):

* attention: a module whose forward looks its function up in transformers'
  ``ALL_ATTENTION_FUNCTIONS`` by ``config._attn_implementation``
  (`attention_interface_problem`) is routed to our attention through its config, as a family's
  is; a class named ``*Attention`` that does not, or cannot be routed, is left alone with why.
* norm: a module with a floating ``weight`` of shape (H,), a numeric epsilon
  (``NORM_EPS_ATTRIBUTES``) and no bias -> ``ops.rms_norm`` with offset 0 or 1, whichever the
  probe verifies (`probe_norm`).
* mlp: a module with ``gate_proj``/``up_proj``/``down_proj`` -> ``ops.swiglu`` when the probe
  verifies it (`probe_mlp`).
* rope: a module whose forward calls a module-level function named ``*rotary*`` with a
  signature of ``ROPE_PARAMETERS`` -> the function resolved to our adapter when the probe
  verifies it on q/k of the module's head_dim and, for the text style, the cos/sin of the
  model's rotary module (`probe_rope`).

Swaps a probe verified say ``probe-verified`` in the report (`PatchReport.probe_verified`);
a module whose probe disagrees is left alone with the probe's max error as the reason. The
vision part is every module holding a vision sub-config of the model's config, with its
submodules; the rest is the text part.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field

import torch
from torch import nn

from ascend_vlm._compat.attention import attention_interface_problem
from ascend_vlm._compat.decorators import ROPE_PARAMETERS, rope_problem
from ascend_vlm._compat.module_internals import MLP_PROJECTIONS
from ascend_vlm.models.family_spec import ModelSpec, PartSpec, RmsNorm, Rope
from ascend_vlm.patching.adapters import norm_eps, swap_mlp, swap_norm, swap_rope
from ascend_vlm.patching.part import Part, rope_table_scale
from ascend_vlm.patching.probes import Verdict, probe_mlp, probe_norm, probe_rope
from ascend_vlm.patching.report import PROBE_VERIFIED
from ascend_vlm.patching.routing import attention_configs_to_route
from ascend_vlm.patching.state import PatchState, disabled_by

_NOTE = f", {PROBE_VERIFIED}"
# A module-level function whose name holds this, called in a forward, is a rotary candidate.
_ROTARY_MARK = "rotary"


@dataclass(frozen=True)
class Finding:
    """One norm, MLP or RoPE module found by structure, and its probe's verdict; ``eps`` is a
    norm's epsilon, ``rope`` the rotary function and style a RoPE module calls."""

    kind: str
    part: str
    module: nn.Module
    verdict: Verdict
    eps: float = 0.0
    rope: Rope | None = None
    table_scale: float = 1.0


@dataclass
class GenericPlan:
    """What `discover` found in one model: the modules of each part, the attention classes
    routed per part, the (kind, module, reason) rows left alone, and the probed findings."""

    parts: dict[str, list[nn.Module]]
    attention: dict[str, tuple[str, ...]]
    left_alone: list[tuple[str, str, str]] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)


def _named_classes(spec: ModelSpec) -> set[str]:
    """Every class name the spec's parts name in any field (those modules are the spec's)."""
    names: set[str] = set()
    for part in (spec.text, spec.vision):
        names |= set(part.attention)
        for entry in (*part.norms, *part.mlps, *part.ropes, *part.left_alone):
            names |= set(entry.classes)
    return names


def _vision_configs(config) -> list:
    """The vision sub-configs of `config` (a sub-config named ``*vision*``), at any depth."""
    from transformers import PreTrainedConfig

    found = []
    for name in getattr(type(config), "sub_configs", {}):
        sub_config = config.__dict__.get(name)
        if isinstance(sub_config, PreTrainedConfig):
            if "vision" in name:
                found.append(sub_config)
            found += _vision_configs(sub_config)
    return found


def split_parts(base: nn.Module) -> dict[str, list[nn.Module]]:
    """{"text": modules, "vision": modules}: the vision part is every module holding a vision
    sub-config of ``base.config`` (by identity) and its submodules; the text part the rest."""
    vision_ids = {id(config) for config in _vision_configs(base.config)}
    vision: dict[int, nn.Module] = {}
    for module in base.modules():
        if module is not base and id(module.__dict__.get("config")) in vision_ids:
            vision.update((id(m), m) for m in module.modules())
    text = [m for m in base.modules() if id(m) not in vision]
    return {"text": text, "vision": list(vision.values())}


def _attention_problem(cls: type, holder: nn.Module) -> str | None:
    """Why attention class `cls` (`holder` one of its modules) cannot be routed, or None."""
    from transformers import PreTrainedConfig

    problem = attention_interface_problem(cls)
    if problem is None and not isinstance(holder.__dict__.get("config"), PreTrainedConfig):
        problem = f"{cls.__name__} holds no config to route its attention through"
    value_dim, key_dim = (getattr(holder, n, None) for n in ("v_head_dim", "qk_head_dim"))
    if problem is None and value_dim is not None and key_dim not in (None, value_dim):
        problem = f"{cls.__name__}'s value head size {value_dim} is not its query/key's {key_dim}"
    return problem


def _attention_routes(parts: dict[str, list[nn.Module]], plan: GenericPlan) -> None:
    """Fill ``plan.attention`` with the attention classes of each part that can be routed
    through their config; the others (classes named ``*Attention`` or looking a function up in
    ``ALL_ATTENTION_FUNCTIONS``) go to ``plan.left_alone`` with why. A class sharing its config
    with one that cannot be routed is not routed either: routing is per config."""
    candidates = {}  # (part, class) -> (problem, configs its modules hold)
    for part, modules in parts.items():
        for cls in dict.fromkeys(type(m) for m in modules):
            names = getattr(getattr(cls.forward, "__code__", None), "co_names", ())
            if cls.__name__.endswith("Attention") or "ALL_ATTENTION_FUNCTIONS" in names:
                held = [m for m in modules if type(m) is cls]
                configs = {id(m.__dict__.get("config")) for m in held}
                candidates[part, cls] = (_attention_problem(cls, held[0]), configs)
    blocked = {}
    for (_, cls), (problem, configs) in candidates.items():
        if problem is not None:
            blocked.update(dict.fromkeys(configs - {id(None)}, cls.__name__))
    plan.attention = {part: () for part in parts}
    for (part, cls), (problem, configs) in candidates.items():
        sharer = next((blocked[c] for c in configs if c in blocked), None)
        if problem is None and sharer is not None:
            problem = f"{cls.__name__} shares its config with {sharer}, which cannot be routed"
        if problem is None:
            plan.attention[part] += (cls.__name__,)
        else:
            plan.left_alone.append((f"attention-{part}", cls.__name__, problem))


def _is_norm(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (
        isinstance(weight, torch.Tensor)
        and weight.dim() == 1
        and weight.is_floating_point()
        and getattr(module, "bias", None) is None
        and norm_eps(module) is not None
    )


def _is_gated_mlp(module: nn.Module) -> bool:
    return all(isinstance(getattr(module, p, None), nn.Module) for p in MLP_PROJECTIONS)


def _rotary_calls(cls: type) -> list[tuple[str, types.FunctionType, str | None]]:
    """(name, function, style or None) of each ``*rotary*`` module-level function `cls`'s
    forward calls; the style is the first of ``ROPE_PARAMETERS`` whose signature it has."""
    forward = cls.forward
    while hasattr(forward, "__wrapped__"):
        forward = forward.__wrapped__
    if not isinstance(forward, types.FunctionType):
        return []
    calls = []
    for name in forward.__code__.co_names:
        function = forward.__globals__.get(name)
        if _ROTARY_MARK in name.lower() and callable(function):
            style = next((s for s in ROPE_PARAMETERS if not rope_problem(cls, name, s)), None)
            calls.append((name, function, style))
    return calls


def _head_dim(module: nn.Module) -> int | None:
    head_dim = getattr(module, "head_dim", None)
    config = module.__dict__.get("config")
    if head_dim is None and config is not None:
        head_dim = getattr(config, "head_dim", None)
        heads = getattr(config, "num_attention_heads", None)
        if head_dim is None and heads:
            head_dim = getattr(config, "hidden_size", 0) // heads
    return head_dim if isinstance(head_dim, int) and head_dim > 0 else None


def _rotary_tables(modules: list[nn.Module], like: torch.Tensor, head_dim: int):
    """cos/sin [2, 5, D] from the part's first rotary module (one with an ``inv_freq``) called
    as ``rotary(x, position_ids)``, or None when there is none or its tables are not of that
    shape."""
    rotary = next(
        (m for m in modules if isinstance(getattr(m, "inv_freq", None), torch.Tensor)), None
    )
    if rotary is None:
        return None
    x = torch.zeros(2, 5, head_dim, dtype=like.dtype, device=like.device)
    positions = torch.arange(5, device=like.device).expand(2, 5)
    try:
        with torch.no_grad():
            tables = rotary(x, positions)
    except Exception:  # a rotary module with another call convention: random tables serve
        return None
    if (
        isinstance(tables, tuple)
        and len(tables) == 2
        and all(
            isinstance(t, torch.Tensor) and t.shape[:2] == (2, 5) and t.dim() == 3 for t in tables
        )
    ):
        return tables
    return None


def _rope_findings(modules: list[nn.Module], part: str, skip: set[str]) -> list[Finding]:
    """A Finding per module of `modules` calling a rotary function; probes are shared by the
    modules with the same function, style, head_dim and dtype."""
    table_scale = rope_table_scale(modules)
    verdicts: dict[tuple, Verdict] = {}
    findings = []
    for module in modules:
        if type(module).__name__ in skip:
            continue
        swapped = None
        for function_name, function, style in _rotary_calls(type(module)):
            rope = Rope((type(module).__name__,), function_name, style or "text")
            head_dim = _head_dim(module)
            like = next((p for p in module.parameters() if p.is_floating_point()), None)
            like = like if like is not None else torch.zeros(())
            if style is None:
                why = rope_problem(type(module), function_name, "text")
                verdict = Verdict(None, float("inf"), why)
            elif head_dim is None:
                verdict = Verdict(None, float("inf"), "no head_dim to probe the rotary with")
            else:
                key = (function, style, head_dim, like.dtype, like.device)
                if key not in verdicts:
                    tables = _rotary_tables(modules, like, head_dim) if style == "text" else None
                    verdicts[key] = probe_rope(function, style, head_dim, like, tables, table_scale)
                verdict = verdicts[key]
            if verdict.setting is not None and swapped is not None:
                # Rebinding works on one function of a forward; a second would undo the first.
                why = f"{type(module).__name__}.forward's {swapped} is the rotary rebound"
                verdict = Verdict(None, verdict.max_error, why)
            elif verdict.setting is not None:
                swapped = function_name
            findings.append(
                Finding("rope", part, module, verdict, rope=rope, table_scale=table_scale)
            )
    return findings


def discover(base: nn.Module, spec: ModelSpec, unsupported: str) -> GenericPlan:
    """Find and probe what the generic path swaps in `base`, outside what `spec` names;
    `unsupported` says why the model has no family (it starts the reasons of what is left alone
    for want of an attention routable through transformers' interface)."""
    skip = _named_classes(spec)
    parts = split_parts(base)
    plan = GenericPlan(parts=parts, attention={})
    unnamed = {part: [m for m in ms if type(m).__name__ not in skip] for part, ms in parts.items()}
    _attention_routes(unnamed, plan)
    for part, modules in parts.items():
        for module in modules:
            if type(module).__name__ in skip:
                continue
            if _is_norm(module):
                eps = norm_eps(module)
                plan.findings.append(
                    Finding("norm", part, module, probe_norm(module, eps), eps=eps)
                )
            elif _is_gated_mlp(module):
                plan.findings.append(Finding("mlp", part, module, probe_mlp(module)))
        plan.findings += _rope_findings(modules, part, skip)
    why = f"{unsupported}; no attention routable through transformers' AttentionInterface"
    why += " (strict=False)"
    if _vision_configs(base.config) and not plan.attention["vision"]:
        plan.left_alone.append(("attention-vision", "vision tower", why))
    if not spec.text.attention and not plan.attention["text"]:
        plan.left_alone.append(("attention-text", base.config.model_type, why))
    return plan


def apply_plan(state: PatchState, plan: GenericPlan) -> list:
    """Make the swaps of `plan` the options allow through `state`'s ledger edits and report
    the rest; returns the configs to route to our attention (`route_attention`)."""
    routed = []
    for name, modules in plan.parts.items():
        part = Part(name, modules, state.options)
        routed += attention_configs_to_route(state, part, PartSpec(attention=plan.attention[name]))
    for kind, module, why in plan.left_alone:
        state.report.record_left_alone(kind, module, why)
    for finding in plan.findings:
        name, verdict = type(finding.module).__name__, finding.verdict
        if not Part(finding.part, [], state.options).enabled(finding.kind):
            state.report.record_left_alone(finding.kind, name, disabled_by(finding.kind))
        elif verdict.setting is None:
            state.report.record_left_alone(finding.kind, name, verdict.reason)
        elif finding.kind == "norm":
            norm = RmsNorm((name,), offset=verdict.setting)
            swap_norm(state, finding.module, finding.eps, norm, _NOTE)
        elif finding.kind == "mlp":
            swap_mlp(state, finding.module, _NOTE)
        else:
            swap_rope(state, finding.module, finding.rope, finding.table_scale, _NOTE)
    return routed
