"""One QuantizationConfig through its lifecycle: quantize and unquantize through the edit
ledger, quantizing while from_pretrained loads (bit for bit equal to quantize), the AWQ
refusal there, the report's table."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from transformers import AutoModelForImageTextToText

from ascend_vlm._errors import PatchError
from ascend_vlm.models import tiny
from ascend_vlm.patching.ledger import applied_features
from ascend_vlm.quantization import QuantizationConfig, QuantLinear, quantize, unquantize


def _model():
    return tiny.build_model("qwen2_vl", attn_implementation="sdpa")


def _state(model) -> dict[str, torch.Tensor]:
    return {key: value.clone() for key, value in model.state_dict().items()}


def _quantized_names(model) -> list[str]:
    return [name for name, module in model.named_modules() if isinstance(module, QuantLinear)]


@pytest.fixture
def float_checkpoint(tmp_path):
    model = _model()
    folder = tmp_path / "float"
    model.save_pretrained(folder)
    return model, folder


def test_unquantize_gives_the_float_model_back_bit_for_bit():
    model = _model()
    inputs = tiny.make_inputs("qwen2_vl", model, n_images=1)
    before = _state(model)
    with torch.no_grad():
        expected = model(**inputs).logits
    config = QuantizationConfig(bits=4, group_size=32, keep_float_weights=True)
    report = quantize(model, config, progress=False)
    assert _quantized_names(model) == list(report.modules)
    assert [f.name for f in applied_features(model)] == ["quantization"]
    assert unquantize(model) is model
    assert not _quantized_names(model) and not applied_features(model)
    assert not hasattr(model.config, "quantization_config")
    after = model.state_dict()
    assert set(after) == set(before) and all(torch.equal(after[k], before[k]) for k in before)
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, expected)
    quantize(model, config, progress=False)  # quantizable again
    assert _quantized_names(model) == list(report.modules)


def test_unquantize_without_the_float_weights_says_how_to_keep_them():
    model = _model()
    quantize(model, QuantizationConfig(bits=8), progress=False)
    message = r"float weights were not kept .* reload the model, or .*keep_float_weights=True"
    with pytest.raises(PatchError, match=message):
        unquantize(model)
    assert _quantized_names(model)  # still quantized
    with pytest.raises(ValueError, match=r"^model: expected a model quantized by quantize"):
        unquantize(_model())


def test_print_report_shows_a_table_per_part_and_layer_kind():
    report = quantize(_model(), QuantizationConfig(bits=4, group_size=32), progress=False)
    lines = str(report).splitlines()
    assert lines[0] == (
        f"ascend_vlm.quantize report: w4 g32 asymmetric, rtn, {len(report.modules)} layers"
    )
    assert lines[1].split() == ["part", "layer", "count", "fp16", "MB", "quantized", "MB", "ratio"]
    rows = {tuple(line.split()[:2]): line.split() for line in lines[3:-2]}
    layers_per_kind = len(report.modules) // 7  # q, k, v, o, gate, up, down per decoder layer
    assert rows[("language", "mlp.down_proj")][2] == str(layers_per_kind)
    assert set(rows) == {
        ("language", f"{group}.{kind}_proj")
        for group, kinds in (("self_attn", "qkvo"), ("mlp", ("gate", "up", "down")))
        for kind in kinds
    }
    total = lines[-1].split()
    assert total[0] == "total" and total[1] == str(len(report.modules))
    assert total[-1] == f"{report.ratio_to_fp16:.3f}x"


@pytest.mark.parametrize(
    "config",
    [
        QuantizationConfig(bits=8),
        QuantizationConfig(bits=4, group_size=32, include=("language", "vision")),
        QuantizationConfig(bits=4, group_size=64, symmetric=True, keep_float_weights=True),
    ],
)
def test_quantizing_while_loading_equals_quantize_bit_for_bit(float_checkpoint, config):
    model, folder = float_checkpoint
    report = quantize(model, config, progress=False)
    loaded = AutoModelForImageTextToText.from_pretrained(
        folder, quantization_config=config, attn_implementation="sdpa"
    )
    assert _quantized_names(loaded) == list(report.modules)
    assert loaded.config.quantization_config == report.config
    first, second = model.state_dict(), loaded.state_dict()
    assert set(first) == set(second) and all(torch.equal(first[k], second[k]) for k in first)
    inputs = tiny.make_inputs("qwen2_vl", model, n_images=1)
    with torch.no_grad():
        assert torch.equal(loaded(**inputs).logits, model(**inputs).logits)
    if config.keep_float_weights:
        unquantize(loaded)
        reference = _model()  # the same seed: the saved float weights
        original = reference.state_dict()
        restored = loaded.state_dict()
        assert all(torch.equal(restored[k], original[k]) for k in original)
    else:
        with pytest.raises(PatchError, match="float weights were not kept"):
            unquantize(loaded)


def test_quantizing_while_loading_in_bf16_equals_quantize_in_bf16(float_checkpoint):
    _, folder = float_checkpoint
    config = QuantizationConfig(bits=4, group_size=32)
    eager = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.bfloat16)
    quantize(eager, config, progress=False)
    loaded = AutoModelForImageTextToText.from_pretrained(
        folder, dtype=torch.bfloat16, quantization_config=config
    )
    first, second = eager.state_dict(), loaded.state_dict()
    assert set(first) == set(second) and all(torch.equal(first[k], second[k]) for k in first)
    assert loaded.get_submodule(_quantized_names(loaded)[0]).scale.dtype == torch.bfloat16


def test_a_checkpoint_quantized_while_loading_saves_and_reloads(float_checkpoint, tmp_path):
    _, folder = float_checkpoint
    config = QuantizationConfig(bits=4, group_size=32)
    loaded = AutoModelForImageTextToText.from_pretrained(folder, quantization_config=config)
    loaded.save_pretrained(tmp_path / "w4")
    saved = json.loads((tmp_path / "w4" / "config.json").read_text())["quantization_config"]
    assert saved["modules"] == _quantized_names(loaded) and saved["bits"] == 4
    reloaded = AutoModelForImageTextToText.from_pretrained(tmp_path / "w4")
    first, second = loaded.state_dict(), reloaded.state_dict()
    assert set(first) == set(second) and all(torch.equal(first[k], second[k]) for k in first)
    with pytest.raises(PatchError, match="float weights were not kept"):
        unquantize(reloaded)


def test_awq_while_loading_is_refused(float_checkpoint):
    _, folder = float_checkpoint
    config = QuantizationConfig(bits=4, method="awq")
    with pytest.raises(ValueError, match=r"^quantization_config.method: expected 'rtn' .*AWQ"):
        AutoModelForImageTextToText.from_pretrained(folder, quantization_config=config)


def test_a_failing_probe_is_named(float_checkpoint, monkeypatch):
    from ascend_vlm.quantization import transformers_quantizer

    _, folder = float_checkpoint
    broken = dataclasses.replace(
        transformers_quantizer.QUANTIZER_PROBES[1], check=lambda: "no such call"
    )
    monkeypatch.setattr(
        transformers_quantizer,
        "QUANTIZER_PROBES",
        (transformers_quantizer.QUANTIZER_PROBES[0], broken),
    )
    with pytest.raises(PatchError, match=r"probe 'quantize-op-call': no such call"):
        AutoModelForImageTextToText.from_pretrained(
            folder, quantization_config=QuantizationConfig()
        )


def test_a_tied_output_head_is_refused_while_loading(tmp_path):
    model = _model()
    model.config.tie_word_embeddings = True
    model.config.get_text_config().tie_word_embeddings = True
    model.tie_weights()
    model.save_pretrained(tmp_path / "tied")
    config = QuantizationConfig(include=("language", "lm_head"))
    with pytest.raises(ValueError, match=r"^include: the output head shares its weight"):
        AutoModelForImageTextToText.from_pretrained(tmp_path / "tied", quantization_config=config)


def test_unquantize_refuses_layers_wrapped_since():
    from peft import LoraConfig, get_peft_model

    model = _model()
    quantize(model, QuantizationConfig(keep_float_weights=True), progress=False)
    adapted = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match=r"q_proj is a Linear, no longer the QuantLinear"):
        unquantize(adapted)
    assert _quantized_names(adapted)


def test_quantization_stacks_beneath_patch_through_the_ledger():
    import ascend_vlm

    model = _model()
    inputs = tiny.make_inputs("qwen2_vl", model, n_images=1)
    ascend_vlm.patch(model)
    with torch.no_grad():
        expected = model(**inputs).logits
    config = QuantizationConfig(bits=4, group_size=32, keep_float_weights=True)
    quantize(model, config, progress=False)
    assert [feature.name for feature in applied_features(model)] == ["quantization", "patch"]
    unquantize(model)
    assert [feature.name for feature in applied_features(model)] == ["patch"]
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, expected)
    quantize(model, QuantizationConfig(bits=8), progress=False)  # float weights not kept
    ascend_vlm.unpatch(model)  # what sits above it still comes off
    assert [feature.name for feature in applied_features(model)] == ["quantization"]
