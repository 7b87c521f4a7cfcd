"""Which prompt positions survive: visual-token scores per method, the per-row keep plan, and
SnapKV's per-head choice. Tensor functions only: every result stays on the inputs' device (no
host reads), so the selection adds no synchronisation on an NPU.

Scores are "higher = kept first" over a prompt ``[B, S]``; only visual positions are ranked.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from ascend_vlm import ops
from ascend_vlm.pruning.config import SnapKVConfig


class KeepPlan(NamedTuple):
    """The prompt positions the pruned layers keep per row: ``kept`` ``[B, S']`` (long) and
    ``live`` ``[B, S']`` (bool). A row whose own count is below ``S'`` (it drops more visual
    tokens than the row dropping fewest) fills up with its best dropped tokens, kept as dead
    slots (``live`` False) that no query attends to; those come first, then the live ones in
    prompt order (the last position stays last)."""

    kept: torch.Tensor
    live: torch.Tensor


def _first(mask: torch.Tensor) -> torch.Tensor:
    """Per row, the positions where ``mask`` [B, S] is True, in order, then the others."""
    return torch.argsort((~mask).to(torch.int8), dim=1, stable=True)


def fastv_scores(
    query_last: torch.Tensor,
    key: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention each prompt position receives from the last query row, mean over query heads:
    ``query_last`` ``[B, Nq, 1, D]``, keys ``[B, Nkv, Skv, D]``, ``mask`` the call's mask rows for
    that query (or None), ``scale`` the call's -> ``[B, Skv]`` float32."""
    probabilities = ops.attention_probabilities(query_last, key, mask, scale=scale)
    return probabilities.mean(dim=1)[:, 0]


def divprune_scores(
    features: torch.Tensor, visual: torch.Tensor, steps: int, width: int
) -> torch.Tensor:
    """Greedy max-min diversity order of the visual hidden states ``features`` ``[B, S, H]``
    (``visual`` ``[B, S]`` bool) under cosine distance ``d = 1 - cos``: the first pick is the token
    farthest from its nearest neighbour, each next pick the token farthest from everything picked.
    Runs ``steps`` picks per row; the ``i``-th pick scores ``steps - i``, unpicked tokens -1.
    ``width`` is the most visual tokens any row has (known on the host, so no read here)."""
    batch, length = visual.shape
    positions = _first(visual)[:, :width]
    valid = visual.gather(1, positions)
    picked_features = features.gather(1, positions[..., None].expand(-1, -1, features.shape[-1]))
    unit = F.normalize(picked_features.float(), dim=-1)
    distance = 1.0 - unit @ unit.transpose(1, 2)
    inf = float("inf")
    pair_valid = valid[:, :, None] & valid[:, None, :]
    eye = torch.eye(width, dtype=torch.bool, device=distance.device)
    nearest = distance.masked_fill(~pair_valid | eye, inf).amin(dim=2)
    candidate = nearest.masked_fill(~valid, -inf)
    closest = torch.full_like(nearest, inf)
    order = torch.full((batch, width), -1.0, device=distance.device)
    rows = torch.arange(batch, device=distance.device)
    for step in range(steps):
        best, pick = candidate.max(dim=1)
        fresh = best > -inf
        order[rows, pick] = torch.where(fresh, float(steps - step), order[rows, pick])
        closest = torch.minimum(closest, distance[rows, pick].masked_fill(~valid, inf))
        candidate = closest.masked_fill(~valid | (order >= 0), -inf)
    scores = torch.full((batch, length), -1.0, device=distance.device)
    return scores.scatter(1, positions, torch.where(valid, order, -1.0))


def random_scores(visual: torch.Tensor, seed: int) -> torch.Tensor:
    """Seeded random scores by visual ordinal: the ``o``-th visual token of every row draws the
    ``o``-th number of one ``seed``-ed stream, so a row ranks the same alone or in any batch."""
    ordinal = visual.long().cumsum(dim=1) - 1
    width = visual.shape[1]
    stream = torch.rand(width, generator=torch.Generator().manual_seed(seed))
    return stream.to(visual.device)[ordinal.clamp(min=0)]


def uniform_scores(visual: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """Evenly spaced visual tokens in prompt order: of a row's ``n`` visual tokens the ordinal
    ``o`` is kept iff ``floor((o + 1) k / n) > floor(o k / n)`` (exactly ``k = kept[row]`` of them);
    those score 1, the rest 0."""
    count = visual.sum(dim=1, keepdim=True).clamp(min=1)
    ordinal = visual.long().cumsum(dim=1) - 1
    share = kept[:, None]
    chosen = (ordinal + 1) * share // count > ordinal * share // count
    return chosen.float()


def keep_plan(
    scores: torch.Tensor,
    visual: torch.Tensor,
    live_counts: torch.Tensor,
    kept_counts: torch.Tensor,
    length: int,
) -> KeepPlan:
    """Per row keep every non-visual position and the ``kept_counts[row]`` best-scoring visual
    ones, of which the best ``live_counts[row]`` are live; ``length`` positions per row in all
    (``S - min dropped``, the same for every row). Ties keep prompt order."""
    ranked = scores.float().masked_fill(~visual, float("-inf"))
    order = torch.argsort(ranked, dim=1, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(
        1, order, torch.arange(order.shape[1], device=order.device).expand_as(order)
    )
    keep = ~visual | (rank < kept_counts[:, None])
    live = ~visual | (rank < live_counts[:, None])
    kept = _first(keep)[:, :length]
    live = live.gather(1, kept)
    # Dead slots go first, the rest in prompt order: next to live slots they would shift the
    # neighbourhoods a later SnapKV pools over; at the front they sit with the padding, where
    # a row alone has its pooling's zero padding.
    dead_first = torch.argsort(live.to(torch.int8), dim=1, stable=True)
    return KeepPlan(kept.gather(1, dead_first), live.gather(1, dead_first))


class SnapKVChoice(NamedTuple):
    """The cache slots one layer keeps, ``slots`` ``[B, H, K]`` ascending (``H`` the KV heads, or
    1 for all), and ``live`` ``[B, H, K]``: False for the slots a row keeps only to stay
    rectangular (it alone would keep fewer)."""

    slots: torch.Tensor
    live: torch.Tensor


def snapkv_choice(
    probabilities: torch.Tensor,
    valid: torch.Tensor,
    config: SnapKVConfig,
    kv_heads: int,
) -> SnapKVChoice:
    """SnapKV's choice from the window queries' attention ``probabilities`` ``[B, Nq, W, L]``
    over a layer's ``L`` prompt slots, of which ``valid`` ``[B, L]`` are real (not padding, not
    dead). Votes summed over the window on the first ``L - W`` slots are pooled over
    ``config.kernel_size`` neighbours (stride 1, as a row alone would pool them: padding votes
    are 0) and averaged per KV head's query group (or over every head); a row keeps its best
    ``config.kept_slots(n) - (its real window slots)`` for its ``n`` real slots (ties to the
    later slot), and the window.
    Every row gets the slot count of the longest; the extra ones are not live."""
    batch, heads, window, length = probabilities.shape
    prefix = length - window
    votes = probabilities[..., :prefix].sum(dim=2)
    flat = votes.reshape(batch * heads, 1, prefix)
    pad = config.kernel_size // 2
    if config.pooling == "avg":
        pooled = F.avg_pool1d(flat, config.kernel_size, stride=1, padding=pad)
    else:
        pooled = F.max_pool1d(flat, config.kernel_size, stride=1, padding=pad)
    pooled = pooled.reshape(batch, kv_heads, heads // kv_heads, prefix).mean(dim=2)
    if not config.per_head:
        pooled = pooled.mean(dim=1, keepdim=True)
    pooled = pooled.masked_fill(~valid[:, None, :prefix], float("-inf"))
    slots = config.kept_slots(length) - window
    real_window = valid[:, prefix:].sum(dim=1)
    live_slots = (config.kept_slots(valid.sum(dim=1)) - real_window).clamp(min=0)
    # Ties go to the later slot: counted from the window, a row's slots are where they are
    # alone, whatever padding precedes them.
    from_window = torch.argsort(pooled.flip(-1), dim=-1, descending=True, stable=True)
    best = prefix - 1 - from_window[..., :slots]
    ranked_live = torch.arange(slots, device=best.device) < live_slots[:, None, None]
    chosen, order = best.sort(dim=-1)
    live = ranked_live.expand_as(best).gather(-1, order)
    shape = (*chosen.shape[:2], window)
    window_slots = torch.arange(prefix, length, device=chosen.device).expand(shape)
    window_live = valid[:, None, prefix:].expand(shape)
    return SnapKVChoice(
        torch.cat([chosen, window_slots], dim=-1), torch.cat([live, window_live], dim=-1)
    )
