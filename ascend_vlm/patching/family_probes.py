"""Probes of the transformers internals each family spec of :mod:`ascend_vlm.models` names: the
classes ``patch`` swaps exist, store what the adapters read, route attention through the
interface, call their RoPE function, and the vision towers and sub-configs sit where the specs
and the config routing expect them.

========================== ==========================================================================
probe                      detail
========================== ==========================================================================
config-sub-configs         a config class lists its sub-configs in ``sub_configs`` and an instance
                           holds them in its ``__dict__`` under those names (config routing).
classes:<model_type>       the module classes the family specs name exist in that modeling module
                           (or in the family's, for a projector's classes).
attributes:<model_type>    the norm classes store ``weight`` and one of ``NORM_EPS_ATTRIBUTES``, the
                           MLP classes their projections (``mlp_projections``) and one of
                           ``MLP_ACTIVATIONS``, the sparse MoE blocks their experts module (the
                           adapters read them; a module without them is left alone).
attention-routing:<mt>     each attention class's forward looks its function up in
                           ``ALL_ATTENTION_FUNCTIONS`` by ``config._attn_implementation``.
rope:<model_type>          the RoPE function exists with the parameters of its style
                           (``ROPE_PARAMETERS``) and each listed class's forward calls it, under
                           decorators `rewrap` can rebuild.
linear-attention:<mt>      each Gated DeltaNet class's forward calls the gated delta rule and
                           convolution functions the adapter replaces, with their parameters
                           (`ascend_vlm._compat.gated_delta.linear_attention_problem`).
varlen-vision:<mt>         a vision attention whose forward asks ``is_flash_attention_requested``
                           gets True for ``ATTENTION_NAME`` (the "flash" substring rule) and passes
                           its packed segments as ``VARLEN_KWARGS``.
vision-tower:<model_type>  the model classes store the tower under a path of the family spec
                           (the multimodal model's attribute, or the generation model's own).
========================== ==========================================================================

Every one is needed on every supported version: the specs describe 5.17 and 5.25 alike.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import types
from dataclasses import dataclass

from ascend_vlm._compat.attention import ATTENTION_NAME, VARLEN_KWARGS, keyword_names
from ascend_vlm._compat.decorators import rope_problem
from ascend_vlm._compat.gated_delta import linear_attention_problem
from ascend_vlm._compat.module_internals import (
    MLP_ACTIVATIONS,
    NORM_EPS_ATTRIBUTES,
    mlp_projections,
)
from ascend_vlm._compat.probe import NEEDED_ON_EVERY_SUPPORTED_VERSION, Probe
from ascend_vlm.models import REGISTRY, TEXT_BACKBONES, VISION_BACKBONES, spec_for


def _config_sub_configs() -> str | None:
    from transformers import CONFIG_MAPPING, PreTrainedConfig

    for model_type in REGISTRY:
        # The class is read before an instance is made: some versions' __init__ indexes
        # sub_configs itself and would fail there, not here.
        config_class = CONFIG_MAPPING[model_type]
        names = getattr(config_class, "sub_configs", None)
        if not isinstance(names, dict) or not any("vision" in name for name in names):
            return f"{config_class.__name__}.sub_configs names no vision sub-config: {names!r}"
        config = config_class()
        held = [n for n in names if isinstance(config.__dict__.get(n), PreTrainedConfig)]
        if not held:
            return f"{config_class.__name__} holds none of {list(names)} in its __dict__"
    return None


@dataclass(frozen=True)
class _Part:
    """A part spec ("text" or "vision" `side`) of a model family or backbone, with the
    model_type of its (sub-)config, the module defining that config class and, for a family's
    part, the module defining the family's config (a projector's classes live there: Mistral
    3's RMSNorm)."""

    model_type: str
    side: str
    spec: object  # ascend_vlm.models.family_spec.PartSpec
    config_module: str
    family_config_module: str | None = None

    @property
    def modeling(self) -> types.ModuleType:
        """The modeling module beside the config module, which defines the spec's classes."""
        return _modeling(self.config_module)

    def defined(self, name: str) -> object | None:
        """What `name` is in the sub-config's modeling module, else in the family's, or None."""
        modules = [self.config_module, self.family_config_module]
        found = (getattr(_modeling(m), name, None) for m in modules if m is not None)
        return next((value for value in found if value is not None), None)


def _modeling(config_module: str) -> types.ModuleType:
    """The modeling module beside a configuration module."""
    return importlib.import_module(config_module.replace(".configuration_", ".modeling_"))


def _parts() -> list[_Part]:
    """Every part spec `patch` can apply: each family's (from its default config) and each
    known backbone's, one entry per (model_type, spec)."""
    from transformers import CONFIG_MAPPING, AutoConfig

    parts: dict[str, _Part] = {}
    for model_type in REGISTRY:
        config = AutoConfig.for_model(model_type)
        spec = spec_for(config)
        for side in ("text", "vision"):
            name = f"{side}_config"
            # A default config may leave an optional tower out (Gemma 4's vision_config is None).
            sub_config = getattr(config, name) or type(config).sub_configs[name]()
            parts.setdefault(
                sub_config.model_type,
                _Part(
                    sub_config.model_type,
                    side,
                    getattr(spec, side),
                    type(sub_config).__module__,
                    type(config).__module__,
                ),
            )
    for side, table in (("text", TEXT_BACKBONES), ("vision", VISION_BACKBONES)):
        for model_type, spec in table.items():
            parts.setdefault(
                model_type, _Part(model_type, side, spec, CONFIG_MAPPING[model_type].__module__)
            )
    return list(parts.values())


