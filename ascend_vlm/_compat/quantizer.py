"""The transformers internals quantizing while loading relies on
(:mod:`ascend_vlm.quantization.transformers_quantizer`), each a named probe. They are checked
when a model loads with our quantization config, not by the version gate of `patch`: a model
that is never quantized does not depend on them.

========================= ===============================================================
probe                     detail
========================= ===============================================================
quantizer-hooks           ``HfQuantizer`` calls ``_process_model_before_weight_loading`` /
                          ``_process_model_after_weight_loading`` and asks
                          ``param_needs_quantization`` / ``get_quantize_ops`` (5.17 to 5.25).
quantize-op-call          the loader runs a param's ``quantization_operation`` (a
                          ``core_model_loading.ConversionOps``) on the loaded tensor with
                          ``full_layer_name``, ``model`` and ``missing_keys`` (5.17 to 5.25).
========================= ===============================================================
"""

from __future__ import annotations

import inspect

from transformers.quantizers.base import HfQuantizer

from ascend_vlm._compat.probe import NEEDED_ON_EVERY_SUPPORTED_VERSION, Probe

_HOOKS = (
    "_process_model_before_weight_loading",
    "_process_model_after_weight_loading",
    "param_needs_quantization",
    "get_quantize_ops",
)


def _quantizer_hooks() -> str | None:
    missing = [name for name in _HOOKS if not hasattr(HfQuantizer, name)]
    if missing:
        return f"HfQuantizer has no {', '.join(missing)}"
    for caller, hook in (
        ("preprocess_model", "_process_model_before_weight_loading"),
        ("postprocess_model", "_process_model_after_weight_loading"),
    ):
        if hook not in inspect.getsource(getattr(HfQuantizer, caller)):
            return f"HfQuantizer.{caller} does not call {hook}"
    return None


def _quantize_op_call() -> str | None:
    from transformers import core_model_loading

    transform = getattr(core_model_loading, "WeightTransform", None)
    if transform is None or "quantization_operation" not in transform.__slots__:
        return "core_model_loading.WeightTransform holds no quantization_operation"
    source = inspect.getsource(core_model_loading)
    if "self.quantization_operation.convert(" not in source:
        return "no loader calls quantization_operation.convert"
    call = source.split("self.quantization_operation.convert(", 1)[1].split(")", 1)[0]
    absent = [k for k in ("full_layer_name=", "model=", "missing_keys=") if k not in call]
    return f"quantization_operation.convert gets no {', '.join(absent)}" if absent else None


QUANTIZER_PROBES = (
    Probe("quantizer-hooks", _quantizer_hooks, NEEDED_ON_EVERY_SUPPORTED_VERSION),
    Probe("quantize-op-call", _quantize_op_call, NEEDED_ON_EVERY_SUPPORTED_VERSION),
)
