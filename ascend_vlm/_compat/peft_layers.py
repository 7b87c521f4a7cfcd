"""PEFT's tuner layers as the adapter set switches them: setting a layer's active adapter
without PEFT's pass over every resident adapter.

Its probe (:func:`peft_active_adapter_problem`) runs when an adapter set switches, not in
``patch``'s version gate: it checks the installed PEFT, whatever the transformers version.
"""

from __future__ import annotations

import functools


def set_lora_active_adapter(layer: object, name: str) -> None:
    """Make ``name`` the one active adapter of PEFT tuner layer ``layer``, as
    ``BaseTunerLayer.set_adapter`` records it, without that method's pass over every resident
    adapter's ``requires_grad`` (whose cost grows with the adapters resident). The adapters
    must already be frozen. Valid while :func:`peft_active_adapter_problem` is None."""
    layer._active_adapter = [name]


@functools.cache
def peft_active_adapter_problem() -> str | None:
    """Why :func:`set_lora_active_adapter` does not hold with the installed PEFT (probe
    "peft-active-adapter"), None when it does: a two-adapter LoRA linear switched by it must
    report and compute exactly what PEFT's own ``set_adapter`` gives."""
    import copy

    import torch
    from peft import LoraConfig, get_peft_model
    from peft.tuners.tuners_utils import BaseTunerLayer

    torch.manual_seed(0)
    config = LoraConfig(r=2, target_modules=["0"], init_lora_weights=False)
    reference = get_peft_model(torch.nn.Sequential(torch.nn.Linear(4, 4)), config, "first")
    reference.add_adapter("second", config)
    switched = copy.deepcopy(reference)
    reference.set_adapter("second")
    layers = [m for m in switched.modules() if isinstance(m, BaseTunerLayer)]
    for layer in layers:
        set_lora_active_adapter(layer, "second")
    if not layers or layers[0].active_adapters != ["second"]:
        return f"{len(layers)} tuner layers; active_adapters not ['second'] after setting it"
    x = torch.randn(3, 4)
    with torch.no_grad():
        if not torch.equal(reference(x), switched(x)):
            return "a layer switched by _active_adapter computes otherwise than set_adapter"
    return None
