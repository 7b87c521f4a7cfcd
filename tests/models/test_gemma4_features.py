"""The features Gemma 4's descriptor supports, on its tiny model patched: quantization composes
with patch in either order, AdapterSet switches and mixes rows exactly, and the tracer finds the
vision, projector (``embed_vision``) and decode stages."""

from __future__ import annotations

import copy

import pytest
import torch

import ascend_vlm
from ascend_vlm.models import REGISTRY
from ascend_vlm.models.descriptor import Refused
from ascend_vlm.models.tiny import build_model, make_inputs


def _logits(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).logits


def test_the_supported_features_are_the_ones_checked_here():
    answers = REGISTRY["gemma4"].features.answers()
    supported = {name for name, answer in answers.items() if not isinstance(answer, Refused)}
    assert supported == {"quantization", "adapters", "tracing"}


@pytest.mark.parametrize("order", ["patch-then-quantize", "quantize-then-patch"])
def test_quantization_composes_with_patch(order):
    from ascend_vlm.quantization import QuantizationConfig, quantize

    config = QuantizationConfig(bits=4, group_size=32)
    reference = build_model("gemma4", attn_implementation="sdpa")
    inputs = make_inputs("gemma4", reference, n_images=1)
    quantize(reference, config, progress=False)
    model = build_model("gemma4", attn_implementation="sdpa")
    if order == "patch-then-quantize":
        ascend_vlm.patch(model)
    report = quantize(model, config, progress=False)
    if order == "quantize-then-patch":
        ascend_vlm.patch(model)
    assert report.modules and not any("vision" in n for n in report.modules)
    assert not any("embed_vision" in n for n in report.modules)  # the projector is kept
    torch.testing.assert_close(
        _logits(model, inputs), _logits(reference, inputs), atol=1e-5, rtol=1e-4
    )


def _save_adapter(base, folder, seed: int):
    """A random rank-4 LoRA on the language model's q/v/down projections (PEFT cannot wrap the
    vision tower's Gemma4ClippableLinear)."""
    from peft import LoraConfig, get_peft_model

    targets = [
        name.removeprefix("model.")
        for name, _ in base.named_modules()
        if "language_model" in name and name.endswith(("q_proj", "v_proj", "down_proj"))
    ]
    torch.manual_seed(seed)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    peft_model = get_peft_model(copy.deepcopy(base), lora)
    for name, parameter in peft_model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(parameter, std=0.5)
    peft_model.save_pretrained(folder)
    return folder


def test_adapter_set_switches_and_mixes_rows_exactly_on_the_patched_model(tmp_path):
    from peft import PeftModel

    from ascend_vlm.adapters.adapter_set import BASE_ADAPTER, AdapterSet

    base = build_model("gemma4", attn_implementation="sdpa")
    ascend_vlm.patch(base)
    folders = {
        name: _save_adapter(base, tmp_path / name, s) for s, name in enumerate(("red", "green"))
    }
    inputs = make_inputs("gemma4", base, n_images=1)
    expected = {
        name: _logits(PeftModel.from_pretrained(copy.deepcopy(base), folder).eval(), inputs)
        for name, folder in folders.items()
    }
    served = AdapterSet(copy.deepcopy(base))
    for name, folder in folders.items():
        served.load(name, folder)
    for name in ["red", "green", "red"]:
        served.activate(name)
        assert torch.equal(_logits(served.model, inputs), expected[name]), name
    rows = ["red", BASE_ADAPTER, "green"]
    batch = make_inputs("gemma4", base, batch=3, padding="left")
    with torch.no_grad():
        mixed = served.forward(rows, **batch).logits
    for index, name in enumerate(rows):
        served.activate(name)
        real = batch["attention_mask"][index].bool()
        alone = _logits(served.model, batch)[index]
        torch.testing.assert_close(mixed[index][real], alone[real], atol=1e-5, rtol=1e-5)


def test_tracer_records_vision_projector_and_decode_stages():
    from ascend_vlm.observability import trace

    model = build_model("gemma4", attn_implementation="sdpa")
    ascend_vlm.patch(model)
    inputs = make_inputs("gemma4", model, n_images=2)
    with torch.no_grad(), trace(model) as timeline:
        model.generate(**inputs, max_new_tokens=3, min_new_tokens=3, do_sample=False)
    labels = [span.label for span in timeline.stages_of(0)]
    assert labels == ["vision_encode", "projector", "prefill", "decode 1", "decode 2"]
