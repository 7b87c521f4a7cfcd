"""Any history of features gives the model a fresh model with the same features gives.

Hypothesis draws sequences of enable/disable over `patch`, token pruning, SnapKV, the vision
cache, the tracer, the attention tap and mixed-adapter rows, on a PEFT-wrapped tiny Qwen2-VL
(with weight-only quantization applied once at the start in some draws). After every step the
logits equal, bit for bit, those of a fresh copy of the starting model with the same set of
features applied; once everything is removed the model's logits and every module's instance
state (attributes, children, hooks) are the starting model's.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from instance_state import instance_state

import ascend_vlm
from ascend_vlm import pruning, trace_events
from ascend_vlm.adapters.mixed_rows import AdapterRows, StackedAdapters
from ascend_vlm.models import tiny
from ascend_vlm.observability import Tracer
from ascend_vlm.patching.attention_tap import AttentionTap
from ascend_vlm.patching.ledger import applied_features, apply_feature, remove_feature
from ascend_vlm.pruning import PruneConfig, SnapKVConfig
from ascend_vlm.quantization import QuantizationConfig
from ascend_vlm.reuse import VisionCache, disable_vision_cache, enable_vision_cache

FEATURES = (
    "patch",
    "token_pruning",
    "snapkv",
    "vision_cache",
    "tracer",
    "attention_tap",
    "adapter_rows",
)
PRUNE = PruneConfig(method="fastv", layer=2, keep=0.5)
SNAPKV = SnapKVConfig(compression_ratio=0.5, window=2)


def _starting_model(quantized: bool):
    """A tiny Qwen2-VL with sharpened query/key weights (so position bugs show), optionally
    with its MLPs quantized to 8 bits, wrapped by PEFT with one LoRA adapter whose layers
    compute the base alone (mixed-adapter rows add the adapter per row)."""
    from peft import LoraConfig, get_peft_model

    model = tiny.build_model("qwen2_vl", attn_implementation="sdpa", layers=4)
    with torch.no_grad():
        for layer in model.model.language_model.layers:
            layer.self_attn.q_proj.weight.mul_(4)
            layer.self_attn.k_proj.weight.mul_(4)
    if quantized:
        config = QuantizationConfig(bits=8, include=("*.mlp.*",))
        ascend_vlm.quantize(model, config, progress=False)
    torch.manual_seed(1)
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    peft_model = get_peft_model(model, lora)
    for name, parameter in peft_model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(parameter, std=0.5)
    peft_model.base_model.disable_adapter_layers()
    return peft_model.eval()


@dataclass
class _Applied:
    """One model and the feature objects currently on it."""

    model: torch.nn.Module
    on: set[str] = field(default_factory=set)
    objects: dict[str, object] = field(default_factory=dict)
    cache: VisionCache = field(default_factory=lambda: VisionCache(max_bytes=1 << 24))
    taps: list = field(default_factory=list)

    def _pruning(self) -> None:
        pruning.disable_token_pruning(self.model)
        prune = PRUNE if "token_pruning" in self.on else None
        kv = SNAPKV if "snapkv" in self.on else None
        if prune is not None or kv is not None:
            pruning.enable_token_pruning(self.model, prune, kv=kv)

    def enable(self, name: str) -> None:
        self.on.add(name)
        model = self.model
        if name == "patch":
            ascend_vlm.patch(model)
        elif name in ("token_pruning", "snapkv"):
            self._pruning()
        elif name == "vision_cache":
            enable_vision_cache(model, self.cache)
        elif name == "tracer":
            self.objects[name] = Tracer(model)
            self.objects[name].enable()
        elif name == "attention_tap":
            layers = model.base_model.model.model.language_model.layers
            tap = AttentionTap(
                [layer.self_attn for layer in layers],
                lambda module, q, k, mask, scaling: self.taps.append(q.shape),
            )
            self.objects[name] = tap
            apply_feature(model, tap)
        elif name == "adapter_rows":
            from peft.tuners.lora import Linear as LoraLinear

            layers = [m for m in model.modules() if isinstance(m, LoraLinear)]
            rows = AdapterRows(StackedAdapters(layers, ["default"]), ["default", None])
            self.objects[name] = rows
            apply_feature(model, rows)

    def disable(self, name: str) -> None:
        self.on.discard(name)
        model = self.model
        if name == "patch":
            ascend_vlm.unpatch(model)
        elif name in ("token_pruning", "snapkv"):
            self._pruning()
        elif name == "vision_cache":
            disable_vision_cache(model)
        elif name == "tracer":
            self.objects.pop(name).disable()
        else:
            remove_feature(model, self.objects.pop(name))

    def disable_all(self) -> None:
        for name in list(self.on):
            self.disable(name)

    def logits(self, inputs: dict) -> torch.Tensor:
        with torch.no_grad():
            return self.model(**inputs).logits


def _inputs(model) -> dict:
    """Two left-padded rows, each with images (one and two)."""
    base = model.base_model.model
    rows = [tiny.qwen_prompt(base, 1, 5, seed=1), tiny.qwen_prompt(base, 2, 3, seed=2)]
    return tiny.left_padded_qwen_batch(rows)


@pytest.fixture(scope="module")
def starting_models():
    return {quantized: _starting_model(quantized) for quantized in (False, True)}


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    quantized=st.booleans(),
    steps=st.lists(st.sampled_from(FEATURES), min_size=1, max_size=7),
)
def test_any_history_equals_a_fresh_model_with_the_same_features(starting_models, quantized, steps):
    start = starting_models[quantized]
    inputs = _inputs(start)
    with torch.no_grad():
        stock = start(**inputs).logits
    applied = _Applied(copy.deepcopy(start))
    applied.logits(inputs)
    before = instance_state(applied.model)
    for name in steps:
        (applied.disable if name in applied.on else applied.enable)(name)
        fresh = _Applied(copy.deepcopy(start))
        for feature in FEATURES:  # the fresh model in the listed order, one by one
            if feature in applied.on:
                fresh.enable(feature)
        torch.testing.assert_close(applied.logits(inputs), fresh.logits(inputs), rtol=0, atol=0)
        ledger_names = {f.name for f in applied_features(applied.model)}
        assert ledger_names == {f.name for f in applied_features(fresh.model)}
        fresh.disable_all()  # the tracer listens to process-wide events until disabled
    applied.disable_all()
    left = [feature.name for feature in applied_features(applied.model)]
    assert left == (["quantization"] if quantized else [])
    assert torch.equal(applied.logits(inputs), stock)
    assert instance_state(applied.model) == before
    assert not trace_events._LISTENERS
