"""AWQ scale search: the scaled float model computes the same function, the search beats
round-to-nearest where activations have outlier channels, and alpha 0 leaves weights alone."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
import transformers
from torch import nn

from ascend_vlm.models.tiny import FAMILIES, TEXT_VOCAB, TINY, build_model, make_inputs
from ascend_vlm.quantization.awq import GRID, apply_awq_scales
from ascend_vlm.quantization.rtn import quantize_rtn

FAMILY_NAMES = (
    "qwen2_vl",
    "qwen2_5_vl",
    "qwen3_vl",
    "qwen3_vl_moe",
    "llava_clip",
    "qwen3_5",
    "qwen3_5_moe",
)


def _calibration(name: str, model) -> list[dict]:
    return [
        make_inputs(name, model, n_images=1),
        make_inputs(name, model, batch=2, text_len=8, padding="right"),
    ]


def _logits(model, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).logits


def _snapshot(model) -> dict[str, torch.Tensor]:
    return {name: value.clone() for name, value in model.state_dict().items()}


def _changed_modules(model, before: dict[str, torch.Tensor]) -> set[str]:
    return {
        name.rpartition(".")[0]
        for name, value in model.state_dict().items()
        if not torch.equal(value, before[name])
    }


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_scaled_model_computes_the_same_function(name):
    model = build_model(name)
    calibration = _calibration(name, model)
    held_out = make_inputs(name, model, batch=2, text_len=7, padding="left")
    expected = [_logits(model, calibration[0]), _logits(model, held_out)]
    before = _snapshot(model)

    linears = [n for n, m in model.named_modules() if type(m) is torch.nn.Linear]
    report = apply_awq_scales(model, calibration, 4, 32, layers=linears, progress=False)

    for inputs, reference in zip((calibration[0], held_out), expected, strict=True):
        torch.testing.assert_close(_logits(model, inputs), reference, rtol=1e-5, atol=1e-5)
    scaled = [group for group in report.groups if group.alpha > 0]
    assert scaled, "the search scaled no group"
    assert any(".visual." in group.name or "vision" in group.name for group in report.groups)
    changed = _changed_modules(model, before)
    # only producers and consumers of scaled groups change, and every scaled consumer does
    touched = {module for group in scaled for module in (group.name, *group.consumers)}
    assert changed <= touched
    assert {consumer for group in scaled for consumer in group.consumers} <= changed


def test_report_alphas_lie_on_the_grid_and_never_lose_to_rtn():
    model = build_model("qwen2_5_vl")
    report = apply_awq_scales(model, _calibration("qwen2_5_vl", model), 4, 64, progress=False)
    assert report.groups and not report.skipped
    for group in report.groups:
        assert 0 <= group.alpha < 1
        assert group.alpha * GRID == pytest.approx(round(group.alpha * GRID))
        assert group.awq_loss <= group.rtn_loss
        assert group.rows > 0
    names = [group.name for group in report.groups]
    assert all("language_model.layers." in name for name in names)  # vision not asked for
    assert len(names) == len(set(names))


def test_weights_already_on_the_grid_keep_alpha_zero_and_stay_unchanged():
    model = build_model("llava_clip")
    generator = torch.Generator().manual_seed(0)
    on_grid = {}
    with torch.no_grad():
        for index, layer in enumerate(model.model.language_model.layers):
            rows, columns = layer.mlp.down_proj.weight.shape
            levels = torch.randint(-8, 8, (rows, columns), generator=generator).float()
            levels[:, ::32], levels[:, 1::32] = -8, 7  # every 32-column group spans the grid
            layer.mlp.down_proj.weight.copy_(levels * 2**-7)  # exact 4-bit asymmetric RTN
            on_grid[f"model.language_model.layers.{index}.mlp.up_proj"] = layer.mlp.down_proj
    before = {name: linear.weight.clone() for name, linear in on_grid.items()}

    report = apply_awq_scales(model, _calibration("llava_clip", model), 4, 32, progress=False)

    groups = {group.name: group for group in report.groups}
    for name, down_proj in on_grid.items():
        assert groups[name].alpha == 0
        assert groups[name].rtn_loss == groups[name].awq_loss == 0
        assert torch.equal(down_proj.weight, before[name])


def _outlier_model() -> nn.Module:
    """A LLaVA decoder of width 128 without GQA (so v_proj -> o_proj folds too) whose norms
    make 4 input channels of every q/k/v and gate/up projection 50x larger."""
    torch.manual_seed(0)
    size = replace(TINY, hidden=128, intermediate=256, heads=4, kv_heads=4)
    config = FAMILIES["llava_clip"].config(size)
    config._attn_implementation = "eager"
    model = transformers.LlavaForConditionalGeneration(config).eval()
    channels = torch.tensor([3, 40, 77, 101])
    with torch.no_grad():
        for layer in model.model.language_model.layers:
            layer.input_layernorm.weight[channels] *= 50
            layer.post_attention_layernorm.weight[channels] *= 50
    return model


def _fake_quantize(model, bits: int, group_size: int) -> None:
    with torch.no_grad():
        for name, module in model.named_modules():
            if type(module) is nn.Linear and "language_model.layers." in name:
                module.weight.copy_(quantize_rtn(module.weight, bits, group_size).dequantize())


@pytest.mark.parametrize("group_size", [32, 128])
def test_awq_beats_rtn_on_outlier_activations(group_size):
    model = _outlier_model()
    generator = torch.Generator().manual_seed(1)
    calibration = [
        {"input_ids": torch.randint(3, TEXT_VOCAB, (4, 32), generator=generator)} for _ in range(3)
    ]
    held_out = {"input_ids": torch.randint(3, TEXT_VOCAB, (4, 32), generator=generator)}
    reference = _logits(model, held_out)
    rtn = copy.deepcopy(model)
    _fake_quantize(rtn, 4, group_size)

    report = apply_awq_scales(model, calibration, 4, group_size, progress=False)
    torch.testing.assert_close(_logits(model, held_out), reference, rtol=1e-4, atol=1e-4)
    _fake_quantize(model, 4, group_size)

    assert {group.name.rpartition(".")[2] for group in report.groups} >= {"v_proj"}
    assert all(group.awq_loss <= group.rtn_loss for group in report.groups)
    assert report.awq_loss < 0.5 * report.rtn_loss
    rtn_error = torch.mean((_logits(rtn, held_out) - reference) ** 2)
    awq_error = torch.mean((_logits(model, held_out) - reference) ** 2)
    assert awq_error < 0.7 * rtn_error


def test_norm_whose_output_the_consumers_do_not_read_is_not_folded():
    model = build_model("llava_clip")
    mlp = model.model.language_model.layers[0].mlp
    # the MLP now reads something other than post_attention_layernorm's output
    handle = mlp.register_forward_pre_hook(lambda module, args: (args[0] + 0.5,))
    calibration = _calibration("llava_clip", model)
    expected = _logits(model, calibration[1])
    report = apply_awq_scales(model, calibration, 4, 32, progress=False)
    assert report.skipped == ("model.language_model.layers.0.post_attention_layernorm",)
    torch.testing.assert_close(_logits(model, calibration[1]), expected, rtol=1e-5, atol=1e-5)
    handle.remove()


def test_gemma_offset_norms_are_not_folded():
    model = build_model("gemma3")
    calibration = [make_inputs("gemma3", model, batch=2, text_len=8)]
    expected = _logits(model, calibration[0])
    report = apply_awq_scales(model, calibration, 4, 32, progress=False)
    # (1 + weight) norms do not scale with their weight: only the up -> down folds remain
    assert [group.name.rpartition(".")[2] for group in report.groups] == ["up_proj", "up_proj"]
    torch.testing.assert_close(_logits(model, calibration[0]), expected, rtol=1e-5, atol=1e-5)


def test_peft_wrapped_model_leaves_adapted_linears_alone():
    peft = pytest.importorskip("peft")
    model = build_model("qwen2_vl")
    calibration = _calibration("qwen2_vl", model)
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["gate_proj"]))
    expected = _logits(wrapped, calibration[0])
    report = apply_awq_scales(wrapped, calibration, 4, 32, progress=False)
    kinds = {group.name.rpartition(".")[2] for group in report.groups}
    assert kinds == {"input_layernorm", "up_proj"}  # gate_proj is a LoRA layer now
    torch.testing.assert_close(_logits(wrapped, calibration[0]), expected, rtol=1e-5, atol=1e-5)


def test_bfloat16_weights_keep_their_dtype():
    model = build_model("qwen3_vl").to(torch.bfloat16)
    calibration = _calibration("qwen3_vl", model)
    expected = _logits(model, calibration[1]).float()
    report = apply_awq_scales(model, calibration, 8, 0, progress=False)
    assert report.groups
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    torch.testing.assert_close(
        _logits(model, calibration[1]).float(), expected, rtol=0.05, atol=0.05
    )


def test_errors_name_the_argument():
    model = build_model("qwen2_vl")
    with pytest.raises(ValueError, match="calibration: expected at least one batch"):
        apply_awq_scales(model, [], 4, 32, progress=False)
    with pytest.raises(ValueError, match="calibration: expected at least one batch"):
        apply_awq_scales(model, iter(()), 4, 32, progress=False)
    with pytest.raises(TypeError, match="calibration: expected model-input mappings"):
        apply_awq_scales(model, [torch.zeros(2, 3)], 4, 32, progress=False)
    with pytest.raises(ValueError, match="bits: expected one of"):
        apply_awq_scales(model, _calibration("qwen2_vl", model), 3, 32, progress=False)
    with pytest.raises(ValueError, match="group_size"):
        apply_awq_scales(model, _calibration("qwen2_vl", model), 4, 48, progress=False)
    with pytest.raises(ValueError, match=r"model: .*Sequential"):
        apply_awq_scales(nn.Sequential(nn.Linear(4, 4)), [{}], 4, 32, progress=False)
    with pytest.raises(TypeError, match=r"model: expected a torch\.nn\.Module"):
        apply_awq_scales("qwen2_vl", [{}], 4, 32, progress=False)
