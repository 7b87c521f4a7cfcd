"""The scorers and the keep plan on hand-made inputs, and the mask re-indexing."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from ascend_vlm.pruning.config import SnapKVConfig, kept_count
from ascend_vlm.pruning.layer_view import LayerView, remapped_mask
from ascend_vlm.pruning.selection import (
    divprune_scores,
    fastv_scores,
    keep_plan,
    random_scores,
    snapkv_choice,
    uniform_scores,
)


def test_kept_count_is_the_ceiling_and_never_drops_at_keep_one():
    assert [kept_count(0.5, n) for n in (0, 1, 7, 8)] == [0, 1, 4, 4]
    assert kept_count(1.0, 1000) == 1000 and kept_count(0.1, 64) == 7


def test_divprune_picks_the_farthest_point_first_then_max_min_distance():
    # unit vectors at angles 0, 10, 20, 180 and 90 degrees; position 0 is text
    angles = torch.tensor([0.0, 0.0, 10.0, 20.0, 180.0, 90.0]).deg2rad()
    features = torch.stack([angles.cos(), angles.sin()], dim=-1)[None]
    visual = torch.tensor([[False, True, True, True, True, True]])
    scores = divprune_scores(features, visual, steps=3, width=5)
    # nearest-neighbour distance is largest for 180 degrees (next is 90), then 0 (farthest from
    # 180 is 0), then 90 (its min distance to {180, 0} is 1 - cos 90 = 1, larger than 20's)
    assert scores.tolist() == [[-1.0, 2.0, -1.0, -1.0, 3.0, 1.0]]


def test_divprune_rows_with_fewer_visual_tokens_stop_when_exhausted():
    features = torch.randn(2, 5, 4, generator=torch.Generator().manual_seed(0))
    visual = torch.tensor([[True] * 5, [False, False, False, True, True]])
    scores = divprune_scores(features, visual, steps=5, width=5)
    assert sorted(scores[0].tolist()) == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert scores[1, :3].tolist() == [-1.0] * 3 and sorted(scores[1, 3:].tolist()) == [4.0, 5.0]


def test_random_scores_depend_on_the_visual_ordinal_only():
    alone = torch.tensor([[False, True, True, False, True]])
    padded = torch.tensor([[False, False, False, True, True, False, True]])
    a, b = random_scores(alone, 3), random_scores(padded, 3)
    assert torch.equal(a[alone], b[padded])
    assert not torch.equal(random_scores(alone, 3)[alone], random_scores(alone, 4)[alone])


@pytest.mark.parametrize(("count", "kept"), [(8, 4), (10, 3), (7, 7), (5, 1)])
def test_uniform_keeps_exactly_k_evenly_spaced(count, kept):
    visual = torch.ones(1, count, dtype=torch.bool)
    chosen = uniform_scores(visual, torch.tensor([kept]))[0].nonzero().flatten().tolist()
    assert len(chosen) == kept
    gaps = {b - a for a, b in itertools.pairwise(chosen)}
    assert max(gaps, default=0) - min(gaps, default=0) <= 1


def test_keep_plan_keeps_text_and_best_visual_in_order_with_dead_fillers():
    visual = torch.tensor(
        [[False, True, True, True, True, False], [True, True, False, False, False, False]]
    )
    scores = torch.tensor([[9.0, 0.1, 0.9, 0.5, 0.7, 9.0], [0.2, 0.8, 0, 0, 0, 0]])
    # row 0 keeps 2 of 4 (drops 2), row 1 keeps 1 of 2 (drops 1): length 6 - 1 = 5, so row 0
    # also keeps its third-best visual token as a dead slot
    plan = keep_plan(scores, visual, torch.tensor([2, 1]), torch.tensor([3, 1]), 5)
    assert plan.kept.tolist() == [[3, 0, 2, 4, 5], [1, 2, 3, 4, 5]]  # the dead slot first
    assert plan.live.tolist() == [[False, True, True, True, True], [True] * 5]


def test_fastv_scores_are_the_last_query_attention_mean_over_heads():
    # two query heads reading one key head; keys 0 and 1 masked in row 1
    query = torch.tensor([[[[1.0, 0.0]], [[0.0, 1.0]]]]).expand(2, -1, -1, -1)
    key = torch.tensor([[[[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]]]).expand(2, -1, -1, -1)
    mask = torch.tensor([[True, True, True], [False, False, True]])[:, None, None, :]
    scores = fastv_scores(query, key, mask, scale=2.0)
    e = torch.e**2
    # head 0 sees logits (2, 0, 0), head 1 (0, 2, 0): mean of both softmaxes
    expected_row0 = torch.tensor([(e + 1) / (e + 2) / 2, (1 + e) / (e + 2) / 2, 1 / (e + 2)])
    torch.testing.assert_close(scores[0], expected_row0)
    torch.testing.assert_close(scores[1], torch.tensor([0.0, 0.0, 1.0]))


def test_snapkv_keeps_the_window_and_the_most_attended_prompt_positions():
    probabilities = torch.zeros(1, 2, 2, 8)
    probabilities[:, 0, :, 1] = 1.0  # head group 0 looks at position 1
    probabilities[:, 1, :, 4] = 1.0  # head group 1 at position 4
    valid = torch.ones(1, 8, dtype=torch.bool)
    # 8 slots, ratio 0.625: keep 8 - 5 = 3 = window 2 + 1 prefix slot per head
    config = SnapKVConfig(compression_ratio=0.625, window=2, kernel_size=1)
    choice = snapkv_choice(probabilities, valid, config, 2)
    assert choice.slots.tolist() == [[[1, 6, 7], [4, 6, 7]]]
    assert choice.live.all()
    # ratio 0.5: 2 prefix slots shared by both heads, the two attended positions
    shared = dataclasses.replace(config, compression_ratio=0.5, per_head=False)
    assert snapkv_choice(probabilities, valid, shared, 2).slots.tolist() == [[[1, 4, 6, 7]]]
    assert SnapKVConfig(compression_ratio=0.5, window=2).kept_slots(9) == 5
    assert SnapKVConfig(compression_ratio=0.9, window=4).kept_slots(9) == 4
    lengths = torch.tensor([9, 3, 20])
    assert SnapKVConfig(compression_ratio=0.5, window=4).kept_slots(lengths).tolist() == [5, 3, 10]


def test_snapkv_padded_rows_keep_what_they_keep_alone():
    generator = torch.Generator().manual_seed(3)
    alone = torch.rand(1, 2, 2, 6, generator=generator).softmax(-1)
    padded = torch.cat([torch.zeros(1, 2, 2, 4), alone], dim=-1)  # 4 pads on the left
    config = SnapKVConfig(compression_ratio=0.5, window=2, kernel_size=3)
    one = snapkv_choice(alone, torch.ones(1, 6, dtype=torch.bool), config, 1)
    valid = torch.tensor([[False] * 4 + [True] * 6])
    batched = snapkv_choice(padded, valid, config, 1)
    # 10 slots keep 5 (3 prefix + window); the row's 6 real ones keep 3 (1 prefix + window)
    assert one.slots.shape[-1] == 3 and batched.slots.shape[-1] == 5
    live = batched.slots[batched.live] - 4
    assert live.tolist() == one.slots.flatten().tolist()


def test_remapped_mask_reindexes_columns_rows_and_masks_dead_slots():
    # prompt of 4 (position 0 is padding), one generated token; the layer keeps 0, 2, 3 (3 dead)
    mask = torch.ones(1, 1, 1, 5, dtype=torch.bool)
    mask[..., 0] = False
    view = LayerView(torch.tensor([[[0, 2, 3]]]), torch.tensor([[[True, True, False]]]), 4)
    decode = remapped_mask(mask, view, 6)
    assert decode.tolist() == [[[[False, True, False, True, False, False]]]]
    causal = torch.ones(4, 4, dtype=torch.bool).tril()[None, None]
    additive = torch.zeros(causal.shape).masked_fill(~causal, torch.finfo(torch.float32).min)
    prefill = remapped_mask(additive, view, 3, rows=torch.tensor([[0, 2, 3]]))
    assert (prefill == 0).tolist() == [
        [[[True, False, False], [True, True, False], [True, True, False]]]
    ]
