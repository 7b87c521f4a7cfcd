"""Seeing the queries and keys an attention module computes, whatever implementation it runs.

transformers' attention modules call the function their config's ``_attn_implementation``
names with the rotated queries and keys. A tapped module reads a private copy of its config
that names :data:`TAPPED_ATTENTION`: a wrapper running the module's own implementation (sdpa,
eager, ours) and then handing ``(module, query, key, attention_mask, scaling)`` to the tap's
callback. Fused kernels never materialise attention weights; callers that need a few rows of
them (token pruning's scorers, attention maps) compute those from what the callback receives
with ``ops.attention_probabilities``. Untapping gives the module back the config it had.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ascend_vlm._compat.attention import (
    attention_function,
    register_attention_function,
    set_attention_implementation,
)

TAPPED_ATTENTION = "ascend_vlm_tapped"
# The tapped config copy carries the implementation it wraps, the config it replaced and the
# callback.
_INNER_ATTENTION = "_ascend_vlm_inner_attention"
_INNER_CONFIG = "_ascend_vlm_inner_config"
_CALLBACK = "_ascend_vlm_tap_callback"

TapCallback = Callable[[nn.Module, torch.Tensor, torch.Tensor, Any, Any], None]


def tapped_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention-interface function of tapped modules: the module's own implementation (named
    on its config copy), then the tap's callback with the query, key, mask and scaling."""
    settings = module.config.__dict__
    inner = attention_function(module, settings[_INNER_ATTENTION])
    result = inner(module, query, key, value, attention_mask, **kwargs)
    settings[_CALLBACK](module, query, key, attention_mask, kwargs.get("scaling"))
    return result


def tap_attention(attention: nn.Module, callback: TapCallback) -> None:
    """Make ``attention`` (a transformers attention module) call ``callback(module, query,
    key, attention_mask, scaling)`` after each attention call: query/key BNSD after the rotary
    embedding, the mask as the implementation received it (None, bool or additive float),
    scaling the module's (None: ``head_dim ** -0.5``). Tapping a tapped module replaces its
    callback."""
    register_attention_function(TAPPED_ATTENTION, tapped_attention)
    config = attention.config.__dict__.get(_INNER_CONFIG, attention.config)
    tapped = copy.copy(config)
    set_attention_implementation(tapped, TAPPED_ATTENTION)
    tapped.__dict__[_INNER_ATTENTION] = config._attn_implementation
    tapped.__dict__[_INNER_CONFIG] = config
    tapped.__dict__[_CALLBACK] = callback
    attention.__dict__["config"] = tapped


def untap_attention(attention: nn.Module) -> None:
    """Give ``attention`` back the config a tap replaced (no-op when not tapped)."""
    inner = attention.config.__dict__.get(_INNER_CONFIG)
    if inner is not None:
        attention.__dict__["config"] = inner
