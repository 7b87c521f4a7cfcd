"""Where `verify` captures a model's activations, found from its family's descriptor.

A :class:`CapturePoint` names one module of the generation model (its qualified name) and the
kind of op there (:data:`OP_KINDS`). The points come from what `patch` itself reads, never from
name guesses:

* the modules a family spec names (``models.spec_for``), per part: attention classes
  (``attention-text`` / ``attention-vision``), norms, MLPs, sparse MoE blocks and Gated
  DeltaNet mixers, those it swaps and those it leaves alone on purpose (``LeaveAlone`` says
  their kind); a model no family describes gets the generic path's plan instead
  (``patching.generic.discover``: the modules `patch(model, strict=False)` would route or probe,
  and the attention classes it leaves alone);
* RoPE: each module whose forward calls a module-level rotary function the spec (or the generic
  plan) names gets a point ``"<module>.rope"`` for the rotated q/k that function returns (in a
  patched model the function resolves to a `patching.adapters` drop-in, in a stock one to the
  modeling module's own);
* the projector at the layout's path (``Layout.projector``; for the generic path the outermost
  module named by ``models.parts.PROJECTOR_MARKERS``);
* decoder layers at ``Layout.decoder_layers`` and vision blocks: the items of the outermost
  ``ModuleList`` in each part whose items hold an attention or linear-attention point (the
  generic path finds its decoder layers the same way).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ascend_vlm._base_model import base_model
from ascend_vlm.models import KINDS, TEXT_BACKBONES, ModelSpec, PartSpec, descriptor_for, spec_for
from ascend_vlm.models.descriptor import attribute_at
from ascend_vlm.models.parts import PROJECTOR_MARKERS

# The kinds of op a capture point sits on: `patch`'s kinds, then the blocks around them.
OP_KINDS = (*KINDS, "vision-block", "projector", "decoder-layer")
# Kinds whose modules mark the items of a ModuleList as layers (decoder layers, vision blocks).
_MIXER_KINDS = ("attention-text", "attention-vision", "linear-attention")
ROPE_SUFFIX = ".rope"


@dataclass(frozen=True)
class CapturePoint:
    """One capture: ``module`` (qualified name in the generation model) and the ``kind`` of op
    there; a RoPE point (``kind == "rope"``) also names the module-level ``rope_function`` the
    module's forward calls, and its ``name`` is ``module + ".rope"``."""

    name: str
    kind: str
    module: str
    rope_function: str | None = None


def _tower(base: nn.Module, paths: tuple[str, ...]) -> nn.Module | None:
    for path in paths:
        module = attribute_at(base, path)
        if isinstance(module, nn.Module):
            return module
    return None


def _spec_kinds(part: PartSpec) -> tuple[dict[str, str], dict[str, str]]:
    """(class name -> op kind, class name -> rotary function) of one part's spec."""
    kinds = dict.fromkeys(part.attention, "attention")
    for kind, entries in (
        ("norm", part.norms),
        ("mlp", part.mlps),
        ("moe", part.moes),
        ("linear-attention", part.linear_attention),
    ):
        kinds.update((name, kind) for entry in entries for name in entry.classes)
    kinds.update((name, entry.kind) for entry in part.left_alone for name in entry.classes)
    ropes = {name: entry.function for entry in part.ropes for name in entry.classes}
    return kinds, ropes


class _Plan:
    """Op kind and rotary function per module (by identity), and the modules of each part."""

    def __init__(self) -> None:
        self.kinds: dict[int, str] = {}
        self.ropes: dict[int, str] = {}
        self.vision: set[int] = set()

    def add_part(self, name: str, modules: list[nn.Module], spec: PartSpec) -> None:
        kinds, ropes = _spec_kinds(spec)
        for module in modules:
            cls = type(module).__name__
            kind = kinds.get(cls)
            if kind == "attention":
                kind = f"attention-{name}"
            if kind is not None:
                self.kinds.setdefault(id(module), kind)
            if cls in ropes:
                self.ropes.setdefault(id(module), ropes[cls])
        if name == "vision":
            self.vision |= {id(m) for m in modules}


