"""`apply_to_instance`: ``ascend_vlm.patch`` behind the per-kind flags frameworks pass to
Liger-Kernel's ``_apply_liger_kernel_to_instance``."""

from __future__ import annotations

from torch import nn

from ascend_vlm.patching import PatchReport, patch

# Flags `patch` has no option of their own for: each follows the option named beside it.
_FOLLOWS = {"moe": "mlp", "linear_attention": "attention"}


def apply_to_instance(
    model: nn.Module,
    *,
    attention: bool = True,
    norm: bool = True,
    rope: bool = True,
    mlp: bool = True,
    moe: bool = True,
    linear_attention: bool = True,
    vision: bool = True,
    strict: bool = True,
) -> PatchReport:
    """Patch `model` (a transformers VLM instance, optionally PEFT-wrapped) in place with the
    module kinds the flags ask for, and return ``patch``'s report; ``ascend_vlm.unpatch(model)``
    reverts it.

    attention: text attention -> fused attention; norm, rope, mlp: those modules in every
    patched part; vision: the vision tower at all; strict: as ``patch`` (False takes the
    generic path for a model no family describes). ``patch`` routes the experts of MoE blocks
    with the MLPs and Gated DeltaNet (linear attention) layers with attention: ``moe`` must
    equal ``mlp`` and ``linear_attention`` must equal ``attention`` (ValueError naming the
    flag otherwise). TypeError for a flag that is not a bool; PatchError as ``patch`` raises
    (another set of options already applied, an unsupported model with ``strict``).
    """
    flags = {"moe": moe, "linear_attention": linear_attention}
    options = {"attention": attention, "norm": norm, "rope": rope, "mlp": mlp}
    for flag, option in _FOLLOWS.items():
        if not isinstance(flags[flag], bool):
            raise TypeError(f"{flag}: expected True or False, got {flags[flag]!r}")
        if flags[flag] != options[option]:
            raise ValueError(
                f"{flag}: ascend_vlm.patch switches it with {option}, expected {flag}={option}="
                f"{options[option]}, got {flag}={flags[flag]!r}"
            )
    return patch(model, **options, vision=vision, strict=strict)
