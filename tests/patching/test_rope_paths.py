"""Patched RoPE on the paths users take: LoRA on q_proj/v_proj only (k needs no grad), and
every RoPE type transformers ships, scaled tables included, on the CPU and the mock NPU path."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from torch import nn

import ascend_vlm
from ascend_vlm.models.tiny import FAMILIES, build_model, make_inputs

pytestmark = pytest.mark.usefixtures("single_threaded_torch")


def _on(device: torch.device, inputs: dict) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def _lora_loss_and_grads(model, inputs: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    loss = model(**inputs, labels=inputs["input_ids"]).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), grads


@pytest.mark.parametrize("path", ["cpu", "mock"])
def test_lora_on_q_and_v_trains_patched_with_the_stock_gradients(path, request) -> None:
    """PEFT's usual targets: k_proj has no adapter, so only q of the RoPE pair requires grad.
    Backward used to raise "element 1 of tensors does not require grad"."""
    peft = pytest.importorskip("peft")
    device = torch.device("cpu")
    if path == "mock":
        device = request.getfixturevalue("mock_npu").device
    base = build_model("qwen2_vl").to(device)
    config = peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    lora = peft.get_peft_model(base, config)
    for name, parameter in lora.named_parameters():
        if "lora_B" in name:  # nonzero, so lora_A receives a gradient too
            nn.init.normal_(parameter, std=0.1, generator=torch.Generator().manual_seed(3))
    inputs = _on(device, make_inputs("qwen2_vl", lora, n_images=1))
    stock_loss, stock_grads = _lora_loss_and_grads(lora, inputs)
    ascend_vlm.patch(lora)
    loss, grads = _lora_loss_and_grads(lora, inputs)
    assert sorted(grads) == sorted(stock_grads) and any("lora_A" in n for n in grads)
    torch.testing.assert_close(loss, stock_loss, atol=1e-5, rtol=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, stock_grads[name], atol=1e-5, rtol=1e-4, msg=name)


# rope_parameters per type for the tiny models (head_dim 8: 4 frequencies). The lengths are chosen
# so that each type's own path runs with the ~10-20-token inputs: dynamic grows past a
# max_position_embeddings of 4, longrope switches to its long factors past 4 positions.
ROPE_TYPES = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    "longrope": {
        "rope_type": "longrope",
        "short_factor": [1.0, 1.5, 2.0, 3.0],
        "long_factor": [2.0, 3.0, 5.0, 8.0],
        "original_max_position_embeddings": 4,
    },
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
}
# The 1-D types on a Llama text model; the M-RoPE families with their own (default) type and
# with the two types that scale the tables.
CASES = [("llava_clip", rope) for rope in ROPE_TYPES] + [
    (family, rope)
    for family in (
        "qwen2_vl",
        "qwen2_5_vl",
        "qwen3_vl",
        "qwen3_vl_moe",
        "glm4v",
        "glm4v_moe",
        "qwen3_5",
    )
    for rope in ("default", "yarn", "longrope")
]


def _model_with_rope(family: str, rope: str):
    torch.manual_seed(0)
    config = FAMILIES[family].config()
    text = config.text_config
    text.rope_parameters = {**text.rope_parameters, **ROPE_TYPES[rope], "rope_theta": 1e4}
    if rope == "dynamic":
        text.max_position_embeddings = 4
    config._attn_implementation = "eager"
    return getattr(transformers, FAMILIES[family].model_class)(config).eval()


@pytest.mark.parametrize("path", ["cpu", "mock"])
@pytest.mark.parametrize(("family", "rope"), CASES, ids=[f"{f}-{r}" for f, r in CASES])
def test_every_rope_type_matches_stock(family, rope, path, request, monkeypatch) -> None:
    model = _model_with_rope(family, rope)
    scaling = model.model.language_model.rotary_emb.attention_scaling
    assert (scaling > 1.0) == (rope in ("yarn", "longrope"))  # the types that scale the tables
    inputs = make_inputs(family, model, n_images=0 if family.startswith("llava") else 1)
    with torch.no_grad():
        expected = model(**inputs).logits
    report = ascend_vlm.patch(model)
    rope_ops = [op for (kind, _, op) in report.swapped if kind == "rope"]
    assert any(f"table_scale={scaling:g}" in op for op in rope_ops) == (scaling > 1.0), rope_ops
    launches = []
    if path == "mock":
        torch_npu = request.getfixturevalue("mock_npu").torch_npu
        kernel = torch_npu.npu_rotary_mul

        def counting(x, r1, r2, **kwargs):
            launches.append(max(r1.abs().max().item(), r2.abs().max().item()))
            return kernel(x, r1, r2, **kwargs)

        monkeypatch.setattr(torch_npu, "npu_rotary_mul", counting)
    with torch.no_grad():
        got = model(**inputs).logits
        # a copy (pickled recipe) keeps the model's table scale
        copied = copy.deepcopy(model)(**inputs).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(copied, expected, atol=1e-5, rtol=1e-5)
    if path == "mock":  # the kernel ran, with tables in its documented range [-1, 1]
        assert launches and max(launches) <= 1.0 + torch.finfo(torch.float32).eps


def test_table_scale_is_the_largest_scaling_of_any_rotary_module_and_at_least_one() -> None:
    from ascend_vlm.patching.part import rope_table_scale as _rope_table_scale

    plain, per_layer_type, shrinking = nn.Module(), nn.Module(), nn.Module()
    plain.attention_scaling = 1.25
    per_layer_type.full_attention_attention_scaling = 1.5  # Gemma3-style, one per layer type
    per_layer_type.sliding_attention_attention_scaling = 1.0
    shrinking.attention_scaling = 0.5
    assert _rope_table_scale([plain, per_layer_type, shrinking]) == 1.5
    assert _rope_table_scale([shrinking]) == 1.0
    assert _rope_table_scale([nn.Linear(2, 2)]) == 1.0


def _sharpened_gemma4():
    """The tiny Gemma 4 with its query/key norm weights scaled up: its attention (scaling 1 on
    RMS-normalised queries and keys) then peaks on a few positions, so a RoPE that rotated the
    wrong dims or used the wrong positions would move the logits."""
    model = build_model("gemma4")
    norms = [n for n, m in model.named_modules() if n.endswith(("q_norm", "k_norm"))]
    with torch.no_grad():
        for name in norms:
            model.get_submodule(name).weight.mul_(3)
    return model, norms


@pytest.mark.parametrize("path", ["cpu", "mock"])
def test_gemma4_rope_variants_match_stock_with_sharp_attention(path, request) -> None:
    """Gemma 4's three RoPE variants: sliding layers' default RoPE, full layers' proportional
    RoPE (a quarter of a larger head dim rotated, the rest at frequency 0) and the vision tower's
    axial 2-D RoPE (x and y halves of the head dim)."""
    model, norms = _sharpened_gemma4()
    assert any("vision_tower" in n for n in norms) and any("language_model" in n for n in norms)
    text = model.config.text_config
    assert text.rope_parameters["full_attention"]["rope_type"] == "proportional"
    device = torch.device("cpu")
    if path == "mock":
        device = request.getfixturevalue("mock_npu").device
    model = model.to(device)
    inputs = _on(device, make_inputs("gemma4", model, n_images=1, text_len=12))
    image = {k: inputs[k] for k in ("pixel_values", "image_position_ids")}
    with torch.no_grad():
        expected = model(**inputs, output_attentions=True)
        expected_image = model.model.get_image_features(**image).pooler_output[0]
    peak = max(weights.max().item() for weights in expected.attentions)
    assert peak > 0.9  # attention is sharp, so positions decide the logits
    report = ascend_vlm.patch(model)
    try:
        rope_ops = {name: op for (kind, name, op) in report.swapped if kind == "rope"}
        assert set(rope_ops) == {"Gemma4TextAttention", "Gemma4VisionAttention"}, rope_ops
        with torch.no_grad():
            got = model(**inputs).logits
            got_image = model.model.get_image_features(**image).pooler_output[0]
    finally:
        ascend_vlm.unpatch(model)
    torch.testing.assert_close(got_image, expected_image, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got, expected.logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma4_rope_adapters_match_transformers(dtype) -> None:
    """The one-tensor and axial drop-ins match Gemma 4's functions in dtype, shape and value
    (one rounding fewer), gradients included."""
    from transformers.models.gemma4 import modeling_gemma4 as stock

    from ascend_vlm.patching.adapters import rope_adapter

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 3, 16, generator=generator).to(dtype).requires_grad_()
    cos, sin = torch.randn(2, 2, 5, 16, generator=generator).to(dtype).unbind(0)
    positions = torch.randint(0, 4, (2, 5, 2), generator=generator)
    cases = [
        (
            rope_adapter("text-single")(x, cos, sin, unsqueeze_dim=2),
            stock.apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim=2),
        ),
        (
            rope_adapter("text-single")(x.transpose(1, 2), cos, sin),
            stock.apply_rotary_pos_emb(x.transpose(1, 2), cos, sin),
        ),
        (
            rope_adapter("axial")(x, cos, sin, positions),
            stock.apply_multidimensional_rope(x, cos, sin, positions),
        ),
    ]
    for got, want in cases:
        assert got.dtype == want.dtype and got.shape == want.shape
        tolerance = {} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
        torch.testing.assert_close(got, want, **tolerance)
        (grad,) = torch.autograd.grad(got.float().sum(), x)
        (want_grad,) = torch.autograd.grad(want.float().sum(), x)
        torch.testing.assert_close(grad, want_grad)
