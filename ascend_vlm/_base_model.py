"""The transformers model a caller's model stands for: itself, or the one under a PEFT wrapper."""

from __future__ import annotations

from torch import nn


def base_model(model: object) -> nn.Module:
    """``model.get_base_model()`` for a PEFT-wrapped model, else ``model``. TypeError naming
    ``model`` unless it is a ``torch.nn.Module``."""
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"model: expected a torch.nn.Module (a transformers model, optionally PEFT-wrapped), "
            f"got {type(model).__name__}"
        )
    get_base_model = getattr(model, "get_base_model", None)
    return get_base_model() if callable(get_base_model) else model
