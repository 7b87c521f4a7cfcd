"""AdapterSet on the patched tiny Llama 4 and Llama 3.2 Vision: switching equals a fresh PEFT
model holding only the active adapter, and mixed rows equal their single-adapter runs."""

from __future__ import annotations

import copy

import pytest
import torch
from random_adapters import save_random_adapter

import ascend_vlm
from ascend_vlm.adapters.adapter_set import BASE_ADAPTER, AdapterSet
from ascend_vlm.models.parts import model_part
from ascend_vlm.models.tiny import build_model, make_inputs

pytestmark = pytest.mark.usefixtures("single_threaded_torch")


def _logits(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).logits


@pytest.mark.parametrize("family", ["llama4", "mllama"])
def test_adapters_switch_and_mix_rows_on_the_patched_model(family, tmp_path) -> None:
    from peft import PeftModel

    patched = build_model(family, attn_implementation="sdpa")
    ascend_vlm.patch(patched)
    # Language-model attention only: the vision tower's q/v projections share the names.
    targets = [
        name
        for name, _ in patched.named_modules()
        if name.split(".")[-1] in ("q_proj", "v_proj") and model_part(name) == "language"
    ]
    folders = {
        name: save_random_adapter(patched, tmp_path / name, seed, targets=targets)
        for seed, name in enumerate(("red", "green"))
    }
    inputs = make_inputs(family, patched, batch=3, padding="left")
    expected = {
        name: _logits(PeftModel.from_pretrained(copy.deepcopy(patched), folder).eval(), inputs)
        for name, folder in folders.items()
    }
    expected[BASE_ADAPTER] = _logits(patched, inputs)
    assert not torch.equal(expected["red"], expected["green"])
    served = AdapterSet(copy.deepcopy(patched))
    for name, folder in folders.items():
        served.load(name, folder)
    for name in ("red", BASE_ADAPTER, "green", "red"):
        served.activate(name)
        assert torch.equal(_logits(served.model, inputs), expected[name]), name
    rows = ["green", BASE_ADAPTER, "red"]
    with torch.no_grad():
        mixed = served.forward(rows, **inputs).logits
    for index, name in enumerate(rows):
        real = inputs["attention_mask"][index].bool()
        torch.testing.assert_close(
            mixed[index][real], expected[name][index][real], atol=1e-5, rtol=1e-5
        )
