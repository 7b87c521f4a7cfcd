"""`patch`, `unpatch`, `is_patched`: find the family spec, apply it part by part through the
edit ledger (feature ``"patch"``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import nn

from ascend_vlm._base_model import base_model
from ascend_vlm._errors import PatchError
from ascend_vlm.models import (
    TEXT_BACKBONES,
    ModelSpec,
    PartSpec,
    spec_for,
    supported_model_types,
)
from ascend_vlm.patching.adapters import ADAPTERS
from ascend_vlm.patching.attention import register_attention
from ascend_vlm.patching.generic import GenericPlan, apply_plan, discover
from ascend_vlm.patching.ledger import Edits, applied_features, apply_feature, remove_feature
from ascend_vlm.patching.part import Part
from ascend_vlm.patching.report import PatchReport
from ascend_vlm.patching.routing import attention_configs_to_route, route_attention
from ascend_vlm.patching.state import PatchState
from ascend_vlm.patching.version_gate import check_transformers_version


def _find_vision_tower(base: nn.Module, paths: tuple[str, ...]) -> nn.Module | None:
    for path in paths:
        module = base
        for attribute in path.split("."):
            module = getattr(module, attribute, None)
            if not isinstance(module, nn.Module):
                break
        else:
            return module
    return None


def _modules_by_part(base: nn.Module, tower: nn.Module | None) -> dict[str, list[nn.Module]]:
    vision = [] if tower is None else list(tower.modules())
    vision_ids = {id(m) for m in vision}
    text = [m for m in base.modules() if id(m) not in vision_ids]
    return {"text": text, "vision": vision}


def _apply_adapters(state: PatchState, part: Part, spec: PartSpec) -> None:
    """Hand each module of `part` to the adapter of every spec entry naming its class."""
    for module in part.modules:
        name = type(module).__name__
        for field_name, adapter in ADAPTERS.items():
            for entry in getattr(spec, field_name):
                if name in entry.classes:
                    adapter(state, module, entry, part)


def _base_model(model: object, **flags: object) -> nn.Module:
    """The transformers model under a PEFT wrapper (or `model` itself), once the arguments of
    `patch` / `unpatch` are checked: TypeError naming the argument unless `model` is an
    ``nn.Module`` and every flag (``attention=``, ``strict=``, ...) a bool."""
    base = base_model(model)
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name}: expected True or False, got {value!r}")
    return base


def _resolve_spec(base: nn.Module, strict: bool) -> tuple[str, ModelSpec, str | None]:
    """(model_type, spec, reason the model is only partly recognised or None)."""
    config = getattr(base, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type is None:
        raise PatchError(
            f"model: expected a Hugging Face PreTrainedModel with config.model_type, got "
            f"{type(base).__name__}"
        )
    spec = spec_for(config)
    if spec is not None:
        return model_type, spec, None
    if strict:
        raise PatchError(
            f"model_type {model_type!r} is not supported by ascend_vlm.patch; supported "
            f"model_types: {', '.join(supported_model_types())}. Pass strict=False for "
            f"the generic path (attention through transformers' AttentionInterface, "
            f"probe-verified norms, MLPs and RoPE; see the PatchReport)."
        )
    # strict=False: a plain decoder we know keeps its text spec; the generic path does the rest.
    text = TEXT_BACKBONES.get(model_type, PartSpec())
    return model_type, ModelSpec(text=text), f"model_type {model_type!r} is not supported"


@dataclass
class PatchFeature:
    """The ledger feature ``"patch"``: one model's family spec applied with `patch`'s options.
    Each install writes a fresh report (what was swapped and left alone). A model no family
    describes (``unsupported`` says why) also gets the generic path, whose plan is discovered
    and probed at the first install and kept for the next ones."""

    name: ClassVar[str] = "patch"
    base: nn.Module
    options: dict[str, bool]
    model_type: str
    spec: ModelSpec
    unsupported: str | None
    report: PatchReport | None = None
    generic: GenericPlan | None = None

    def install(self, edits: Edits) -> None:
        state = PatchState(self.options, PatchReport(model_type=self.model_type), edits)
        register_attention()
        tower = _find_vision_tower(self.base, self.spec.vision_towers)
        routed = []
        for name, modules in _modules_by_part(self.base, tower).items():
            part, part_spec = Part(name, modules, self.options), getattr(self.spec, name)
            routed += attention_configs_to_route(state, part, part_spec)
            _apply_adapters(state, part, part_spec)
        if self.unsupported is not None:
            if self.generic is None:
                self.generic = discover(self.base, self.spec, self.unsupported)
            routed += apply_plan(state, self.generic)
        route_attention(state, self.base, routed)
        self.report = state.report

    def __setstate__(self, state: dict) -> None:
        # Unpickling a patched model (possibly in a fresh process): its configs name our
        # attention function, so transformers must know it before the first forward.
        register_attention()
        self.__dict__.update(state)


def patch(
    model: nn.Module,
    *,
    attention: bool = True,
    vision: bool = True,
    norm: bool = True,
    rope: bool = True,
    mlp: bool = True,
    strict: bool = True,
) -> PatchReport:
    """Route `model` (a transformers VLM instance, optionally PEFT-wrapped) to `ascend_vlm.ops`.

    attention: text attention -> fused attention; vision: patch the vision tower at all (its
    attention, norms, RoPE, MLPs); norm / rope / mlp: those module kinds in every patched part
    (mlp also covers the routed experts of sparse MoE blocks).
    Idempotent: patching an already patched model with the same options returns its current
    report (written anew whenever the ledger installs the patch again, e.g. under a later
    quantization); different options raise PatchError (call `unpatch` first). Unsupported model_type:
    PatchError listing the supported ones when `strict`, else the generic path
    (`ascend_vlm.patching.generic`): attention that goes through transformers'
    ``AttentionInterface`` is routed to ours, and norms, gated MLPs and rotary functions are
    swapped where a numerical probe at patch time agrees (``PatchReport.probe_verified``); the
    report says what was left alone and why. Returns the PatchReport.
    """
    options = {"attention": attention, "vision": vision, "norm": norm, "rope": rope, "mlp": mlp}
    base = _base_model(model, **options, strict=strict)
    check_transformers_version()
    existing = applied_features(base, PatchFeature.name)
    if existing:
        if existing[0].options != options:
            raise PatchError(
                f"model is already patched with {existing[0].options}; call "
                f"ascend_vlm.unpatch(model) before patching with {options}"
            )
        return existing[0].report
    model_type, spec, unsupported = _resolve_spec(base, strict)
    feature = PatchFeature(base, options, model_type, spec, unsupported)
    apply_feature(base, feature)
    return feature.report


def unpatch(model: nn.Module) -> None:
    """Undo `patch` exactly: rebound methods and attention implementations are restored, so the
    model's outputs are bit-identical to before. A model that is not patched is left as is.
    TypeError unless `model` is an ``nn.Module``."""
    remove_feature(_base_model(model), PatchFeature.name)


def is_patched(model: nn.Module) -> bool:
    """Whether `model` (or the model under its PEFT wrapper) is patched."""
    return bool(applied_features(_base_model(model), PatchFeature.name))
