"""The sparse MoE adapter on each MoE family's real block (tiny text configs): the swapped block
computes what the stock block computes, forward and every gradient, with every experts
implementation transformers dispatches to; the ledger restores the block bit-identically; blocks
the op does not fit are left alone with the reason."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ascend_vlm._compat.experts import experts_problem
from ascend_vlm.models import _moe_blocks
from ascend_vlm.models.family_spec import SparseMoe
from ascend_vlm.models.tiny.moe_blocks import (
    MOE_BLOCK_FAMILIES,
    MOE_EXPERTS,
    MOE_HIDDEN,
    MOE_TOP_K,
    build_moe_block,
)
from ascend_vlm.patching.adapters import Part
from ascend_vlm.patching.ledger import Edits
from ascend_vlm.patching.moe import patch_moe
from ascend_vlm.patching.report import PatchReport
from ascend_vlm.patching.state import PatchState

pytestmark = pytest.mark.usefixtures("single_threaded_torch")

FP32 = {"atol": 1e-5, "rtol": 1e-5}
OPTIONS = {"attention": True, "vision": True, "norm": True, "rope": True, "mlp": True}
ENTRIES = {
    "qwen3_vl_moe": _moe_blocks.QWEN3_VL_MOE_BLOCKS,
    "qwen3_5_moe": _moe_blocks.QWEN3_5_MOE_BLOCKS,
    "glm4v_moe": _moe_blocks.GLM4V_MOE_BLOCKS,
    "llama4": _moe_blocks.LLAMA4_MOE_BLOCKS,
}
# Llama 4's experts are not decorated with use_experts_implementation: one implementation.
CASES = [
    (name, implementation)
    for name in MOE_BLOCK_FAMILIES
    for implementation in (
        ("eager",) if name == "llama4" else ("eager", "grouped_mm", "batched_mm")
    )
]


def _apply(block: nn.Module, entry: SparseMoe, **options: bool) -> tuple[PatchReport, Edits]:
    """`patch_moe` on one block, as `patch` runs it, through a fresh ledger record."""
    report, edits = PatchReport(model_type="test"), Edits()
    part = Part("text", list(block.modules()), {**OPTIONS, **options})
    patch_moe(PatchState(part.options, report, edits), block, entry, part)
    return report, edits


def _run(block: nn.Module, hidden: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """The block's output on ``hidden`` (its first output for Llama 4's (out, logits)) and the
    gradients of a fixed cotangent with respect to ``hidden`` and every parameter."""
    leaf = hidden.clone().requires_grad_(True)
    output = block(leaf)
    output = output[0] if isinstance(output, tuple) else output
    cotangent = torch.randn(output.shape, generator=torch.Generator().manual_seed(2))
    grads = torch.autograd.grad(output, [leaf, *block.parameters()], cotangent)
    return output.detach(), grads


@pytest.mark.parametrize(("name", "implementation"), CASES)
def test_swapped_block_equals_stock_forward_and_backward(name: str, implementation: str) -> None:
    block = build_moe_block(name, implementation)
    # Llama 4's block takes (T, H); the others (B, S, H).
    shape = (12, MOE_HIDDEN) if name == "llama4" else (2, 6, MOE_HIDDEN)
    hidden = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    expected, expected_grads = _run(block, hidden)
    report, edits = _apply(block, ENTRIES[name])
    assert report.swapped_count("moe") == 1, report
    assert "fused=ascend_vlm.ops.moe_experts" in repr(block.experts)
    got, got_grads = _run(block, hidden)
    torch.testing.assert_close(got, expected, **FP32)
    for index, (g, w) in enumerate(zip(got_grads, expected_grads, strict=True)):
        torch.testing.assert_close(g, w, **FP32, msg=lambda m, i=index: f"gradient {i}: {m}")
    edits.undo()
    assert "forward" not in vars(block) and "forward" not in vars(block.experts)
    assert torch.equal(_run(block, hidden)[0], expected)


def test_every_choice_reaches_its_expert_when_all_tokens_pick_the_same_one() -> None:
    """No capacity: twelve tokens routed to expert 0 twice each all get both contributions."""
    block = build_moe_block("qwen3_vl_moe")
    hidden = torch.randn(12, MOE_HIDDEN, generator=torch.Generator().manual_seed(4))
    indices = torch.zeros(12, MOE_TOP_K, dtype=torch.int64)
    weights = torch.full((12, MOE_TOP_K), 0.5)
    with torch.no_grad():
        expected = block.experts(hidden, indices, weights)
        _apply(block, ENTRIES["qwen3_vl_moe"])
        got = block.experts(hidden, indices, weights)
    torch.testing.assert_close(got, expected, **FP32)


def test_blocks_the_op_does_not_fit_are_left_alone_with_the_reason() -> None:
    entry = ENTRIES["qwen3_vl_moe"]
    disabled = build_moe_block("qwen3_vl_moe")
    report, _ = _apply(disabled, entry, mlp=False)
    assert report.left_alone == {
        (
            "moe",
            "Qwen3VLMoeTextSparseMoeBlock",
            "disabled by patch(mlp=False) or patch(vision=False)",
        ): 1
    }
    gelu = build_moe_block("qwen3_vl_moe")
    gelu.experts.act_fn = nn.GELU()
    report, _ = _apply(gelu, entry)
    assert [why for (_, _, why) in report.left_alone] == [
        "Qwen3VLMoeTextExperts.act_fn is GELU, ops.moe_experts computes silu(gate) * up"
    ]
    assert "forward" not in vars(gelu.experts)
    with_bias = build_moe_block("qwen3_vl_moe")
    with_bias.experts.has_bias = True
    assert experts_problem(with_bias.experts, transposed=False) == (
        "Qwen3VLMoeTextExperts.has_bias is True, ops.moe_experts needs False"
    )
    assert experts_problem(build_moe_block("qwen3_vl_moe").experts, transposed=True) == (
        "Qwen3VLMoeTextExperts.is_transposed is False, the family spec says True"
    )


def test_a_llama4_block_whose_experts_were_replaced_runs_its_stock_forward() -> None:
    block = build_moe_block("llama4")
    hidden = torch.randn(6, MOE_HIDDEN, generator=torch.Generator().manual_seed(5))
    _apply(block, ENTRIES["llama4"])
    calls = []
    stock_experts = block.experts
    block.experts = nn.Module()
    block.experts.forward = lambda routed: calls.append(routed.shape) or stock_experts(routed)
    with torch.no_grad():
        block(hidden)
    assert calls == [(MOE_EXPERTS * 6, MOE_HIDDEN)]  # the stock block's dense call
