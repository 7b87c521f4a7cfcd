"""`patch` changes one model: the configs the caller holds (and other models share) stay theirs.

transformers models hold their config by reference: every model built from one config object,
and a composite config's sub-configs, are shared. The patched model's modules read private
copies; the caller's objects keep their identity and values.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import transformers

import ascend_vlm
from ascend_vlm.models.tiny import build_model, make_inputs
from ascend_vlm.patching import ATTENTION_NAME


@pytest.fixture()
def qwen():
    return build_model("qwen2_vl")


def _stock_twin(model):
    """A second model built from `model.config` (the same object), with `model`'s weights."""
    twin = type(model)(model.config).eval()
    twin.load_state_dict(model.state_dict())
    return twin


def _forward(model, inputs, **options):
    with torch.no_grad():
        return model(**inputs, **options)


def _config_snapshot(config) -> dict:
    """A deep copy of the attribute table of `config` and of its sub-configs."""
    snapshot = {k: v for k, v in config.__dict__.items() if k not in type(config).sub_configs}
    snapshot = copy.deepcopy(snapshot)
    for name in type(config).sub_configs:
        snapshot[name] = _config_snapshot(getattr(config, name))
    return snapshot


def test_a_model_built_from_a_patched_models_config_is_stock(qwen):
    inputs = make_inputs("qwen2_vl", qwen, n_images=1)
    stock = _forward(qwen, inputs).logits
    ascend_vlm.patch(qwen)
    second = _stock_twin(qwen)  # raised "Could not find ... flash attention ... 'ascend_flash'"
    assert second.config._attn_implementation == "eager"
    assert second.model.language_model.layers[0].self_attn.config._attn_implementation == "eager"
    assert torch.equal(_forward(second, inputs).logits, stock)
    language_model = type(qwen.model.language_model)(qwen.config.text_config)
    assert language_model.config._attn_implementation == "eager"


def test_an_earlier_model_sharing_the_config_keeps_its_attention(qwen):
    earlier = _stock_twin(qwen)
    inputs = make_inputs("qwen2_vl", qwen, n_images=1)
    before = _forward(earlier, inputs, output_attentions=True)
    assert len(before.attentions) == qwen.config.text_config.num_hidden_layers
    ascend_vlm.patch(qwen)
    after = _forward(earlier, inputs, output_attentions=True)
    assert torch.equal(after.logits, before.logits)
    assert len(after.attentions) == len(before.attentions)
    for got, expected in zip(after.attentions, before.attentions, strict=True):
        assert torch.equal(got, expected)


def test_the_callers_configs_keep_identity_and_values_and_unpatch_restores_them(qwen):
    held = {id(m): m.__dict__.get("config") for m in qwen.modules()}
    snapshot = _config_snapshot(qwen.config)
    ascend_vlm.patch(qwen)
    assert _config_snapshot(qwen.config) == snapshot
    assert qwen.config is held[id(qwen)]  # model.config is the caller's object
    attention = (qwen.model.language_model.layers[0].self_attn, qwen.model.visual.blocks[0].attn)
    assert all(m.config._attn_implementation == ATTENTION_NAME for m in attention)
    # The sub-models keep the caller's configs: each is the sub-config of model.config it was
    # built from (transformers' test_internal_model_config_and_subconfig_are_same).
    assert qwen.model.config is qwen.config
    assert qwen.model.language_model.config is qwen.config.text_config
    assert qwen.model.visual.config is qwen.config.vision_config
    ascend_vlm.unpatch(qwen)
    assert all(m.__dict__.get("config") is held[id(m)] for m in qwen.modules())
    assert _config_snapshot(qwen.config) == snapshot


def test_a_patched_models_saved_config_is_the_callers(qwen, tmp_path):
    inputs = make_inputs("qwen2_vl", qwen, n_images=1)
    stock = _forward(qwen, inputs).logits
    ascend_vlm.patch(qwen)
    qwen.save_pretrained(tmp_path)
    assert "ascend" not in (tmp_path / "config.json").read_text()
    loaded = type(qwen).from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert not ascend_vlm.patching.is_patched(loaded)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "qwen2_vl"
    assert torch.equal(_forward(loaded, inputs).logits, stock)


def test_a_peft_wrapped_model_keeps_the_callers_config(qwen):
    peft = pytest.importorskip("peft")
    user_config = qwen.config
    lora = peft.get_peft_model(qwen, peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    ascend_vlm.patch(lora)
    assert lora.config is user_config and user_config.text_config._attn_implementation == "eager"
    attention = qwen.model.language_model.layers[0].self_attn
    assert attention.config._attn_implementation == ATTENTION_NAME
    twin = type(qwen)(lora.config)
    assert twin.config._attn_implementation == "eager"
    ascend_vlm.unpatch(lora)
    assert attention.config is user_config.text_config


def test_a_pickled_patched_model_keeps_its_private_configs_through_the_round_trip(qwen):
    inputs = make_inputs("qwen2_vl", qwen, n_images=1)
    stock = _forward(qwen, inputs).logits
    ascend_vlm.patch(qwen)
    loaded = copy.deepcopy(qwen)
    assert loaded.config._attn_implementation == "eager"
    attention = loaded.model.language_model.layers[0].self_attn
    assert attention.config._attn_implementation == ATTENTION_NAME
    ascend_vlm.unpatch(loaded)
    assert attention.config is loaded.config.text_config
    assert loaded.model.language_model.config is loaded.config.text_config
    assert loaded.model.config is loaded.config
    assert torch.equal(_forward(loaded, inputs).logits, stock)


@pytest.mark.parametrize("family", ["qwen2_vl", "llava_clip", "gemma3"])
def test_each_sub_model_keeps_the_sub_config_of_model_config_it_was_built_from(family):
    model = build_model(family)
    ascend_vlm.patch(model)
    sub_configs = [getattr(model.config, name) for name in type(model.config).sub_configs]
    sub_models = [
        m
        for m in model.modules()
        if isinstance(m, transformers.PreTrainedModel) and type(m.config) is not type(model.config)
    ]
    assert sub_models  # each family has a language model or a vision tower of its own class
    for sub_model in sub_models:
        assert any(sub_model.config is config for config in sub_configs), type(sub_model)
        assert sub_model.config._attn_implementation == "eager"
