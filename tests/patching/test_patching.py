"""The generic machinery of `ascend_vlm.patch`: per-instance, reversible, idempotent, honest."""

from __future__ import annotations

import inspect
import io
import itertools
import subprocess
import sys

import pytest
import torch
import transformers
from torch import nn

import ascend_vlm
from ascend_vlm import PatchError
from ascend_vlm.models import supported_model_types
from ascend_vlm.models.tiny import TINY_TEXT_CONFIG, build_model, make_inputs
from ascend_vlm.patching import ATTENTION_NAME, ascend_attention_forward, is_patched


@pytest.fixture()
def qwen():
    return build_model("qwen2_vl")


def _logits(model, inputs):
    with torch.no_grad():
        return model(**inputs).logits


def test_patch_is_per_instance_and_leaves_other_models_and_classes_alone(qwen):
    other = build_model("qwen2_vl", seed=1)
    inputs = make_inputs("qwen2_vl", other, n_images=1)
    before = _logits(other, inputs)
    class_forward = type(qwen.model.language_model.norm).forward
    ascend_vlm.patch(qwen)
    assert is_patched(qwen) and not is_patched(other)
    attention = qwen.model.language_model.layers[0].self_attn
    assert attention.config._attn_implementation == ATTENTION_NAME
    assert other.model.language_model.layers[0].self_attn.config._attn_implementation == "eager"
    assert "forward" not in other.model.language_model.norm.__dict__
    assert type(qwen.model.language_model.norm).forward is class_forward
    assert torch.equal(_logits(other, inputs), before)


def test_patch_keeps_parameters_and_repr_names_the_op(qwen):
    parameters = {name: p for name, p in qwen.named_parameters()}
    ascend_vlm.patch(qwen)
    assert all(p is parameters[name] for name, p in qwen.named_parameters())
    layer = qwen.model.language_model.layers[0]
    assert "fused=ascend_vlm.ops.rms_norm" in repr(layer.input_layernorm)
    assert "fused=ascend_vlm.ops.swiglu" in repr(layer.mlp)
    ascend_vlm.unpatch(qwen)
    assert "ascend_vlm" not in repr(qwen)


def test_unpatch_restores_every_rebound_attribute_and_config(qwen):
    instance_dicts = {id(m): dict(m.__dict__) for m in qwen.modules()}
    implementations = [c._attn_implementation for c in (qwen.config, qwen.config.vision_config)]
    ascend_vlm.patch(qwen)
    ascend_vlm.unpatch(qwen)
    for module in qwen.modules():  # the same objects under the same names, configs included
        restored = instance_dicts[id(module)]
        assert module.__dict__.keys() == restored.keys()
        assert all(module.__dict__[name] is value for name, value in restored.items())
    assert [c._attn_implementation for c in (qwen.config, qwen.config.vision_config)] == (
        implementations
    )
    ascend_vlm.unpatch(qwen)  # unpatching an unpatched model is harmless


def test_patching_again_with_other_options_asks_for_unpatch(qwen):
    ascend_vlm.patch(qwen)
    with pytest.raises(PatchError, match="already patched"):
        ascend_vlm.patch(qwen, mlp=False)


def test_report_counts_kinds_and_reasons_and_renders(qwen):
    report = ascend_vlm.patch(qwen, mlp=False, vision=False)
    layers = qwen.config.text_config.num_hidden_layers
    assert report.swapped_count("attention-text") == layers
    assert report.swapped_count("attention-vision") == 0
    assert report.swapped_count("norm") == 2 * layers + 1
    assert report.swapped_count("mlp") == 0
    data = report.as_dict()
    assert data["totals"]["mlp"] == {"swapped": 0, "left_alone": layers + 1}
    reasons = {row["reason"] for row in data["left_alone"]}
    assert any("mlp=False" in reason for reason in reasons)
    assert any("vision=False" in reason for reason in reasons)
    assert qwen.model.visual.blocks[0].attn.config._attn_implementation == "eager"
    assert qwen.model.language_model.layers[0].self_attn.config._attn_implementation == (
        ATTENTION_NAME
    )
    text = str(report)
    assert "Qwen2VLRMSNorm" in text and "ops.rms_norm" in text and "kept:" in text


