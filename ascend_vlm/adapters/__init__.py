"""One base VLM, many LoRA adapters, and new visual words.

* :class:`AdapterSet` (:mod:`~ascend_vlm.adapters.adapter_set`): adapters loaded from
  safetensors folders, switched per request, mixed per batch row, hot-swapped, unloaded.
* :mod:`~ascend_vlm.adapters.visual_vocabulary`: new tokens ("<defect-17>") added to the
  tokenizer, embeddings and output head, initialised from vectors or example images, trained as
  PEFT trainable tokens and saved beside the adapter.
"""

from ascend_vlm.adapters.adapter_set import BASE_ADAPTER, AdapterSet
from ascend_vlm.adapters.visual_vocabulary import (
    VisualTokens,
    add_visual_tokens,
    load_visual_tokens,
    save_visual_tokens,
    trainable_token_indices,
)

__all__ = [
    "BASE_ADAPTER",
    "AdapterSet",
    "VisualTokens",
    "add_visual_tokens",
    "load_visual_tokens",
    "save_visual_tokens",
    "trainable_token_indices",
]
