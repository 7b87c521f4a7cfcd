"""Quantized checkpoint folders, checked strictly: `load_quantized(path)` for this library's
own (written by ``save_pretrained`` after :func:`~ascend_vlm.quantization.quantize.quantize`),
AutoAWQ GEMM and GPTQ checkpoints, and `check_checkpoint` for ``from_pretrained``.

Own checkpoints load through transformers' quantizer path
(:mod:`~ascend_vlm.quantization.transformers_quantizer`): before any weight loads,
`check_checkpoint` checks the quantized tensors from the files' headers, then empty
`QuantLinear`s take them; `load_quantized` adds that every other tensor must be there too.

AutoAWQ GEMM and GPTQ checkpoints name quant_methods transformers hands to its own quantizers
(and their kernel packages), so `load_quantized` reads the folder without its
``quantization_config``: transformers loads every float tensor (norms, embeddings, biases,
unquantized layers) with its own key renaming, tied weights and dtype handling; the quantized
layers' float weights it reports missing are then replaced, through the edit ledger
(:mod:`~ascend_vlm.quantization.feature`, float layers not kept), by `QuantLinear`s holding the
checkpoint's tensors decoded into the library's layout
(:mod:`~ascend_vlm.quantization.foreign_formats`). Those float weights therefore exist,
briefly, at load time.

Checks: every quantized layer must have all its tensors with the expected dtypes and shapes,
every tensor transformers reports missing must be a quantized layer's float weight, and every
checkpoint tensor it leaves unused must belong to a quantized layer; anything else is a
ValueError naming the tensor. Checkpoints whose key names predate transformers 5's module
layout (``model.layers...`` for Qwen-VL, ``language_model.model...`` for LLaVA) are matched to
the model's modules by the same prefix moves transformers applies to them.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ascend_vlm.quantization.config import QUANT_METHOD
from ascend_vlm.quantization.feature import install_quantization
from ascend_vlm.quantization.quant_linear import QuantLinear
from ascend_vlm.quantization.quantized_weight import QuantizedWeight, group_count, storage_of

# Checkpoint-name prefixes of the layouts before transformers 5, and where those modules live
# now (the moves transformers' own conversion mapping applies when it loads such checkpoints).
LEGACY_PREFIXES = (
    (re.compile(r"^language_model\.model\."), "model.language_model."),
    (re.compile(r"^language_model\.lm_head\."), "lm_head."),
    (re.compile(r"^vision_tower\."), "model.vision_tower."),
    (re.compile(r"^multi_modal_projector\."), "model.multi_modal_projector."),
    (re.compile(r"^visual\."), "model.visual."),
    (re.compile(r"^model\.(?!language_model\.|visual\.|vision_tower\.)"), "model.language_model."),
)
# The tensors a quantized layer stores, per format (besides an optional float bias).
_OWN_TENSORS = ("qweight", "scale", "offset")
_FOREIGN_TENSORS = ("qweight", "qzeros", "scales", "g_idx")


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / shard for shard in shards]
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    raise ValueError(
        f"path: expected model.safetensors or model.safetensors.index.json in {folder}"
    )


def _read_tensors(folder: Path, wanted: set[str]) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    tensors = {}
    for file in _weight_files(folder):
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                if key in wanted:
                    tensors[key] = handle.get_tensor(key)
    return tensors


def _checkpoint_keys(folder: Path) -> list[str]:
    from safetensors import safe_open

    keys = []
    for file in _weight_files(folder):
        with safe_open(str(file), framework="pt") as handle:
            keys.extend(handle.keys())
    return keys


def module_name_in(model: nn.Module, checkpoint_prefix: str) -> str | None:
    """The name of ``model``'s module stored under ``checkpoint_prefix`` (itself, or moved by
    :data:`LEGACY_PREFIXES`), or None."""
    names = dict(model.named_modules())
    if checkpoint_prefix in names:
        return checkpoint_prefix
    for pattern, replacement in LEGACY_PREFIXES:
        moved = pattern.sub(replacement, checkpoint_prefix + ".", count=1)[:-1]
        if moved != checkpoint_prefix and moved in names:
            return moved
    return None


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers' loading report lists the quantized layers' tensors as missing/unexpected;
    they are checked here instead."""
    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)


def _model_class(config: Any) -> type:
    import transformers

    for name in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    raise ValueError(
        f"path: config.json names no transformers model class (architectures="
        f"{getattr(config, 'architectures', None)}); pass model_class="
    )


