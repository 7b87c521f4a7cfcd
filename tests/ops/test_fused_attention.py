"""fused_attention specifics: gradients, dropout, fully masked rows, input errors (the naive-formula
comparisons for both paths live in test_op_info.py)."""

from __future__ import annotations

import importlib
import math

import pytest
import torch
import torch.nn.functional as F
from _op_samples import AttentionCase, KernelSpy, on_device, to_bsh
from _recording import RecordOps

from ascend_vlm import ops
from ascend_vlm.kernel_backend import using_backend
from ascend_vlm.ops._attention_args import check_attention_args

attention_module = importlib.import_module("ascend_vlm.ops.fused_attention")


def _implementation(implementation):
    """``implementation`` of fused_attention called as the op is (checked arguments, spec
    order): the registered op would be one opaque call to RecordOps."""

    def call(*args, **kwargs):
        bound = attention_module.SPEC.signature().bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = tuple(bound.arguments.values())
        return implementation(check_attention_args(*arguments), *arguments)

    return call


attention_reference = _implementation(attention_module._reference)
npu_fused_attention = _implementation(attention_module._npu)


def _fp64_case(**overrides) -> AttentionCase:
    base = dict(
        layout="BNSD",
        batch=2,
        kv_heads=1,
        group=2,
        q_len=3,
        kv_len=4,
        head_dim=3,
        mask_kind="left_pad",
        causal=True,
        scale=None,
        dtype=torch.float64,
        seed=7,
        pad_counts=(1, 4),
    )
    return AttentionCase(**{**base, **overrides})


GRAD_CASES = [
    _fp64_case(),
    _fp64_case(layout="BSH", mask_kind="right_pad", causal=False, pad_counts=(0, 2)),
    _fp64_case(mask_kind="additive", q_len=4, kv_len=2, scale=0.7),
    _fp64_case(mask_kind="bool_4d", q_len=1, kv_len=5, group=1, kv_heads=2),
]


@pytest.mark.parametrize("case", GRAD_CASES, ids=lambda c: f"{c.layout}-{c.mask_kind}")
def test_gradcheck_fp64(case: AttentionCase) -> None:
    (q, k, v), kwargs = case.op_args()
    inputs = tuple(t.requires_grad_() for t in (q, k, v))
    assert torch.autograd.gradcheck(lambda *t: ops.fused_attention(*t, **kwargs), inputs)


def test_npu_path_gradients_match_reference(mock_npu) -> None:
    case = _fp64_case(dtype=torch.float32, seed=3)
    args, kwargs = on_device(*case.op_args(), mock_npu.device)
    grads = []
    for use_mock in (True, False):
        inputs = [t.detach().clone().requires_grad_() for t in args]
        if use_mock:
            out = ops.fused_attention(*inputs, **kwargs)
        else:
            with using_backend("cpu"):
                out = ops.fused_attention(*inputs, **kwargs)
        grads.append(torch.autograd.grad(out.square().sum(), inputs))
    for from_npu_path, from_reference in zip(*grads, strict=True):
        torch.testing.assert_close(from_npu_path, from_reference, atol=1e-5, rtol=1e-5)


# --- dropout: applied whenever dropout_p > 0, whatever the grad mode (as SDPA does) -------

DROPOUT_P = 0.4


DROPOUT_CASES = [
    _fp64_case(),
    _fp64_case(layout="BSH", mask_kind="additive", causal=False, scale=0.7, group=1, kv_heads=2),
    _fp64_case(mask_kind="none", q_len=4, kv_len=4),  # plain causal over square scores
]


def _dropout_case_id(case: AttentionCase) -> str:
    return f"{case.layout}-{case.mask_kind}-{'causal' if case.causal else 'full'}"


def _naive_dropout_attention(case: AttentionCase, seed: int, p: float) -> torch.Tensor:
    """float64 softmax attention whose probabilities are kept where the float32
    ``torch.rand([B, Nq, Sq, Skv])`` of a generator seeded with ``seed`` is ``>= p`` and scaled
    by ``1 / (1 - p)`` (the documented contract); rows with no visible key are 0."""
    q, k, v = case.bnsd_inputs()
    k = k.repeat_interleave(case.group, dim=1)
    v = v.repeat_interleave(case.group, dim=1)
    scale = 1.0 / math.sqrt(case.head_dim) if case.scale is None else case.scale
    scores = q @ k.transpose(-1, -2) * scale
    keep = case.expected_keep()
    keep = torch.ones(scores.shape, dtype=torch.bool) if keep is None else keep.expand_as(scores)
    dead = ~keep.any(dim=-1, keepdim=True)
    weights = torch.softmax(scores.masked_fill(~keep & ~dead, -math.inf), dim=-1)
    kept = torch.rand(weights.shape, generator=torch.Generator().manual_seed(seed)) >= p
    out = ((weights * kept / (1 - p)) @ v).masked_fill(dead, 0.0)
    return to_bsh(out) if case.layout == "BSH" else out


