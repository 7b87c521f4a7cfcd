"""Per family: the patched model computes what the unpatched eager model computes.

Each tiny model is built from its config, saved with `save_pretrained` and reloaded with
`from_pretrained` (eager attention), once per module. Checks: swapped module counts per kind;
logits for text-only, one image, several images and left/right padded batches (fp32, atol 1e-4);
`unpatch` restores bit-identical logits; `output_attentions=True` returns eager's weights; greedy
`generate` of 32 new tokens (dynamic cache) and of 8 (StaticCache); loss and every parameter
gradient in training mode.
"""

from __future__ import annotations

import pytest
import torch
import transformers

import ascend_vlm
from ascend_vlm.models import KINDS
from ascend_vlm.models.tiny import FAMILIES, build_model, make_inputs

ATOL = 1e-4
CASES = {
    "text": {"n_images": 0},
    "one_image": {"n_images": 1},
    "several_images": {"n_images": 2},
    "padded_left": {"batch": 3, "padding": "left"},
    "padded_right": {"batch": 3, "padding": "right"},
}


# Swapped module counts per family in KINDS order (attention-text, attention-vision, norm, rope,
# mlp, linear-attention, moe), as in the README's supported-models table: a patch that silently
# stops swapping fails.
EXPECTED_SWAPPED = {
    "qwen2_vl": (2, 1, 5, 3, 2, 0, 0),
    "qwen2_5_vl": (2, 2, 10, 4, 4, 0, 0),
    "qwen3_vl": (2, 2, 9, 4, 2, 0, 0),
    "qwen3_vl_moe": (2, 2, 9, 4, 1, 0, 1),
    "llava_clip": (2, 2, 5, 2, 2, 0, 0),
    "llava_siglip": (2, 2, 5, 2, 2, 0, 0),
    "llava_next": (2, 2, 5, 2, 2, 0, 0),
    "llava_onevision": (2, 2, 5, 2, 2, 0, 0),
    "idefics3": (2, 2, 5, 2, 2, 0, 0),
    "smolvlm": (2, 2, 5, 2, 2, 0, 0),
    "paligemma": (2, 2, 5, 2, 0, 0, 0),  # gelu MLPs
    "gemma3": (2, 2, 14, 2, 0, 0, 0),  # gelu MLPs
    "internvl": (2, 2, 9, 2, 2, 0, 0),
    "gemma4": (4, 2, 45, 6, 0, 0, 0),  # gelu MLPs
    "glm4v": (2, 2, 15, 4, 4, 0, 0),
    "glm46v": (2, 2, 15, 4, 4, 0, 0),
    "glm4v_moe": (2, 2, 10, 4, 4, 0, 1),
    "qwen3_5": (1, 2, 9, 3, 3, 2, 0),
    "qwen3_5_moe": (1, 2, 9, 3, 3, 2, 3),
    "llama4": (2, 2, 5, 4, 2, 0, 1),
    "mllama": (2, 3, 7, 1, 2, 0, 0),  # a self- and a cross-attention layer
    "mistral3": (2, 2, 11, 4, 4, 0, 0),
    "paddleocr_vl": (2, 2, 5, 4, 2, 0, 0),  # LayerNorm ViT, fc1/fc2 vision MLPs
    "deepseek_ocr2": (2, 2, 10, 4, 4, 0, 1),  # SAM kept
}


# Attention weights agree to 1e-6 with eager's, to 5e-6 where the logits are large: Gemma 4
# attends with scaling 1 on RMS-normalised queries and keys (logits of the order of head_dim), so
# the one rounding of the fused RoPE (two in transformers) and the fused vision attention move
# its weights by up to ~2e-6 in fp32.
WEIGHTS_ATOL = {"gemma4": 5e-6}


@pytest.fixture(scope="module")
def reloaded(tmp_path_factory):
    """family name -> tiny model reloaded from disk (built on first use, shared by the module)."""
    cache: dict[str, torch.nn.Module] = {}

    def get(name: str) -> torch.nn.Module:
        if name not in cache:
            path = tmp_path_factory.mktemp(name)
            build_model(name).save_pretrained(path)
            model_class = getattr(transformers, FAMILIES[name].model_class)
            cache[name] = model_class.from_pretrained(path, attn_implementation="eager").eval()
        return cache[name]

    return get


def _logits(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).logits


