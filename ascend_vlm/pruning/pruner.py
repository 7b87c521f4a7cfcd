"""The hooks that prune visual tokens and compress prompt caches, and their per-model state.

One forward of the multimodal model is a :class:`_Forward`. At a prefill (a prompt with visual
tokens into an empty cache) the layers from ``PruneConfig.layer`` on are handed the kept
positions only (hidden states, rotary tables, position ids and a re-indexed mask), so they
compute and cache nothing else; with SnapKV each layer's prompt cache is cut down right after
the layer ran. What each cache layer then holds is recorded against the cache object
(:class:`LayerView`), and every later forward on that cache (decode steps, a text follow-up)
hands those layers the mask re-indexed to their slots. Positions are never recomputed: kept
tokens carry their original rotary angles, and generated tokens continue from the full prompt
length, exactly as without pruning.

Scores that need attention (FastV, SnapKV) come from the attention call itself: for the prefill
only, the scored layer's attention module reads a private config copy naming
``SCORED_ATTENTION``, a wrapper that runs the module's own implementation (sdpa, eager, ours)
and computes the few probability rows it needs with ``ops.attention_probabilities``.
"""

from __future__ import annotations

import contextvars
import copy
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ascend_vlm import ops
from ascend_vlm._compat import (
    attention_function,
    cache_argument,
    cache_layer_kind,
    register_attention_function,
    replace_cached_states,
    set_attention_implementation,
)
from ascend_vlm.pruning.config import PruneConfig, SnapKVConfig, kept_count
from ascend_vlm.pruning.families import PruningTarget
from ascend_vlm.pruning.layer_view import (
    LayerView,
    causal_mask,
    gathered_positions,
    identity_view,
    remapped_mask,
)
from ascend_vlm.pruning.selection import (
    divprune_scores,
    fastv_scores,
    keep_plan,
    random_scores,
    snapkv_choice,
    uniform_scores,
)
from ascend_vlm.pruning.stats import PruningStats, prefill_stats

SCORED_ATTENTION = "ascend_vlm_scored"
# The scored config copy carries the implementation it wraps and the config it replaced.
_INNER_ATTENTION = "_ascend_vlm_inner_attention"
_INNER_CONFIG = "_ascend_vlm_inner_config"
_ACTIVE: contextvars.ContextVar[_Forward | None] = contextvars.ContextVar(
    "ascend_vlm_pruning_forward", default=None
)


def scored_attention(module: nn.Module, query, key, value, attention_mask, **kwargs):
    """Attention-interface function of the scored layers: the module's own implementation (named
    on its config copy), plus the probability rows the active prefill asked this layer for."""
    inner = attention_function(module, module.config.__dict__[_INNER_ATTENTION])
    result = inner(module, query, key, value, attention_mask, **kwargs)
    forward = _ACTIVE.get()
    if forward is not None:
        forward.take_scores(module.layer_idx, query, key, attention_mask, kwargs.get("scaling"))
    return result


@dataclass
class _Prefill:
    """What one prefill knows before its layers run: ``visual`` [B, S] (bool, real visual tokens),
    per-row visual counts and kept counts (host ints), and the pruned prompt length."""

    visual: torch.Tensor
    counts: list[int]
    live_counts: list[int]
    kept_counts: list[int]
    length: int
    token_view: LayerView | None = None
    rows: torch.Tensor | None = None
    fastv: torch.Tensor | None = None
    windows: dict[int, torch.Tensor] = field(default_factory=dict)
    views: dict[int, LayerView] = field(default_factory=dict)