def _decoder(method_config: dict) -> tuple[tuple[str, ...], Any]:
    """The tensor names a quantized layer stores and ``decode(name, tensors) ->
    QuantizedWeight`` for the checkpoint's ``quantization_config``."""
    method = method_config.get("quant_method")
    if method == QUANT_METHOD:
        bits, group_size = method_config["bits"], method_config["group_size"]
        symmetric = method_config["symmetric"]

        def decode_own(name: str, tensors: dict[str, torch.Tensor]) -> QuantizedWeight:
            if not symmetric and "offset" not in tensors:
                raise ValueError(
                    f"{name}.offset: missing from the checkpoint (quantization_config says "
                    "symmetric: false)"
                )
            return _own_weight(name, tensors, bits, group_size)

        return _OWN_TENSORS, decode_own
    from ascend_vlm.quantization.foreign_formats import (
        decode_awq_gemm,
        decode_gptq,
        read_quantization_config,
    )

    foreign = read_quantization_config(method_config)

    def decode_foreign(name: str, tensors: dict[str, torch.Tensor]) -> QuantizedWeight:
        need = ("qweight", "qzeros", "scales")
        for part in need:
            if part not in tensors:
                raise ValueError(f"{name}.{part}: missing from the checkpoint")
        if foreign.method == "awq":
            return decode_awq_gemm(
                tensors["qweight"],
                tensors["qzeros"],
                tensors["scales"],
                foreign.group_size,
                name=name,
            )
        return decode_gptq(
            tensors["qweight"],
            tensors["qzeros"],
            tensors["scales"],
            tensors.get("g_idx"),
            foreign.bits,
            foreign.group_size,
            foreign.checkpoint_format,
            name=name,
        )

    return _FOREIGN_TENSORS, decode_foreign


def _own_weight(
    name: str, tensors: dict[str, torch.Tensor], bits: int, group_size: int
) -> QuantizedWeight:
    for part in ("qweight", "scale"):
        if part not in tensors:
            raise ValueError(f"{name}.{part}: missing from the checkpoint")
    qweight, scale = tensors["qweight"], tensors["scale"]
    storage, _ = storage_of(bits, 0)
    if qweight.dtype != storage or qweight.dim() != 2:
        raise ValueError(
            f"{name}.qweight: expected a 2-D {storage} tensor for {bits} bits, got "
            f"{qweight.dtype} of shape {tuple(qweight.shape)}"
        )
    if scale.dim() != 2 or scale.shape[1] != qweight.shape[0]:
        raise ValueError(
            f"{name}.scale: expected shape (groups, {qweight.shape[0]}), got {tuple(scale.shape)}"
        )
    offset = tensors.get("offset")
    if offset is not None and offset.shape != scale.shape:
        raise ValueError(
            f"{name}.offset: expected the scale's shape {tuple(scale.shape)}, got "
            f"{tuple(offset.shape)}"
        )
    return QuantizedWeight(qweight, scale, offset, bits, group_size, in_features=-1)


def _quantized_layers(
    model: nn.Module, keys: list[str], tensor_names: tuple[str, ...], listed: list | None
) -> tuple[dict[str, dict[str, str]], dict[str, str]]:
    """The checkpoint's quantized layers: ``prefix -> {part: key}`` and ``module name ->
    prefix``. ValueError naming the tensor for a layer the model has no linear layer for, and
    for a checkpoint missing a layer ``listed`` (the config's ``modules``) or holding another."""
    layers: dict[str, dict[str, str]] = {}
    for key in keys:
        prefix, _, part = key.rpartition(".")
        if part in tensor_names:
            layers.setdefault(prefix, {})[part] = key
    # A quantized layer's bias: AutoGPTQ stores one (zeros) for every layer, biased or not.
    for key in keys:
        prefix, _, part = key.rpartition(".")
        if part == "bias" and prefix in layers:
            layers[prefix]["bias"] = key
    modules = {}
    for prefix in layers:
        name = module_name_in(model, prefix)
        if name is None or not isinstance(model.get_submodule(name), nn.Linear):
            raise ValueError(
                f"{prefix}.qweight: the checkpoint quantizes a layer the model has no linear "
                f"layer for ({type(model).__name__})"
            )
        modules[name] = prefix
    if listed is not None and set(listed) != set(modules):
        absent = sorted(set(listed) - set(modules))
        if absent:
            raise ValueError(
                f"{absent[0]}.qweight: missing from the checkpoint (quantization_config lists "
                f"{len(listed)} quantized layers, the checkpoint holds {len(modules)})"
            )
        extra = sorted(set(modules) - set(listed))[0]
        raise ValueError(f"{extra}.qweight: in the checkpoint but not in quantization_config")
    return layers, modules


# safetensors' dtype names in file headers.
_HEADER_DTYPES = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
}


def check_checkpoint(model: nn.Module, files: list[str], method_config: dict) -> None:
    """Check this library's checkpoint ``files`` against ``model`` (float linears, weights
    not loaded) from their headers alone, before transformers loads them: every quantized layer
    ``method_config`` lists is there with all its tensors, of the dtypes and shapes its layer
    needs (the checks ``load_quantized`` makes, on empty tensors). ValueError naming the
    tensor."""
    from safetensors import safe_open

    empty = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                view = handle.get_slice(key)
                dtype = _HEADER_DTYPES.get(view.get_dtype(), torch.float32)
                empty[key] = torch.empty(view.get_shape(), dtype=dtype, device="meta")
    tensor_names, decode = _decoder(method_config)
    layers, modules = _quantized_layers(
        model, list(empty), tensor_names, method_config.get("modules")
    )
    for name, prefix in modules.items():
        parts = {part: empty[key] for part, key in layers[prefix].items() if part != "bias"}
        _fitted(prefix, decode(prefix, parts), model.get_submodule(name))


