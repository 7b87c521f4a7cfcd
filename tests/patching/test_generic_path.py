"""The generic path of ``patch(model, strict=False)``: models no family describes get fused
attention wherever it goes through transformers' AttentionInterface, and norms, gated MLPs and
rotary functions only where a numerical probe at patch time agrees."""

from __future__ import annotations

import copy
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from generic_vlm import aya_inputs, aya_vision
from torch import nn

import ascend_vlm
from ascend_vlm._compat.attention import attention_interface_problem
from ascend_vlm.models.tiny import TINY_TEXT_CONFIG
from ascend_vlm.patching.probes import probe_norm

ROOT = Path(__file__).resolve().parents[2]
INPUT_IDS = torch.tensor([[1, 5, 9, 17, 33, 2, 7, 4], [3, 8, 12, 6, 21, 40, 11, 9]])


def _ministral() -> transformers.MinistralForCausalLM:
    """A tiny Ministral: a text model type no family or text backbone names."""
    torch.manual_seed(0)
    config = transformers.MinistralConfig(
        **TINY_TEXT_CONFIG, head_dim=8, attn_implementation="eager"
    )
    return transformers.MinistralForCausalLM(config).eval()


def _logits(model: nn.Module, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).logits


def _loss_and_grads(model: nn.Module, inputs: dict) -> tuple[torch.Tensor, list]:
    model.train()
    model.zero_grad()
    loss = model(**inputs, labels=inputs["input_ids"]).loss
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.eval()
    return loss.detach(), grads


@pytest.mark.parametrize("build", [aya_vision, _ministral], ids=["aya_vision", "ministral"])
def test_unknown_type_gets_fused_attention_with_equal_logits_generate_and_gradients(build):
    model = build()
    inputs = aya_inputs() if build is aya_vision else {"input_ids": INPUT_IDS}
    logits = _logits(model, inputs)
    generated = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    loss, grads = _loss_and_grads(model, inputs)
    calls = []
    report = ascend_vlm.patch(model, strict=False)
    ops_attention = ascend_vlm.ops.fused_attention
    with pytest.MonkeyPatch.context() as patcher:
        patcher.setattr(
            ascend_vlm.patching.attention.ops,
            "fused_attention",
            lambda *a, **k: calls.append(1) or ops_attention(*a, **k),
        )
        patched = _logits(model, inputs)
    assert calls, "the patched model never called ops.fused_attention"
    assert report.swapped_count("attention-text") == 2
    if build is aya_vision:
        assert report.swapped_count("attention-vision") == 2
    torch.testing.assert_close(patched, logits, atol=1e-4, rtol=0)
    assert torch.equal(model.generate(**inputs, max_new_tokens=8, do_sample=False), generated)
    patched_loss, patched_grads = _loss_and_grads(model, inputs)
    torch.testing.assert_close(patched_loss, loss, atol=1e-5, rtol=0)
    assert len(patched_grads) == len(grads)
    for patched_grad, grad in zip(patched_grads, grads, strict=True):
        torch.testing.assert_close(patched_grad, grad, atol=1e-4, rtol=1e-3)
    ascend_vlm.unpatch(model)
    assert torch.equal(_logits(model, inputs), logits)


def test_a_plain_decoder_gets_probe_verified_norm_mlp_and_rope_swaps():
    model = _ministral()
    report = ascend_vlm.patch(model, strict=False)
    verified = {(kind, module): count for kind, module, _, count in report.probe_verified()}
    assert verified == {
        ("norm", "MinistralRMSNorm"): 5,
        ("mlp", "MinistralMLP"): 2,
        ("rope", "MinistralAttention"): 2,
    }
    assert all(op.endswith("probe-verified") for _, _, op, _ in report.probe_verified())
    assert "probe-verified" in str(report)
    assert report.as_dict()["probe_verified"] == 9


def test_cohere2s_layer_norm_and_interleaved_rotary_fail_their_probes_and_are_left_alone():
    model = aya_vision()
    report = ascend_vlm.patch(model, strict=False)
    reasons = {
        (kind, module): why
        for (kind, module, why) in report.left_alone
        if module in ("Cohere2LayerNorm", "Cohere2Attention")
    }
    assert set(reasons) == {("norm", "Cohere2LayerNorm"), ("rope", "Cohere2Attention")}
    assert reasons["norm", "Cohere2LayerNorm"].startswith("probe: ops.rms_norm disagrees")
    assert "max abs error" in reasons["rope", "Cohere2Attention"]
    assert "forward" not in model.model.language_model.norm.__dict__
    assert "forward" not in model.model.language_model.layers[0].self_attn.__dict__


