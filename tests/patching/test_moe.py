"""The sparse MoE adapter on each MoE family's real block (tiny text configs): the swapped block
computes what the stock block computes, forward and every gradient, with every experts
implementation transformers dispatches to; the ledger restores the block bit-identically; blocks
the op does not fit are left alone with the reason. Then a LoRA on the tiny Qwen3-VL-MoE model
trains patched exactly as stock, and sharpened attention keeps its M-RoPE positions."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from torch import nn

import ascend_vlm
from ascend_vlm._compat.experts import experts_problem
from ascend_vlm.models import _moe_blocks
from ascend_vlm.models.family_spec import SparseMoe
from ascend_vlm.models.tiny import FAMILIES, build_model, make_inputs
from ascend_vlm.models.tiny.moe_blocks import (
    MOE_BLOCK_FAMILIES,
    MOE_EXPERTS,
    MOE_HIDDEN,
    MOE_TOP_K,
    build_moe_block,
)
from ascend_vlm.patching.ledger import Edits
from ascend_vlm.patching.moe import patch_moe
from ascend_vlm.patching.part import Part
from ascend_vlm.patching.report import PatchReport
from ascend_vlm.patching.state import PatchState

pytestmark = pytest.mark.usefixtures("single_threaded_torch")

FP32 = {"atol": 1e-5, "rtol": 1e-5}
SHARPENING = 4.0
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
    copied = copy.deepcopy(block)  # the rebound forward follows the copy's own modules
    with torch.no_grad():
        copied.experts.down_proj.zero_()
    assert torch.equal(_run(block, hidden)[0], got)
    assert not torch.equal(_run(copied, hidden)[0], got)
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


def _lora_model(patched: bool):
    """The tiny Qwen3-VL-MoE model (patched or not) under one seeded LoRA on q_proj/v_proj and
    on the sparse blocks' expert weights (PEFT ``target_parameters``), B non-zero."""
    peft = pytest.importorskip("peft")
    model = build_model("qwen3_vl_moe")
    if patched:
        ascend_vlm.patch(model)
    config = peft.LoraConfig(
        r=2,
        target_modules=["q_proj", "v_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        lora_dropout=0.0,
    )
    torch.manual_seed(1)
    lora = peft.get_peft_model(model, config)
    for name, parameter in lora.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(parameter, std=0.1, generator=torch.Generator().manual_seed(3))
    return lora.train()


def _loss_and_grads(model, inputs: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    loss = model(**inputs, labels=inputs["input_ids"]).loss
    loss.backward()
    return loss.detach(), {
        n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad
    }


def test_lora_on_the_moe_model_trains_patched_as_stock() -> None:
    stock, patched = _lora_model(patched=False), _lora_model(patched=True)
    inputs = make_inputs("qwen3_vl_moe", stock, n_images=1)
    stock_loss, stock_grads = _loss_and_grads(stock, inputs)
    loss, grads = _loss_and_grads(patched, inputs)
    assert torch.isfinite(loss)
    torch.testing.assert_close(loss, stock_loss, atol=1e-5, rtol=1e-5)
    assert sorted(grads) == sorted(stock_grads)
    assert any("experts" in n and "lora_A" in n for n in grads)  # the experts' LoRA is on the path
    for name, grad in grads.items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(grad, stock_grads[name], atol=1e-5, rtol=1e-4, msg=name)
    adapters = {n: p.detach().clone() for n, p in patched.named_parameters() if p.requires_grad}
    torch.optim.SGD([p for p in patched.parameters() if p.requires_grad], lr=0.1).step()
    changed = [n for n, p in patched.named_parameters() if not torch.equal(p, adapters.get(n, p))]
    assert sorted(changed) == sorted(adapters)
    stepped_loss, _ = _loss_and_grads(patched, inputs)
    assert torch.isfinite(stepped_loss) and stepped_loss != loss


def test_sharpened_attention_keeps_the_interleaved_mrope_positions() -> None:
    """Tiny random models attend almost uniformly; scaled-up q/k norms (the text attention
    normalises q and k per head) and vision qkv make attention peaked, so a rotary applied at a
    wrong position or M-RoPE section would change the logits."""
    torch.manual_seed(0)
    config = FAMILIES["qwen3_vl_moe"].config()
    config._attn_implementation = "eager"
    model = getattr(transformers, FAMILIES["qwen3_vl_moe"].model_class)(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight", "attn.qkv.weight")):
                parameter.mul_(SHARPENING)
    inputs = make_inputs("qwen3_vl_moe", model, n_images=1, text_len=12)
    with torch.no_grad():
        expected = model(**inputs, output_attentions=True)
        ascend_vlm.patch(model)
        got = model(**inputs).logits
    # most text queries put over half their weight on one key
    peaks = torch.stack([a.amax(-1).median() for a in expected.attentions])
    assert peaks.min() > 0.5, peaks
    torch.testing.assert_close(got, expected.logits, atol=1e-4, rtol=1e-4)
