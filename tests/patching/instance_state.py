"""What an edit could change on a model's modules, to compare a model with itself before."""

from __future__ import annotations

import torch
from torch import nn


def instance_state(model: nn.Module) -> dict:
    """Each module's instance attributes (by identity; tensors a stock forward writes, such as
    Qwen2-VL's ``rope_deltas``, by name only), its children (by identity) and its hooks."""
    return {
        name: (
            {
                key: None if isinstance(value, torch.Tensor) else id(value)
                for key, value in vars(module).items()
            },
            {key: id(child) for key, child in module._modules.items()},
            tuple(module._forward_hooks),
            tuple(module._forward_pre_hooks),
        )
        for name, module in model.named_modules()
    }
