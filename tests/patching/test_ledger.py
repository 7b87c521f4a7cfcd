"""The edit ledger (``patching/ledger.py``): every kind of edit undone exactly, features stacked in
the canonical order whatever order they come in, a failed install leaving nothing, irreversible
swaps refused, and the attention tap surviving ``unpatch``."""

from __future__ import annotations

import pytest
import torch
from instance_state import instance_state
from torch import nn

import ascend_vlm
from ascend_vlm import PatchError
from ascend_vlm.models import tiny
from ascend_vlm.patching.attention_tap import (
    TAPPED_ATTENTION,
    AttentionTap,
    tapped_implementation,
)
from ascend_vlm.patching.ledger import (
    FEATURE_ORDER,
    Edits,
    applied_features,
    apply_feature,
    remove_feature,
)


class _Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(3, 3)

    def forward(self, x):
        return self.inner(x)


class _Recording:
    """A feature that writes its name into a shared log attribute (so the order in which the
    ledger installs features is visible) and can be told to fail."""

    def __init__(self, name: str, module: nn.Module, log: list, fail: bool = False) -> None:
        self.name, self.module, self.log, self.fail = name, module, log, fail

    def install(self, edits: Edits) -> None:
        edits.set_attribute(self.module, "stack", (*getattr(self.module, "stack", ()), self.name))
        edits.add_hook(self.module.register_forward_hook(lambda m, a, out: out + 1))
        edits.on_undo(lambda: self.log.append(f"undo {self.name}"))
        self.log.append(f"install {self.name}")
        if self.fail:
            raise RuntimeError("install failed on purpose")


def test_every_kind_of_edit_is_undone_exactly():
    model = _Toy()
    before = instance_state(model)
    old_inner = model.inner
    calls = []

    class _Everything:
        name = "patch"

        def install(self, edits: Edits) -> None:
            edits.set_attribute(model.inner, "forward", lambda x: x * 0)
            edits.set_attribute(model, "training", False)
            edits.swap_submodule(model, "inner", nn.Identity())
            edits.add_hook(model.register_forward_pre_hook(lambda m, a: None))
            edits.on_undo(lambda: calls.append("cleaned"))

    feature = _Everything()
    apply_feature(model, feature)
    assert isinstance(model.inner, nn.Identity) and applied_features(model) == [feature]
    assert remove_feature(model, "patch") == [feature]
    assert model.inner is old_inner and calls == ["cleaned"]
    assert instance_state(model) == before
    assert "_ascend_vlm_ledger" not in vars(model)


def test_features_stack_in_the_canonical_order_whatever_order_they_come_in():
    model, log = _Toy(), []
    tracer = _Recording("tracer", model, log)
    patch = _Recording("patch", model, log)
    pruning = _Recording("token_pruning", model, log)
    apply_feature(model, tracer)
    apply_feature(model, pruning)
    apply_feature(model, patch)
    assert model.stack == ("patch", "token_pruning", "tracer")
    assert [f.name for f in applied_features(model)] == ["patch", "token_pruning", "tracer"]
    # applying patch beneath undid the two above, newest first, and installed them again
    assert log[-5:] == [
        "undo tracer",
        "undo token_pruning",
        "install patch",
        "install token_pruning",
        "install tracer",
    ]
    remove_feature(model, pruning)
    assert model.stack == ("patch", "tracer")
    x = torch.zeros(1, 3)
    torch.testing.assert_close(model(x), model.inner(x) + 2)  # two hooks left, +1 each


def _shape_of(model: nn.Module) -> dict:
    """Each module's attribute names, children and hook counts: what a re-installed feature
    gives back (its hook handles are new)."""
    return {
        name: (set(vars(m)), dict(m._modules), len(m._forward_hooks), len(m._forward_pre_hooks))
        for name, m in model.named_modules()
    }


def test_a_failing_install_leaves_the_model_and_the_features_above_as_they_were():
    model, log = _Toy(), []
    apply_feature(model, _Recording("tracer", model, log))
    before = _shape_of(model)
    with pytest.raises(RuntimeError, match="on purpose"):
        apply_feature(model, _Recording("patch", model, log, fail=True))
    assert [f.name for f in applied_features(model)] == ["tracer"]
    assert model.stack == ("tracer",)
    assert _shape_of(model) == before


class _NeedsWhatWasBeneath(_Recording):
    """Fails to install unless the model carries quantization exactly when it first did."""

    def install(self, edits: Edits) -> None:
        quantized = "quantization" in getattr(self.module, "stack", ())
        self.first = getattr(self, "first", quantized)
        self.fail = quantized != self.first
        super().install(edits)


