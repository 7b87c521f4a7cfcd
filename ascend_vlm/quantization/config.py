"""`QuantizationConfig`: one weight-only quantization scheme, validated once, serving both
``quantize(model, config)`` and ``from_pretrained(path, quantization_config=config)``.

It is transformers' ``QuantizationConfigMixin`` (quant_method ``"ascend_vlm"``, registered in
:mod:`~ascend_vlm.quantization.transformers_quantizer`), so the model's config records it and
``save_pretrained`` writes it to ``config.json``, where loading reads it back.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from transformers.utils.quantization_config import QuantizationConfigMixin

from ascend_vlm.models.parts import PARTS
from ascend_vlm.quantization.rtn import check_scheme, resolve_symmetric

METHODS = ("rtn", "awq")
QUANT_METHOD = "ascend_vlm"
# The group size a bit width gets when none is named: 8 bits per channel (the int8 kernels'
# fast case), 4 bits in groups of 128.
DEFAULT_GROUP_SIZE = {8: 0, 4: 128}


def _check_bool(argument: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{argument}: expected True or False, got {value!r}")


def _check_names(argument: str, entries: object, parts_allowed: bool) -> tuple[str, ...]:
    if isinstance(entries, str) or not isinstance(entries, Iterable):
        raise TypeError(f"{argument}: expected a sequence of strings, got {entries!r}")
    entries = tuple(entries)
    for entry in entries:
        if not isinstance(entry, str) or not entry:
            raise TypeError(f"{argument}: expected non-empty strings, got {entry!r}")
        if parts_allowed and entry not in PARTS and not any(c in entry for c in "*?[."):
            raise ValueError(
                f"{argument}: expected model parts {PARTS} or module-name patterns (with '.', "
                f"'*', '?' or '['), got {entry!r}"
            )
    return entries


class QuantizationConfig(QuantizationConfigMixin):
    """A weight-only quantization scheme for a VLM's linear layers.

    ``bits``: 8 or 4. ``group_size``: 0 (per output channel) or a multiple of 32 from 32 to
    256; None: :data:`DEFAULT_GROUP_SIZE` for ``bits``. ``symmetric``: no offsets; None: True
    for 8 bits, False for 4. ``method``: ``"rtn"`` (round to nearest) or ``"awq"``
    (activation-aware scales searched on calibration batches first; eager ``quantize`` only).
    ``include``: model parts (:data:`ascend_vlm.models.parts.PARTS`) or ``fnmatch`` patterns
    of module names; ``exclude``: patterns that win over them. ``modules``: the quantized
    layers' names, as a quantized model records them (None before quantization); when given
    they are the selection, and ``include`` / ``exclude`` are not consulted.
    ``keep_float_weights``: keep each replaced float layer, so that
    :func:`~ascend_vlm.quantization.quantize.unquantize` gives the float model back bit for bit
    (costs the float weights' memory beside the quantized ones, on the device they were on when
    quantized; RTN only, as AWQ rescales float weights in place).

    Raises TypeError / ValueError naming the field, what it accepts and what came.
    """

    def __init__(
        self,
        bits: int = 8,
        group_size: int | None = None,
        symmetric: bool | None = None,
        method: str = "rtn",
        include: Sequence[str] = ("language",),
        exclude: Sequence[str] = (),
        modules: Sequence[str] | None = None,
        keep_float_weights: bool = False,
        quant_method: str = QUANT_METHOD,
    ) -> None:
        if quant_method != QUANT_METHOD:
            raise ValueError(f"quant_method: expected {QUANT_METHOD!r}, got {quant_method!r}")
        if group_size is None:
            group_size = DEFAULT_GROUP_SIZE.get(bits, 0)
        check_scheme(bits, group_size)
        if symmetric is not None:
            _check_bool("symmetric", symmetric)
        if method not in METHODS:
            raise ValueError(f"method: expected one of {METHODS}, got {method!r}")
        _check_bool("keep_float_weights", keep_float_weights)
        if keep_float_weights and method == "awq":
            raise ValueError(
                "keep_float_weights: expected False with method 'awq' (AWQ rescales the float "
                "weights in place, so the kept ones would not be the originals), got True"
            )
        self.quant_method = QUANT_METHOD
        self.bits = bits
        self.group_size = group_size
        self.symmetric = resolve_symmetric(bits, symmetric)
        self.method = method
        self.include = _check_names("include", include, parts_allowed=True)
        self.exclude = _check_names("exclude", exclude, parts_allowed=False)
        self.modules = None if modules is None else _check_names("modules", modules, False)
        self.keep_float_weights = keep_float_weights

    def recorded(self, modules: Sequence[str]) -> QuantizationConfig:
        """This scheme with the names of the layers it quantized: what a quantized model's
        config records (``keep_float_weights`` is not part of a checkpoint: False)."""
        fields = {**self.to_dict(), "modules": tuple(modules), "keep_float_weights": False}
        return QuantizationConfig(**fields)

    def to_dict(self) -> dict[str, Any]:
        """The fields as JSON types (lists for the name sequences)."""
        fields = dict(vars(self))
        for name in ("include", "exclude", "modules"):
            if fields[name] is not None:
                fields[name] = list(fields[name])
        return fields

    def __eq__(self, other: object) -> bool:
        return isinstance(other, QuantizationConfig) and self.to_dict() == other.to_dict()

    __hash__ = None
