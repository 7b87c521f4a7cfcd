"""Seeing the queries and keys an attention module computes, whatever implementation it runs.

transformers' attention modules call the function their config's ``_attn_implementation``
names with the rotated queries and keys. A tapped module reads a private copy of its config
that names :data:`TAPPED_ATTENTION`: a wrapper running the module's own implementation (sdpa,
eager, ours) and then handing ``(module, query, key, attention_mask, scaling)`` to the tap's
callback. Fused kernels never materialise attention weights; callers that need a few rows of
them (token pruning's scorers, attention maps) compute those from what the callback receives
with ``ops.attention_probabilities``.

Two ways in. :class:`AttentionTap` is a ledger feature (``"attention_tap"``): applied with
``apply_feature(model, AttentionTap(modules, callback))`` it stays until removed, stacked above
`patch`, so a tap on a patched model keeps tapping the stock attention after ``unpatch``.
`tap_for_call` / `untap_after_call` tap one module for the span of a single forward call: a
feature's hooks (token pruning's scorers) tap before the call and untap before it returns, so
the change never outlives the call and the ledger, which records what stays between calls,
never sees it.
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
from ascend_vlm.patching.ledger import Edits

TAPPED_ATTENTION = "ascend_vlm_tapped"
# The tapped config copy carries the implementation it runs, the config it replaced and the
# callbacks, innermost tap first.
_INNER_ATTENTION = "_ascend_vlm_inner_attention"
_INNER_CONFIG = "_ascend_vlm_inner_config"
_CALLBACKS = "_ascend_vlm_tap_callbacks"
# Marks a copy made by `tap_for_call`, which `untap_after_call` may replace; a persistent
# `AttentionTap` copy belongs to the ledger.
_FOR_CALL = "_ascend_vlm_tap_for_call"

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
    for callback in settings[_CALLBACKS]:
        callback(module, query, key, attention_mask, kwargs.get("scaling"))
    return result


def tapped_implementation(config: Any) -> str:
    """The attention implementation ``config`` runs, looking through any taps."""
    return config.__dict__.get(_INNER_ATTENTION, config._attn_implementation)


def _tapped_config(config: Any, callback: TapCallback, *, for_call: bool) -> Any:
    """A shallow copy of ``config`` naming :data:`TAPPED_ATTENTION` that runs the
    implementation ``config`` runs, then ``config``'s callbacks (when it is tapped already),
    then ``callback``; it keeps ``config`` and whether `tap_for_call` made it."""
    register_attention_function(TAPPED_ATTENTION, tapped_attention)
    tapped = copy.copy(config)
    set_attention_implementation(tapped, TAPPED_ATTENTION)
    tapped.__dict__[_INNER_ATTENTION] = tapped_implementation(config)
    tapped.__dict__[_INNER_CONFIG] = config
    tapped.__dict__[_CALLBACKS] = (*config.__dict__.get(_CALLBACKS, ()), callback)
    tapped.__dict__[_FOR_CALL] = for_call
    return tapped


class AttentionTap:
    """Ledger feature: each of ``modules`` (transformers attention modules) calls
    ``callback(module, query, key, attention_mask, scaling)`` after each attention call: query
    and key BNSD after the rotary embedding, the mask as the implementation received it (None,
    bool or additive float), scaling the module's (None: ``head_dim ** -0.5``)."""

    name = "attention_tap"

    def __init__(self, modules: list[nn.Module], callback: TapCallback) -> None:
        self.modules = list(modules)
        self.callback = callback

    def install(self, edits: Edits) -> None:
        for module in self.modules:
            edits.set_attribute(
                module, "config", _tapped_config(module.config, self.callback, for_call=False)
            )


def tap_for_call(attention: nn.Module, callback: TapCallback) -> None:
    """Tap ``attention`` as :class:`AttentionTap` does, for the forward call in progress only;
    `untap_after_call` must run before that call returns. Tapping a module tapped this way
    replaces its callback; a module tapped by an :class:`AttentionTap` is tapped over."""
    config = attention.config
    if _tapped_for_call(attention):
        config = config.__dict__[_INNER_CONFIG]
    attention.__dict__["config"] = _tapped_config(config, callback, for_call=True)


def untap_after_call(attention: nn.Module) -> None:
    """Give ``attention`` back the config `tap_for_call` replaced (no-op when not tapped for
    the call)."""
    if _tapped_for_call(attention):
        attention.__dict__["config"] = attention.config.__dict__[_INNER_CONFIG]


def _tapped_for_call(attention: nn.Module) -> bool:
    return attention.config.__dict__.get(_FOR_CALL, False)
