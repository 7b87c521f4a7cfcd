"""ops.moe_experts equals each family's transformers MoE block (tiny text configs), forward and
backward, with every experts implementation transformers offers; and its NPU path (mock
torch_npu) equals its CPU reference, through the kernels the module docstring names."""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from _op_samples import KernelSpy, on_device

from ascend_vlm import ops
from ascend_vlm.models.tiny.moe_blocks import MOE_HIDDEN as HIDDEN
from ascend_vlm.models.tiny.moe_blocks import MOE_TOP_K as TOP_K
from ascend_vlm.models.tiny.moe_blocks import build_moe_block

TOKENS = 12
FP32 = {"atol": 1e-5, "rtol": 1e-5}
# transformers' implementations of experts classes decorated with use_experts_implementation
# (integrations/moe.py); Llama 4's experts are not, and run all experts densely.
IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm")


def _route(block: torch.nn.Module, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The (weights, indices) the block's router gives ``hidden``."""
    _, weights, indices = block.gate(hidden)
    return weights, indices


def _route_llama4(
    block: torch.nn.Module, hidden: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama 4's router returns dense (T, E) scores (sigmoid of the top-k logits, 0 elsewhere):
    the top-k indices of the logits and their scores."""
    scores, logits = block.router(hidden)
    indices = torch.topk(logits, TOP_K, dim=1).indices
    return scores.gather(1, indices), indices


@dataclass(frozen=True)
class Family:
    """``route``: the family MoE block's router's (weights, indices);
    ``shared``: what the block adds beside the routed experts; ``output``: the block's
    output tensor (B, S, H) or (T, H); ``options``: the op's layout and routing for the family."""

    route: Callable[[torch.nn.Module, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    shared: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]
    output: Callable[[object], torch.Tensor]
    options: dict
    decorated: bool = True


def _no_shared(_block: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(hidden)


FAMILIES = {
    "qwen3_vl_moe": Family(
        _route,
        _no_shared,
        lambda out: out,
        {},
    ),
    "qwen3_5_moe": Family(
        _route,
        lambda block, h: F.sigmoid(block.shared_expert_gate(h)) * block.shared_expert(h),
        lambda out: out,
        {},
    ),
    "glm4v_moe": Family(
        _route,
        lambda block, h: block.shared_experts(h),
        lambda out: out,
        {},
    ),
    "llama4": Family(
        _route_llama4,
        lambda block, h: block.shared_expert(h),
        lambda out: out[0],
        {"transposed": True, "routing_weights_on": "input"},
        decorated=False,
    ),
}
CASES = [
    (family, implementation)
    for family, info in FAMILIES.items()
    for implementation in (IMPLEMENTATIONS if info.decorated else ("eager",))
]


def _experts(block: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    return block.experts.gate_up_proj, block.experts.down_proj


@pytest.mark.parametrize(("name", "implementation"), CASES)
def test_equals_the_family_block_forward_and_backward(name: str, implementation: str) -> None:
    family = FAMILIES[name]
    block = build_moe_block(name, implementation)
    hidden = torch.randn(2, TOKENS // 2, HIDDEN, generator=torch.Generator().manual_seed(1))
    leaf = hidden.clone().requires_grad_(True)
    expected = family.output(block(leaf)).reshape(TOKENS, HIDDEN)

    ours_leaf = hidden.clone().requires_grad_(True)
    tokens = ours_leaf.reshape(TOKENS, HIDDEN)  # what each block feeds its router and experts
    weights, indices = family.route(block, tokens)
    gate_up, down = _experts(block)
    routed = ops.moe_experts(tokens, weights, indices, gate_up, down, **family.options)
    ours = routed + family.shared(block, tokens)
    torch.testing.assert_close(ours, expected, **FP32)

    # LoRA on an MoE model trains: gradients reach the input, the router and the experts.
    cotangent = torch.randn(expected.shape, generator=torch.Generator().manual_seed(2))
    watched = [*_experts(block), *(p for n, p in block.named_parameters() if "expert" not in n)]
    want = torch.autograd.grad(expected, [leaf, *watched], cotangent)
    got = torch.autograd.grad(ours, [ours_leaf, *watched], cotangent, allow_unused=True)
    for index, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g, w, **FP32, msg=lambda m, i=index: f"gradient {i}: {m}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_npu_path_equals_the_reference(
    name: str, dtype: torch.dtype, mock_npu, monkeypatch
) -> None:
    """Same routed output on the mock NPU as on CPU; bfloat16 permutes with the MoE kernels,
    fp16/fp32 with torch's sort and gather, all with two grouped matmuls and one swiglu."""
    family = FAMILIES[name]
    block = build_moe_block(name).to(dtype)
    hidden = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(3)).to(dtype)
    with torch.no_grad():
        weights, indices = family.route(block, hidden)
        args = (hidden, weights, indices, *_experts(block))
        reference = ops.moe_experts(*args, **family.options)
        spies = {
            kernel: KernelSpy(monkeypatch, mock_npu.torch_npu, kernel)
            for kernel in (
                "npu_moe_token_permute",
                "npu_grouped_matmul",
                "npu_swiglu",
                "npu_moe_token_unpermute",
            )
        }
        on_npu, options = on_device(args, family.options, mock_npu.device)
        out = ops.moe_experts(*on_npu, **options)
    permutes = int(dtype == torch.bfloat16)
    assert {kernel: spy.calls for kernel, spy in spies.items()} == {
        "npu_moe_token_permute": permutes,
        "npu_grouped_matmul": 2,
        "npu_swiglu": 1,
        "npu_moe_token_unpermute": permutes,
    }
    tolerance = FP32 if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(out.cpu().float(), reference.float(), **tolerance)


def test_no_token_is_dropped_when_every_token_picks_one_expert() -> None:
    """All T*K choices on one expert: each token still gets its K contributions."""
    block = build_moe_block("qwen3_vl_moe")
    hidden = torch.randn(TOKENS, HIDDEN)
    indices = torch.zeros(TOKENS, TOP_K, dtype=torch.int64)
    weights = torch.full((TOKENS, TOP_K), 0.5)
    with torch.no_grad():
        out = ops.moe_experts(hidden, weights, indices, *_experts(block))
        expected = block.experts(hidden, indices, weights)
    torch.testing.assert_close(out, expected, **FP32)


def test_expert_indices_outside_the_experts_raise_on_the_reference_path() -> None:
    """A value rule: checked where the reference reads the counts, not by the fake."""
    hidden, weights = torch.randn(3, 4), torch.rand(3, 2)
    gate_up, down = torch.randn(3, 10, 4), torch.randn(3, 4, 5)
    for indices, values in (
        ([[0, 1], [1, 3], [2, 0]], "[0, 3]"),
        ([[0, -1], [1, 2], [2, 0]], "[-1, 2]"),
    ):
        message = f"selected_experts: expected expert indices in [0, 2] (E=3 experts in gate_up_proj), got values in {values}"
        with pytest.raises(ValueError, match=re.escape(message)):
            ops.moe_experts(hidden, weights, torch.tensor(indices), gate_up, down)


def test_no_tokens_give_an_empty_output() -> None:
    out = ops.moe_experts(
        torch.randn(0, 4),
        torch.rand(0, 2),
        torch.zeros(0, 2, dtype=torch.int64),
        torch.randn(3, 10, 4),
        torch.randn(3, 4, 5),
    )
    assert out.shape == (0, 4)


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_grouped_gemm_and_the_per_expert_loop_agree(
    dtype: torch.dtype, transposed: bool
) -> None:
    """The reference's two plans: torch's grouped GEMM where it takes the call (16-byte
    aligned rows), a matmul pair per expert otherwise; values and gradients agree."""
    module = importlib.import_module("ascend_vlm.ops.moe_experts")
    generator = torch.Generator().manual_seed(4)
    counts = [3, 0, 5, 1]
    rows = torch.randn(9, 16, generator=generator).to(dtype).requires_grad_(True)
    shapes = ((4, 16, 16), (4, 8, 16)) if transposed else ((4, 16, 16), (4, 16, 8))
    gate_up, down = (
        torch.randn(shape, generator=generator).to(dtype).requires_grad_(True) for shape in shapes
    )
    assert module._cpu_grouped_mm_takes(rows, gate_up, down)
    assert not module._cpu_grouped_mm_takes(rows[:, :15], gate_up, down)
    results = []
    for plan in (module._experts_grouped, module._experts_looped):
        out = plan(rows, counts, gate_up, down, transposed)
        cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(dtype)
        results.append((out, *torch.autograd.grad(out, [rows, gate_up, down], cotangent)))
    tolerance = FP32 if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    for grouped, looped in zip(*results, strict=True):
        torch.testing.assert_close(grouped, looped, **tolerance)


@pytest.mark.parametrize(
    ("soc", "dtype"),
    [
        ("Ascend910A", torch.bfloat16),
        ("Ascend310P3", torch.float16),
        ("Ascend910B1", torch.float64),
    ],
)
def test_other_socs_and_float64_run_the_reference_on_the_device(
    soc: str, dtype: torch.dtype, mock_npu, monkeypatch
) -> None:
    """The MoE kernels are documented for Atlas A2/A3 and fp16/bf16/fp32 only."""
    monkeypatch.setattr(mock_npu.torch_npu.npu, "get_device_name", lambda device=None: soc)
    block = build_moe_block("qwen3_vl_moe").to(dtype)
    hidden = torch.randn(TOKENS, HIDDEN, dtype=dtype)
    with torch.no_grad():
        args = (hidden, *_route(block, hidden), *_experts(block))
        reference = ops.moe_experts(*args)
        spies = [
            KernelSpy(monkeypatch, mock_npu.torch_npu, kernel)
            for kernel in ("npu_moe_token_permute", "npu_grouped_matmul")
        ]
        out = ops.moe_experts(*on_device(args, {}, mock_npu.device)[0])
    assert [spy.calls for spy in spies] == [0, 0]
    torch.testing.assert_close(out.cpu(), reference)
