"""Mixed-adapter rows through the stacked adapters (``adapters/mixed_rows.py``): each row equals
its adapter run alone and PEFT's own mixed-batch forward, across ranks, partial targets,
beams, hot swaps and unloads; DoRA adapters refuse mixed rows cleanly."""

from __future__ import annotations

import copy

import pytest
import torch
from PIL import Image
from random_adapters import save_random_adapter

from ascend_vlm.adapters.adapter_set import BASE_ADAPTER, AdapterSet

TOLERANCE = {"atol": 1e-5, "rtol": 1e-5}


@pytest.fixture(scope="module")
def folders(model_and_processor, tmp_path_factory):
    base, _ = model_and_processor
    root = tmp_path_factory.mktemp("mixed_rows")
    return {
        "r4": save_random_adapter(base, root / "r4", 1),
        "r8": save_random_adapter(base, root / "r8", 2, rank=8),
        "q_only": save_random_adapter(base, root / "q_only", 3, targets=("q_proj",)),
        "r4b": save_random_adapter(base, root / "r4b", 4),
        "dora": save_random_adapter(base, root / "dora", 5, use_dora=True),
    }


def _inputs(processor, rows):
    images = [Image.new("RGB", (56, 56), (30 * i, 120, 200 - 20 * i)) for i in range(rows)]
    content = [{"type": "image"}, {"type": "text", "text": "What colour?"}]
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    return processor(text=[prompt] * rows, images=images, return_tensors="pt")


def _served(base, folders, names):
    served = AdapterSet(copy.deepcopy(base))
    for name in names:
        served.load(name, folders[name])
    return served


def _alone(served, inputs, rows):
    logits = []
    for index, name in enumerate(rows):
        served.activate(name)
        with torch.no_grad():
            logits.append(served.model(**inputs).logits[index])
    return torch.stack(logits)


ROWS = ["r8", BASE_ADAPTER, "q_only", "r4", "r8"]


def _served_rows_equal_alone_and_peft(base, processor, folders):
    """The stacked path serves ROWS of ``base`` with ``folders``' r4, r8 and q_only adapters,
    each row as its adapter alone and as PEFT's mixed rows; returns (served, inputs, logits)."""
    inputs = _inputs(processor, len(ROWS))
    served = _served(base, folders, ["r4", "r8", "q_only"])
    assert served._row_stacks() is not None  # plain LoRA: the stacked path serves the rows
    with torch.no_grad():
        mixed = served.forward(ROWS, **inputs).logits
        peft_mixed = served._peft(**inputs, adapter_names=ROWS).logits
    torch.testing.assert_close(mixed, _alone(served, inputs, ROWS), **TOLERANCE)
    torch.testing.assert_close(mixed, peft_mixed, **TOLERANCE)
    return served, inputs, mixed


def test_glm4v_rows_equal_each_adapter_alone_and_peft_mixed_rows(glm4v_and_processor, tmp_path):
    base, processor = glm4v_and_processor
    # GLM's vision MLPs have a down_proj too: the language model's alone, its fused gate_up_proj
    language = {"targets": ("q_proj", "v_proj", "gate_up_proj", "down_proj")}
    language["exclude_modules"] = r".*visual.*"
    folders = {
        "r4": save_random_adapter(base, tmp_path / "r4", 1, **language),
        "r8": save_random_adapter(base, tmp_path / "r8", 2, rank=8, **language),
        "q_only": save_random_adapter(base, tmp_path / "q_only", 3, targets=("q_proj",)),
    }
    _served_rows_equal_alone_and_peft(base, processor, folders)


def test_stacked_rows_equal_each_adapter_alone_and_peft_mixed_rows(model_and_processor, folders):
    base, processor = model_and_processor
    served, inputs, mixed = _served_rows_equal_alone_and_peft(base, processor, folders)
    served.activate("r4")
    with torch.no_grad():
        # The active adapter is back after the mixed call, and is not added twice during it.
        again = served.forward(ROWS, **inputs).logits
        active = served.model(**inputs).logits
    assert torch.equal(again, mixed)
    torch.testing.assert_close(active, _alone(served, inputs, ["r4"] * len(ROWS)), **TOLERANCE)


def test_stacked_rows_generate_as_each_adapter_alone_with_beams(model_and_processor, folders):
    base, processor = model_and_processor
    rows = ["r8", "r4", BASE_ADAPTER]
    inputs = _inputs(processor, len(rows))
    served = _served(base, folders, ["r4", "r8"])
    settings = {"max_new_tokens": 4, "do_sample": False, "num_beams": 2}
    with torch.no_grad():
        mixed = served.generate(rows, **inputs, **settings)
        for index, name in enumerate(rows):
            served.activate(name)
            alone = served.model.generate(**inputs, **settings)[index]
            assert torch.equal(mixed[index], alone), name


def test_without_fast_switching_peft_serves_the_rows(model_and_processor, folders, monkeypatch):
    monkeypatch.setattr(
        "ascend_vlm.adapters.adapter_set.peft_active_adapter_problem", lambda: "forced"
    )
    base, processor = model_and_processor
    inputs = _inputs(processor, len(ROWS))
    served = _served(base, folders, ["r4", "r8", "q_only"])
    assert served._row_stacks() is None
    with torch.no_grad():
        mixed = served.forward(ROWS, **inputs).logits
    torch.testing.assert_close(mixed, _alone(served, inputs, ROWS), **TOLERANCE)