def _seed_drawn_after(manual_seed: int) -> int:
    """The dropout seed the wrapper draws right after ``torch.manual_seed(manual_seed)``."""
    torch.manual_seed(manual_seed)
    return int(torch.randint(2**62, ()))


@pytest.mark.parametrize("mode", ["no_grad", "grad", "requires_grad"])
@pytest.mark.parametrize("case", DROPOUT_CASES, ids=_dropout_case_id)
def test_dropout_applies_whatever_the_grad_mode(case: AttentionCase, mode: str) -> None:
    (q, k, v), kwargs = case.op_args()
    if mode == "requires_grad":  # the registered op (autograd) instead of the eager fast path
        q.requires_grad_()
    seed = _seed_drawn_after(5)
    torch.manual_seed(5)
    with torch.set_grad_enabled(mode != "no_grad"):
        out = ops.fused_attention(q, k, v, dropout_p=DROPOUT_P, **kwargs)
    expected = _naive_dropout_attention(case, seed, DROPOUT_P)
    torch.testing.assert_close(out.detach(), expected, atol=1e-12, rtol=1e-12)
    no_dropout = ops.fused_attention(q, k, v, **kwargs).detach()
    assert not torch.allclose(out.detach(), no_dropout)


def test_the_seed_comes_from_torchs_rng_and_an_explicit_seed_wins() -> None:
    (q, k, v), kwargs = DROPOUT_CASES[0].op_args()
    torch.manual_seed(3)
    first = ops.fused_attention(q, k, v, dropout_p=DROPOUT_P, **kwargs)
    second = ops.fused_attention(q, k, v, dropout_p=DROPOUT_P, **kwargs)
    torch.manual_seed(3)
    assert torch.equal(ops.fused_attention(q, k, v, dropout_p=DROPOUT_P, **kwargs), first)
    assert not torch.equal(first, second)  # one fresh seed per call
    explicit = ops.fused_attention(q, k, v, dropout_p=DROPOUT_P, dropout_seed=11, **kwargs)
    torch.testing.assert_close(
        explicit, _naive_dropout_attention(DROPOUT_CASES[0], 11, DROPOUT_P), atol=1e-12, rtol=1e-12
    )


def test_npu_path_drops_the_same_entries(mock_npu, monkeypatch) -> None:
    """On the NPU path dropout runs through the reference (the kernel's own mask cannot be
    recomputed by backward), outside grad mode too."""
    spy = KernelSpy(monkeypatch, mock_npu.torch_npu, "npu_fusion_attention")
    case = _fp64_case(dtype=torch.float32)
    args, kwargs = on_device(*case.op_args(), mock_npu.device)
    with torch.no_grad():
        out = ops.fused_attention(*args, dropout_p=DROPOUT_P, dropout_seed=11, **kwargs)
        assert spy.calls == 0
        ops.fused_attention(*args, **kwargs)
        assert spy.calls == 1  # the mock is really in place
    expected = _naive_dropout_attention(case, 11, DROPOUT_P).float()
    torch.testing.assert_close(out.cpu(), expected, atol=1e-5, rtol=1e-5)


def test_gradients_see_the_forwards_mask() -> None:
    """A fixed seed makes the op a function of its inputs: finite differences agree with the
    backward, which recomputes the forward."""
    (q, k, v), kwargs = DROPOUT_CASES[1].op_args()
    inputs = tuple(t.requires_grad_() for t in (q, k, v))
    assert torch.autograd.gradcheck(
        lambda *t: ops.fused_attention(*t, dropout_p=0.5, dropout_seed=11, **kwargs), inputs
    )


def test_registered_op_needs_a_seed_for_dropout() -> None:
    q, k, v = DROPOUT_CASES[0].bnsd_inputs()
    with pytest.raises(ValueError, match=r"dropout_seed: expected an int when dropout_p > 0"):
        torch.ops.ascend_vlm.fused_attention(q, k, v, dropout_p=DROPOUT_P)


def test_fully_masked_rows_are_zero_not_nan() -> None:
    q, k, v = (torch.randn(1, 2, 3, 4) for _ in range(3))
    out = ops.fused_attention(q, k, v, attention_mask=torch.zeros(1, 3, dtype=torch.bool))
    assert torch.equal(out, torch.zeros_like(out))


