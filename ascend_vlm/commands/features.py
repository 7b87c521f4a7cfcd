"""The feature options of ``python -m ascend_vlm eval``, registered in one place.

Each feature adds one ``REGISTRY.register`` call below
(:meth:`~ascend_vlm.commands.options.OptionRegistry.register`); its ``add_arguments`` /
``apply`` functions may live here or in the feature's own module.
"""

from __future__ import annotations

import argparse
from typing import Any

from ascend_vlm.commands.adapter_option import add_adapter_arguments, apply_adapters
from ascend_vlm.commands.options import REGISTRY
from ascend_vlm.commands.pruning_option import (
    add_pruning_arguments,
    apply_pruning,
    finish_pruning,
)
from ascend_vlm.commands.quantization_option import (
    add_quantization_arguments,
    apply_quantization,
)
from ascend_vlm.commands.vision_cache_option import (
    add_vision_cache_arguments,
    apply_vision_cache,
    finish_vision_cache,
)


def _add_patch_arguments(group: Any) -> None:
    group.add_argument(
        "--patch",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="swap in the fused ops with ascend_vlm.patch(model) (default); --no-patch "
        "evaluates the stock model",
    )


def _apply_patch(model: Any, args: argparse.Namespace) -> dict[str, Any]:
    if not args.patch:
        return {"summary": "not patched", "patched": False}
    from ascend_vlm.patching import patch

    report = patch(model).as_dict()
    swapped = sum(total["swapped"] for total in report["totals"].values())
    left_alone = sum(total["left_alone"] for total in report["totals"].values())
    summary = f"patched: {swapped} modules swapped, {left_alone} left alone"
    return {"summary": summary, "patched": True, "report": report}


# First: AWQ calibrates on, and RTN rounds, the weights as loaded; patching then routes the
# quantized linear layers' neighbours through the fused ops.
REGISTRY.register("quantize", add_quantization_arguments, apply_quantization, needs_processor=True)

REGISTRY.register(
    "patch",
    _add_patch_arguments,
    _apply_patch,
    presets={"patched": ["--patch"], "unpatched": ["--no-patch"]},
)

# After "patch": LoRA wraps the patched model's linear layers, as in the fine-tune script.
REGISTRY.register("adapter", add_adapter_arguments, apply_adapters, needs_processor=True)

# After "patch": options apply in registration order, so a pruned run is patched first.
REGISTRY.register("prune", add_pruning_arguments, apply_pruning, finish=finish_pruning)

# The vision tower runs before the language model: cached features are unpruned features.
REGISTRY.register(
    "vision-cache", add_vision_cache_arguments, apply_vision_cache, finish=finish_vision_cache
)