def test_options_off_change_nothing_and_keep_outputs_bitwise(qwen):
    inputs = make_inputs("qwen2_vl", qwen, n_images=1)
    reference = _logits(qwen, inputs)
    report = ascend_vlm.patch(
        qwen, attention=False, vision=False, norm=False, rope=False, mlp=False
    )
    assert (
        sum(report.swapped_count(kind) for kind in ("attention-text", "norm", "rope", "mlp")) == 0
    )
    assert torch.equal(_logits(qwen, inputs), reference)


def test_peft_lora_patch_and_unpatch(qwen):
    peft = pytest.importorskip("peft")
    inputs = make_inputs("qwen2_vl", qwen, n_images=1)
    lora = peft.get_peft_model(qwen, peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    for name, parameter in lora.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(parameter, std=0.1)  # make the adapters change the output
    reference = _logits(lora, inputs)
    report = ascend_vlm.patch(lora)
    assert report.swapped_count("attention-text") == qwen.config.text_config.num_hidden_layers
    torch.testing.assert_close(_logits(lora, inputs), reference, atol=1e-4, rtol=0)
    ascend_vlm.unpatch(lora)
    assert not is_patched(qwen)
    assert torch.equal(_logits(lora, inputs), reference)


def _pickled_and_loaded(model):
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def test_a_patched_model_pickles_loads_patched_and_unpatches_to_the_original(qwen):
    inputs = make_inputs("qwen2_vl", qwen, n_images=1)
    stock = _logits(qwen, inputs)
    report = ascend_vlm.patch(qwen)
    patched = _logits(qwen, inputs)
    loaded = _pickled_and_loaded(qwen)
    assert is_patched(loaded) and str(ascend_vlm.patch(loaded)) == str(report)
    text_attention = loaded.model.language_model.layers[0].self_attn
    rope = inspect.unwrap(text_attention.forward.func).__globals__["apply_rotary_pos_emb"]
    # the RoPE rebinding survives (a bound method would unpickle as the stock forward)
    assert rope.func.__module__ == "ascend_vlm.patching.adapters"
    assert torch.equal(_logits(loaded, inputs), patched)
    ascend_vlm.unpatch(loaded)
    assert all("forward" not in m.__dict__ for m in loaded.modules())
    assert torch.equal(_logits(loaded, inputs), stock)


def test_a_patched_model_unpickled_in_a_fresh_process_runs_its_attention(qwen, tmp_path):
    inputs = make_inputs("qwen2_vl", qwen, n_images=1)
    ascend_vlm.patch(qwen)
    torch.save({"model": qwen, "inputs": inputs, "logits": _logits(qwen, inputs)}, tmp_path / "m")
    code = (
        "import torch\n"
        f"saved = torch.load({str(tmp_path / 'm')!r}, weights_only=False)\n"
        "with torch.no_grad():\n"
        "    logits = saved['model'](**saved['inputs']).logits\n"
        "assert torch.equal(logits, saved['logits']), 'logits differ'\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr[-2000:]


def _tiny_llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**TINY_TEXT_CONFIG, attn_implementation="eager")
    return transformers.LlamaForCausalLM(config).eval()


def test_unsupported_model_strict_raises_listing_supported_model_types():
    with pytest.raises(PatchError) as error:
        ascend_vlm.patch(_tiny_llama())
    for model_type in supported_model_types():
        assert model_type in str(error.value)


def test_unsupported_model_lenient_patches_known_decoder_and_says_what_it_skipped():
    model = _tiny_llama()
    input_ids = torch.tensor([[1, 5, 9, 17, 33]])
    reference = _logits(model, {"input_ids": input_ids})
    report = ascend_vlm.patch(model, strict=False)
    swapped = tuple(
        report.swapped_count(kind) for kind in ("attention-text", "norm", "rope", "mlp")
    )
    assert swapped == (2, 5, 2, 2)
    torch.testing.assert_close(
        _logits(model, {"input_ids": input_ids}), reference, atol=1e-4, rtol=0
    )


def test_unsupported_vision_language_model_lenient_reports_its_vision_tower(qwen, monkeypatch):
    # The generic path routes every attention that goes through transformers' interface; one
    # whose attention does not (here: none does) gets its vision tower and text side reported.
    monkeypatch.setattr(ascend_vlm.patching.core, "spec_for", lambda config: None)
    monkeypatch.setattr(
        ascend_vlm.patching.generic, "attention_interface_problem", lambda cls: "stand-in"
    )
    report = ascend_vlm.patch(qwen, strict=False)
    rows = report.as_dict()["left_alone"]
    assert {(row["kind"], row["module"]) for row in rows if row["reason"] != "stand-in"} == {
        ("attention-vision", "vision tower"),
        ("attention-text", "qwen2_vl"),
    }
    assert report.swapped_count("attention-text") == report.swapped_count("attention-vision") == 0


def test_lenient_report_of_a_text_only_model_names_no_vision_tower():
    report = ascend_vlm.patch(_tiny_llama(), strict=False)
    assert report.as_dict()["left_alone"] == []  # it listed a vision tower the model lacks
    assert "vision" not in str(report)


def test_non_transformers_module_is_refused():
    with pytest.raises(PatchError, match=r"config\.model_type"):
        ascend_vlm.patch(nn.Linear(2, 2))


@pytest.mark.parametrize("model", [None, "model", 3])
@pytest.mark.parametrize("function", [ascend_vlm.patch, ascend_vlm.unpatch, is_patched])
def test_a_model_that_is_no_module_is_a_type_error(function, model):
    with pytest.raises(
        TypeError, match=rf"model: expected a torch.nn.Module.*got {type(model).__name__}$"
    ):
        function(model)


@pytest.mark.parametrize("option", ["attention", "vision", "norm", "rope", "mlp", "strict"])
@pytest.mark.parametrize("value", ["yes", 0, 1, None])
def test_patch_options_must_be_bools(qwen, option, value):
    with pytest.raises(TypeError, match=rf"^{option}: expected True or False, got {value!r}$"):
        ascend_vlm.patch(qwen, **{option: value})
    assert not is_patched(qwen)


def test_attention_function_refuses_softcap_and_batched_varlen():
    query = torch.zeros(2, 2, 3, 4)
    module = nn.Module()
    with pytest.raises(ValueError, match="softcap"):
        ascend_attention_forward(module, query, query, query, None, softcap=30.0)
    lengths = torch.tensor([0, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="batch 1"):
        ascend_attention_forward(module, query, query, query, None, cu_seq_lens_q=lengths)


def test_attention_function_hands_every_layer_the_callers_mask_object(monkeypatch):
    """transformers hands one mask to every layer; passing it on as that same object (sliced
    only when longer than the keys) lets the op read it on the host once per forward."""
    masks: list[torch.Tensor] = []

    def spy(query, key, value, *, attention_mask=None, **options):
        masks.append(attention_mask)
        return torch.zeros_like(query)

    monkeypatch.setattr(ascend_vlm.ops, "fused_attention", spy)
    query, key = torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 5, 4)
    exact, longer = (
        torch.ones(1, 1, 3, 5, dtype=torch.bool),
        torch.ones(1, 1, 3, 7, dtype=torch.bool),
    )
    for _ in range(2):
        ascend_attention_forward(nn.Module(), query, key, key, exact)
    ascend_attention_forward(nn.Module(), query, key, key, longer)
    assert masks[0] is exact and masks[1] is exact
    assert masks[2].shape == (1, 1, 3, 5) and masks[2].data_ptr() == longer.data_ptr()


def _attach_accelerate_style_hook(module: nn.Module, calls: list[str]) -> None:
    """What accelerate's `add_hook_to_module` does to a module (accelerate is not installed
    here): the original forward goes to `_old_forward`, `_hf_hook` holds the hook and the
    instance `forward` becomes a wrapper that runs the hook around `module._old_forward`."""
    module._old_forward = module.forward
    module._hf_hook = object()

    def hooked_forward(*args, **kwargs):
        calls.append(type(module).__name__)  # where accelerate moves weights / inputs
        return module._old_forward(*args, **kwargs)

    module.forward = hooked_forward


def test_accelerate_hooks_stay_in_front_of_the_patched_forwards(qwen):
    inputs = make_inputs("qwen2_vl", qwen, n_images=0)
    reference = _logits(qwen, inputs)
    layer = qwen.model.language_model.layers[0]
    hooked = (layer.input_layernorm, layer.mlp, layer.self_attn)
    calls: list[str] = []
    for module in hooked:
        _attach_accelerate_style_hook(module, calls)
    wrappers = [module.forward for module in hooked]
    originals = [module._old_forward for module in hooked]
    ascend_vlm.patch(qwen)
    assert [module.forward for module in hooked] == wrappers
    assert all(m._old_forward != old for m, old in zip(hooked, originals, strict=True))
    patched = _logits(qwen, inputs)
    norm, mlp, attention = hooked
    assert calls == [type(module).__name__ for module in (norm, attention, mlp)]
    torch.testing.assert_close(patched, reference, atol=1e-4, rtol=0)
    ascend_vlm.unpatch(qwen)
    assert [module.forward for module in hooked] == wrappers
    assert [module._old_forward for module in hooked] == originals
    assert torch.equal(_logits(qwen, inputs), reference)


@pytest.mark.parametrize(
    ("argument", "options"),
    [("dropout", {"dropout": 0.1}), ("sliding_window", {"sliding_window": 2})],
)
def test_packed_varlen_attention_refuses_what_it_cannot_honour(argument, options):
    packed = torch.randn(1, 2, 6, 4)
    lengths = torch.tensor([0, 3, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match=f"^{argument}:"):
        ascend_attention_forward(
            nn.Module(), packed, packed, packed, None, cu_seq_lens_q=lengths, **options
        )
    output, _ = ascend_attention_forward(
        nn.Module(), packed, packed, packed, None, cu_seq_lens_q=lengths, sliding_window=None
    )
    assert output.shape == (1, 6, 2, 4)


def _per_segment_attention(query, key, value, bounds, causal):
    """Reference: SDPA on each packed segment alone (GQA by repeating key/value heads)."""
    groups = query.shape[1] // key.shape[1]
    key, value = (t.repeat_interleave(groups, dim=1) for t in (key, value))
    outputs = []
    for start, end in itertools.pairwise(bounds):
        q, k, v = (t[:, :, start:end] for t in (query, key, value))
        outputs.append(nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal))
    return torch.cat(outputs, dim=2).transpose(1, 2)


@pytest.mark.parametrize("backend", ["cpu", "mock"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "bounds",
    [[0, 6], [0, 3, 6, 9], [0, 2, 6, 9]],  # one segment, equal segments, unequal segments
    ids=["one", "equal", "unequal"],
)
def test_packed_attention_attends_within_each_segment(bounds, causal, backend, request):
    if backend == "mock":
        request.getfixturevalue("mock_npu")
    generator = torch.Generator().manual_seed(len(bounds))
    total = bounds[-1]
    query = torch.randn(1, 4, total, 8, generator=generator)
    key, value = (torch.randn(1, 2, total, 8, generator=generator) for _ in range(2))
    module = nn.Module()
    module.is_causal = causal
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32)
    output, _ = ascend_attention_forward(
        module, query, key, value, None, cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens
    )
    expected = _per_segment_attention(query, key, value, bounds, causal)
    torch.testing.assert_close(output, expected, atol=1e-5, rtol=1e-5)


def test_packed_attention_checks_offsets_and_bounds():
    packed = torch.randn(1, 2, 6, 4)
    for bounds, limit in (([0, 3, 5], None), ([1, 3, 6], None), ([0, 3, 6], 2)):
        with pytest.raises(ValueError, match=r"^(cu_seqlens_q|max_seqlen_q):"):
            ascend_attention_forward(
                nn.Module(),
                packed,
                packed,
                packed,
                None,
                cu_seq_lens_q=torch.tensor(bounds),
                max_length_q=limit,
            )


@pytest.mark.parametrize(
    ("x_dtype", "weight_dtype"),
    [
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.float32),
        (torch.float32, torch.bfloat16),
        (torch.bfloat16, torch.bfloat16),
    ],
)
def test_patched_norm_keeps_the_stock_dtype_and_rounding(qwen, x_dtype, weight_dtype):
    # Stock Llama-style norms return weight * x_norm.to(x.dtype): promote(weight, x) with x_norm
    # rounded to x.dtype first; mixed dtypes must match bit for bit.
    norm = qwen.model.language_model.norm.to(weight_dtype)
    with torch.no_grad():
        norm.weight.normal_(generator=torch.Generator().manual_seed(0))
    x = (3 * torch.randn(2, 5, norm.weight.shape[0], generator=torch.Generator())).to(x_dtype)
    stock = norm(x)
    ascend_vlm.patch(qwen)
    assert "fused=ascend_vlm.ops.rms_norm" in repr(norm)
    patched = norm(x)
    assert patched.dtype == stock.dtype == torch.promote_types(x_dtype, weight_dtype)
    if x_dtype == weight_dtype:  # the fused op rounds once where the stock module rounds twice
        torch.testing.assert_close(patched, stock)
    else:
        assert torch.equal(patched, stock)


