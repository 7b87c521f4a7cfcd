"""quantize(model): which layers it swaps, outputs close to the float model's, composition with
patch in either order and with generate, its report, and bad arguments."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ascend_vlm
from ascend_vlm.models import tiny
from ascend_vlm.quantization import QuantizationConfig, QuantLinear, quantize

FAMILIES = [
    "qwen2_vl",
    "qwen2_5_vl",
    "qwen3_vl",
    "qwen3_vl_moe",
    "llava_clip",
    "glm4v",
    "glm4v_moe",
    "qwen3_5",
    "qwen3_5_moe",
    "llama4",
    "mllama",
    "mistral3",
    "paddleocr_vl",
    "deepseek_ocr2",
]
W4G32 = QuantizationConfig(bits=4, group_size=32)


def _model(name: str = "qwen2_vl"):
    return tiny.build_model(name, attn_implementation="sdpa")


def _logits(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).logits


def _quantized_names(model) -> set[str]:
    return {name for name, module in model.named_modules() if isinstance(module, QuantLinear)}


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize(("bits", "group_size", "tolerance"), [(8, 0, 0.01), (4, 32, 0.2)])
def test_language_linears_are_swapped_and_outputs_stay_close(name, bits, group_size, tolerance):
    model = _model(name)
    inputs = tiny.make_inputs(name, model, n_images=1)
    expected = _logits(model, inputs)
    linears = {n for n, m in model.named_modules() if type(m) is nn.Linear}
    report = quantize(model, QuantizationConfig(bits=bits, group_size=group_size), progress=False)
    swapped = _quantized_names(model)
    assert swapped == set(report.modules) and swapped
    assert all(".visual." not in n and "vision_tower" not in n for n in swapped)
    assert all("projector" not in n and "merger" not in n for n in swapped)
    assert "lm_head" not in swapped and swapped < linears
    got = _logits(model, inputs)
    error = (got - expected).abs().max() / expected.abs().max()
    assert 0 < error < tolerance
    assert report.config.bits == bits and report.fp16_bytes > report.quantized_bytes > 0


def test_parts_patterns_and_exclusions_choose_the_layers():
    model = _model()
    config = QuantizationConfig(
        bits=8, include=("language", "vision", "lm_head"), exclude=("*.layers.0.*",)
    )
    report = quantize(model, config, progress=False)
    names = set(report.modules)
    assert "lm_head" in names
    assert any(n.startswith("model.visual.blocks.") for n in names)
    assert not any(".layers.0." in n for n in names)
    assert not any("merger" in n for n in names)  # the projector was not included
    pattern = _model()
    only = quantize(pattern, QuantizationConfig(include=("*.mlp.down_proj",)), progress=False)
    assert only.modules and all(n.endswith("mlp.down_proj") for n in only.modules)


@pytest.mark.parametrize("order", ["patch-then-quantize", "quantize-then-patch"])
def test_quantize_composes_with_patch_in_either_order(order):
    reference = _model()
    inputs = tiny.make_inputs("qwen2_vl", reference, n_images=1)
    quantize(reference, W4G32, progress=False)
    expected = _logits(reference, inputs)
    model = _model()
    if order == "patch-then-quantize":
        ascend_vlm.patch(model)
        quantize(model, W4G32, progress=False)
    else:
        quantize(model, W4G32, progress=False)
        ascend_vlm.patch(model)
    torch.testing.assert_close(_logits(model, inputs), expected, rtol=1e-4, atol=1e-5)


def test_the_mock_npu_runs_the_int4_kernel_and_matches_the_cpu():
    from ascend_vlm.testing.mock_npu import mock_npu

    model = _model().to(torch.float16)
    inputs = tiny.make_inputs("qwen2_vl", model, n_images=1)
    inputs["pixel_values"] = inputs["pixel_values"].to(torch.float16)
    quantize(model, W4G32, progress=False)
    ascend_vlm.patch(model)
    on_cpu = _logits(model, inputs)
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert all(layer._npu_weight is None for layer in layers)
    with mock_npu():
        on_mock = _logits(model, inputs)
        with torch.no_grad():
            generated = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    # every layer ran the kernel on its int32 packing, converted once
    assert all(layer._npu_weight is not None for layer in layers)
    assert generated.shape[1] == inputs["input_ids"].shape[1] + 4
    torch.testing.assert_close(on_mock, on_cpu, rtol=2e-2, atol=2e-2)


def test_the_config_records_the_scheme():
    model = _model()
    report = quantize(model, QuantizationConfig(bits=4, group_size=64), progress=False)
    assert model.config.quantization_config is report.config
    assert model.config.quantization_config.to_dict() == {
        "quant_method": "ascend_vlm",
        "method": "rtn",
        "bits": 4,
        "group_size": 64,
        "symmetric": False,
        "include": ["language"],
        "exclude": [],
        "modules": list(report.modules),
        "keep_float_weights": False,
    }


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"bits": 3}, ValueError, r"^bits: expected one of \(4, 8\), got 3"),
        ({"bits": "8"}, TypeError, r"^bits: expected an int, got str"),
        ({"group_size": 48}, ValueError, r"^group_size: expected 0 \(per channel\) or a multiple"),
        ({"symmetric": 1}, TypeError, r"^symmetric: expected True or False, got 1"),
        ({"method": "gptq"}, ValueError, r"^method: expected one of \('rtn', 'awq'\), got 'gptq'"),
        ({"include": ("bogus",)}, ValueError, r"^include: expected model parts .* got 'bogus'"),
        ({"include": "language"}, TypeError, r"^include: expected a sequence of strings"),
        ({"exclude": ("",)}, TypeError, r"^exclude: expected non-empty strings, got ''"),
        ({"keep_float_weights": "yes"}, TypeError, r"^keep_float_weights: expected True or False"),
        ({"keep_float_weights": True, "method": "awq"}, ValueError, r"^keep_float_weights: expected False with method 'awq'"),
        ({"quant_method": "awq"}, ValueError, r"^quant_method: expected 'ascend_vlm', got 'awq'"),
    ],
)  # fmt: skip
def test_the_config_names_a_bad_field(kwargs, error, message):
    with pytest.raises(error, match=message):
        QuantizationConfig(**kwargs)


@pytest.mark.parametrize(
    ("config", "error", "message"),
    [
        ({"bits": 8}, TypeError, r"^config: expected a QuantizationConfig, got dict"),
        (QuantizationConfig(include=("*.nothing_here",)), ValueError, r"^include: \['\*.nothing_here'\] .* selects no"),
        (QuantizationConfig(modules=("model.nothing",)), ValueError, r"^modules: 'model.nothing' is not an nn.Linear"),
        (QuantizationConfig(method="awq"), ValueError, r"^calibration: AWQ needs calibration batches"),
    ],
)  # fmt: skip
def test_bad_arguments_are_named(config, error, message):
    with pytest.raises(error, match=message):
        quantize(_model(), config, progress=False)


def test_a_quantized_or_adapted_model_is_refused():
    model = _model()
    quantize(model, QuantizationConfig(), progress=False)
    with pytest.raises(ValueError, match=r"^model: already quantized \(model\.language_model"):
        quantize(model, QuantizationConfig(), progress=False)
    from peft import LoraConfig, get_peft_model

    adapted = get_peft_model(_model(), LoraConfig(r=2, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match=r"carries PEFT adapters; quantize the base model first"):
        quantize(adapted, QuantizationConfig(), progress=False)


def test_awq_calibrates_on_shapes_vqa_by_default_and_beats_rtn_there():
    from transformers import AutoTokenizer, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    from ascend_vlm.default_model import ImageTextProcessor, default_model_path
    from ascend_vlm.quantization.calibration import shapes_calibration

    # a processor that loads on every supported transformers (the saved one needs torchvision
    # before 5.25)
    path = default_model_path()
    image_processor = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=112 * 112)
    processor = ImageTextProcessor(AutoTokenizer.from_pretrained(path), image_processor)
    model = Qwen2VLForConditionalGeneration.from_pretrained(path).eval()
    batches = shapes_calibration(processor, samples=4, batch_size=2)
    assert len(batches) == 2 and "labels" not in batches[0]
    assert batches[0]["input_ids"].shape[0] == 2 and "pixel_values" in batches[0]
    config = QuantizationConfig(bits=4, group_size=32, method="awq")
    report = quantize(model, config, processor=processor, progress=False)
    assert report.config.method == "awq" and report.awq.groups
    assert report.awq.awq_loss <= report.awq.rtn_loss
    assert model.config.quantization_config.method == "awq"


def test_awq_rescales_only_the_layers_it_quantizes():
    model = _model("llava_clip")
    inputs = tiny.make_inputs("llava_clip", model, n_images=1)
    language = {n: p.detach().clone() for n, p in model.named_parameters() if "language_model" in n}
    config = QuantizationConfig(bits=4, group_size=32, method="awq", include=("vision",))
    report = quantize(model, config, calibration=[inputs], progress=False)
    assert report.modules and all("vision_tower" in n for n in report.modules)
    assert all(torch.equal(p, language[n]) for n, p in model.named_parameters() if n in language)
    assert all("vision_tower" in group.name for group in report.awq.groups)


def test_a_tied_output_head_is_refused():
    model = _model()
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.get_input_embeddings().weight
    with pytest.raises(ValueError, match=r"^include: the output head shares its weight"):
        quantize(model, QuantizationConfig(include=("language", "lm_head")), progress=False)
    assert not _quantized_names(model)