class _Forward:
    """One forward of the multimodal model: its cache, the views recorded for that cache, and
    (at a prefill) the state the layers build up."""

    def __init__(self, pruner: TokenPruner, cache: Any, views: dict[int, LayerView] | None):
        self.pruner = pruner
        self.cache = cache
        self.views = views or {}
        self.prefill: _Prefill | None = None
        self.masks: dict[tuple, torch.Tensor] = {}
        self.swapped: dict[int, Any] = {}
        self.token: contextvars.Token | None = None

    def view(self, layer: int) -> LayerView | None:
        """How layer ``layer`` sees the prompt in this forward (None: as transformers does)."""
        if self.prefill is not None:
            return self.prefill.token_view if layer >= self.pruner.token_layer else None
        return self.views.get(layer)

    def take_scores(self, layer: int, query, key, mask, scale) -> None:
        """Keep the probability rows layer ``layer``'s attention call owes this prefill."""
        prefill, pruner = self.prefill, self.pruner
        if prefill is None:
            return
        if pruner.prune is not None and layer == pruner.token_layer - 1:
            length = prefill.visual.shape[1]
            rows = None if mask is None else mask[..., -1:, : key.shape[2]]
            prefill.fastv = fastv_scores(query[:, :, -1:], key, rows)[:, :length]
        if pruner.kv is not None and layer in pruner.compressed_layers:
            length = query.shape[2]
            window = min(pruner.kv.window, length)
            keys = key[:, :, :length]
            if mask is None:
                rows = causal_mask(window, length, query.device)
            else:
                rows = mask[..., -window:, :length]
            prefill.windows[layer] = ops.attention_probabilities(
                query[:, :, -window:], keys, rows, scale=scale
            )


