"""Qwen3.5's Gated DeltaNet layers patched: prefill runs ``ops.chunk_gated_delta_rule``, cached
decode ``ops.recurrent_gated_delta_rule``, the short convolution ``ops.causal_conv1d``, with the
states in transformers' own cache; generation, training and the NPU path match stock.

The tiny model is sharpened so that positions and the recurrent state decide its outputs: a slow
decay (the state remembers the whole prompt), larger q/k/v projections and query/key weights of
the full-attention layer, so a wrong state, conv state or rotary position moves the logits.
"""

from __future__ import annotations

import copy
import math
from dataclasses import replace

import pytest
import torch
import transformers

import ascend_vlm
from ascend_vlm import ops
from ascend_vlm.models.tiny import FAMILIES, TINY, make_inputs

pytestmark = pytest.mark.usefixtures("single_threaded_torch")
ATOL = 1e-4


def _sharpened(size=TINY, dtype=torch.float32, **text):
    """A tiny Qwen3.5 (eager) whose linear-attention state and positions matter (module doc)."""
    torch.manual_seed(0)
    config = FAMILIES["qwen3_5"].config(size)
    for name, value in text.items():
        setattr(config.text_config, name, value)
    config._attn_implementation = "eager"
    model = transformers.Qwen3_5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for layer in model.model.language_model.layers:
            if hasattr(layer, "linear_attn"):
                mixer = layer.linear_attn
                mixer.A_log.fill_(math.log(0.1))  # decay ~0.93 per token: a long memory
                mixer.in_proj_qkv.weight.mul_(8)
                mixer.out_proj.weight.mul_(4)
            else:
                layer.self_attn.q_proj.weight.mul_(6)
                layer.self_attn.k_proj.weight.mul_(6)
    return model.to(dtype)


@pytest.fixture(scope="module")
def model():
    return _sharpened()


class _OpCalls:
    """Records (op, tokens, with a state) for each call of the three ops the adapter uses."""

    def __init__(self, monkeypatch) -> None:
        self.calls: list[tuple[str, int, bool]] = []
        for name, state_at in (
            ("chunk_gated_delta_rule", 5),
            ("recurrent_gated_delta_rule", 5),
            ("causal_conv1d", 2),
        ):
            monkeypatch.setattr(ops, name, self._recording(name, getattr(ops, name), state_at))

    def _recording(self, name, op, state_at):
        def record(*args, **kwargs):
            state = args[state_at] if len(args) > state_at else None
            self.calls.append((name, args[0].shape[1], state is not None))
            return op(*args, **kwargs)

        return record

    def of(self, name: str) -> list[tuple[int, bool]]:
        return [(tokens, state) for op, tokens, state in self.calls if op == name]


def _generate(model, inputs, new_tokens: int):
    with torch.no_grad():
        return model.generate(
            **inputs,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )


def test_prefill_runs_the_chunked_op_and_decode_the_recurrent_op(model, monkeypatch):
    inputs = make_inputs("qwen3_5", model, n_images=1)
    prompt = inputs["input_ids"].shape[1]
    linear_layers = sum(t == "linear_attention" for t in model.config.text_config.layer_types)
    ascend_vlm.patch(model)
    try:
        recorded = _OpCalls(monkeypatch)
        _generate(model, inputs, 4)
    finally:
        ascend_vlm.unpatch(model)
    assert recorded.of("chunk_gated_delta_rule") == [(prompt, False)] * linear_layers
    assert recorded.of("recurrent_gated_delta_rule") == [(1, True)] * (3 * linear_layers)
    # the convolution: the whole prompt from zeros, then one token continuing the conv state
    conv = recorded.of("causal_conv1d")
    assert conv == [(prompt, False)] * linear_layers + [(1, True)] * (3 * linear_layers)


def test_generate_32_tokens_with_the_stock_cache_matches_stock_logits_and_tokens(model):
    inputs = make_inputs("qwen3_5", model, n_images=1)
    expected = _generate(model, inputs, 32)
    ascend_vlm.patch(model)
    try:
        produced = _generate(model, inputs, 32)
    finally:
        ascend_vlm.unpatch(model)
    assert type(produced.past_key_values) is type(expected.past_key_values)
    assert torch.equal(produced.sequences, expected.sequences)
    for step, (got, want) in enumerate(zip(produced.logits, expected.logits, strict=True)):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0, msg=f"step {step}")
    # the sharpening makes the prompt matter: a different prompt continues differently
    other = make_inputs("qwen3_5", model, n_images=1, text_len=9)
    assert not torch.equal(
        _generate(model, other, 32).sequences[:, -32:], expected.sequences[:, -32:]
    )


def test_cached_decode_equals_a_stock_pass_without_cache(model):
    """The patched model's second generated token (one recurrent-op step on the cached state,
    conv state and KV cache) against the stock model's uncached pass over the whole sequence."""
    inputs = make_inputs("qwen3_5", model, n_images=2)
    ascend_vlm.patch(model)
    try:
        produced = _generate(model, inputs, 2)
    finally:
        ascend_vlm.unpatch(model)
    ids = produced.sequences[:, :-1]
    longer = {
        **inputs,
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "mm_token_type_ids": torch.nn.functional.pad(inputs["mm_token_type_ids"], (0, 1)),
    }
    with torch.no_grad():
        expected = model(**longer, use_cache=False).logits[:, -1]
    torch.testing.assert_close(produced.logits[1], expected, atol=ATOL, rtol=0)