def _swapped_classes(spec) -> list[str]:
    names = [*spec.attention]
    for entries in (spec.norms, spec.mlps, spec.ropes, spec.moes, spec.linear_attention):
        names += [name for entry in entries for name in entry.classes]
    return list(dict.fromkeys(names))


def _classes_probe(part: _Part) -> str | None:
    absent = [name for name in _swapped_classes(part.spec) if part.defined(name) is None]
    return f"{part.modeling.__name__} has no {', '.join(absent)}" if absent else None


def _attributes_probe(part: _Part) -> str | None:
    """Attribute names a class stores, read from its ``__init__``'s code (no model is built)."""
    expected = [
        (name, ("weight",), NORM_EPS_ATTRIBUTES) for n in part.spec.norms for name in n.classes
    ]
    expected += [
        (name, mlp_projections(mlp.fused), MLP_ACTIVATIONS)
        for mlp in part.spec.mlps
        for name in mlp.classes
    ]
    expected += [(name, (moe.experts,), ()) for moe in part.spec.moes for name in moe.classes]
    for name, required, one_of in expected:
        stored = set(part.defined(name).__init__.__code__.co_names)
        absent = [attribute for attribute in required if attribute not in stored]
        if one_of and not stored & set(one_of):
            absent.append(" or ".join(one_of))
        if absent:
            return f"{name}.__init__ stores no {', '.join(absent)}"
    return None


def _attention_routing_probe(part: _Part) -> str | None:
    for name in part.spec.attention:
        forward = inspect.unwrap(part.defined(name).forward)
        if "ALL_ATTENTION_FUNCTIONS" not in forward.__code__.co_names:
            return f"{name}.forward does not look its function up in ALL_ATTENTION_FUNCTIONS"
    return None


def _rope_probe(part: _Part) -> str | None:
    for rope in part.spec.ropes:
        if not callable(part.defined(rope.function)):
            return f"{part.modeling.__name__} has no {rope.function}"
        for name in rope.classes:
            problem = rope_problem(part.defined(name), rope.function, rope.style)
            if problem:
                return problem
    return None


def _linear_attention_probe(part: _Part) -> str | None:
    module = part.modeling
    for entry in part.spec.linear_attention:
        for name in entry.classes:
            problem = linear_attention_problem(getattr(module, name))
            if problem:
                return problem
    return None


def _varlen_vision_probe(part: _Part) -> str | None:
    for name in part.spec.attention:
        forward = inspect.unwrap(part.defined(name).forward)
        if "is_flash_attention_requested" not in forward.__code__.co_names:
            continue  # a tower without a packed path: one call per image or a padded batch
        requested = forward.__globals__["is_flash_attention_requested"]
        stand_in = types.SimpleNamespace(_attn_implementation=ATTENTION_NAME)
        if not requested(stand_in):
            return f"is_flash_attention_requested is False for {ATTENTION_NAME!r}"
        absent = set(VARLEN_KWARGS) - keyword_names(forward.__code__)
        if absent:
            return f"{name}.forward does not pass {', '.join(sorted(absent))}"
    return None


def _vision_tower_probe(model_type: str) -> str | None:
    from transformers import AutoConfig
    from transformers.models.auto import modeling_auto

    config = AutoConfig.for_model(model_type)
    paths = [p.split(".") for p in spec_for(config).vision_towers]
    module = _modeling(type(config).__module__)
    base = getattr(module, modeling_auto.MODEL_MAPPING_NAMES[model_type])
    head = getattr(module, modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES[model_type])
    stored = {cls: set(cls.__init__.__code__.co_names) for cls in (base, head)}
    for path in paths:
        if len(path) == 2 and path[0] in stored[head] and path[1] in stored[base]:
            return None
        # A generation model that holds the tower itself (Llama 4 has no multimodal model).
        if len(path) == 1 and path[0] in stored[head]:
            return None
    return (
        f"neither {head.__name__} nor {base.__name__} stores the vision tower under "
        f"{' or '.join('.'.join(p) for p in paths)}"
    )


def family_probes() -> tuple[Probe, ...]:
    """The sub-config probe, then the probes per part and per family (the family probes import
    the modeling modules they examine when they run)."""
    every = NEEDED_ON_EVERY_SUPPORTED_VERSION
    found = [Probe("config-sub-configs", _config_sub_configs, every)]
    for part in _parts():
        checks = {
            "classes": _classes_probe,
            "attributes": _attributes_probe,
            "attention-routing": _attention_routing_probe,
        }
        if part.spec.ropes:
            checks["rope"] = _rope_probe
        if part.spec.linear_attention:
            checks["linear-attention"] = _linear_attention_probe
        if part.side == "vision":
            checks["varlen-vision"] = _varlen_vision_probe
        for kind, check in checks.items():
            found.append(Probe(f"{kind}:{part.model_type}", functools.partial(check, part), every))
    for model_type in REGISTRY:
        check = functools.partial(_vision_tower_probe, model_type)
        found.append(Probe(f"vision-tower:{model_type}", check, every))
    return tuple(found)