class TokenPruner:
    """The pruning state of one model: its configs, hooks, and the views of the caches it filled
    (weakly keyed by cache, so a finished generation's record goes with its cache)."""

    def __init__(self, target: PruningTarget, prune: PruneConfig | None, kv: SnapKVConfig | None):
        self.target = target
        self.prune = prune
        self.kv = kv
        depth = len(target.layers)
        self.token_layer = prune.layer if prune is not None else depth
        self.compressed_layers = range(1, depth) if kv is not None else range(0)
        self.records: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.last_stats: PruningStats | None = None
        self.handles: list = []
        self._ids = torch.tensor(target.visual_token_ids)

    # ------------------------------------------------------------------ installation

    def install(self, base: nn.Module) -> None:
        register_attention_function(SCORED_ATTENTION, scored_attention)
        multimodal = self.target.multimodal
        self.handles.append(base.register_forward_pre_hook(self._refuse_labels, with_kwargs=True))
        self.handles.append(multimodal.register_forward_pre_hook(self._begin, with_kwargs=True))
        self.handles.append(
            multimodal.register_forward_hook(self._end, with_kwargs=True, always_call=True)
        )
        for index, layer in enumerate(self.target.layers):
            self.handles.append(
                layer.register_forward_pre_hook(self._layer_hook(index), with_kwargs=True)
            )
            self.handles.append(
                layer.register_forward_hook(self._layer_done(index), always_call=True)
            )

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    # ------------------------------------------------------------------ the model forward

    @staticmethod
    def _refuse_labels(module, args, kwargs):
        if kwargs.get("labels") is not None:
            raise ValueError(
                "labels: token pruning drops prompt positions, so a loss over the prompt cannot "
                "be computed; call ascend_vlm.pruning.disable_token_pruning(model) for training"
            )

    def _begin(self, module, args, kwargs):
        cache = cache_argument(kwargs)
        record = self.records.get(cache) if cache is not None else None
        forward = _Forward(self, cache, record)
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if input_ids is not None and input_ids.shape[1] > 1:
            visual = torch.isin(input_ids, self._ids.to(input_ids.device))
            attention_mask = kwargs.get("attention_mask")
            if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:
                visual &= attention_mask[:, -input_ids.shape[1] :].bool()
            counts = visual.sum(dim=1).tolist()  # the one host read of a prefill: its shape
            if any(counts):
                self._check_prefill(cache, record)
                forward.prefill = self._plan(visual, counts)
        forward.token = _ACTIVE.set(forward)

    def _check_prefill(self, cache, record) -> None:
        if record is not None or (cache is not None and int(cache.get_seq_length()) > 0):
            raise ValueError(
                "input_ids: token pruning prunes a prompt's first forward into an empty cache; "
                "this prompt continues a filled cache and carries new visual tokens (start a new "
                "cache, or disable pruning for multi-turn prompts with new images)"
            )
        if cache is None:
            return
        kinds = {cache_layer_kind(cache, index) for index in range(len(self.target.layers))}
        accepted = {"dynamic"} if self.kv is not None else {"dynamic", "static"}
        if not kinds <= accepted:
            raise ValueError(
                f"cache: token pruning needs full-attention {' or '.join(sorted(accepted))} "
                f"cache layers (sliding-window layers drop the slots a pruned layer maps; "
                f"SnapKV shrinks a dynamic cache, a static one cannot free slots), got "
                f"{sorted(kinds)}"
            )

    def _plan(self, visual: torch.Tensor, counts: list[int]) -> _Prefill:
        length = visual.shape[1]
        if self.prune is None:
            return _Prefill(visual, counts, counts, counts, length)
        live = [kept_count(self.prune.keep, count) for count in counts]
        fewest_dropped = min(count - kept for count, kept in zip(counts, live, strict=True))
        kept = [count - fewest_dropped for count in counts]
        return _Prefill(visual, counts, live, kept, length - fewest_dropped)

    def _end(self, module, args, kwargs, output):
        forward = _ACTIVE.get()
        if forward is None or forward.pruner is not self:
            return
        _ACTIVE.reset(forward.token)
        prefill = forward.prefill
        if prefill is None or output is None:
            return
        depth = len(self.target.layers)
        views = {
            index: view
            for index in range(depth)
            if (view := prefill.views.get(index, forward.view(index))) is not None
        }
        if forward.cache is not None and views:
            self.records[forward.cache] = views
        self.last_stats = prefill_stats(self.target.layers, prefill, views, self.token_layer)

    # ------------------------------------------------------------------ the decoder layers

    def _layer_hook(self, index: int):
        def hook(layer, args, kwargs):
            forward = _ACTIVE.get()
            if forward is None or forward.pruner is not self:
                return None
            if forward.cache is None:
                # transformers made the cache inside the language model: record against it
                forward.cache = cache_argument(kwargs)
            prefill = forward.prefill
            if prefill is not None:
                wants_scores = (
                    self.prune is not None
                    and self.prune.needs_attention
                    and index == self.token_layer - 1
                ) or (index in self.compressed_layers and forward.cache is not None)
                if wants_scores:
                    self._score_layer(forward, index, layer)
                if index == self.token_layer:
                    args, kwargs = self._cut(forward, args, kwargs)
            view = forward.view(index)
            if view is None:
                return args, kwargs
            if prefill is None:
                self._check_layout(forward.cache, index, view, args, kwargs)
            kwargs = dict(kwargs)
            rows = prefill.rows if prefill is not None else None
            kwargs["attention_mask"] = self._mask(forward, index, view, kwargs, args, rows)
            if rows is not None:
                cos, sin = kwargs["position_embeddings"]
                kwargs["position_embeddings"] = (
                    gathered_positions(cos, rows, -2),
                    gathered_positions(sin, rows, -2),
                )
                positions = kwargs.get("position_ids")
                if isinstance(positions, torch.Tensor) and positions.shape[-1] == prefill.length:
                    kwargs["position_ids"] = gathered_positions(positions, rows, -1)
            return args, kwargs

        return hook

    def _layer_done(self, index: int):
        def hook(layer, args, output):
            forward = _ACTIVE.get()
            if forward is None or forward.pruner is not self:
                return
            attention = forward.swapped.pop(index, None)
            if attention is not None:
                attention.__dict__["config"] = attention.config.__dict__[_INNER_CONFIG]
            prefill = forward.prefill
            if prefill is not None and index in prefill.windows and output is not None:
                self._compress(forward, index)

        return hook

    def _score_layer(self, forward: _Forward, index: int, layer: nn.Module) -> None:
        attention = layer.self_attn
        config = attention.config
        scored = copy.copy(config)
        set_attention_implementation(scored, SCORED_ATTENTION)
        scored.__dict__[_INNER_ATTENTION] = config._attn_implementation
        scored.__dict__[_INNER_CONFIG] = config
        attention.__dict__["config"] = scored
        forward.swapped[index] = attention

    def _cut(self, forward: _Forward, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """At the first pruned layer: choose the kept positions, cut the hidden states."""
        prefill = forward.prefill
        hidden = args[0] if args else kwargs["hidden_states"]
        device = hidden.device
        live_counts = torch.tensor(prefill.live_counts, device=device)
        kept_counts = torch.tensor(prefill.kept_counts, device=device)
        method = self.prune.method
        if method == "fastv":
            scores = prefill.fastv
        elif method == "divprune":
            steps, width = max(prefill.kept_counts), max(prefill.counts)
            scores = divprune_scores(hidden, prefill.visual, steps, width)
        elif method == "random":
            scores = random_scores(prefill.visual, self.prune.seed)
        else:
            scores = uniform_scores(prefill.visual, live_counts)
        plan = keep_plan(scores, prefill.visual, live_counts, kept_counts, prefill.length)
        prefill.rows = plan.kept
        prefill.token_view = LayerView(
            plan.kept[:, None, :], plan.live[:, None, :], prefill.visual.shape[1]
        )
        hidden = gathered_positions(hidden, plan.kept, -2)
        if args:
            return (hidden, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": hidden}

    @staticmethod
    def _check_layout(cache, index: int, view: LayerView, args: tuple, kwargs: dict) -> None:
        """Refuse a dynamic cache whose layer ``index`` no longer holds the slots its view maps
        (cropped by assisted decoding, or filled without pruning), instead of attending to the
        wrong keys. Layer 0, already written in this forward, holds the original length."""
        if cache is None or cache_layer_kind(cache, index) != "dynamic":
            return
        queries = (args[0] if args else kwargs["hidden_states"]).shape[1]
        generated = cache.get_seq_length(0) - queries - view.prompt_length
        held = cache.get_seq_length(index)
        if held != view.length + generated:
            raise RuntimeError(
                f"cache: layer {index} holds {held} slots where the pruned prompt's layout needs "
                f"{view.length + generated}; the cache was cropped or extended outside token "
                f"pruning (assisted decoding and cache cropping are not supported with it)"
            )

    def _mask(self, forward, index, view, kwargs, args, rows) -> torch.Tensor:
        cache = forward.cache
        mask = kwargs.get("attention_mask")
        hidden = args[0] if args else kwargs["hidden_states"]
        queries = hidden.shape[1] if rows is None else rows.shape[1]
        key = (id(view), id(mask), rows is not None)
        cached = forward.masks.get(key)
        if cached is not None:
            return cached
        if mask is None:
            full = view.prompt_length if cache is None else int(cache.get_seq_length(0))
            original_queries = view.prompt_length if rows is not None else queries
            mask = causal_mask(original_queries, full, hidden.device)
        width = queries if cache is None else int(cache.get_mask_sizes(queries, index)[0])
        heads = self.target.layers[index].self_attn.config.num_attention_heads
        remapped = remapped_mask(mask, view, width, rows=rows, query_heads=heads)
        forward.masks[key] = remapped
        return remapped

    def _compress(self, forward: _Forward, index: int) -> None:
        """SnapKV on layer ``index``'s freshly written prompt cache."""
        prefill, kv = forward.prefill, self.kv
        probabilities = prefill.windows.pop(index)
        length = probabilities.shape[-1]
        window = probabilities.shape[2]
        kept = kv.kept_positions(length)
        if kept >= length:
            return
        attention = self.target.layers[index].self_attn
        kv_heads = attention.config.num_key_value_heads
        slots = snapkv_choice(
            probabilities,
            length - window,
            kept - window,
            kv_heads,
            kernel_size=kv.kernel_size,
            pooling=kv.pooling,
            per_head=kv.per_head,
        )
        base = forward.view(index) or identity_view(slots.shape[0], length, slots.device)
        prefill.views[index] = base.narrowed(slots)
        if forward.cache is not None:
            cached = forward.cache.layers[index]
            index_shape = (-1, kv_heads, -1, cached.keys.shape[-1])
            gather = slots[..., None].expand(index_shape)
            keys = cached.keys[:, :, :length].gather(2, gather)
            values = cached.values[:, :, :length].gather(2, gather)
            replace_cached_states(forward.cache, index, keys, values)
