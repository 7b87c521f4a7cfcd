"""`output_attentions=True` on a patched model returns the weights stock eager attention returns.

transformers 5 collects attention weights through output-capture hooks on the attention
modules; a patched call that is asked for them runs the eager math for that call only.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

import ascend_vlm
from ascend_vlm.models.tiny import build_model, make_inputs
from ascend_vlm.patching import ascend_attention_forward

ATOL = 1e-4  # logits, as in tests/models/test_families.py
WEIGHTS_ATOL = 1e-6  # fp32 weights


@pytest.fixture()
def qwen():
    return build_model("qwen2_vl")


def _assert_same_attentions(got, expected) -> None:
    assert len(got) == len(expected) > 0
    for produced, reference in zip(got, expected, strict=True):
        assert produced.shape == reference.shape
        torch.testing.assert_close(produced, reference, atol=WEIGHTS_ATOL, rtol=0)


def _stock_and_patched(model, run):
    with torch.no_grad():
        expected = run(model)
        ascend_vlm.patch(model)
        try:
            produced = run(model)
        finally:
            ascend_vlm.unpatch(model)
    return expected, produced


@pytest.mark.parametrize("case", [{"n_images": 1}, {"batch": 3, "padding": "left"}])
def test_forward_returns_the_eager_weights_and_the_eager_logits(qwen, case):
    inputs = make_inputs("qwen2_vl", qwen, **case)
    expected, produced = _stock_and_patched(qwen, lambda m: m(**inputs, output_attentions=True))
    assert len(expected.attentions) == qwen.config.text_config.num_hidden_layers
    _assert_same_attentions(produced.attentions, expected.attentions)
    torch.testing.assert_close(produced.logits, expected.logits, atol=ATOL, rtol=0)


def test_weights_asked_for_through_the_config_are_returned(qwen):
    qwen.config.text_config.output_attentions = True  # no output_attentions= in the call
    inputs = make_inputs("qwen2_vl", qwen, n_images=1)
    expected, produced = _stock_and_patched(qwen, lambda m: m(**inputs))
    _assert_same_attentions(produced.attentions, expected.attentions)


def test_calls_that_do_not_ask_return_no_weights(qwen):
    inputs = make_inputs("qwen2_vl", qwen, n_images=1)
    ascend_vlm.patch(qwen)
    with torch.no_grad():
        assert qwen(**inputs).attentions is None


def _generate(model, inputs, **settings):
    return model.generate(
        **inputs,
        max_new_tokens=4,
        min_new_tokens=4,
        do_sample=False,
        output_attentions=True,
        return_dict_in_generate=True,
        **settings,
    )


def _assert_same_generation(produced, expected) -> None:
    assert torch.equal(produced.sequences, expected.sequences)
    assert len(produced.attentions) == len(expected.attentions) == 4
    for got, reference in zip(produced.attentions, expected.attentions, strict=True):
        _assert_same_attentions(got, reference)


def test_generate_returns_the_eager_weights_of_every_step(qwen):
    inputs = make_inputs("qwen2_vl", qwen, n_images=1)
    expected, produced = _stock_and_patched(qwen, lambda m: _generate(m, inputs))
    _assert_same_generation(produced, expected)


def test_assisted_decoding_with_attentions_matches_stock(qwen):
    # It raised IndexError in transformers' candidate verification on empty attentions.
    assistant = build_model("qwen2_vl", seed=1)
    inputs = make_inputs("qwen2_vl", qwen, n_images=1)
    expected, produced = _stock_and_patched(
        qwen, lambda m: _generate(m, inputs, assistant_model=assistant)
    )
    _assert_same_generation(produced, expected)


def _segment_reference(query, key, value, bounds, causal):
    """Per segment: eager softmax attention (causal aligned bottom-right); the weights as one
    block-diagonal [1, N, T, T] matrix."""
    total = query.shape[2]
    weights = torch.zeros(1, query.shape[1], total, total)
    outputs = []
    for start, end in itertools.pairwise(bounds):
        scores = query[:, :, start:end] @ key[:, :, start:end].transpose(2, 3) * 0.5
        if causal:
            allowed = torch.ones(end - start, end - start, dtype=torch.bool).tril()
            scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
        block = scores.softmax(-1)
        weights[:, :, start:end, start:end] = block
        outputs.append(block @ value[:, :, start:end])
    return torch.cat(outputs, dim=2).transpose(1, 2), weights


@pytest.mark.parametrize("causal", [False, True])
def test_packed_varlen_weights_are_block_diagonal_eager_weights(causal):
    torch.manual_seed(0)
    bounds = [0, 3, 8, 10]
    query, key, value = (torch.randn(1, 2, 10, 4) for _ in range(3))
    offsets = torch.tensor(bounds, dtype=torch.int32)
    output, weights = ascend_attention_forward(
        nn.Module(),
        query,
        key,
        value,
        None,
        scaling=0.5,
        is_causal=causal,
        cu_seq_lens_q=offsets,
        cu_seq_lens_k=offsets,
        output_attentions=True,
    )
    expected_output, expected_weights = _segment_reference(query, key, value, bounds, causal)
    torch.testing.assert_close(weights, expected_weights, atol=WEIGHTS_ATOL, rtol=0)
    torch.testing.assert_close(output, expected_output, atol=WEIGHTS_ATOL, rtol=0)
    fused, none = ascend_attention_forward(
        nn.Module(), query, key, value, None, scaling=0.5, is_causal=causal, cu_seq_lens_q=offsets
    )
    assert none is None
    torch.testing.assert_close(fused, output, atol=WEIGHTS_ATOL, rtol=0)


def test_weights_of_a_gqa_call_without_a_mask_are_causal_softmax_weights():
    torch.manual_seed(0)
    query, key = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8)
    value = torch.randn(1, 2, 5, 8)
    module = nn.Module()
    module.is_causal = True
    output, weights = ascend_attention_forward(
        module, query, key, value, None, output_attentions=True
    )
    repeated = key.repeat_interleave(2, dim=1)
    scores = query @ repeated.transpose(2, 3) / 8**0.5
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    expected = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    torch.testing.assert_close(weights, expected, atol=WEIGHTS_ATOL, rtol=0)
    expected_output = (expected @ value.repeat_interleave(2, dim=1)).transpose(1, 2)
    torch.testing.assert_close(output, expected_output, atol=WEIGHTS_ATOL, rtol=0)
