"""The two stock models `verify` compares a model with, built from its own weights.

* The **reference** (:func:`reference_model`): a stock transformers instance of the model's
  class, on the CPU, eager attention, its weights the model's upcast to ``float32`` (or
  ``float64``); or a stock model the caller loaded (e.g. from the fp32 checkpoint), checked to
  hold the same weights (:func:`check_reference`).
* The **noise floor** (:func:`floor_model`): the stock model on the CPU in the test dtype, its
  weights and buffers the model's own (shared with it, not copied, when the model is on the
  CPU in that dtype): what rounding to that dtype alone costs, module by module.

So at most the model and these two copies of its weights are alive at once (the floor's shared
with the model on a CPU run).
"""

from __future__ import annotations

import copy
import warnings

import torch
from torch import nn

from ascend_vlm.patching import applied_features

REFERENCE_DTYPES = (torch.float32, torch.float64)


def require_transformers_model(base: nn.Module) -> None:
    """ValueError naming ``model`` unless ``base`` is a transformers PreTrainedModel with a
    config, which the stock reference is built from."""
    from transformers import PreTrainedModel

    if not isinstance(base, PreTrainedModel) or getattr(base, "config", None) is None:
        raise ValueError(
            f"model: expected a transformers PreTrainedModel (optionally PEFT-wrapped) to build "
            f"the stock reference from, got {type(base).__name__}"
        )


def _stock_instance(base: nn.Module) -> nn.Module:
    """A freshly built stock instance of ``base``'s class from a copy of its config (eager
    attention), on the CPU in eval mode; ValueError naming ``model`` when it cannot be built."""
    require_transformers_model(base)
    config = copy.deepcopy(base.config)
    config._attn_implementation = "eager"
    try:
        with torch.device("cpu"):
            return type(base)(config).eval()
    except Exception as error:  # a class that does not build from its own config
        raise ValueError(
            f"model: expected a {type(base).__name__} that builds from its config as the stock "
            f"reference, got {type(error).__name__}: {error}"
        ) from error


def _check_names_and_shapes(
    expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor], argument: str, what: str
) -> None:
    missing = sorted(set(expected) - set(got))
    unexpected = sorted(set(got) - set(expected))
    reshaped = sorted(
        name
        for name in set(expected) & set(got)
        if tuple(expected[name].shape) != tuple(got[name].shape)
    )
    if missing or unexpected or reshaped:
        details = [
            f"{label} {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}"
            for label, names in (
                ("missing", missing),
                ("unexpected", unexpected),
                ("of other shapes", reshaped),
            )
            if names
        ]
        raise ValueError(
            f"{argument}: expected the weights of {what} (same names and shapes), got "
            f"{'; '.join(details)}"
        )


# The complex dtype a model's complex buffers (Llama 4's RoPE tables) take beside each real one.
_COMPLEX_DTYPES = {torch.float64: torch.complex128}


def cast_floating(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``model`` with its floating parameters and buffers cast to ``dtype`` in place; complex
    buffers stay complex (``Module.to(dtype)`` would drop their imaginary part), as complex128
    beside ``float64``."""
    complex_buffers = {name: b for name, b in model.named_buffers() if b.is_complex()}
    persistent = set(model.state_dict())
    with warnings.catch_warnings():
        # Those buffers are put back below; the warning about their imaginary part is moot.
        warnings.filterwarnings("ignore", "Casting complex values to real")
        model.to(dtype)
    for name, buffer in complex_buffers.items():
        owner, _, leaf = name.rpartition(".")
        kept = buffer.to(_COMPLEX_DTYPES.get(dtype, buffer.dtype))
        model.get_submodule(owner).register_buffer(leaf, kept, persistent=name in persistent)
    return model


def reference_model(base: nn.Module, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The stock reference of ``base`` (module docstring): a new instance holding ``base``'s
    weights in ``dtype`` (one of :data:`REFERENCE_DTYPES`) on the CPU. ValueError naming
    ``model`` when the class does not build from its config or ``base``'s weights are not a
    stock model's (quantized layers, other shapes)."""
    reference = _stock_instance(base)
    weights = base.state_dict()
    _check_names_and_shapes(
        reference.state_dict(), weights, "model", f"a stock {type(base).__name__}"
    )
    reference.load_state_dict({name: value.to("cpu") for name, value in weights.items()})
    return cast_floating(reference, dtype)


def floor_model(base: nn.Module, dtype: torch.dtype) -> nn.Module:
    """The noise-floor model of ``base`` (module docstring): a stock instance holding
    ``base``'s floating weights and buffers in ``dtype`` on the CPU."""
    floor = _stock_instance(base)
    weights = base.state_dict()
    _check_names_and_shapes(floor.state_dict(), weights, "model", f"a stock {type(base).__name__}")

    def on_cpu(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to("cpu", dtype) if tensor.is_floating_point() else tensor.to("cpu")

    floor.load_state_dict({name: on_cpu(value) for name, value in weights.items()}, assign=True)
    # Buffers outside the state dict (rotary frequencies) as the model holds them.
    for name, buffer in base.named_buffers():
        if name not in weights:
            owner, _, leaf = name.rpartition(".")
            floor.get_submodule(owner).register_buffer(leaf, buffer.to("cpu"), persistent=False)
    return floor


def check_reference(reference: nn.Module, base: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``reference`` (a stock model the caller built) moved to the CPU in ``dtype``, once it
    is checked to be unmodified by any ascend_vlm feature and to hold ``base``'s weights: the
    same names and shapes, and values that round to ``base``'s. ValueError naming
    ``reference`` otherwise. The caller's object is moved and cast in place."""
    features = [feature.name for feature in applied_features(reference)]
    if features:
        raise ValueError(
            f"reference: expected a stock model, got one carrying {', '.join(features)}; "
            f"pass an unpatched model with the same weights, or None to build one"
        )
    expected, got = base.state_dict(), reference.state_dict()
    _check_names_and_shapes(expected, got, "reference", f"model ({type(base).__name__})")
    for name, value in expected.items():
        if not value.is_floating_point():
            continue
        rounded = got[name].to("cpu", value.dtype).double()
        difference = (rounded - value.to("cpu").double()).abs()
        tolerance = torch.finfo(value.dtype).eps * value.to("cpu").double().abs()
        if bool((difference > tolerance).any()):
            raise ValueError(
                f"reference: expected the weights of model, got {name} differing by up to "
                f"{difference.max().item():.3g} after rounding to {value.dtype}"
            )
    return cast_floating(reference.to("cpu"), dtype).eval()
