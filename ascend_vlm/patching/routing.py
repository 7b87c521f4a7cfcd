"""Attention routing: which configs name our attention, on private copies the model's modules read."""

from __future__ import annotations

import copy

from torch import nn

from ascend_vlm._compat.attention import ATTENTION_NAME, set_attention_implementation
from ascend_vlm.models.family_spec import PartSpec
from ascend_vlm.patching.part import Part
from ascend_vlm.patching.state import PatchState


def _attention_configs(modules: list[nn.Module], classes: tuple[str, ...]) -> tuple[list, int]:
    """Distinct configs of the attention modules (and of the PreTrainedModels holding them)."""
    from transformers import PreTrainedConfig, PreTrainedModel

    configs: dict[int, object] = {}
    count = 0
    for module in modules:
        is_attention = type(module).__name__ in classes
        count += is_attention
        config = getattr(module, "config", None)
        if (is_attention or isinstance(module, PreTrainedModel)) and isinstance(
            config, PreTrainedConfig
        ):
            configs.setdefault(id(config), config)
    return list(configs.values()), count


def attention_configs_to_route(state: PatchState, part: Part, spec: PartSpec) -> list:
    """Report the attention of one part; returns the configs to route to our attention."""
    kind = f"attention-{part.name}"
    report = state.report
    configs, count = _attention_configs(part.modules, spec.attention)
    label = "/".join(spec.attention)
    if count == 0:
        return []
    if not state.options["attention" if part.name == "text" else "vision"]:
        why = (
            "disabled by patch(attention=False)"
            if part.name == "text"
            else "disabled by patch(vision=False)"
        )
        report.left_alone[(kind, label, why)] = count
        return []
    softcapped = [c for c in configs if getattr(c, "attn_logit_softcapping", None) is not None]
    if softcapped:
        why = "attention logit soft-capping is not supported by ops.fused_attention"
        report.left_alone[(kind, label, why)] = count
        return []
    report.swapped[(kind, label, "ops.fused_attention / ops.varlen_attention")] = count
    return configs


def route_attention(state: PatchState, base: nn.Module, routed: list) -> None:
    """Point the modules inside `base` at private copies of their configs, the copies of the
    `routed` configs naming our attention.

    transformers reads the attention implementation from the config object each module holds,
    and that object is shared: with the caller, with every other model built from it, and
    between a composite config and the sub-configs it holds by reference. Writing our name into
    it would route those other models through our function (and a model built from it later
    would fail to initialise: transformers takes a "flash" name for a hub kernel). So each
    distinct config reachable from `base`'s submodules is copied once (a shallow copy: its own
    attribute table, shared values), a composite copy holds the copies of its sub-configs, and
    the submodules' ``config`` attributes are rebound to the copies. ``base.config`` and the
    configs of the sub-models inside it (``PreTrainedModel`` submodules: language model, vision
    tower) stay the caller's objects, so ``model.config``, ``save_pretrained`` and models built
    from it are stock, and a sub-model's config is still the very sub-config of
    ``model.config`` it was built from (transformers relies on that identity). Those sub-models
    build their masks under the caller's implementation name; `ascend_attention_forward` takes
    every mask those make (boolean, additive float or None).
    """
    if not routed:
        return
    from transformers import PreTrainedConfig, PreTrainedModel

    routed_ids = {id(config) for config in routed}
    copies: dict[int, PreTrainedConfig] = {}

    def owned(config: PreTrainedConfig) -> PreTrainedConfig:
        private = copies.get(id(config))
        if private is None:
            private = copies[id(config)] = copy.copy(config)
            if id(config) in routed_ids:
                set_attention_implementation(private, ATTENTION_NAME)
            for name in type(config).sub_configs:
                sub_config = config.__dict__.get(name)
                if isinstance(sub_config, PreTrainedConfig):
                    private.__dict__[name] = owned(sub_config)
        return private

    for module in base.modules():
        config = module.__dict__.get("config")
        if isinstance(config, PreTrainedConfig) and not isinstance(module, PreTrainedModel):
            state.rebind(module, "config", owned(config))
