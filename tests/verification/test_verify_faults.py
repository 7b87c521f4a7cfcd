"""`ascend_vlm.verify` on the mock NPU, for every supported family's tiny model patched: with
no fault nothing is flagged; with one kernel fault injected on purpose
(`ascend_vlm.testing.faults`), the first flagged capture is the first capture the fault
changes, with the fault's op kind.

The first capture a fault changes is found apart from verify's reference and noise floor: the
patched model runs twice under the same capture points, with and without the fault, and the
first capture (in execution order) the fault moves by more than a few units of the dtype's
rounding is where the fault shows.

The attention-scale fault runs in fp16: a softmax scale off by 1% moves an attention output by
about as much as bf16's own rounding does (the stock bf16 model's error at that output), so
in bf16 it is within k = 4 times the floor; fp16's floor is 8 times lower.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ascend_vlm
from ascend_vlm.models import descriptor_for
from ascend_vlm.models.tiny import FAMILIES, build_model, make_inputs
from ascend_vlm.patching import apply_feature, remove_feature
from ascend_vlm.patching.attention_tap import AttentionTap
from ascend_vlm.testing import faults
from ascend_vlm.verification.capture import capturing
from ascend_vlm.verification.capture_points import capture_points
from ascend_vlm.verification.reference import cast_floating

pytestmark = [pytest.mark.usefixtures("single_threaded_torch"), pytest.mark.mock_npu]

# For the attention-scale fault, each attention's queries and keys are scaled so that its
# logits q.k * scaling spread with this standard deviation: sharp enough for a 1% scale error
# to move the output beyond fp16's rounding, not so sharp that softmax saturates.
_LOGIT_SPREAD = 1.5
_QK_LEAVES = ("q_proj", "k_proj", "q_norm", "k_norm")


def _logit_spreads(model: nn.Module, inputs: dict) -> dict[nn.Module, float]:
    """Each attention module's standard deviation of q.k * scaling on ``inputs``."""
    attention = [
        model.get_submodule(point.module)
        for point in capture_points(model)
        if point.kind.startswith("attention")
        and hasattr(model.get_submodule(point.module), "config")
    ]
    spreads = {}

    def measure(module, query, key, mask, scaling):
        key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        spreads.setdefault(module, (query @ key.transpose(-1, -2) * scale).std().item())

    apply_feature(model, tap := AttentionTap(attention, measure))
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        remove_feature(model, tap)
    return spreads


def _sharpen(model: nn.Module, inputs: dict) -> None:
    """Scale the queries and keys of every attention module to logits of spread
    ``_LOGIT_SPREAD``: its q/k projections' parameters (the q and k rows of a fused ``qkv``),
    and its q/k norms' scale (offset-aware: ``offset + weight`` scales)."""
    spec = descriptor_for(model.config).patch(model.config)
    offsets = {c: n.offset for n in spec.text.norms + spec.vision.norms for c in n.classes}
    with torch.no_grad():
        for attention, spread in _logit_spreads(model, inputs).items():
            factor = (_LOGIT_SPREAD / spread) ** 0.5
            for leaf, module in attention.named_children():
                if leaf in _QK_LEAVES and leaf.endswith("norm") and hasattr(module, "weight"):
                    offset = offsets.get(type(module).__name__, 0.0)
                    module.weight.copy_(factor * (offset + module.weight) - offset)
                elif leaf in _QK_LEAVES:
                    for parameter in module.parameters():
                        parameter.mul_(factor)
                elif leaf == "qkv" and isinstance(module, nn.Linear):
                    rows = 2 * module.out_features // 3
                    module.weight[:rows].mul_(factor)
                    if module.bias is not None:
                        module.bias[:rows].mul_(factor)


def _patched(family: str, dtype: torch.dtype, sharpen: bool) -> tuple[nn.Module, dict]:
    # sdpa: the attention tap runs the module's implementation, and eager's is the text one
    # for Llama 4's vision attention.
    model = build_model(family, attn_implementation="sdpa" if sharpen else "eager")
    inputs = make_inputs(family, model, n_images=1)
    if sharpen:
        _sharpen(model, inputs)
    inputs = {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}
    cast_floating(model, dtype)
    ascend_vlm.patch(model)
    return model, inputs


def _captures(model: nn.Module, inputs: dict) -> dict:
    captured = {}

    def keep(key, tensors):
        captured[key] = tuple(t.detach().clone() for t in tensors)

    with capturing(model, capture_points(model), keep), torch.no_grad():
        model(**inputs)
    return captured


def _relative_change(clean: tuple, faulty: tuple) -> float:
    clean_values = torch.cat([t.double().reshape(-1) for t in clean])
    faulty_values = torch.cat([t.double().reshape(-1) for t in faulty])
    return ((faulty_values - clean_values).norm() / clean_values.norm()).item()


def _first_changed(model: nn.Module, inputs: dict, fault, dtype: torch.dtype):
    """The first capture the fault moves by more than 4 units of ``dtype``'s rounding
    (relative L2 of the faulty run against the clean one)."""
    clean = _captures(model, inputs)
    with fault():
        faulty = _captures(model, inputs)
    limit = 4 * torch.finfo(dtype).eps
    return next((k for k, t in clean.items() if _relative_change(t, faulty[k]) > limit), None)


def _moe_families() -> list[str]:
    return [
        name
        for name, family in FAMILIES.items()
        if descriptor_for(family.config()).patch(family.config()).text.moes
    ]


# Fault -> (its injector, the test dtype, whether attention is sharpened).
FAULTS = {
    "rope": (faults.rope_sin_flipped, torch.bfloat16, False),
    "norm": (faults.rms_norm_eps_scaled, torch.bfloat16, False),
    "attention": (faults.attention_scale_off, torch.float16, True),
    "moe": (faults.moe_expert_swapped, torch.bfloat16, False),
}
CASES = [(family, fault) for family in FAMILIES for fault in FAULTS if fault != "moe"] + [
    (family, "moe") for family in _moe_families()
]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_patched_model_without_fault_flags_nothing(family) -> None:
    model, inputs = _patched(family, torch.bfloat16, sharpen=False)
    report = ascend_vlm.verify(model, inputs)
    assert report.modules and report.first_flagged is None, str(report)
    assert report.patched and report.dtype == "bfloat16" and not report.not_captured
    assert {m.kind for m in report.modules} >= {"decoder-layer", "vision-block", "projector"}


@pytest.mark.parametrize(("family", "fault"), CASES, ids=[f"{f}-{k}" for f, k in CASES])
def test_verify_names_the_first_faulty_module_and_its_op_kind(family, fault) -> None:
    inject, dtype, sharpen = FAULTS[fault]
    model, inputs = _patched(family, dtype, sharpen)
    expected = _first_changed(model, inputs, inject, dtype)
    assert expected is not None, f"the {fault} fault changes nothing in {family}"
    with inject() as injected:
        report = ascend_vlm.verify(model, inputs)
    assert injected.calls > 0
    first = report.first_flagged
    assert first is not None, str(report)
    assert (first.name, first.call) == expected, str(report)
    assert first.kind.startswith(fault), str(report)