def _family_plan(base: nn.Module, spec: ModelSpec) -> _Plan:
    plan = _Plan()
    tower = _tower(base, spec.vision_towers)
    vision = [] if tower is None else list(tower.modules())
    vision_ids = {id(m) for m in vision}
    plan.add_part("vision", vision, spec.vision)
    plan.add_part("text", [m for m in base.modules() if id(m) not in vision_ids], spec.text)
    return plan


def _generic_plan(base: nn.Module, model_type: str) -> _Plan:
    """The plan of a model no family describes: its text backbone's spec where one is known,
    then what the generic path finds (`discover` probes the found modules once)."""
    from ascend_vlm.patching.generic import discover

    spec = ModelSpec(text=TEXT_BACKBONES.get(model_type, PartSpec()))
    generic = discover(base, spec, f"model_type {model_type!r} is not supported")
    plan = _Plan()
    for part, modules in generic.parts.items():
        left_alone = tuple(cls for kind, cls, _ in generic.left_alone if kind.endswith(part))
        attention = PartSpec(attention=generic.attention[part] + left_alone)
        plan.add_part(part, modules, (spec.text if part == "text" else PartSpec()) + attention)
    for finding in generic.findings:
        if finding.kind == "rope":
            plan.ropes.setdefault(id(finding.module), finding.rope.function)
        else:
            plan.kinds.setdefault(id(finding.module), finding.kind)
    return plan


def _outermost(names: list[str]) -> list[str]:
    """``names`` without those nested in another of them."""
    return [n for n in names if not any(n.startswith(o + ".") for o in names if o != n)]


def _layer_points(
    named: dict[str, nn.Module], plan: _Plan, decoder_layers: str | None
) -> list[CapturePoint]:
    """Decoder layers (the items at ``decoder_layers`` when the layout gives it) and vision
    blocks: the items of the outermost ModuleLists whose items hold a mixer (attention or
    linear attention), in the vision part (and, without ``decoder_layers``, the text part)."""
    mixers = {id(m) for m in named.values() if plan.kinds.get(id(m)) in _MIXER_KINDS}
    lists = [
        name
        for name, module in named.items()
        if isinstance(module, nn.ModuleList)
        and any(id(m) in mixers for item in module for m in item.modules())
    ]
    found = [(name, "vision-block") for name in _outermost(lists) if id(named[name]) in plan.vision]
    if decoder_layers is None:
        found += [
            (n, "decoder-layer") for n in _outermost(lists) if id(named[n]) not in plan.vision
        ]
    else:
        found.append((decoder_layers, "decoder-layer"))
    return [
        CapturePoint(f"{name}.{index}", kind, f"{name}.{index}")
        for name, kind in found
        for index in range(len(named[name]))
    ]


def capture_points(model: nn.Module) -> list[CapturePoint]:
    """The capture points of ``model`` (a transformers VLM for generation, optionally
    PEFT-wrapped; patched or not, the points are the same), in module order (`verify` orders
    them by execution)."""
    base = base_model(model)
    config = base.config
    descriptor = descriptor_for(config)
    named = dict(base.named_modules())
    if descriptor is None:
        plan = _generic_plan(base, config.model_type)
        projectors = [n for n in named if n and n.split(".")[-1] in PROJECTOR_MARKERS]
        decoder_layers = None
    else:
        plan = _family_plan(base, spec_for(config))
        prefix = f"{descriptor.layout.multimodal}." if descriptor.layout.multimodal else ""
        projectors = [prefix + descriptor.layout.projector]
        decoder_layers = prefix + descriptor.layout.decoder_layers
    points = [CapturePoint(n, "projector", n) for n in _outermost(projectors) if n in named]
    points += _layer_points(named, plan, decoder_layers if decoder_layers in named else None)
    for name, module in named.items():
        kind = plan.kinds.get(id(module))
        if id(module) in plan.ropes:
            points.append(CapturePoint(name + ROPE_SUFFIX, "rope", name, plan.ropes[id(module)]))
        if kind is not None and name:
            points.append(CapturePoint(name, kind, name))
    # A module that is the projector and a module the spec names is captured once, as projector.
    unique: dict[str, CapturePoint] = {}
    for point in points:
        unique.setdefault(point.name, point)
    return list(unique.values())