@pytest.mark.parametrize("change", ["apply", "remove"])
def test_a_feature_failing_to_install_again_gives_back_the_stack_it_was_on(change):
    model, log = _Toy(), []
    quantization = _Recording("quantization", model, [])
    if change == "remove":
        apply_feature(model, quantization)
    patch, tracer = _NeedsWhatWasBeneath("patch", model, log), _Recording("tracer", model, [])
    apply_feature(model, patch)
    apply_feature(model, tracer)
    before, stack = _shape_of(model), model.stack
    with pytest.raises(RuntimeError, match="on purpose"):
        if change == "apply":
            apply_feature(model, quantization)
        else:
            remove_feature(model, quantization)
    # patch could not go on top of the change: the model carries what it carried before
    assert applied_features(model) == ([quantization] if change == "remove" else []) + [
        patch,
        tracer,
    ]
    assert model.stack == stack and _shape_of(model) == before


def test_a_swap_that_did_not_keep_the_module_refuses_to_be_undone():
    model = _Toy()

    class _Lossy:
        name = "quantization"

        def install(self, edits: Edits) -> None:
            edits.swap_submodule(model, "inner", nn.Identity(), keep_previous=False)

    apply_feature(model, _Lossy())
    with pytest.raises(PatchError, match="quantization cannot be undone"):
        remove_feature(model, "quantization")
    assert isinstance(model.inner, nn.Identity)
    # features above it still come and go
    log = []
    tracer = _Recording("tracer", model, log)
    apply_feature(model, tracer)
    remove_feature(model, tracer)
    assert [f.name for f in applied_features(model)] == ["quantization"]


def test_names_and_objects_are_checked():
    model = _Toy()
    with pytest.raises(ValueError, match=r"feature name: expected one of .*got 'unknown'"):
        apply_feature(model, _Recording("unknown", model, []))
    with pytest.raises(TypeError, match="feature: expected an object with name and install"):
        apply_feature(model, object())
    feature = _Recording("tracer", model, [])
    apply_feature(model, feature)
    with pytest.raises(ValueError, match="this tracer is already applied"):
        apply_feature(model, feature)
    assert remove_feature(_Toy(), "tracer") == []
    assert set(FEATURE_ORDER) >= {"patch", "quantization", "token_pruning", "tracer"}


def _sharpened_qwen():
    """A tiny Qwen2-VL whose query/key weights are scaled up, so attention is far from uniform
    and a tap that received the wrong queries would show."""
    model = tiny.build_model("qwen2_vl", attn_implementation="sdpa")
    with torch.no_grad():
        for layer in model.model.language_model.layers:
            layer.self_attn.q_proj.weight.mul_(4)
            layer.self_attn.k_proj.weight.mul_(4)
    return model


def test_a_tap_survives_unpatch_and_taps_the_stock_attention():
    model = _sharpened_qwen()
    inputs = tiny.make_inputs("qwen2_vl", model, n_images=1)
    with torch.no_grad():
        stock = model(**inputs).logits
    attention = model.model.language_model.layers[0].self_attn
    seen = []
    ascend_vlm.patch(model)
    tap = AttentionTap([attention], lambda module, q, k, mask, scaling: seen.append(q.clone()))
    apply_feature(model, tap)
    ascend_vlm.unpatch(model)
    assert attention.config._attn_implementation == TAPPED_ATTENTION
    assert tapped_implementation(attention.config) == "sdpa"
    with torch.no_grad():
        tapped = model(**inputs).logits
    assert torch.equal(tapped, stock) and len(seen) == 1
    remove_feature(model, tap)
    assert attention.config._attn_implementation == "sdpa"
    assert not applied_features(model)


def test_a_stack_that_cannot_be_restored_says_what_the_model_carries():
    model = _Toy()
    patch = _Recording("patch", model, [])
    apply_feature(model, patch)
    patch.fail = True  # from now on every install fails, the restoring one too
    with pytest.raises(PatchError, match=r"and so did restoring patch .*carries no feature"):
        apply_feature(model, _Recording("quantization", model, []))


def test_a_compiled_model_keeps_its_features_on_the_module_it_wraps():
    from ascend_vlm.observability import Tracer

    model = tiny.build_model("qwen2_vl", attn_implementation="sdpa")
    compiled = torch.compile(model)  # nothing compiles before the first call
    ascend_vlm.patch(compiled)
    tracer = Tracer(compiled)
    tracer.enable()
    assert [f.name for f in applied_features(model)] == ["patch", "tracer"]
    assert applied_features(compiled) == applied_features(model)
    assert "_ascend_vlm_ledger" not in vars(compiled)
    ascend_vlm.unpatch(compiled)
    tracer.disable()
    assert not applied_features(model) and "_ascend_vlm_ledger" not in vars(model)
