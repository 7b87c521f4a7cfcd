"""LoRA adapters over Qwen3.5's Gated DeltaNet projections on the patched model: an active
adapter and mixed adapter rows equal a fresh PEFT model holding that adapter. Qwen3.5-MoE
refuses adapters: mixed rows fail on a LoRA layer inside its sparse MoE block."""

from __future__ import annotations

import copy

import pytest
import torch
from random_adapters import save_random_adapter

import ascend_vlm
from ascend_vlm.adapters.adapter_set import AdapterSet
from ascend_vlm.models import descriptor_for
from ascend_vlm.models.descriptor import Refused
from ascend_vlm.models.tiny import build_model, make_inputs

pytestmark = pytest.mark.usefixtures("single_threaded_torch")
LINEAR_ATTENTION_TARGETS = ("in_proj_qkv", "in_proj_z", "out_proj", "q_proj", "down_proj")


def test_adapter_set_on_the_linear_attention_projections_equals_fresh_peft(tmp_path):
    family = "qwen3_5"  # qwen3_5_moe refuses adapters: mixed rows fail in its sparse MoE block
    from peft import PeftModel

    base = build_model(family)
    folders = {
        name: save_random_adapter(base, tmp_path / name, seed, targets=LINEAR_ATTENTION_TARGETS)
        for seed, name in enumerate(("red", "green"))
    }
    inputs = make_inputs(family, base, batch=2, padding="right")
    real = inputs["attention_mask"].bool()
    model = copy.deepcopy(base)
    ascend_vlm.patch(model)
    adapters = AdapterSet(model)
    for name, folder in folders.items():
        adapters.load(name, folder)
    with torch.no_grad():
        mixed = adapters.forward(["red", "green"], **inputs).logits
        for row, (name, folder) in enumerate(folders.items()):
            fresh = PeftModel.from_pretrained(copy.deepcopy(base), folder).eval()
            expected = fresh(**inputs).logits
            adapters.activate(name)
            active = adapters.model(**inputs).logits
            torch.testing.assert_close(active[real], expected[real], atol=1e-4, rtol=0)
            torch.testing.assert_close(
                mixed[row][real[row]], expected[row][real[row]], atol=1e-4, rtol=0
            )


def test_the_moe_family_refuses_adapters_whose_mixed_rows_fail_in_its_moe_block(tmp_path):
    model = build_model("qwen3_5_moe")
    answer = descriptor_for(model.config).features.adapters
    assert isinstance(answer, Refused) and "mixed adapter rows" in answer.reason
    folder = save_random_adapter(model, tmp_path / "red", 0, targets=("down_proj",))
    adapters = AdapterSet(model)
    adapters.load("red", folder)
    inputs = make_inputs("qwen3_5_moe", model, batch=2)
    with pytest.raises(RuntimeError, match=r"adapter_names: expected the layer input as \[rows"):
        adapters.forward(["red", "__base__"], **inputs)
