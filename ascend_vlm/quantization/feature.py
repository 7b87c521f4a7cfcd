"""Quantization as a feature of the edit ledger (:mod:`ascend_vlm.patching.ledger`): the
``nn.Linear`` -> `QuantLinear` swaps and the recorded ``config.quantization_config``, made
through the ledger so that :func:`unquantize` reverts them exactly.

Every way a model gets quantized installs this feature: ``quantize(model, config)``,
``from_pretrained(float_checkpoint, quantization_config=config)`` (quantizing while loading)
and ``from_pretrained(quantized_checkpoint)`` (the layers built empty before the weights
load).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from ascend_vlm._base_model import base_model
from ascend_vlm._errors import PatchError
from ascend_vlm.patching.ledger import Edits, applied_features, apply_feature, remove_feature
from ascend_vlm.quantization.config import QuantizationConfig
from ascend_vlm.quantization.quant_linear import QuantLinear
from ascend_vlm.quantization.quantized_weight import QuantizedWeight

FEATURE_NAME = "quantization"


class QuantizationFeature:
    """Swaps the layers named in ``weights`` of ``root`` (a transformers model) for
    `QuantLinear`s, keeping the float layers when ``keep_float_weights``, and sets
    ``root.config.quantization_config`` to ``config`` (a foreign checkpoint's: its dict).

    Per layer, ``weights`` holds a `QuantizedWeight` (built into a `QuantLinear` with the float
    layer's bias), a ready `QuantLinear`, or None (an empty layer of the config's scheme, for a
    checkpoint's weights to load into). The `QuantLinear`s are built on the first ``install``
    and reused after (the ledger may re-run it); the feature then holds no other reference to
    their tensors, so moving the model moves all of them. The kept float layers are outside the
    module tree: ``model.to(...)`` leaves them where they were.
    """

    name = FEATURE_NAME

    def __init__(
        self,
        root: nn.Module,
        config: QuantizationConfig | Mapping[str, Any],
        weights: Mapping[str, QuantizedWeight | QuantLinear | None],
        keep_float_weights: bool,
    ) -> None:
        self.root = root
        self.config = config
        self.keep_float_weights = keep_float_weights
        self._names = tuple(weights)
        self._unbuilt = dict(weights)
        self._layers: dict[str, QuantLinear] = {}

    def install(self, edits: Edits) -> None:
        for name in self._names:
            parent_name, _, child = name.rpartition(".")
            parent = self.root.get_submodule(parent_name) if parent_name else self.root
            layer = self._layers.get(name)
            if layer is None:
                weight = self._unbuilt.pop(name)
                layer = self._layers[name] = self._build(weight, parent._modules[child])
            edits.swap_submodule(parent, child, layer, keep_previous=self.keep_float_weights)
        edits.set_attribute(self.root.config, "quantization_config", self.config)

    def installed(self) -> list[tuple[str, QuantLinear]]:
        """``(name, QuantLinear)`` of the layers ``install`` built, in model order."""
        return list(self._layers.items())

    def _build(
        self, weight: QuantizedWeight | QuantLinear | None, linear: nn.Module
    ) -> QuantLinear:
        if isinstance(weight, QuantLinear):
            return weight
        if weight is not None:
            return QuantLinear.from_quantized(weight, linear.bias)
        config = self.config
        return QuantLinear(
            linear.in_features,
            linear.out_features,
            config.bits,
            config.group_size,
            symmetric=config.symmetric,
            bias=linear.bias is not None,
            dtype=linear.weight.dtype,
            device=linear.weight.device,
        )


def install_quantization(
    model: nn.Module,
    config: QuantizationConfig | Mapping[str, Any],
    weights: Mapping[str, QuantizedWeight | QuantLinear | None],
    keep_float_weights: bool,
) -> None:
    """Apply a :class:`QuantizationFeature` of these arguments to ``model`` (PEFT wrapper
    unwrapped) through the ledger."""
    root = base_model(model)
    apply_feature(model, QuantizationFeature(root, config, weights, keep_float_weights))


def unquantize(model: nn.Module) -> nn.Module:
    """Undo the quantization of ``model`` (from ``quantize`` or ``from_pretrained``): the float
    layers back in place of the `QuantLinear`s, bit for bit, and ``config.quantization_config``
    as it was; returns ``model``.

    Raises ValueError when ``model`` is not quantized or a `QuantLinear` was replaced since
    (e.g. wrapped by PEFT adapters), and PatchError when its float weights
    were not kept (``keep_float_weights=False``, or a quantized checkpoint that never had them):
    reload the model, or quantize with ``QuantizationConfig(keep_float_weights=True)``.
    """
    features = applied_features(model, FEATURE_NAME)
    if not features:
        raise ValueError(
            f"model: expected a model quantized by quantize or from_pretrained, got a "
            f"{type(base_model(model)).__name__} with no quantization applied"
        )
    if not all(feature.keep_float_weights for feature in features):
        raise PatchError(
            "model: the float weights were not kept when it was quantized, so they cannot be "
            "restored; reload the model, or quantize with "
            "QuantizationConfig(keep_float_weights=True)"
        )
    for feature in features:
        for name, layer in feature.installed():
            if feature.root.get_submodule(name) is not layer:
                found = type(feature.root.get_submodule(name)).__name__
                raise ValueError(
                    f"model: {name} is a {found}, no longer the QuantLinear quantization "
                    "installed (PEFT adapters on top?); remove what wraps it first"
                )
    remove_feature(model, FEATURE_NAME)
    return model