def _real_tokens(logits: torch.Tensor, inputs) -> torch.Tensor:
    # Pad positions attend to nothing; eager softmaxes garbage there, the fused op returns 0.
    return logits[inputs["attention_mask"].bool()]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_patch_swaps_the_expected_modules_of_every_kind(reloaded, family):
    report = ascend_vlm.patch(reloaded(family))
    ascend_vlm.unpatch(reloaded(family))
    swapped = tuple(report.swapped_count(kind) for kind in KINDS)
    assert swapped == EXPECTED_SWAPPED[family], dict(zip(KINDS, swapped, strict=True))


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_patched_logits_match_eager_and_unpatch_restores_bits(reloaded, family, case):
    model = reloaded(family)
    inputs = make_inputs(family, model, **CASES[case])
    reference = _logits(model, inputs)
    report = ascend_vlm.patch(model)
    try:
        assert report.swapped_count("attention-text") > 0
        patched = _logits(model, inputs)
        assert ascend_vlm.patch(model) is report  # patching twice is a no-op
    finally:
        ascend_vlm.unpatch(model)
    torch.testing.assert_close(
        _real_tokens(patched, inputs), _real_tokens(reference, inputs), atol=ATOL, rtol=0
    )
    assert torch.equal(_logits(model, inputs), reference)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_output_attentions_returns_the_eager_weights(reloaded, family):
    model = reloaded(family)
    inputs = make_inputs(family, model, n_images=1)
    with torch.no_grad():
        expected = model(**inputs, output_attentions=True)
        ascend_vlm.patch(model)
        try:
            produced = model(**inputs, output_attentions=True)
        finally:
            ascend_vlm.unpatch(model)
    assert len(produced.attentions) == len(expected.attentions) > 0
    for got, reference in zip(produced.attentions, expected.attentions, strict=True):
        torch.testing.assert_close(got, reference, atol=WEIGHTS_ATOL.get(family, 1e-6), rtol=0)
    torch.testing.assert_close(produced.logits, expected.logits, atol=ATOL, rtol=0)


def _generate_unpatched_and_patched(model, inputs, **settings):
    settings = dict(min_new_tokens=settings["max_new_tokens"], do_sample=False, **settings)
    with torch.no_grad():
        expected = model.generate(**inputs, **settings)
        ascend_vlm.patch(model)
        try:
            produced = model.generate(**inputs, **settings)
        finally:
            ascend_vlm.unpatch(model)
    return expected, produced


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_generate_32_tokens_identical(reloaded, family):
    model = reloaded(family)
    inputs = make_inputs(family, model, n_images=1)
    expected, produced = _generate_unpatched_and_patched(
        model, inputs, max_new_tokens=32, use_cache=True
    )
    assert produced.shape[1] == inputs["input_ids"].shape[1] + 32
    assert torch.equal(produced, expected)


def _stock_static_cache_problem(model) -> str | None:
    """Why the unpatched model cannot generate with a StaticCache on this transformers, or None."""
    import inspect

    from transformers import masking_utils

    text = model.config.get_text_config()
    chunked = "chunked_attention" in (getattr(text, "layer_types", None) or ())
    takes = inspect.signature(masking_utils.create_chunked_causal_mask).parameters
    if chunked and "block_sequence_ids" not in takes:
        return (
            "this transformers' create_masks_for_generate passes block_sequence_ids, which its "
            "create_chunked_causal_mask does not take: stock static-cache generate fails"
        )
    cross = getattr(text, "cross_attention_layers", None)
    if cross and "_prepare_static_cache" not in vars(type(model)):
        return (
            "this transformers sizes every StaticCache layer alike, and the cross-attention "
            "layers' image-tile keys overflow it: stock static-cache generate fails"
        )
    return None


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_generate_with_static_cache_identical(reloaded, family):
    # Prefill into an empty StaticCache: the key length is the cache length (> query length) and
    # the mask function returns None, so causal alignment of the attention op decides the result.
    model = reloaded(family)
    problem = _stock_static_cache_problem(model)
    if problem:
        pytest.skip(problem)
    inputs = make_inputs(family, model, n_images=1)
    expected, produced = _generate_unpatched_and_patched(
        model, inputs, max_new_tokens=8, cache_implementation="static"
    )
    assert torch.equal(produced, expected)


def _loss_and_grads(model, inputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    labels = inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)
    loss = model(**inputs, labels=labels).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


@pytest.mark.parametrize("family", list(FAMILIES))
def test_training_loss_and_every_gradient_match(reloaded, family):
    model = reloaded(family)
    inputs = make_inputs(family, model, n_images=1)
    model.train()
    try:
        loss, grads = _loss_and_grads(model, inputs)
        ascend_vlm.patch(model)
        patched_loss, patched_grads = _loss_and_grads(model, inputs)
    finally:
        ascend_vlm.unpatch(model)
        model.eval()
    torch.testing.assert_close(patched_loss, loss, atol=ATOL, rtol=0)
    assert patched_grads.keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(patched_grads[name], grad, atol=ATOL, rtol=1e-4, msg=name)


@pytest.mark.parametrize("case", ["several_images", "padded_left", "padded_right"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_patched_logits_on_the_npu_path_match_eager(reloaded, family, case, mock_npu):
    from ascend_vlm.kernel_backend import active_backend

    model = reloaded(family).to(mock_npu.device)
    inputs = {
        k: v.to(mock_npu.device) for k, v in make_inputs(family, model, **CASES[case]).items()
    }
    assert active_backend() in ("mock", "npu")
    reference = _logits(model, inputs)
    ascend_vlm.patch(model)
    try:
        patched = _logits(model, inputs)
    finally:
        ascend_vlm.unpatch(model)
    torch.testing.assert_close(
        _real_tokens(patched, inputs), _real_tokens(reference, inputs), atol=ATOL, rtol=0
    )
