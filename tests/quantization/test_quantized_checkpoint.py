"""Quantized checkpoints: quantize + save_pretrained + load_quantized gives bit-identical
outputs; truncated or mismatched checkpoints name the tensor; folders that are not quantized
checkpoints are refused."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from ascend_vlm.models import tiny
from ascend_vlm.quantization import QuantizationConfig, QuantLinear, load_quantized, quantize


def _saved(tmp_path, bits: int, group_size: int, symmetric: bool | None = None):
    model = tiny.build_model("qwen2_vl", attn_implementation="sdpa")
    config = QuantizationConfig(bits=bits, group_size=group_size, symmetric=symmetric)
    report = quantize(model, config, progress=False)
    folder = tmp_path / f"w{bits}g{group_size}"
    model.save_pretrained(folder)
    return model, report, folder


@pytest.mark.parametrize(
    ("bits", "group_size", "symmetric"), [(8, 0, None), (8, 32, False), (4, 32, None), (4, 0, True)]
)
def test_save_then_load_gives_bit_identical_outputs(tmp_path, bits, group_size, symmetric):
    model, report, folder = _saved(tmp_path, bits, group_size, symmetric)
    loaded = load_quantized(folder, attn_implementation="sdpa")
    names = {n for n, m in loaded.named_modules() if isinstance(m, QuantLinear)}
    assert names == set(report.modules)
    first, second = model.state_dict(), loaded.state_dict()
    assert set(first) == set(second)
    assert all(torch.equal(first[key], second[key]) for key in first)
    inputs = tiny.make_inputs("qwen2_vl", model, n_images=1)
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, loaded(**inputs).logits)
    assert loaded.config.quantization_config == report.config


@pytest.mark.parametrize(("bits", "group_size"), [(8, 0), (4, 32)])
def test_transformers_from_pretrained_loads_the_quantized_layers(tmp_path, bits, group_size):
    from transformers import AutoModelForImageTextToText

    model, report, folder = _saved(tmp_path, bits, group_size)
    loaded = AutoModelForImageTextToText.from_pretrained(folder, attn_implementation="sdpa")
    names = {n for n, m in loaded.named_modules() if isinstance(m, QuantLinear)}
    assert names == set(report.modules)
    first, second = model.state_dict(), loaded.state_dict()
    assert set(first) == set(second) and all(torch.equal(first[k], second[k]) for k in first)
    resaved = tmp_path / "resaved"
    loaded.save_pretrained(resaved)
    config = json.loads((resaved / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "ascend_vlm" and config["modules"] == list(report.modules)
    inputs = tiny.make_inputs("qwen2_vl", model, n_images=1)
    with torch.no_grad():
        assert torch.equal(load_quantized(resaved)(**inputs).logits, model(**inputs).logits)


def _rewrite(folder, change) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def _first_key(tensors: dict, suffix: str) -> str:
    return next(key for key in sorted(tensors) if key.endswith(suffix))


def test_a_missing_quantized_tensor_is_named(tmp_path):
    _, _, folder = _saved(tmp_path, 4, 32)
    removed = []

    def drop_scale(tensors):
        key = _first_key(tensors, ".scale")
        removed.append(key)
        del tensors[key]

    _rewrite(folder, drop_scale)
    with pytest.raises(ValueError, match=rf"^{removed[0][: -len('.scale')]}\.scale: missing"):
        load_quantized(folder)


def test_from_pretrained_checks_the_quantized_tensors_before_loading(tmp_path):
    from transformers import AutoModelForImageTextToText

    _, _, folder = _saved(tmp_path, 4, 32)

    def shrink_scale(tensors):
        key = _first_key(tensors, ".scale")
        tensors[key] = tensors[key][:-1].contiguous()

    _rewrite(folder, shrink_scale)
    with pytest.raises(ValueError, match=r"_proj\.offset: expected the scale's shape \(1, \d+\)"):
        AutoModelForImageTextToText.from_pretrained(folder)


def test_a_missing_offset_of_an_asymmetric_checkpoint_is_named(tmp_path):
    _, _, folder = _saved(tmp_path, 4, 32)
    removed = []

    def drop_offset(tensors):
        removed.append(_first_key(tensors, ".offset"))
        del tensors[removed[0]]

    _rewrite(folder, drop_offset)
    with pytest.raises(ValueError, match=rf"^{removed[0]}: missing from the checkpoint"):
        load_quantized(folder)


def test_a_quantized_layer_missing_as_a_whole_is_named(tmp_path):
    _, _, folder = _saved(tmp_path, 8, 0)

    def drop_layer(tensors):
        prefix = _first_key(tensors, ".qweight")[: -len(".qweight")]
        for key in [k for k in tensors if k.startswith(prefix + ".")]:
            del tensors[key]

    _rewrite(folder, drop_layer)
    with pytest.raises(ValueError, match=r"\.qweight: missing from the checkpoint \(quantization_"):
        load_quantized(folder)


def test_a_missing_float_tensor_is_named(tmp_path):
    _, _, folder = _saved(tmp_path, 8, 0)
    _rewrite(
        folder, lambda tensors: tensors.pop(_first_key(tensors, "post_attention_layernorm.weight"))
    )
    with pytest.raises(
        ValueError, match=r"post_attention_layernorm\.weight: missing from the checkpoint"
    ):
        load_quantized(folder)


def test_a_mismatched_quantized_tensor_is_named(tmp_path):
    _, _, folder = _saved(tmp_path, 4, 32)

    def shrink(tensors):
        key = _first_key(tensors, ".qweight")
        tensors[key] = tensors[key][:, :-1].contiguous()

    _rewrite(folder, shrink)
    with pytest.raises(
        ValueError, match=r"_proj: decoded qweight of shape \(\d+, \d+\) does not fit"
    ):
        load_quantized(folder)


def test_a_wrong_integer_dtype_is_named(tmp_path):
    _, _, folder = _saved(tmp_path, 8, 0)

    def widen(tensors):
        key = _first_key(tensors, ".qweight")
        tensors[key] = tensors[key].to(torch.int16)

    _rewrite(folder, widen)
    with pytest.raises(ValueError, match=r"\.qweight: expected a 2-D torch.int8 tensor for 8 bits"):
        load_quantized(folder)


def test_folders_that_are_not_quantized_checkpoints_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"^path: expected a checkpoint folder with config.json"):
        load_quantized(tmp_path / "nothing")
    plain = tmp_path / "plain"
    tiny.build_model("qwen2_vl").save_pretrained(plain)
    with pytest.raises(ValueError, match=r"config.json has no quantization_config"):
        load_quantized(plain)
    _, _, folder = _saved(tmp_path, 8, 0)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["quant_method"] = "bitsandbytes"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"bitsandbytes"):
        load_quantized(folder)


def _foreign_checkpoint(tmp_path, method: str, checkpoint_format: str = "gptq"):
    """The tiny Qwen2-VL saved as an AutoAWQ GEMM or GPTQ checkpoint of its language-model
    linears (4 bits, groups of 32), packed by the test's own packers under the key names
    transformers saves; returns the folder and, per layer, the float64 weight the format's
    integers, zeros and scales define."""
    from _foreign_packers import pack_awq, pack_gptq_columns, pack_gptq_rows, reference_weight

    from ascend_vlm.quantization.quantize import selected_linears
    from ascend_vlm.quantization.rtn import quantize_rtn

    model = tiny.build_model("qwen2_vl", attn_implementation="sdpa")
    folder = tmp_path / f"{method}-{checkpoint_format}"
    model.save_pretrained(folder)
    tensors = load_file(folder / "model.safetensors")
    expected = {}
    for name, linear in selected_linears(model, QuantizationConfig()):
        key = next(k for k in tensors if k.endswith(name.split("language_model.")[-1] + ".weight"))
        prefix = key[: -len(".weight")]
        del tensors[key]
        grid = quantize_rtn(linear.weight, 4, 32, symmetric=False)
        unsigned = (grid.values().long() + 8).t().contiguous()  # (K, N) in [0, 15]
        zeros = (8 - grid.offset).round().long()  # (groups, N)
        scales = grid.scale.to(torch.float16)
        if method == "awq":
            tensors[f"{prefix}.qweight"] = pack_awq(unsigned)
            tensors[f"{prefix}.qzeros"] = pack_awq(zeros)
        else:
            stored = zeros - 1 if checkpoint_format == "gptq" else zeros
            tensors[f"{prefix}.qweight"] = pack_gptq_rows(unsigned, 4)
            tensors[f"{prefix}.qzeros"] = pack_gptq_columns(stored, 4)
            tensors[f"{prefix}.g_idx"] = torch.arange(unsigned.shape[0], dtype=torch.int32) // 32
        tensors[f"{prefix}.scales"] = scales
        expected[name] = reference_weight(unsigned, zeros, scales, 32)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    if method == "awq":
        config["quantization_config"] = {
            "quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
            "version": "gemm",
        }  # fmt: skip
    else:
        config["quantization_config"] = {
            "quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False,
            "sym": False, "checkpoint_format": checkpoint_format,
        }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    return model, folder, expected


@pytest.mark.parametrize(
    ("method", "checkpoint_format"), [("awq", "gemm"), ("gptq", "gptq"), ("gptq", "gptq_v2")]
)
def test_awq_and_gptq_checkpoints_load_into_quant_linears(tmp_path, method, checkpoint_format):
    model, folder, expected = _foreign_checkpoint(tmp_path, method, checkpoint_format)
    loaded = load_quantized(folder, attn_implementation="sdpa")
    for name, weight in expected.items():
        layer = loaded.get_submodule(name)
        assert isinstance(layer, QuantLinear) and layer.bits == 4 and layer.group_size == 32
        torch.testing.assert_close(layer.dequantize(torch.float64), weight, rtol=0, atol=1e-12)
    # the same function as the float model carrying those weights
    with torch.no_grad():
        for name, weight in expected.items():
            model.get_submodule(name).weight.copy_(weight.float())
    inputs = tiny.make_inputs("qwen2_vl", model, n_images=1)
    with torch.no_grad():
        torch.testing.assert_close(
            loaded(**inputs).logits, model(**inputs).logits, rtol=1e-4, atol=1e-5
        )


def test_gptq_bias_tensors_of_unbiased_layers_are_taken(tmp_path):
    # AutoGPTQ stores a bias for every quantized layer: zeros where the layer had none
    model, folder, expected = _foreign_checkpoint(tmp_path, "gptq")
    biased = []

    def add_biases(tensors):
        for key in [k for k in tensors if k.endswith(".qweight")]:
            prefix = key[: -len(".qweight")]
            rows = tensors[f"{prefix}.scales"].shape[1]
            value = torch.zeros(rows, dtype=torch.float16)
            if not biased and prefix.endswith("down_proj"):
                value = torch.linspace(-1, 1, rows, dtype=torch.float16)
                biased.append(prefix)
            tensors[f"{prefix}.bias"] = value

    _rewrite(folder, add_biases)
    loaded = load_quantized(folder)
    gained = []
    for name in expected:
        own_bias = model.get_submodule(name).bias is not None  # Qwen2's q/k/v have biases
        if loaded.get_submodule(name).bias is not None and not own_bias:
            gained.append(name)
    assert len(gained) == 1 and gained[0].endswith(biased[0].split("model.")[-1])
    bias = loaded.get_submodule(gained[0]).bias
    torch.testing.assert_close(bias, torch.linspace(-1, 1, len(bias)), rtol=0, atol=1e-3)


def test_a_truncated_awq_tensor_is_named(tmp_path):
    _, folder, _ = _foreign_checkpoint(tmp_path, "awq")

    def truncate(tensors):
        key = _first_key(tensors, ".qzeros")
        tensors[key] = tensors[key][:, :-1].contiguous()

    _rewrite(folder, truncate)
    with pytest.raises(ValueError, match=r"\.qzeros: expected int32 of shape"):
        load_quantized(folder)


def test_act_order_gptq_is_refused(tmp_path):
    _, folder, _ = _foreign_checkpoint(tmp_path, "gptq")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["desc_act"] = True
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="desc_act"):
        load_quantized(folder)