@pytest.mark.parametrize(
    ("x_dtype", "weight_dtype"),
    [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16), (torch.float32,) * 2],
)
def test_patched_gemma4_norms_round_once_to_the_input_dtype(x_dtype, weight_dtype):
    # Gemma 4's norms (with a weight and without: with_scale=False) compute in fp32 and round
    # once to x's dtype whatever the weight's dtype.
    model = build_model("gemma4")
    attention = model.model.language_model.layers[0].self_attn
    norms = {"q_norm": attention.q_norm.to(weight_dtype), "v_norm": attention.v_norm}
    assert not hasattr(norms["v_norm"], "weight")
    with torch.no_grad():
        norms["q_norm"].weight.normal_(generator=torch.Generator().manual_seed(0))
    x = (3 * torch.randn(2, 5, 4, 8, generator=torch.Generator().manual_seed(1))).to(x_dtype)
    stock = {name: norm(x) for name, norm in norms.items()}
    ascend_vlm.patch(model)
    for name, norm in norms.items():
        assert "fused=ascend_vlm.ops.rms_norm" in repr(norm), name
        patched = norm(x)
        assert patched.dtype == stock[name].dtype == x_dtype, name
        torch.testing.assert_close(patched, stock[name], msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_adapters_match_transformers(dtype):
    """The RoPE adapters match transformers' functions in dtype, shape and (fp32 rounding)
    value, gradients included, with GQA head counts."""
    from transformers.models.qwen2_vl import modeling_qwen2_vl as stock

    from ascend_vlm.patching.adapters import rope_adapter

    _rope_text, _rope_vision = rope_adapter("text"), rope_adapter("vision")

    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 5, 8, generator=generator).to(dtype).requires_grad_()
    k = torch.randn(2, 2, 5, 8, generator=generator).to(dtype).requires_grad_()
    cos, sin = torch.randn(2, 2, 5, 8, generator=generator).to(dtype).unbind(0)
    got = _rope_text(q, k, cos, sin)
    want = stock.apply_rotary_pos_emb(q, k, cos, sin)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        if dtype == torch.float32:  # addcmul rounds once where transformers rounds twice
            torch.testing.assert_close(g, w)
    grads = [torch.autograd.grad(sum(t.float().sum() for t in out), (q, k)) for out in (got, want)]
    for g, w in zip(*grads, strict=True):
        torch.testing.assert_close(g, w)

    qv, kv = torch.randn(2, 6, 3, 8, generator=generator).to(dtype).unbind(0)
    cos_v, sin_v = torch.randn(2, 6, 8, generator=generator).unbind(0)
    got_v = _rope_vision(qv, kv, cos_v, sin_v)
    want_v = stock.apply_rotary_pos_emb_vision(qv, kv, cos_v, sin_v)
    for g, w in zip(got_v, want_v, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        torch.testing.assert_close(g, w)