# right padding: a left pad's logits (which eager and the fused op compute differently for a
# fully masked row) would predict the first real token
@pytest.mark.parametrize("case", [{"n_images": 2}, {"batch": 3, "padding": "right"}])
def test_training_loss_and_every_gradient_match(case):
    model = _sharpened()
    inputs = make_inputs("qwen3_5", model, **case)
    labels = inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)
    model.train()

    def loss_and_grads():
        model.zero_grad(set_to_none=True)
        loss = model(**inputs, labels=labels).loss
        loss.backward()
        return loss.detach(), {
            n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
        }

    loss, grads = loss_and_grads()
    ascend_vlm.patch(model)
    patched_loss, patched_grads = loss_and_grads()
    ascend_vlm.unpatch(model)
    torch.testing.assert_close(patched_loss, loss, atol=ATOL, rtol=0)
    assert patched_grads.keys() == grads.keys()
    assert any(".linear_attn.A_log" in n for n in grads)
    for name, grad in grads.items():
        torch.testing.assert_close(patched_grads[name], grad, atol=ATOL, rtol=1e-4, msg=name)


def test_the_npu_path_launches_the_gated_delta_kernels_and_matches_stock(mock_npu, monkeypatch):
    """bfloat16 with the kernels' head dims (128): prefill on the chunk kernel, decode on the
    recurrent kernel; the result stays within bfloat16 rounding of stock."""
    model = _sharpened(dtype=torch.bfloat16, linear_key_head_dim=128, linear_value_head_dim=128).to(
        mock_npu.device
    )
    inputs = {
        k: v.to(mock_npu.device) for k, v in make_inputs("qwen3_5", model, n_images=1).items()
    }
    expected = _generate(model, inputs, 3)
    launches = {}
    for kernel in ("npu_chunk_gated_delta_rule", "npu_recurrent_gated_delta_rule"):
        original = getattr(mock_npu.torch_npu, kernel)

        def counting(*args, _kernel=kernel, _original=original, **kwargs):
            launches[_kernel] = launches.get(_kernel, 0) + 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(mock_npu.torch_npu, kernel, counting)
    ascend_vlm.patch(model)
    try:
        produced = _generate(model, inputs, 3)
    finally:
        ascend_vlm.unpatch(model)
    linear_layers = sum(t == "linear_attention" for t in model.config.text_config.layer_types)
    assert launches == {
        "npu_chunk_gated_delta_rule": linear_layers,
        "npu_recurrent_gated_delta_rule": 2 * linear_layers,
    }
    for got, want in zip(produced.logits, expected.logits, strict=True):
        torch.testing.assert_close(got.float(), want.float(), atol=0.1, rtol=0.05)


def test_full_attention_positions_matter_and_match_stock(model):
    """The sharpened query/key weights make the partial interleaved M-RoPE decide the logits:
    stretching the distances between positions changes them, and the patched model follows
    stock."""
    inputs = make_inputs("qwen3_5", model, n_images=2)
    with torch.no_grad():
        expected = model(**inputs).logits
        ascend_vlm.patch(model)
        try:
            patched = model(**inputs).logits
            position_ids, _ = model.model.get_rope_index(
                inputs["input_ids"], inputs["mm_token_type_ids"], inputs["image_grid_thw"]
            )
            stretched = model(**inputs, position_ids=position_ids * 2).logits
        finally:
            ascend_vlm.unpatch(model)
    torch.testing.assert_close(patched, expected, atol=ATOL, rtol=0)
    assert (stretched - patched).abs().max() > 100 * ATOL


def test_a_pickled_patched_model_keeps_its_linear_attention_and_unpatches(model):
    inputs = make_inputs("qwen3_5", model, n_images=1)
    with torch.no_grad():
        stock = model(**inputs).logits
        ascend_vlm.patch(model)
        try:
            patched = model(**inputs).logits
            loaded = copy.deepcopy(model)
        finally:
            ascend_vlm.unpatch(model)
        mixer = loaded.model.language_model.layers[0].linear_attn
        assert "chunk_gated_delta_rule" in repr(mixer)
        assert torch.equal(loaded(**inputs).logits, patched)
        ascend_vlm.unpatch(loaded)
        assert all("forward" not in m.__dict__ for m in loaded.modules())
        assert torch.equal(loaded(**inputs).logits, stock)


def test_attention_false_leaves_the_linear_attention_alone_with_the_reason(model):
    report = ascend_vlm.patch(model, attention=False)
    ascend_vlm.unpatch(model)
    assert report.swapped_count("linear-attention") == 0
    reasons = {why for (kind, _, why) in report.left_alone if kind == "linear-attention"}
    assert reasons == {"disabled by patch(attention=False) or patch(vision=False)"}


def test_a_bigger_size_builds_with_both_layer_types():
    from ascend_vlm.models.tiny import SIZES

    config = FAMILIES["qwen3_5"].config(replace(SIZES["tiny"], layers=3))
    assert config.text_config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
