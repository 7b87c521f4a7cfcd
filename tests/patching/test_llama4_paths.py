"""Llama 4's own paths, patched: complex RoPE on interleaved pairs (text and vision) with
sharpened query/key weights so positions matter, chunked attention across chunk boundaries
(padded batches, sdpa and eager masks, decoding), the NoPE layers' query temperature, and the
calls the chunks cannot survive."""

from __future__ import annotations

import copy

import pytest
import torch

import ascend_vlm
from ascend_vlm import ops
from ascend_vlm.models.tiny import build_model, make_inputs
from ascend_vlm.models.tiny.llama import LLAMA4_ATTENTION_CHUNK
from ascend_vlm.patching import adapters
from ascend_vlm.patching.attention import ascend_attention_forward

pytestmark = pytest.mark.usefixtures("single_threaded_torch")


def _sharpened(attn_implementation: str = "eager", **text_overrides):
    """The tiny Llama 4 with its text and vision query/key weights scaled up, so attention is
    far from uniform and a wrong position (or chunk) shows in the logits."""
    model = build_model("llama4", attn_implementation=attn_implementation)
    for name, value in text_overrides.items():
        setattr(model.config.text_config, name, value)
    attentions = [layer.self_attn for layer in model.language_model.model.layers]
    attentions += [layer.self_attn for layer in model.vision_model.model.layers]
    with torch.no_grad():
        for attention in attentions:
            attention.q_proj.weight.mul_(4)
            attention.k_proj.weight.mul_(4)
    return model


def _logits(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).logits


def _patched_and_stock(model, inputs) -> tuple[torch.Tensor, torch.Tensor]:
    stock = _logits(model, inputs)
    ascend_vlm.patch(model)
    try:
        patched = _logits(model, inputs)
    finally:
        ascend_vlm.unpatch(model)
    return patched, stock


def _real(logits: torch.Tensor, inputs) -> torch.Tensor:
    return logits[inputs["attention_mask"].bool()]


@pytest.mark.parametrize("path", ["cpu", "mock"])
def test_complex_rope_with_sharpened_weights_matches_stock(path, request) -> None:
    model = _sharpened()
    if path == "mock":
        model = model.to(request.getfixturevalue("mock_npu").device)
    inputs = make_inputs("llama4", model, n_images=1)
    stock = _logits(model, inputs)
    ascend_vlm.patch(model)
    try:
        patched = _logits(model, inputs)
        copied = _logits(copy.deepcopy(model), inputs)  # the rebound forwards pickle as recipes
    finally:
        ascend_vlm.unpatch(model)
    torch.testing.assert_close(patched, stock, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(copied, stock, atol=1e-5, rtol=1e-5)


def test_the_rope_test_sees_the_pair_convention(monkeypatch) -> None:
    """The sharpened model tells interleaved pairs from NeoX halves: rotating halves with the
    same angles moves the logits far beyond the tolerance above."""
    model = _sharpened()
    inputs = make_inputs("llama4", model, n_images=1)

    def halves(q, k, freqs, *, table_scale):
        table = freqs.reshape(-1, q.shape[1], q.shape[-1] // 2)
        cos, sin = (torch.cat((t, t), dim=-1) for t in (table.real, table.imag))
        pair = ops.rotary_embedding_pair(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        return tuple(x.transpose(1, 2) for x in pair)

    monkeypatch.setattr(adapters.ops, "rotary_embedding_pair_complex", halves)
    adapters._forward_with_rope.cache_clear()
    try:
        patched, stock = _patched_and_stock(model, inputs)
    finally:
        adapters._forward_with_rope.cache_clear()
    assert (patched - stock).abs().max() > 1e-2


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("padding", ["none", "left", "right"])
def test_prompts_crossing_the_attention_chunks_match_stock(attn_implementation, padding) -> None:
    model = _sharpened(attn_implementation)
    batch = 1 if padding == "none" else 3
    inputs = make_inputs("llama4", model, batch=batch, text_len=10, padding=padding)
    assert inputs["input_ids"].shape[1] > 2 * LLAMA4_ATTENTION_CHUNK
    patched, stock = _patched_and_stock(model, inputs)
    torch.testing.assert_close(_real(patched, inputs), _real(stock, inputs), atol=1e-5, rtol=0)
    # ... and the chunks matter: with one chunk over the whole prompt the logits move.
    model.config.text_config.attention_chunk_size = 64
    unchunked = _logits(model, inputs)
    assert (_real(unchunked, inputs) - _real(stock, inputs)).abs().max() > 1e-3


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_decoding_across_chunk_boundaries_matches_stock(attn_implementation) -> None:
    model = _sharpened(attn_implementation)
    inputs = make_inputs("llama4", model, n_images=1)
    settings = {"max_new_tokens": 3 * LLAMA4_ATTENTION_CHUNK, "do_sample": False}
    with torch.no_grad():
        stock = model.generate(**inputs, **settings, min_new_tokens=settings["max_new_tokens"])
        ascend_vlm.patch(model)
        try:
            patched = model.generate(
                **inputs, **settings, min_new_tokens=settings["max_new_tokens"]
            )
        finally:
            ascend_vlm.unpatch(model)
    assert torch.equal(patched, stock)


def test_the_nope_layers_query_temperature_reaches_our_attention_as_in_eager() -> None:
    """NoPE layers scale the query by a temperature growing with the position (floor_scale 2
    in the tiny config) before the attention function: patched logits equal eager's, and the
    temperature moves them."""
    model = _sharpened()
    nope = model.language_model.model.layers[1].self_attn
    assert not nope.use_rope and nope.attn_temperature_tuning
    inputs = make_inputs("llama4", model, n_images=1)
    patched, stock = _patched_and_stock(model, inputs)
    torch.testing.assert_close(patched, stock, atol=1e-5, rtol=1e-5)
    # The temperature is not 1 over this prompt: without it the logits move.
    nope.attn_temperature_tuning = False
    assert (_logits(model, inputs) - stock).abs().max() > 1e-4


def _chunked_layer():
    model = build_model("llama4")
    layer = model.language_model.model.layers[0].self_attn
    assert model.config.text_config.layer_types[0] == "chunked_attention"
    return layer


def test_packed_varlen_calls_on_a_chunked_layer_are_refused() -> None:
    layer = _chunked_layer()
    query = torch.randn(1, 4, 10, 8)
    key = value = torch.randn(1, 2, 10, 8)
    offsets = torch.tensor([0, 10])
    with pytest.raises(ValueError, match=r"^attention_chunk_size: packed varlen attention"):
        ascend_attention_forward(
            layer, query, key, value, None, cu_seq_lens_q=offsets, cu_seq_lens_k=offsets
        )


def test_a_chunked_layer_without_a_mask_over_several_chunks_is_refused() -> None:
    layer = _chunked_layer()
    query = torch.randn(1, 4, 1, 8)
    key = value = torch.randn(1, 2, LLAMA4_ATTENTION_CHUNK + 1, 8)
    with pytest.raises(ValueError, match=r"^attention_mask: expected the chunked-attention mask"):
        ascend_attention_forward(layer, query, key, value, None)
    # Within one chunk no mask is needed (what sdpa_mask returns there).
    inside = key[:, :, :LLAMA4_ATTENTION_CHUNK]
    output, _ = ascend_attention_forward(layer, query, inside, inside, None)
    assert output.shape == (1, 1, 4, 8)