def _refuse_loading_problems(
    model: nn.Module, info: dict, expected_missing: set[str], quantized_keys: set[str]
) -> None:
    stray = sorted(set(info["missing_keys"]) - expected_missing)
    if stray:
        raise ValueError(f"{stray[0]}: missing from the checkpoint ({len(stray)} tensors missing)")
    unused = sorted(set(info["unexpected_keys"]) - quantized_keys)
    if unused:
        raise ValueError(f"{unused[0]}: in the checkpoint but not in {type(model).__name__}")
    mismatched = info.get("mismatched_keys") or []
    if mismatched:
        raise ValueError(f"{mismatched[0][0]}: shape in the checkpoint does not match the model")


def load_quantized(
    path: str | os.PathLike, *, model_class: type | None = None, **from_pretrained_kwargs: Any
) -> nn.Module:
    """The quantized model saved in the folder ``path`` (see the module docstring).

    ``model_class``: the transformers class to build (default: the config's architecture);
    other keyword arguments go to its ``from_pretrained`` (e.g. ``dtype``). Raises ValueError
    naming the folder when it has no config.json or no ``quantization_config``, and naming the
    tensor for a checkpoint that is truncated or does not match the model.
    """
    from transformers import AutoConfig

    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise ValueError(f"path: expected a checkpoint folder with config.json, got {folder}")
    method_config = json.loads((folder / "config.json").read_text()).get("quantization_config")
    if not isinstance(method_config, dict):
        raise ValueError(
            f"path: {folder}/config.json has no quantization_config; load it with from_pretrained"
        )
    if method_config.get("quant_method") == QUANT_METHOD:
        # transformers' quantizer path (transformers_quantizer), which checks the quantized
        # tensors before loading; here every other tensor must be there too.
        cls = model_class or _model_class(AutoConfig.from_pretrained(folder))
        with _quiet_transformers():
            model, info = cls.from_pretrained(
                folder, output_loading_info=True, **from_pretrained_kwargs
            )
        _refuse_loading_problems(model, info, set(), set())
        return model
    tensor_names, decode = _decoder(method_config)
    config = AutoConfig.from_pretrained(folder)
    with contextlib.suppress(AttributeError):
        del config.quantization_config
    cls = model_class or _model_class(config)
    with _quiet_transformers():
        model, info = cls.from_pretrained(
            folder, config=config, output_loading_info=True, **from_pretrained_kwargs
        )
    layers, modules = _quantized_layers(model, _checkpoint_keys(folder), tensor_names, None)
    # transformers reports unused tensors under the names it moved them to (if any).
    quantized_keys = {key for parts in layers.values() for key in parts.values()} | {
        f"{name}.{part}" for name, prefix in modules.items() for part in layers[prefix]
    }
    _refuse_loading_problems(model, info, {f"{name}.weight" for name in modules}, quantized_keys)

    wanted = {key for prefix in modules.values() for key in layers[prefix].values()}
    tensors = _read_tensors(folder, wanted)
    built = {}
    for name, prefix in modules.items():
        linear = model.get_submodule(name)
        parts = {part: tensors[key] for part, key in layers[prefix].items()}
        stored_bias = parts.pop("bias", None)
        weight = _fitted(prefix, decode(prefix, parts), linear)
        bias = linear.bias.detach() if linear.bias is not None else None
        if bias is None and stored_bias is not None and stored_bias.any():
            bias = stored_bias.to(weight.scale)
        built[name] = QuantLinear.from_quantized(weight, bias)
    install_quantization(model, method_config, built, keep_float_weights=False)
    return model


def _fitted(prefix: str, weight: QuantizedWeight, linear: nn.Linear) -> QuantizedWeight:
    """``weight`` checked against the layer it replaces, on its device, its scales in its
    dtype."""
    in_features = weight.in_features if weight.in_features > 0 else linear.in_features
    place = {"device": linear.weight.device, "dtype": linear.weight.dtype}
    fitted = QuantizedWeight(
        weight.qweight.to(linear.weight.device),
        weight.scale.to(**place),
        None if weight.offset is None else weight.offset.to(**place),
        weight.bits,
        weight.group_size,
        in_features,
    )
    _, width = storage_of(weight.bits, in_features)
    expected = {
        "qweight": (linear.out_features, width),
        "scale": (group_count(in_features, weight.group_size), linear.out_features),
    }
    got = {"qweight": tuple(weight.qweight.shape), "scale": tuple(weight.scale.shape)}
    for part, shape in expected.items():
        if got[part] != shape:
            raise ValueError(
                f"{prefix}: decoded {part} of shape {got[part]} does not fit a "
                f"{linear.in_features} -> {linear.out_features} linear layer (expected {shape})"
            )
    return fitted