class ShiftedRMSNorm(transformers.models.llama.modeling_llama.LlamaRMSNorm):
    """An RMSNorm whose forward adds 1e-2: not what ops.rms_norm computes."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return super().forward(hidden_states) + 1e-2


class OffsetRMSNorm(nn.Module):
    """A (1 + weight) RMSNorm of a class no family names, its weight starting at zero."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x = hidden_states.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x * (1.0 + self.weight.float())).to(hidden_states.dtype)


def test_a_norm_computing_something_else_fails_the_probe_with_its_max_error():
    verdict = probe_norm(ShiftedRMSNorm(32), 1e-6)
    assert verdict.setting is None
    assert verdict.max_error == pytest.approx(1e-2, rel=1e-3)
    model = _ministral()
    model.model.norm = ShiftedRMSNorm(32, eps=1e-6)
    inputs = {"input_ids": INPUT_IDS}
    report = ascend_vlm.patch(model, strict=False)
    (reason,) = [why for (_, module, why) in report.left_alone if module == "ShiftedRMSNorm"]
    assert "max abs error 0.01 with offset 0" in reason and "with offset 1" in reason
    assert "forward" not in model.model.norm.__dict__
    model.model.norm.weight.data.normal_()
    expected = ShiftedRMSNorm.forward(model.model.norm, torch.ones(1, 32))
    assert torch.equal(model.model.norm(torch.ones(1, 32)), expected)
    assert _logits(model, inputs).shape == (2, 8, TINY_TEXT_CONFIG["vocab_size"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_one_plus_weight_norm_passes_the_probe_with_offset_one(dtype):
    model = _ministral().to(dtype)
    model.model.norm = OffsetRMSNorm(32).to(dtype)
    inputs = {"input_ids": INPUT_IDS}
    stock = _logits(model, inputs)
    report = ascend_vlm.patch(model, strict=False)
    assert ("norm", "OffsetRMSNorm", "ops.rms_norm(offset=1), probe-verified", 1) in (
        report.probe_verified()
    )
    assert "fused=ascend_vlm.ops.rms_norm" in repr(model.model.norm)
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(_logits(model, inputs), stock, atol=tolerance, rtol=0)
    ascend_vlm.unpatch(model)
    assert torch.equal(_logits(model, inputs), stock)


def test_generic_swaps_respect_the_patch_options():
    report = ascend_vlm.patch(_ministral(), strict=False, norm=False, mlp=False, rope=False)
    assert report.probe_verified() == []
    assert report.left_alone_count("norm") == 5 and report.left_alone_count("rope") == 2


def test_an_attention_outside_the_interface_is_named_with_why():
    class PlainAttention(nn.Module):
        def forward(self, hidden_states):
            return torch.softmax(hidden_states, -1)

    problem = attention_interface_problem(PlainAttention)
    assert problem is not None and "ALL_ATTENTION_FUNCTIONS" in problem
    llama = transformers.models.llama.modeling_llama.LlamaAttention
    assert attention_interface_problem(llama) is None
    # Inkling hands its attention function a position bias, which ours would drop.
    inkling = transformers.models.inkling.modeling_inkling.InklingAttention
    assert "passes position_bias" in attention_interface_problem(inkling)


def test_a_generically_patched_model_deep_copies_and_still_unpatches_exactly():
    model = _ministral()
    inputs = {"input_ids": INPUT_IDS}
    stock = _logits(model, inputs)
    ascend_vlm.patch(model, strict=False)
    patched = _logits(model, inputs)
    twin = copy.deepcopy(model)
    assert torch.equal(_logits(twin, inputs), patched)
    ascend_vlm.unpatch(twin)
    assert torch.equal(_logits(twin, inputs), stock)


def test_the_generic_path_table_is_current_for_a_type_it_lists():
    result = subprocess.run(
        [sys.executable, "scripts/generic_path_table.py", "--types", "fuyu", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]


def test_the_generic_path_table_check_fails_on_a_stale_row(monkeypatch, tmp_path):
    spec = importlib.util.spec_from_file_location("table", ROOT / "scripts/generic_path_table.py")
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    doc = tmp_path / "generic_path.md"
    doc.write_text(table.DOC.read_text(encoding="utf-8"), encoding="utf-8")
    monkeypatch.setattr(table, "DOC", doc)
    monkeypatch.setattr(
        table, "run_isolated", lambda model_type: {"type": model_type, "error": "x"}
    )
    monkeypatch.setattr(sys, "argv", ["generic_path_table.py", "--types", "fuyu", "--check"])
    assert table.main() == 1
