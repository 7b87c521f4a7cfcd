"""The mock's MoE kernels follow their torch-npu docs: npu_moe_token_permute /
npu_moe_token_unpermute (the docs' own examples) and npu_grouped_matmul's grouped "单单单" call,
and refuse what the docs rule out."""

from __future__ import annotations

import re

import pytest
import torch

from ascend_vlm.testing.mock_ops import (
    npu_grouped_matmul,
    npu_moe_token_permute,
    npu_moe_token_unpermute,
)

TOKENS = torch.tensor([[1, 1], [2, 2], [3, 3], [4, 4]], dtype=torch.float16)
INDICES = torch.tensor([[0, 1], [1, 0], [0, 2], [2, 0]])  # the permute doc's example


def test_permute_sorts_rows_by_expert_and_indexes_where_each_choice_went() -> None:
    permuted, sorted_indices = npu_moe_token_permute(TOKENS, INDICES)
    assert sorted_indices.dtype == torch.int32 and permuted.shape == (8, 2)
    # The doc's contract: permuted[sorted_indices[i]] = tokens[i // topK].
    for i, row in enumerate(sorted_indices.tolist()):
        assert torch.equal(permuted[row], TOKENS[i // 2])
    experts_of_rows = INDICES.reshape(-1)[torch.argsort(sorted_indices.long())]
    assert experts_of_rows.tolist() == sorted(experts_of_rows.tolist())
    # Stable: expert 0's rows keep token order (tokens 0, 1, 2, 3).
    assert permuted[:4, 0].tolist() == [1, 2, 3, 4]


def test_permute_keeps_the_first_num_out_tokens_rows() -> None:
    assert npu_moe_token_permute(TOKENS, INDICES, 5)[0].shape == (5, 2)
    assert npu_moe_token_permute(TOKENS, INDICES, -3)[0].shape == (5, 2)
    assert npu_moe_token_permute(TOKENS, INDICES, 0)[0].shape == (8, 2)


def test_unpermute_weights_and_sums_the_doc_example() -> None:
    permuted = torch.tensor([[1, 1], [2, 2], [3, 3], [4, 4]] * 2, dtype=torch.float16)
    sorted_indices = torch.tensor([0, 4, 5, 1, 2, 6, 7, 3], dtype=torch.int32)
    probs = torch.ones((4, 2), dtype=torch.float16) / 2
    out = npu_moe_token_unpermute(permuted, sorted_indices, probs=probs)
    assert out.dtype == torch.float16
    assert out.tolist() == [[1, 1], [2, 2], [3, 3], [4, 4]]
    # Without probs topK is 1: a pure gather back.
    assert torch.equal(
        npu_moe_token_unpermute(permuted, sorted_indices), permuted[[0, 4, 5, 1, 2, 6, 7, 3]]
    )


def test_permute_then_unpermute_round_trips() -> None:
    permuted, sorted_indices = npu_moe_token_permute(TOKENS, INDICES)
    probs = torch.ones((4, 2), dtype=torch.float16)
    assert torch.equal(npu_moe_token_unpermute(permuted, sorted_indices, probs), 2 * TOKENS)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: npu_moe_token_permute(TOKENS.int(), INDICES), "tokens: expected dtype in"),
        (lambda: npu_moe_token_permute(TOKENS[None], INDICES), "tokens: expected 2-D"),
        (lambda: npu_moe_token_permute(TOKENS, INDICES.float()), "indices: expected dtype in"),
        (
            lambda: npu_moe_token_permute(TOKENS, INDICES[:3]),
            "indices: expected (num_tokens=4, topK)",
        ),
        (
            lambda: npu_moe_token_permute(TOKENS, -INDICES - 1),
            "indices: expected values in [0, 16777215)",
        ),
        (lambda: npu_moe_token_permute(TOKENS, INDICES, None, True), "padded_mode: expected False"),
        (
            lambda: npu_moe_token_permute(
                TOKENS[:1].expand(1, 2), torch.zeros(1, 513, dtype=torch.int64)
            ),
            "indices: expected topK <= 512",
        ),
        (
            lambda: npu_moe_token_unpermute(TOKENS, torch.tensor([0, 0, 1, 2], dtype=torch.int32)),
            "sorted_indices: expected a permutation of [0, 3] (no repeated index)",
        ),
        (
            lambda: npu_moe_token_unpermute(TOKENS, torch.arange(4)),
            "sorted_indices: expected dtype in (int32)",
        ),
        (
            lambda: npu_moe_token_unpermute(TOKENS, torch.arange(4, dtype=torch.int32), TOKENS[:3]),
            "probs: expected 2-D (num_tokens, topK) with num_tokens * topK = 4",
        ),
        (
            lambda: npu_moe_token_unpermute(TOKENS, torch.arange(4, dtype=torch.int32), None, True),
            "padded_mode/restore_shape: expected False/None",
        ),
    ],
)
def test_permute_and_unpermute_reject_what_the_docs_rule_out(call, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        call()


X = torch.randn(7, 4)
WEIGHT = torch.randn(3, 4, 5)  # (G, K, N)


@pytest.mark.parametrize("group_list_type", [0, 1])
def test_grouped_matmul_multiplies_each_groups_rows_by_its_weight(group_list_type: int) -> None:
    counts = [2, 0, 5]
    group_list = torch.tensor(counts if group_list_type else [2, 2, 7])
    (y,) = npu_grouped_matmul(
        [X],
        [WEIGHT],
        group_list=group_list,
        split_item=2,
        group_type=0,
        group_list_type=group_list_type,
    )
    expected = torch.cat([X[:2] @ WEIGHT[0], X[2:] @ WEIGHT[2]])
    torch.testing.assert_close(y, expected)


def test_grouped_matmul_takes_a_transposed_weight_view() -> None:
    stored = WEIGHT.transpose(1, 2).contiguous()  # (G, N, K), as nn.Linear keeps it
    (y,) = npu_grouped_matmul(
        [X],
        [stored.transpose(1, 2)],
        group_list=torch.tensor([7, 7, 7]),
        split_item=3,
        group_type=0,
    )
    torch.testing.assert_close(y, X @ WEIGHT[0])


def _gmm(**overrides):
    arguments = {
        "x": [X],
        "weight": [WEIGHT],
        "group_list": torch.tensor([2, 2, 7]),
        "split_item": 2,
        "group_type": 0,
    }
    arguments.update(overrides)
    return lambda: npu_grouped_matmul(arguments.pop("x"), arguments.pop("weight"), **arguments)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (_gmm(group_list=torch.tensor([2, 2, 6])), "group_list: expected non-decreasing"),
        (_gmm(group_list=torch.tensor([3, 2, 7])), "group_list: expected non-decreasing"),
        (_gmm(group_list=torch.tensor([2, 7])), "group_list: expected 1-D of length 3"),
        (
            _gmm(group_list=torch.tensor([2, 2, 7], dtype=torch.int32)),
            "group_list: expected dtype in (int64)",
        ),
        (_gmm(group_list=torch.tensor([2, 0, 4]), group_list_type=1), "counts summing to M=7"),
        (_gmm(split_item=0), "split_item: expected 2 or 3"),
        (_gmm(act_type=5), "act_type: expected 0"),
        (_gmm(weight=[WEIGHT.half()]), "weight: expected dtype torch.float32 like x"),
        (_gmm(weight=[WEIGHT[:, :3]]), "weight: expected one 3-D (G, K=4, N)"),
        (_gmm(x=[X.t().contiguous().t()]), "x: expected one contiguous 2-D (M, K) tensor"),
        (_gmm(x=[X.int()], weight=[WEIGHT.int()]), "x: expected dtype in"),
    ],
)
def test_grouped_matmul_rejects_what_the_doc_rules_out(call, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        call()


@pytest.mark.parametrize(
    "overrides",
    [
        {"bias": [torch.zeros(3, 5)]},
        {"antiquant_scale": [torch.ones(3, 5)]},
        {"group_type": -1},
        {"x": [X, X]},
        {"group_list": None},
    ],
)
def test_grouped_matmul_scenarios_the_mock_does_not_model_are_not_implemented(overrides) -> None:
    with pytest.raises(NotImplementedError, match="mock npu_grouped_matmul"):
        _gmm(**overrides)()
