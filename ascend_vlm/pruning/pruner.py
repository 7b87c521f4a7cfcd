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
only, the scored layer's attention module is tapped (:mod:`ascend_vlm.patching.attention_tap`) and the
tap computes the few probability rows it needs with ``ops.attention_probabilities``.
"""

from __future__ import annotations

import contextvars
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ascend_vlm import ops
from ascend_vlm import trace_events as events
from ascend_vlm._compat.attention import ATTENTION_NAME
from ascend_vlm._compat.cache import cache_argument, cache_layer_kind, replace_cached_states
from ascend_vlm.models.decoder_parts import DecoderParts
from ascend_vlm.patching.attention_tap import (
    tap_for_call,
    tapped_implementation,
    untap_after_call,
)
from ascend_vlm.patching.ledger import Edits
from ascend_vlm.pruning.config import PruneConfig, SnapKVConfig, kept_count
from ascend_vlm.pruning.layer_view import (
    LayerView,
    attended,
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

# Implementations whose masks the layer views re-index (4-D bool / additive float, or None).
MASKED_ATTENTION = ("eager", "sdpa", ATTENTION_NAME)
_ACTIVE: contextvars.ContextVar[_Forward | None] = contextvars.ContextVar(
    "ascend_vlm_pruning_forward", default=None
)
# cache object -> {layer: LayerView}: how each pruned or compressed layer of a cache filled by
# a pruned prefill holds the prompt. Module-wide, so a model pruned again (same configs) keeps
# reading the caches it filled before; weak, so a finished generation's record goes with it.
_CACHE_VIEWS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def recorded_views(cache: Any) -> dict[int, LayerView] | None:
    """The layer views recorded for ``cache`` by a pruned prefill (None: not filled so)."""
    return _CACHE_VIEWS.get(cache)


def _take_scores(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None,
) -> None:
    """Tap of the scored layers: the probability rows the active prefill asks them for."""
    forward = _ACTIVE.get()
    if forward is not None:
        forward.take_scores(module.layer_idx, query, key, attention_mask, scaling)


def _hidden_states(args: tuple, kwargs: dict) -> torch.Tensor:
    """The hidden states a decoder layer call received."""
    return args[0] if args else kwargs["hidden_states"]


@dataclass
class _Prefill:
    """What one prefill knows before its layers run: ``visual`` [B, S] (bool, real visual tokens
    but the last position), per-row visual, live and kept counts (host ints) and the pruned
    prompt length; then what its layers produce."""

    visual: torch.Tensor
    counts: list[int]
    live_counts: list[int]
    kept_counts: list[int]
    length: int
    element_size: int = 0
    token_view: LayerView | None = None
    kept_rows: torch.Tensor | None = None
    fastv_scores: torch.Tensor | None = None
    windows: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    compressed_views: dict[int, LayerView] = field(default_factory=dict)


class _Forward:
    """One forward of the multimodal model: its cache, the views recorded for that cache, and
    (at a prefill) the state the layers build up."""

    def __init__(self, pruner: TokenPruner, cache: Any, previous: _Forward | None) -> None:
        self.pruner = pruner
        self.cache = cache
        self.recorded = (recorded_views(cache) if cache is not None else None) or {}
        self.previous = previous
        self.prefill: _Prefill | None = None
        self.masks: dict[tuple, torch.Tensor] = {}
        self.swapped: dict[int, nn.Module] = {}

    def layer_view(self, layer: int) -> LayerView | None:
        """How layer ``layer`` sees the prompt in this forward (None: as transformers does): at a
        prefill the token view from the cut on, later what the prefill recorded."""
        if self.prefill is not None:
            return self.prefill.token_view if layer >= self.pruner.token_layer else None
        return self.recorded.get(layer)

    def take_scores(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        mask: torch.Tensor | None,
        scale: float | None,
    ) -> None:
        """Keep the probability rows layer ``layer``'s attention call owes this prefill."""
        prefill, pruner = self.prefill, self.pruner
        if prefill is None:
            return
        if pruner.prune is not None and layer == pruner.token_layer - 1:
            prompt = prefill.visual.shape[1]
            last_row = None if mask is None else mask[..., -1:, : key.shape[2]]
            scores = fastv_scores(query[:, :, -1:], key, last_row, scale)
            prefill.fastv_scores = scores[:, :prompt]
        if pruner.kv is not None and layer in pruner.compressed_layers:
            slots = query.shape[2]  # this layer's prompt slots (pruned or not)
            window = min(pruner.kv.window, slots)
            if mask is None:
                rows = causal_mask(window, slots, query.device)
            else:
                rows = mask[..., -window:, :slots]
            probabilities = ops.attention_probabilities(
                query[:, :, -window:], key[:, :, :slots], rows, scale=scale
            )
            valid = attended(rows[..., -1, :]).reshape(-1, slots).expand(query.shape[0], -1)
            prefill.windows[layer] = (probabilities, valid)


