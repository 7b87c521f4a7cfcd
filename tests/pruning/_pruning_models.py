"""The tiny models and greedy generation the pruning tests share."""

import torch

from ascend_vlm.models import tiny

LAYERS = 4


def tiny_model(name: str = "qwen2_vl", attn: str = "sdpa", layers: int = LAYERS):
    """A tiny model of family ``name`` with ``layers`` decoder layers (fp32, eval)."""
    return tiny.build_model(name, attn_implementation=attn, layers=layers)


def greedy(model, inputs: dict, steps: int = 4, **kwargs) -> torch.Tensor:
    """``steps`` greedy tokens (sequences, prompt included) without gradients."""
    with torch.no_grad():
        return model.generate(**inputs, max_new_tokens=steps, do_sample=False, **kwargs)