def test_reference_reads_a_mask_once_and_again_after_an_in_place_change() -> None:
    """Dead rows of a mask-only call are asked once per mask object and version (transformers
    hands one mask to every layer); a row killed in place is still zeroed."""
    q, k, v = (torch.randn(2, 2, 3, 4) for _ in range(3))
    mask = torch.ones(2, 1, 3, 3, dtype=torch.bool)

    def attend() -> torch.Tensor:
        return attention_reference(q, k, v, mask)

    assert _host_reads(attend) == 1
    assert _host_reads(attend) == 0
    mask[1, :, 2] = False  # query 2 of batch 1 now sees no key
    out = attend()
    assert torch.equal(out[1, :, 2], torch.zeros_like(out[1, :, 2]))
    torch.testing.assert_close(out[:, :, :2], F.scaled_dot_product_attention(q, k, v)[:, :, :2])


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [((1, 257, 2, 4), torch.float32), ((1, 2, 2, 4), torch.float64)],
    ids=["257-heads", "fp64"],
)
def test_npu_path_keeps_what_the_kernel_cannot_take_on_the_reference(
    shape, dtype, mock_npu, monkeypatch
) -> None:
    spy = KernelSpy(monkeypatch, mock_npu.torch_npu, "npu_fusion_attention")
    q = torch.randn(shape, dtype=dtype, device=mock_npu.device)
    out = ops.fused_attention(q, q, q, causal=True)
    assert spy.calls == 0
    with using_backend("cpu"):
        torch.testing.assert_close(out, ops.fused_attention(q, q, q, causal=True))


def _host_reads(call) -> int:
    """How many device-to-host reads (``bool(t)``, ``t.item()``) `call` makes."""
    with RecordOps() as recorder:
        call()
    return sum(name.startswith("aten._local_scalar_dense") for name in recorder.names)


def test_npu_path_reads_no_mask_values_on_the_host(mock_npu, monkeypatch) -> None:
    spy = KernelSpy(monkeypatch, mock_npu.torch_npu, "npu_fusion_attention")
    q, k, v = (torch.randn(2, 2, 3, 4, device=mock_npu.device) for _ in range(3))
    padding = torch.tensor([[True] * 3, [False] * 3], device=mock_npu.device)  # row 1 dead
    additive = torch.zeros(2, 1, 3, 3, device=mock_npu.device)
    additive[0, ..., 0] = torch.finfo(torch.float32).min

    def attend(mask: torch.Tensor) -> torch.Tensor:
        return npu_fused_attention(q, k, v, mask, causal=True)

    outputs = {}
    assert _host_reads(lambda: outputs.setdefault("bool", attend(padding))) == 0
    assert _host_reads(lambda: attend(additive)) == 1  # the first layer sees a new mask ...
    assert _host_reads(lambda: outputs.setdefault("float", attend(additive))) == 0  # ... others not
    assert spy.calls == 3
    additive[1, ..., 1] = 0.5  # a real bias, written in place: read again, kept off the kernel
    outputs["bias"] = attend(additive)
    assert spy.calls == 3
    pure = additive.clone()
    pure[1, ..., 1] = 0.0
    for name, mask in (("bool", padding), ("float", pure), ("bias", additive)):
        with using_backend("cpu"):
            expected = ops.fused_attention(q, k, v, attention_mask=mask, causal=True)
        torch.testing.assert_close(outputs[name], expected, msg=name)
    assert torch.equal(outputs["bool"][1], torch.zeros_like(outputs["bool"][1]))


@pytest.mark.parametrize(
    "options",
    [
        {"causal": True},  # non-square causal: dead-row handling in the reference
        {"attention_mask": torch.tensor([[False, False, True, True, True]])},
    ],
    ids=["causal", "padding_mask"],
)
def test_compiled_backward_matches_eager(options: dict) -> None:
    """Backward recomputes the reference on traced tensors: no host read of their values."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 3, 8, generator=gen)
    k, v = (torch.randn(1, 2, 5, 8, generator=gen) for _ in range(2))

    def grads(function) -> tuple[torch.Tensor, ...]:
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        function(*leaves).square().sum().backward()
        return tuple(leaf.grad for leaf in leaves)

    def attend(*qkv: torch.Tensor) -> torch.Tensor:
        return ops.fused_attention(*qkv, **options)

    torch._dynamo.reset()
    compiled = torch.compile(attend, fullgraph=True, backend="aot_eager", dynamic=True)
    torch.testing.assert_close(grads(compiled), grads(attend))