class TokenPruner:
    """The pruning state of one model (a ledger feature): its configs, its hooks, and the
    statistics of its last pruned prefill."""

    name = "token_pruning"

    def __init__(
        self,
        base: nn.Module,
        target: DecoderParts,
        prune: PruneConfig | None,
        kv: SnapKVConfig | None,
    ):
        self.base = base
        self.target = target
        self.prune = prune
        self.kv = kv
        depth = len(target.layers)
        self.token_layer = prune.layer if prune is not None else depth
        self.compressed_layers = range(1, depth) if kv is not None else range(0)
        self.last_stats: PruningStats | None = None
        self._ids = torch.tensor(target.visual_token_ids)

    # ------------------------------------------------------------------ installation

    def install(self, edits: Edits) -> None:
        """Ledger feature ``"token_pruning"``: hook the model's forward, its multimodal
        model's and each decoder layer's; on removal, also untap any scored layer an
        interrupted prefill left tapped."""
        multimodal = self.target.multimodal
        hook = edits.add_hook
        hook(self.base.register_forward_pre_hook(self._refuse_labels, with_kwargs=True))
        hook(multimodal.register_forward_pre_hook(self._begin, with_kwargs=True))
        hook(multimodal.register_forward_hook(self._end, with_kwargs=True, always_call=True))
        for index, layer in enumerate(self.target.layers):
            hook(layer.register_forward_pre_hook(self._layer_hook(index), with_kwargs=True))
            hook(layer.register_forward_hook(self._layer_done(index), always_call=True))
        edits.on_undo(self._end_interrupted_prefill)

    def _end_interrupted_prefill(self) -> None:
        """On removal: a forward of this model that an exception interrupted in this thread
        leaves its scored layers tapped and itself active; end it."""
        active = _ACTIVE.get()
        if active is not None and active.pruner is self:
            for attention in active.swapped.values():
                untap_after_call(attention)
            _ACTIVE.set(active.previous)

    def _active(self) -> _Forward | None:
        """This model's forward in progress (None outside one, or inside another model's)."""
        forward = _ACTIVE.get()
        return forward if forward is not None and forward.pruner is self else None

    # ------------------------------------------------------------------ the model forward

    @staticmethod
    def _refuse_labels(module: nn.Module, args: tuple, kwargs: dict) -> None:
        if kwargs.get("labels") is not None:
            raise ValueError(
                "labels: token pruning drops prompt positions, so a loss over the prompt cannot "
                "be computed; call ascend_vlm.pruning.disable_token_pruning(model) for training"
            )

    def _begin(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        previous = _ACTIVE.get()
        if previous is not None and previous.pruner is self:
            # a forward of this model cannot run inside itself: that one was interrupted
            for attention in previous.swapped.values():
                untap_after_call(attention)
            previous = previous.previous
        cache = cache_argument(kwargs)
        forward = _Forward(self, cache, previous)
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if input_ids is not None and input_ids.shape[1] > 1:
            visual = torch.isin(input_ids, self._ids.to(input_ids.device))
            visual[:, -1] = False  # generation reads the last position's logits
            attention_mask = kwargs.get("attention_mask")
            if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:
                visual &= attention_mask[:, -input_ids.shape[1] :].bool()
            counts = visual.sum(dim=1).tolist()  # the one host read of a prefill: its shape
            if any(counts):
                self._check_prefill(cache, forward.recorded)
                forward.prefill = self._plan(visual, counts)
        elif cache is not None and not forward.recorded:
            self._check_unrecorded(cache)
        _ACTIVE.set(forward)

    def _check_prefill(self, cache: Any, recorded: dict) -> None:
        implementation = tapped_implementation(self.target.layers[0].self_attn.config)
        if implementation not in MASKED_ATTENTION:
            raise ValueError(
                f"attn_implementation: token pruning re-indexes 4-D attention masks and runs "
                f"with {', '.join(MASKED_ATTENTION)}, got {implementation!r}"
            )
        if recorded or (cache is not None and int(cache.get_seq_length()) > 0):
            raise ValueError(
                "input_ids: token pruning prunes a prompt's first forward into an empty cache; "
                "this prompt continues a filled cache and carries new visual tokens (start a new "
                "conversation with an empty cache for a prompt with new images)"
            )
        if cache is not None:
            self._check_cache_kinds(cache)

    def _check_cache_kinds(self, cache: Any) -> None:
        kinds = {cache_layer_kind(cache, index) for index in range(len(self.target.layers))}
        accepted = {"dynamic"} if self.kv is not None else {"dynamic", "static"}
        if not kinds <= accepted:
            raise ValueError(
                f"cache: token pruning needs full-attention {' or '.join(sorted(accepted))} "
                f"cache layers (sliding-window layers drop the slots a pruned layer maps; "
                f"SnapKV shrinks a dynamic cache, a static one cannot free slots), got "
                f"{sorted(kinds)}"
            )

    def _check_unrecorded(self, cache: Any) -> None:
        """A dynamic cache with no recorded views must hold one length in every layer; uneven
        ones were filled by a pruned prefill whose record is gone (or edited by hand)."""
        depth = len(self.target.layers)
        if any(cache_layer_kind(cache, index) != "dynamic" for index in range(depth)):
            return
        lengths = {cache.get_seq_length(index) for index in range(depth)}
        if len(lengths) > 1:
            raise RuntimeError(
                f"cache: its layers hold {sorted(lengths)} slots but no pruned layout is recorded "
                f"for it; continue a pruned cache only with the process and pruning that filled it"
            )

    def _plan(self, visual: torch.Tensor, counts: list[int]) -> _Prefill:
        length = visual.shape[1]
        if self.prune is None:
            self._warn_if_window_covers(length)
            return _Prefill(visual, counts, counts, counts, length)
        live = [kept_count(self.prune.keep, count) for count in counts]
        fewest_dropped = min(count - kept for count, kept in zip(counts, live, strict=True))
        kept = [count - fewest_dropped for count in counts]
        self._warn_if_window_covers(length - fewest_dropped)
        return _Prefill(visual, counts, live, kept, length - fewest_dropped)

    def _warn_if_window_covers(self, prompt_slots: int) -> None:
        """Warn when SnapKV's window spans the whole prompt (nothing is compressed); not an
        error, as a short request is still answered correctly."""
        if self.kv is not None and self.kv.window >= prompt_slots:
            warnings.warn(
                f"SnapKVConfig.window: expected fewer than the prompt's {prompt_slots} slots "
                f"(SnapKV always keeps the window), got {self.kv.window}; this prefill's KV "
                f"cache is left uncompressed. Use a smaller window or a longer prompt",
                UserWarning,
                stacklevel=2,
            )

    def _end(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        forward = self._active()
        if forward is None:
            return
        _ACTIVE.set(forward.previous)
        prefill = forward.prefill
        if prefill is None or output is None:
            return
        views = {}
        for index in range(len(self.target.layers)):
            view = prefill.compressed_views.get(index, forward.layer_view(index))
            if view is not None:
                views[index] = view
        if forward.cache is not None and views:
            _CACHE_VIEWS[forward.cache] = views
        stats = prefill_stats(self.target.layers, prefill, views, self.token_layer)
        self.last_stats = stats
        if events.listening():
            events.emit(
                "pruning",
                self.target.multimodal,
                visual_tokens=list(stats.visual_tokens),
                kept_visual_tokens=list(stats.kept_visual_tokens),
                kv_ratio=stats.kv_ratio,
                flops_ratio=stats.flops_ratio,
            )

    # ------------------------------------------------------------------ the decoder layers

    def _layer_hook(self, index: int):
        def hook(layer: nn.Module, args: tuple, kwargs: dict):
            forward = self._active()
            if forward is None:
                return None
            prefill = forward.prefill
            if forward.cache is None and cache_argument(kwargs) is not None:
                # transformers made the cache inside the language model: record against it
                forward.cache = cache_argument(kwargs)
                if prefill is not None:
                    self._check_cache_kinds(forward.cache)
            if prefill is not None:
                if index == 0:
                    prefill.element_size = _hidden_states(args, kwargs).element_size()
                wants_scores = (
                    self.prune is not None
                    and self.prune.needs_attention
                    and index == self.token_layer - 1
                ) or (index in self.compressed_layers and forward.cache is not None)
                if wants_scores:
                    self._score_layer(forward, index, layer)
                if index == self.token_layer:
                    args, kwargs = self._cut(forward, args, kwargs)
            view = forward.layer_view(index)
            if view is None:
                return args, kwargs
            if prefill is None:
                self._check_layout(forward.cache, index, view, args, kwargs)
            kwargs = dict(kwargs)
            rows = prefill.kept_rows if prefill is not None else None
            kwargs["attention_mask"] = self._mask(forward, index, view, args, kwargs, rows)
            if rows is not None:
                cos, sin = kwargs["position_embeddings"]
                kwargs["position_embeddings"] = (
                    gathered_positions(cos, rows, -2),
                    gathered_positions(sin, rows, -2),
                )
                positions = kwargs.get("position_ids")
                prompt = prefill.visual.shape[1]
                if isinstance(positions, torch.Tensor) and positions.shape[-1] == prompt:
                    kwargs["position_ids"] = gathered_positions(positions, rows, -1)
            return args, kwargs

        return hook

    def _layer_done(self, index: int):
        def hook(layer: nn.Module, args: tuple, output: Any) -> None:
            forward = self._active()
            if forward is None:
                return
            attention = forward.swapped.pop(index, None)
            if attention is not None:
                untap_after_call(attention)
            prefill = forward.prefill
            if prefill is not None and index in prefill.windows and output is not None:
                self._compress(forward, index)

        return hook

    def _score_layer(self, forward: _Forward, index: int, layer: nn.Module) -> None:
        tap_for_call(layer.self_attn, _take_scores)
        forward.swapped[index] = layer.self_attn

    def _cut(self, forward: _Forward, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """At the first pruned layer: choose the kept positions, cut the hidden states."""
        prefill = forward.prefill
        hidden = _hidden_states(args, kwargs)
        device = hidden.device
        live_counts = torch.tensor(prefill.live_counts, device=device)
        kept_counts = torch.tensor(prefill.kept_counts, device=device)
        method = self.prune.method
        if method == "fastv":
            scores = prefill.fastv_scores
            if scores is None:
                raise RuntimeError(
                    f"fastv: layer {self.token_layer - 1}'s attention call did not run through "
                    f"its attention implementation, so it gave no scores"
                )
        elif method == "divprune":
            steps, width = max(prefill.kept_counts), max(prefill.counts)
            scores = divprune_scores(hidden, prefill.visual, steps, width)
        elif method == "random":
            scores = random_scores(prefill.visual, self.prune.seed)
        else:
            scores = uniform_scores(prefill.visual, live_counts)
        plan = keep_plan(scores, prefill.visual, live_counts, kept_counts, prefill.length)
        prefill.kept_rows = plan.kept
        prefill.token_view = LayerView(
            plan.kept[:, None, :], plan.live[:, None, :], prefill.visual.shape[1]
        )
        hidden = gathered_positions(hidden, plan.kept, -2)
        if args:
            return (hidden, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": hidden}

    @staticmethod
    def _check_layout(cache: Any, index: int, view: LayerView, args: tuple, kwargs: dict) -> None:
        """Refuse a dynamic cache whose layer ``index`` no longer holds the slots its view maps
        (cropped or extended outside pruning), instead of attending to the wrong keys. Layer 0,
        already written in this forward, holds the original length."""
        if cache is None or cache_layer_kind(cache, index) != "dynamic":
            return
        queries = _hidden_states(args, kwargs).shape[1]
        generated = cache.get_seq_length(0) - queries - view.prompt_length
        held = cache.get_seq_length(index)
        if held != view.length + generated:
            raise RuntimeError(
                f"cache: layer {index} holds {held} slots where the pruned prompt's layout needs "
                f"{view.length + generated}; the cache was cropped or extended outside token "
                f"pruning"
            )

    def _mask(
        self,
        forward: _Forward,
        index: int,
        view: LayerView,
        args: tuple,
        kwargs: dict,
        rows: torch.Tensor | None,
    ) -> torch.Tensor:
        """The mask layer ``index`` attends with: transformers' (original coordinates; causal
        when it passed None) re-indexed through ``view`` to the layer's key slots, its query rows
        picked by ``rows`` at a prefill. One per view and mask per forward."""
        cache = forward.cache
        mask = kwargs.get("attention_mask")
        hidden = _hidden_states(args, kwargs)
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
        probabilities, valid = prefill.windows.pop(index)
        slots = probabilities.shape[-1]
        if kv.kept_slots(slots) >= slots:
            return
        kv_heads = self.target.layers[index].self_attn.config.num_key_value_heads
        choice = snapkv_choice(probabilities, valid, kv, kv_heads)
        base = forward.layer_view(index) or identity_view(valid.shape[0], slots, valid.device)
        prefill.compressed_views[index] = base.narrowed(choice.slots, choice.live)
        cached = forward.cache.layers[index]
        gather = choice.slots[..., None].expand(-1, kv_heads, -1, cached.keys.shape[-1])
        keys = cached.keys[:, :, :slots].gather(2, gather)
        values = cached.values[:, :, :slots].gather(2, gather)
        replace_cached_states(forward.cache, index, keys, values)
