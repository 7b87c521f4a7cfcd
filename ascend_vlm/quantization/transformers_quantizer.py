"""transformers' side of :class:`~ascend_vlm.quantization.config.QuantizationConfig`: with
:mod:`ascend_vlm.quantization` imported, ``from_pretrained`` takes the config (quant_method
``"ascend_vlm"``, registered through ``register_quantization_config`` / ``register_quantizer``).

* A float checkpoint with ``quantization_config=QuantizationConfig(...)`` (RTN) is quantized
  while it loads: the quantizer selects the layers on the empty model, each selected weight is
  rounded as it arrives (:func:`~ascend_vlm.quantization.quantize.quantize_linear`, the same
  rounding as ``quantize``) and its float tensor dropped unless ``keep_float_weights``; after
  loading, the `QuantLinear`s are installed through the edit ledger
  (:mod:`~ascend_vlm.quantization.feature`). The model equals ``quantize(model, config)`` on the
  float model, bit for bit. AWQ is refused: it needs calibration batches run through the float
  model.
* A checkpoint ``save_pretrained`` wrote after quantization (its ``config.json`` records the
  config and the quantized ``modules``) gets empty `QuantLinear`s installed before the weights
  load, so they load into them. Without the registration transformers would skip the unknown
  method and load those layers as float layers of random weights.

Both rely on transformers internals that no public contract covers; each is checked by a named
probe (:data:`ascend_vlm._compat.quantizer.QUANTIZER_PROBES`, run once per process) when a
model loads, and a failing probe is a PatchError naming it.
"""

from __future__ import annotations

import functools
from typing import Any

import transformers
from torch import nn
from transformers.core_model_loading import ConversionOps
from transformers.quantizers.auto import (
    AUTO_QUANTIZER_MAPPING,
    register_quantization_config,
    register_quantizer,
)
from transformers.quantizers.base import HfQuantizer

from ascend_vlm._compat.probe import probe_failure, require_probes
from ascend_vlm._compat.quantizer import QUANTIZER_PROBES
from ascend_vlm._errors import PatchError
from ascend_vlm.quantization.config import QUANT_METHOD, QuantizationConfig
from ascend_vlm.quantization.feature import install_quantization
from ascend_vlm.quantization.quantize import quantization_targets, quantize_linear
from ascend_vlm.quantization.quantized_checkpoint import check_checkpoint
from ascend_vlm.quantization.quantized_weight import QuantizedWeight

# The probes read transformers' source; once per process (the installed version does not change).
_failure_once = functools.cache(probe_failure)


def _require_probes(names: tuple[str, ...], action: str) -> None:
    require_probes(
        (probe for probe in QUANTIZER_PROBES if probe.name in names),
        f"quantization_config: {action}",
        f"transformers {transformers.__version__}",
        PatchError,
        _failure_once,
    )


class QuantizeWhileLoading(ConversionOps):
    """The op transformers runs on each selected float weight as it loads: rounds it into the
    quantizer's weights and drops it (``missing_keys`` forgets it: the layer is replaced after
    loading), or passes it on to load as well when ``keep_float_weights``."""

    def __init__(self, hf_quantizer: AscendVLMQuantizer) -> None:
        self.hf_quantizer = hf_quantizer

    def convert(
        self,
        input_dict: dict[str, Any],
        full_layer_name: str | None = None,
        model: nn.Module | None = None,
        missing_keys: set[str] | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        (value,) = input_dict.values()
        tensor = value[0] if isinstance(value, list) else value
        name = full_layer_name.removesuffix(".weight")
        quantizer = self.hf_quantizer
        dtype = model.get_submodule(name).weight.dtype
        quantizer.weights[name] = quantize_linear(quantizer.quantization_config, tensor.to(dtype))
        if quantizer.quantization_config.keep_float_weights:
            return input_dict
        if missing_keys is not None:
            missing_keys.discard(full_layer_name)
        return {}


class AscendVLMQuantizer(HfQuantizer):
    """Quantizes a float checkpoint while it loads, or builds a quantized checkpoint's layers
    (module docstring)."""

    requires_calibration = False
    quantization_config: QuantizationConfig

    def __init__(self, quantization_config: QuantizationConfig, **kwargs: Any) -> None:
        super().__init__(quantization_config, **kwargs)
        self.weights: dict[str, QuantizedWeight] = {}  # rounded as they load
        self._targets: dict[str, str] = {}  # "<layer>.weight" -> "<layer>"

    def validate_environment(self, *args: Any, **kwargs: Any) -> None:
        config = self.quantization_config
        if self.pre_quantized:
            _require_probes(("quantizer-hooks",), "loading a quantized checkpoint")
            if config.modules is None:
                raise ValueError(
                    "quantization_config.modules: expected the quantized layers' names in the "
                    "checkpoint's config.json, got none"
                )
            return
        if config.method != "rtn":
            raise ValueError(
                f"quantization_config.method: expected 'rtn' to quantize while loading, got "
                f"{config.method!r} (AWQ runs calibration batches through the float model: "
                "load it, then call quantize(model, config, processor=...))"
            )
        _require_probes(("quantizer-hooks", "quantize-op-call"), "quantizing while loading")

    def _process_model_before_weight_loading(
        self, model: nn.Module, checkpoint_files: list[str] | None = None, **kwargs: Any
    ) -> None:
        config = self.quantization_config
        if self.pre_quantized:
            if checkpoint_files:
                check_checkpoint(model, checkpoint_files, config.to_dict())
            install_quantization(model, config, dict.fromkeys(config.modules), False)
            return
        targets = quantization_targets(model, config)
        self._targets = {f"{name}.weight": name for name, _ in targets}

    def param_needs_quantization(self, model: nn.Module, param_name: str, **kwargs: Any) -> bool:
        return not self.pre_quantized and param_name in self._targets

    def get_quantize_ops(self) -> QuantizeWhileLoading:
        return QuantizeWhileLoading(self)

    def _process_model_after_weight_loading(self, model: nn.Module, **kwargs: Any) -> nn.Module:
        if self.pre_quantized:
            return model
        absent = [key for key, name in self._targets.items() if name not in self.weights]
        if absent:
            raise ValueError(f"{absent[0]}: missing from the checkpoint ({len(absent)} missing)")
        config = self.quantization_config
        weights = {name: self.weights.pop(name) for name in self._targets.values()}
        self.quantization_config = recorded = config.recorded(weights)
        # postprocess_model set it just before; the ledger records it as absent instead, so
        # unquantize removes it.
        vars(model.config).pop("quantization_config", None)
        install_quantization(model, recorded, weights, config.keep_float_weights)
        return model

    def is_serializable(self, *args: Any, **kwargs: Any) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        return True  # LoRA adapters on top; the quantized weights stay frozen


if QUANT_METHOD not in AUTO_QUANTIZER_MAPPING:  # importing twice (reloads) registers once
    register_quantization_config(QUANT_METHOD)(QuantizationConfig)
    register_quantizer(QUANT_METHOD)(AscendVLMQuantizer)
