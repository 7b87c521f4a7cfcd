"""Visual-token pruning and prompt KV-cache compression at prefill, with real savings.

``enable_token_pruning(model, PruneConfig(method="fastv", layer=2, keep=0.5))`` makes every
later prefill of ``model`` drop visual tokens before decoder layer ``layer``: those layers
compute, and cache, only the kept positions. ``kv=SnapKVConfig(compression_ratio=0.5)``
additionally (or alone) cuts every layer's prompt cache down after prefill. Both compose with
:func:`ascend_vlm.patch` in either order, work with ``generate`` (dynamic and static caches;
SnapKV: dynamic), left-padded batches and any number of images or video frames per row, and
keep every kept token's original position (Qwen-VL M-RoPE included). With ``keep=1.0`` the
model's outputs are those of the unpruned model.

Forward calls on a pruned prompt return hidden states and logits for the kept positions only
(the last position is always kept, so generation reads the right logits); a forward with
``labels`` is refused. Prompts without visual tokens pass through unpruned (and uncompressed).
"""

from __future__ import annotations

from torch import nn

from ascend_vlm._base_model import base_model
from ascend_vlm.models import model_types_supporting, require_feature
from ascend_vlm.models.decoder_parts import decoder_parts
from ascend_vlm.patching.ledger import applied_features, apply_feature, remove_feature
from ascend_vlm.patching.version_gate import check_transformers_version
from ascend_vlm.pruning.config import PruneConfig, SnapKVConfig
from ascend_vlm.pruning.pruner import TokenPruner
from ascend_vlm.pruning.stats import PruningStats

# Derived from the family descriptors in `ascend_vlm.models`, which say why each other family
# is refused: decoder-only language models behind a vision tower whose prompt attends causally.
SUPPORTED_MODEL_TYPES = model_types_supporting("token_pruning")

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "PruneConfig",
    "PruningStats",
    "SnapKVConfig",
    "disable_token_pruning",
    "enable_token_pruning",
    "pruning_enabled",
    "pruning_stats",
]


def _pruner(model: nn.Module) -> TokenPruner | None:
    pruners = applied_features(model, TokenPruner.name)
    return pruners[0] if pruners else None


def enable_token_pruning(
    model: nn.Module,
    prune: PruneConfig | None = None,
    *,
    kv: SnapKVConfig | None = None,
) -> None:
    """Prune the visual tokens (``prune``) and/or compress the prompt cache (``kv``) of every
    later prefill of ``model`` (a transformers VLM, optionally PEFT-wrapped).

    Raises TypeError for arguments of the wrong type; ValueError when neither config is given,
    the model family is not supported (the message lists :data:`SUPPORTED_MODEL_TYPES`),
    ``prune.layer`` is not below the language model's depth (or, for Qwen3-VL, not past its
    deepstack layers), or pruning is already enabled with other configs (call
    :func:`disable_token_pruning` first); ``ascend_vlm.PatchError`` when the installed
    transformers is outside the supported range (the gate `patch` uses). Enabling again with the
    same configs does nothing.
    """
    base = base_model(model)
    if prune is not None and not isinstance(prune, PruneConfig):
        raise TypeError(f"prune: expected a PruneConfig or None, got {type(prune).__name__}")
    if kv is not None and not isinstance(kv, SnapKVConfig):
        raise TypeError(f"kv: expected a SnapKVConfig or None, got {type(kv).__name__}")
    if prune is None and kv is None:
        raise ValueError("prune, kv: expected a PruneConfig, a SnapKVConfig or both, got neither")
    existing = _pruner(base)
    if existing is not None:
        if (existing.prune, existing.kv) == (prune, kv):
            return
        raise ValueError(
            f"model: token pruning is already enabled with prune={existing.prune}, "
            f"kv={existing.kv}; call disable_token_pruning(model) first"
        )
    check_transformers_version()
    target = decoder_parts(base, "token_pruning" if prune is not None else "kv_compression")
    if prune is not None and kv is not None:
        require_feature(base, "kv_compression")
    depth = len(target.layers)
    if prune is not None:
        if prune.layer >= depth:
            raise ValueError(
                f"layer: expected 1 <= layer < {depth} (the language model's decoder layers), "
                f"got {prune.layer}"
            )
        if prune.layer < target.deepstack_layers:
            raise ValueError(
                f"layer: {target.model_type} adds vision features to the outputs of its first "
                f"{target.deepstack_layers} decoder layers (deepstack), so pruning starts at layer "
                f">= {target.deepstack_layers}, got {prune.layer}"
            )
    if kv is not None and depth < 2:
        raise ValueError(f"kv: SnapKV leaves layer 0 whole and needs >= 2 layers, got {depth}")
    apply_feature(base, TokenPruner(base, target, prune, kv))


def disable_token_pruning(model: nn.Module) -> None:
    """Remove token pruning from ``model`` (a no-op when it is not enabled). A cache filled while
    pruning was on holds the pruned layout: continue it only with pruning enabled as it was."""
    remove_feature(base_model(model), TokenPruner.name)


def pruning_enabled(model: nn.Module) -> bool:
    """Whether token pruning is enabled on ``model``."""
    return _pruner(base_model(model)) is not None


def pruning_stats(model: nn.Module) -> PruningStats | None:
    """The :class:`PruningStats` of ``model``'s last pruned prefill (None before the first one,
    or when pruning is not enabled)."""
    pruner = _pruner(base_model(model))
    return None if pruner is None else pruner.last_stats
