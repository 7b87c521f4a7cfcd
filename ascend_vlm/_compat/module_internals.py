"""What the module adapters read of transformers' and accelerate's modules: the attributes of
norms and gated MLPs, the SiLU activation's class, and where an accelerate hook keeps the
forward it wraps.

========================== ==========================================================================
probe                      detail
========================== ==========================================================================
silu-activation            ``ACT2FN["silu"]``'s class is one of ``SILU_ACTIVATIONS`` (MLP adapter).
accelerate-hooks           ``add_hook_to_module`` keeps ``_hf_hook`` and calls ``_old_forward`` at
                           each call, so rebinding ``_old_forward`` keeps the hook
                           (`forward_attribute`).
========================== ==========================================================================

Both are needed on every supported version (``SiLUActivation`` in 5.17 and 5.25 alike; the
accelerate hook does not depend on transformers). The norm and MLP attributes are probed per
family (``attributes:<model_type>``, :mod:`ascend_vlm.patching.family_probes`).
"""

from __future__ import annotations

from ascend_vlm._compat.probe import NEEDED_ON_EVERY_SUPPORTED_VERSION, Probe

SILU_ACTIVATIONS = ("SiLU", "SiLUActivation")
# Attributes the module adapters read: an RMSNorm's epsilon (Llama style, then Gemma style), a
# gated MLP's projections (separate gate and up, or one ``gate_up_proj`` giving cat(gate, up):
# GLM, Phi-3) and its activation's attribute (Llama style, then Llama 4 / Phi-3 / GLM style).
NORM_EPS_ATTRIBUTES = ("variance_epsilon", "eps")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
FUSED_MLP_PROJECTIONS = ("gate_up_proj", "down_proj")
MLP_ACTIVATIONS = ("act_fn", "activation_fn")


def mlp_projections(fused: bool) -> tuple[str, ...]:
    """The projection attribute names of a gated MLP, ``fused`` when its gate and up
    projections are one ``gate_up_proj``."""
    return FUSED_MLP_PROJECTIONS if fused else MLP_PROJECTIONS


# The accelerate hook's attribute and the forward it wraps (`accelerate.hooks.add_hook_to_module`).
_HOOK_ATTRIBUTE, _HOOKED_FORWARD = "_hf_hook", "_old_forward"


def forward_attribute(module: object) -> str:
    """The instance attribute holding the forward that `module`'s calls run: ``"forward"``, or
    for a module carrying an accelerate hook (``device_map=...``, offload), the wrapped forward
    the hook's wrapper looks up at every call, so rebinding it keeps the hook around it."""
    if hasattr(module, _HOOK_ATTRIBUTE) and _HOOKED_FORWARD in vars(module):
        return _HOOKED_FORWARD
    return "forward"


def _silu_activation() -> str | None:
    from transformers.activations import ACT2FN

    name = type(ACT2FN["silu"]).__name__
    return None if name in SILU_ACTIVATIONS else f'ACT2FN["silu"] is a {name}'


def _accelerate_hooks() -> str | None:
    try:
        from accelerate.hooks import ModelHook, add_hook_to_module
    except ImportError:
        return None  # nothing can attach accelerate hooks to a model
    import torch

    module = add_hook_to_module(torch.nn.Identity(), ModelHook())
    if forward_attribute(module) != _HOOKED_FORWARD:
        return f"add_hook_to_module sets no {_HOOK_ATTRIBUTE} / instance {_HOOKED_FORWARD}"
    vars(module)[_HOOKED_FORWARD] = lambda x: x + 1
    if module(torch.zeros(1)).item() != 1.0:
        return "the hooked forward does not call _old_forward at call time"
    return None


MODULE_PROBES = (
    Probe("silu-activation", _silu_activation, NEEDED_ON_EVERY_SUPPORTED_VERSION),
    Probe("accelerate-hooks", _accelerate_hooks, NEEDED_ON_EVERY_SUPPORTED_VERSION),
)
