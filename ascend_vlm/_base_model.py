"""The transformers model a caller's model stands for: itself, or the one under a PEFT or
``torch.compile`` wrapper."""

from __future__ import annotations

from torch import nn

from ascend_vlm._compat.torch_internals import compiled_module


def base_model(model: object) -> nn.Module:
    """``model.get_base_model()`` for a PEFT-wrapped model, else ``model``, each looked through
    a ``torch.compile`` wrapper (which calls the module it wraps, so features go on that one and
    every feature of a model finds the same ledger). TypeError naming ``model`` unless it is a
    ``torch.nn.Module``."""
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"model: expected a torch.nn.Module (a transformers model, optionally PEFT-wrapped), "
            f"got {type(model).__name__}"
        )
    model = compiled_module(model)
    get_base_model = getattr(model, "get_base_model", None)
    return compiled_module(get_base_model()) if callable(get_base_model) else model
