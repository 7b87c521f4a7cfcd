"""AdapterSet: outputs with an adapter active equal a fresh model holding only that adapter,
after any sequence of loads and switches; mixed rows equal their single-adapter runs; unload
gives the base back exactly; hot swap; bad input named."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from PIL import Image
from random_adapters import save_random_adapter

import ascend_vlm
from ascend_vlm.adapters.adapter_set import BASE_ADAPTER, AdapterSet

NAMES = ("red", "green", "blue")


@pytest.fixture(scope="module")
def adapters(model_and_processor, tmp_path_factory):
    base, _ = model_and_processor
    root = tmp_path_factory.mktemp("adapters")
    folders = {
        name: save_random_adapter(base, root / name, seed) for seed, name in enumerate(NAMES)
    }
    folders["vision"] = save_random_adapter(base, root / "vision", 9, targets=["qkv"])
    folders["rank8"] = save_random_adapter(base, root / "rank8", 11, rank=8)
    return folders


def _inputs(processor, rows=1):
    images = [Image.new("RGB", (56, 56), (40 * i, 90, 200)) for i in range(rows)]
    content = [{"type": "image"}, {"type": "text", "text": "What colour?"}]
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    return processor(text=[prompt] * rows, images=images, return_tensors="pt")


def _logits(model, inputs):
    with torch.no_grad():
        return model(**inputs).logits


def _fresh_with(base, folder):
    from peft import PeftModel

    return PeftModel.from_pretrained(copy.deepcopy(base), folder).eval()


@pytest.mark.parametrize("switching", ["tuner-layers", "peft-set-adapter"])
def test_active_adapter_equals_a_fresh_model_with_only_it(
    model_and_processor, adapters, switching, monkeypatch
):
    if switching == "peft-set-adapter":  # the path taken when the _compat probe fails
        monkeypatch.setattr(
            "ascend_vlm.adapters.adapter_set.peft_active_adapter_problem", lambda: "forced"
        )
    base, processor = model_and_processor
    inputs = _inputs(processor)
    expected = {name: _logits(_fresh_with(base, adapters[name]), inputs) for name in NAMES}
    expected[BASE_ADAPTER] = _logits(base, inputs)
    assert not torch.equal(expected["red"], expected["green"])
    served = AdapterSet(copy.deepcopy(base))
    assert served.active == BASE_ADAPTER and served.names == ()
    served.load("red", adapters["red"])
    assert served.active == BASE_ADAPTER  # loading does not switch
    assert torch.equal(_logits(served.model, inputs), expected[BASE_ADAPTER])
    served.load("green", adapters["green"])
    served.load("blue", adapters["blue"])
    order = random.Random(0).choices([BASE_ADAPTER, *NAMES], k=12)
    for name in order:
        served.activate(name)
        assert served.active == name
        assert torch.equal(_logits(served.model, inputs), expected[name]), name
    served.unload("green")
    served.activate("blue")
    assert torch.equal(_logits(served.model, inputs), expected["blue"])
    served.load("green", adapters["green"])  # reloaded under the same name
    assert served.active == "blue" and torch.equal(_logits(served.model, inputs), expected["blue"])
    served.activate("green")
    assert torch.equal(_logits(served.model, inputs), expected["green"])
    assert (served._layers is None) == (switching == "peft-set-adapter")
    rows = [BASE_ADAPTER, "red"]
    with torch.no_grad():
        mixed = served.forward(rows, **_inputs(processor, rows=2)).logits
    assert torch.equal(_logits(served.model, inputs), expected["green"])  # still active
    assert mixed.shape[0] == 2


def test_patched_model_switches_exactly_too(model_and_processor, adapters):
    base, processor = model_and_processor
    inputs = _inputs(processor)
    patched = copy.deepcopy(base)
    ascend_vlm.patch(patched)
    expected = _logits(_fresh_with(patched, adapters["red"]), inputs)
    served = AdapterSet(patched)
    served.load("green", adapters["green"])
    served.load("red", adapters["red"])
    served.activate("red")
    assert torch.equal(_logits(served.model, inputs), expected)


def test_mixed_rows_equal_their_single_adapter_batches(model_and_processor, adapters):
    base, processor = model_and_processor
    inputs = _inputs(processor, rows=4)
    served = AdapterSet(copy.deepcopy(base))
    for name in NAMES:
        served.load(name, adapters[name])
    rows = ["red", BASE_ADAPTER, "blue", "red"]
    with torch.no_grad():
        mixed = served.forward(rows, **inputs).logits
    for index, name in enumerate(rows):
        served.activate(name)
        alone = _logits(served.model, inputs)[index]
        torch.testing.assert_close(mixed[index], alone, atol=1e-5, rtol=1e-5)
    served.activate(BASE_ADAPTER)  # per-row names still apply while the base is active
    with torch.no_grad():
        again = served.forward(rows, **inputs).logits
        generated = served.generate(rows, **inputs, max_new_tokens=3, do_sample=False)
    assert torch.equal(again, mixed)
    assert served.active == BASE_ADAPTER
    assert torch.equal(_logits(served.model, inputs), _logits(base, inputs))
    assert generated.shape[0] == 4


def test_unloading_every_adapter_gives_the_base_back_exactly(model_and_processor, adapters):
    base, processor = model_and_processor
    model = copy.deepcopy(base)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    modules = [type(m) for m in model.modules()]
    served = AdapterSet(model)
    served.load("red", adapters["red"])
    served.load("vision", adapters["vision"])
    served.activate("vision")
    served.unload("vision")
    assert served.active == BASE_ADAPTER
    served.unload("red")
    assert served.model is model and served.names == ()
    assert [type(m) for m in model.modules()] == modules
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[name], before[name]) for name in before)
    inputs = _inputs(processor)
    assert torch.equal(_logits(model, inputs), _logits(base, inputs))


def test_vision_adapters_switch_but_do_not_mix(model_and_processor, adapters):
    base, processor = model_and_processor
    inputs = _inputs(processor, rows=2)
    expected = _logits(_fresh_with(base, adapters["vision"]), inputs)
    served = AdapterSet(copy.deepcopy(base))
    served.load("red", adapters["red"])
    served.load("vision", adapters["vision"])
    served.activate("vision")
    assert torch.equal(_logits(served.model, inputs), expected)
    with pytest.raises(ValueError, match="adapters vision adapt the vision tower or projector"):
        served.forward(["red", "red"], **inputs)


def test_hotswap_replaces_weights_in_place(model_and_processor, adapters):
    base, processor = model_and_processor
    inputs = _inputs(processor)
    served = AdapterSet(copy.deepcopy(base))
    served.load("slot", adapters["red"])
    served.prepare_for_hotswap(target_rank=8)
    served.activate("slot")
    compiled = torch.compile(served.model, backend="eager")
    with torch.no_grad():
        compiled(**inputs)
    served.hotswap("slot", adapters["green"])
    with torch._dynamo.config.patch(error_on_recompile=True), torch.no_grad():
        swapped = compiled(**inputs).logits
        served.hotswap("slot", adapters["rank8"])  # up to the prepared rank: no recompile
        ranked = compiled(**inputs).logits
    torch.testing.assert_close(swapped, _logits(_fresh_with(base, adapters["green"]), inputs))
    torch.testing.assert_close(ranked, _logits(_fresh_with(base, adapters["rank8"]), inputs))
    assert served.names == ("slot",)


def test_bad_input_is_named(model_and_processor, adapters, tmp_path):
    base, processor = model_and_processor
    served = AdapterSet(copy.deepcopy(base))
    served.load("red", adapters["red"])
    with pytest.raises(ValueError, match=r"name: expected one of __base__, red, got 'zz'"):
        served.activate("zz")
    with pytest.raises(
        ValueError, match=r"adapter_names: expected one of __base__, red, got 'green'"
    ):
        served.forward(["red", "green"], **_inputs(processor, rows=2))
    with pytest.raises(ValueError, match="name: adapter 'red' is already loaded"):
        served.load("red", adapters["green"])
    for reserved in (BASE_ADAPTER, "lora", "a", "v1.2", "a/b", ""):
        with pytest.raises(ValueError, match="name: expected an adapter name of letters, digits"):
            served.load(reserved, adapters["green"])
    binary = tmp_path / "binary"
    binary.mkdir()
    (binary / "adapter_config.json").write_text(
        (adapters["red"] / "adapter_config.json").read_text()
    )
    (binary / "adapter_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"safetensors only\), got adapter_model.bin"):
        served.load("bin", binary)
    with pytest.raises(ValueError, match="expected a PEFT adapter folder"):
        served.load("none", tmp_path)
    # an adapter trained on a model of other widths
    config = copy.deepcopy(base.config)
    config.text_config.hidden_size = 64
    config.text_config.intermediate_size = 96
    other = type(base)(config)
    foreign = save_random_adapter(other, tmp_path / "foreign", 3)
    with pytest.raises(
        ValueError,
        match=r"adapter for another base: .*proj.lora_A.weight has shape \[4, \d+\], .* needs lora_A \[r, 256\]",
    ):
        served.load("foreign", foreign)
    assert served.names == ("red",)
    with pytest.raises(ValueError, match="name: expected a resident adapter"):
        served.unload("zz")
    served.prepare_for_hotswap(target_rank=4)
    with pytest.raises(
        ValueError, match="adapter of rank 8 cannot be hot-swapped into slots prepared for rank 4"
    ):
        served.hotswap("red", adapters["rank8"])  # rank 8 into a slot prepared for rank 4


def test_hotswap_of_other_targets_is_refused(model_and_processor, adapters):
    base, _ = model_and_processor
    served = AdapterSet(copy.deepcopy(base))
    served.load("red", adapters["red"])
    with pytest.raises(
        ValueError, match=r"cannot hot-swap .* into adapter 'red': it adapts other modules"
    ):
        served.hotswap("red", adapters["vision"])


def test_vision_cache_is_keyed_by_the_active_vision_adapter(model_and_processor, adapters):
    from ascend_vlm.reuse import VisionCache, enable_vision_cache

    base, processor = model_and_processor
    inputs = _inputs(processor)
    expected = {
        "vision": _logits(_fresh_with(base, adapters["vision"]), inputs),
        BASE_ADAPTER: _logits(base, inputs),
    }
    model = copy.deepcopy(base)
    cache = VisionCache(max_bytes=1 << 20)
    enable_vision_cache(model, cache)
    served = AdapterSet(model)
    served.load("vision", adapters["vision"])
    for name in ["vision", BASE_ADAPTER, "vision", BASE_ADAPTER]:
        served.activate(name)
        assert torch.equal(_logits(served.model, inputs), expected[name]), name
    assert cache.stats().hits == 2  # each adapter's features were reused, never the other's


@pytest.mark.parametrize("bits", [8, 4])
def test_adapters_serve_over_a_quantized_base(model_and_processor, adapters, bits):
    from ascend_vlm.quantization import QuantizationConfig, quantize

    base, processor = model_and_processor
    quantized = copy.deepcopy(base)
    quantize(quantized, QuantizationConfig(bits=bits, group_size=32), progress=False)
    inputs = _inputs(processor)
    expected = {name: _logits(_fresh_with(quantized, adapters[name]), inputs) for name in NAMES}
    served = AdapterSet(copy.deepcopy(quantized))
    for name in NAMES:
        served.load(name, adapters[name])
    for name in (*NAMES, "red"):
        served.activate(name)
        assert torch.equal(_logits(served.model, inputs), expected[name]), name
    served.activate(BASE_ADAPTER)
    assert torch.equal(_logits(served.model, inputs), _logits(quantized, inputs))