def test_stacks_follow_loads_unloads_and_hotswaps(model_and_processor, folders):
    base, processor = model_and_processor
    inputs = _inputs(processor, 2)
    served = _served(base, folders, ["r4"])
    rows = ["r4", BASE_ADAPTER]
    with torch.no_grad():
        served.forward(rows, **inputs)  # builds the stacks
        served.load("r8", folders["r8"])
        after_load = served.forward(["r8", "r4"], **inputs).logits
        torch.testing.assert_close(after_load, _alone(served, inputs, ["r8", "r4"]), **TOLERANCE)
        served.hotswap("r4", folders["r4b"])
        after_swap = served.forward(rows, **inputs).logits
        served.activate(BASE_ADAPTER)
        served.unload("r8")  # while the base is active
        after_unload = served.forward(rows, **inputs).logits
    expected = _alone(served, inputs, rows)  # r4 now holds r4b's weights
    fresh = _served(base, folders, ["r4b"])
    torch.testing.assert_close(expected[0], _alone(fresh, inputs, ["r4b"])[0], **TOLERANCE)
    torch.testing.assert_close(after_swap, expected, **TOLERANCE)
    torch.testing.assert_close(after_unload, expected, **TOLERANCE)


def test_dora_rows_are_refused_and_other_rows_served_beside_dora(model_and_processor, folders):
    base, processor = model_and_processor
    inputs = _inputs(processor, 3)
    served = _served(base, folders, ["r4", "dora"])
    assert served._row_stacks() is None  # a variant: PEFT's own path serves the rows
    served.activate("r4")
    before = _alone(served, inputs, ["r4"])
    with pytest.raises(ValueError, match="adapter_names: rows name dora, which use DoRA"):
        served.forward(["dora", "r4", BASE_ADAPTER], **inputs)
    assert served.active == "r4"
    assert torch.equal(_alone(served, inputs, ["r4"]), before)
    rows = ["r4", BASE_ADAPTER, "r4"]
    with torch.no_grad():
        mixed = served.forward(rows, **inputs).logits
    torch.testing.assert_close(mixed, _alone(served, inputs, rows), **TOLERANCE)


def test_rows_of_the_base_only_and_refused_modes(model_and_processor, folders):
    base, processor = model_and_processor
    inputs = _inputs(processor, 2)
    served = _served(base, folders, ["r4", "r8"])
    with torch.no_grad():
        both_base = served.forward([BASE_ADAPTER, BASE_ADAPTER], **inputs).logits
        served.generate([BASE_ADAPTER] * 2, **inputs, max_new_tokens=2, do_sample=False)
    torch.testing.assert_close(both_base, _alone(served, inputs, [BASE_ADAPTER] * 2), **TOLERANCE)
    served.model.train()
    with pytest.raises(ValueError, match="adapter_names: expected the model in eval mode"):
        served.forward(["r4", BASE_ADAPTER], **inputs)
    served.model.eval()
    served.model.base_model.merge_adapter(["r4"])
    with pytest.raises(ValueError, match="adapter_names: expected unmerged adapters"):
        served.forward(["r4", BASE_ADAPTER], **inputs)


def test_stacks_follow_in_place_weight_changes_and_casts(model_and_processor, folders):
    base, processor = model_and_processor
    inputs = _inputs(processor, 2)
    served = _served(base, folders, ["r4", "r8"])
    rows = ["r8", "r4"]
    with torch.no_grad():
        served.forward(rows, **inputs)  # builds the stacks
        for name, parameter in served.model.named_parameters():
            if "lora_B.r8" in name:
                parameter.zero_()  # r8 now adds nothing
        changed = served.forward(rows, **inputs).logits
    torch.testing.assert_close(changed, _alone(served, inputs, rows), **TOLERANCE)
    torch.testing.assert_close(changed[0], _alone(served, inputs, [BASE_ADAPTER])[0], **TOLERANCE)
    served.model.to(torch.float64)
    inputs["pixel_values"] = inputs["pixel_values"].double()
    with torch.no_grad():
        assert served.forward(rows, **inputs).logits.dtype == torch.float64


def test_a_load_peft_fails_half_way_leaves_no_trace(model_and_processor, folders, monkeypatch):
    from peft import PeftModel

    base, processor = model_and_processor
    inputs = _inputs(processor, 2)
    served = _served(base, folders, ["r4"])
    served.activate("r4")
    before = _alone(served, inputs, ["r4", "r4"])
    load_adapter = PeftModel.load_adapter

    def fail_after_injecting(self, *args, **kwargs):
        load_adapter(self, *args, **kwargs)
        raise RuntimeError("disk error while loading")

    monkeypatch.setattr(PeftModel, "load_adapter", fail_after_injecting)
    with pytest.raises(RuntimeError, match="disk error"):
        served.load("r8", folders["r8"])
    assert served.names == ("r4",) and served.active == "r4"
    with pytest.raises(ValueError, match="name: expected one of __base__, r4, got 'r8'"):
        served.activate("r8")
    torch.testing.assert_close(_alone(served, inputs, ["r4", "r4"]), before, **TOLERANCE)
    with torch.no_grad():
        mixed = served.forward(["r4", BASE_ADAPTER], **inputs).logits
    torch.testing.assert_close(mixed, _alone(served, inputs, ["r4", BASE_ADAPTER]), **TOLERANCE)
