"""Fine-tuning frameworks meet ascend_vlm here: transformers' ``Trainer`` and the trainers built
on it (TRL's ``SFTTrainer``, LLaMA-Factory) take :class:`AscendVLMCallback`, which patches the
model when training begins and puts the sparse all-reduce hook on the DDP-wrapped model.

Exports load on first access, so ``import ascend_vlm.integrations`` does not import
transformers' trainer stack.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ["AscendVLMCallback"]

_LAZY_ATTRIBUTES = {
    "AscendVLMCallback": "ascend_vlm.integrations.callback",
}

if TYPE_CHECKING:
    from ascend_vlm.integrations.callback import AscendVLMCallback


def __getattr__(name: str) -> Any:
    if name in _LAZY_ATTRIBUTES:
        return getattr(importlib.import_module(_LAZY_ATTRIBUTES[name]), name)
    raise AttributeError(f"module 'ascend_vlm.integrations' has no attribute {name!r}")
