"""ascend_vlm where users fine-tune: transformers' Trainer, TRL, accelerate and frameworks that
call a function.

* :class:`AscendVLMCallback` (:mod:`.callback`): a ``TrainerCallback`` for Trainer and the
  trainers built on it (TRL's ``SFTTrainer``, LLaMA-Factory) that patches the model when
  training begins and puts the sparse all-reduce hook on the DDP-wrapped model.
* :func:`apply_to_instance` (:mod:`.apply`): a Liger-style switchboard over :func:`ascend_vlm.patch`.
* :mod:`.fsdp`: FSDP2 (``fully_shard``) per layer, with LoRA: :func:`fsdp_distributed_config`
  (sharded while loading, Trainer on NPU or CPU ranks), :func:`fsdp_training_arguments`
  (accelerate's FSDP2 under Trainer on accelerators), :func:`shard_model` (loops of one's own).

The attention implementation ``"ascend_flash"`` needs nothing from here: ``import ascend_vlm``
registers it. Names load on first access, so importing this package does not import
transformers' trainer stack.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = [
    "AscendVLMCallback",
    "apply_to_instance",
    "fsdp_distributed_config",
    "fsdp_training_arguments",
    "shard_model",
]

_LAZY_ATTRIBUTES = {
    "AscendVLMCallback": "ascend_vlm.integrations.callback",
    "apply_to_instance": "ascend_vlm.integrations.apply",
    "fsdp_distributed_config": "ascend_vlm.integrations.fsdp",
    "fsdp_training_arguments": "ascend_vlm.integrations.fsdp",
    "shard_model": "ascend_vlm.integrations.fsdp",
}

if TYPE_CHECKING:
    from ascend_vlm.integrations.apply import apply_to_instance
    from ascend_vlm.integrations.callback import AscendVLMCallback
    from ascend_vlm.integrations.fsdp import (
        fsdp_distributed_config,
        fsdp_training_arguments,
        shard_model,
    )


def __getattr__(name: str) -> Any:
    if name in _LAZY_ATTRIBUTES:
        return getattr(importlib.import_module(_LAZY_ATTRIBUTES[name]), name)
    raise AttributeError(f"module 'ascend_vlm.integrations' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
