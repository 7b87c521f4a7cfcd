"""Community AutoAWQ GEMM and GPTQ checkpoints: one linear layer's tensors decoded into
:class:`~ascend_vlm.quantization.quantized_weight.QuantizedWeight`, and a config.json's
``quantization_config`` read into :class:`ForeignQuantConfig`.

Both formats store, for a weight ``W`` of ``N`` output rows and ``K`` input columns quantized to
``b`` bits in groups of ``G`` input columns (``G = K`` per channel, ``group_size`` -1), unsigned
integers ``u`` in [0, 2^b - 1], unsigned zero points ``z`` and float scales ``s``::

    W[n, k] = (u[k, n] - z[k // G, n]) * s[k // G, n]

packed ``P = 32 // b`` values to an int32 word, value ``i`` of a word in bits ``[b*i, b*i + b)``
(masked after the shift, so the word's sign bit is just data).

AutoAWQ GEMM (``quant_method`` "awq", ``version`` "gemm"; 4 bits, P = 8), packed along N:
  ``qweight`` int32 ``(K, N/8)``, ``qzeros`` int32 ``(K/G, N/8)``, ``scales`` ``(K/G, N)``. Value
  ``i`` of word ``j`` holds column ``8*j + AWQ_PACK_ORDER[i]``, ``AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3,
  5, 7)``. ``K`` is a multiple of ``G``.

GPTQ (``quant_method`` "gptq", ``desc_act`` False; 4 or 8 bits here): ``qweight`` int32
  ``(K/P, N)`` packed along K in order (value ``i`` of row ``r`` is input column ``r*P + i``);
  ``qzeros`` int32 ``(ceil(K/G), N/P)`` packed along N in order; ``scales`` ``(ceil(K/G), N)``;
  ``g_idx`` ``(K,)`` with ``g_idx[k] == k // G``. ``checkpoint_format`` "gptq" (v1) stores
  ``z - 1`` (``z = stored + 1``, per value, as the v1 dequantizing kernels read it); "gptq_v2"
  stores ``z``. A ``g_idx`` that is not ``k // G`` (act-order, ``desc_act`` True) is refused.

Into the library's contract ``W[n, k] = (q[n, k] + offset[g, n]) * scale[g, n]`` with signed
``q``: ``u - z = (u - 2^(b-1)) + (2^(b-1) - z)``, so::

    q = u - 2^(b-1)        (int8 (N, K) for 8 bits, packed by pack_int4 for 4 bits)
    offset = 2^(b-1) - z   (in the scales' dtype: small integers, exact in fp16 and bf16)
    scale = s

``offset`` is None when every zero point is ``2^(b-1)`` (a symmetric checkpoint). The foreign
group size -1 becomes ``group_size`` 0; other group sizes must be in
:data:`~ascend_vlm.quantization.quantized_weight.GROUP_SIZES`.

Every tensor that has the wrong dtype, rank or shape is a ValueError naming it
(``name + "." + part``), e.g. ``layers.0.q_proj.qzeros: expected int32 of shape (2, 16), got
(2, 15)``. Of the three tensors, the one whose shape disagrees with the two others is named.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ascend_vlm.ops.int4_layout import pack_int4
from ascend_vlm.quantization.config import QUANT_METHOD
from ascend_vlm.quantization.quantized_weight import BITS, GROUP_SIZES, QuantizedWeight

FOREIGN_METHODS = ("awq", "gptq")
AWQ_VERSIONS = ("gemm",)
GPTQ_FORMATS = ("gptq", "gptq_v2")
PER_CHANNEL = -1  # the formats' group_size for one group spanning all of K
# Value i of an AutoAWQ GEMM word holds column AWQ_PACK_ORDER[i] of its eight.
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_AWQ_SLOT_OF_COLUMN = tuple(AWQ_PACK_ORDER.index(column) for column in range(8))
_WORD_BITS = 32


@dataclass(frozen=True)
class ForeignQuantConfig:
    """A checkpoint's ``quantization_config``, as far as decoding its layers needs.

    ``method``: "awq" or "gptq"; ``bits``: 4 or 8 (AWQ: 4); ``group_size``: the format's own
    value, a member of ``GROUP_SIZES`` or -1 for per channel; ``checkpoint_format``: "gemm" for
    AWQ, "gptq" (v1, zero points stored minus 1) or "gptq_v2". Which layers are quantized is
    read from the checkpoint's tensors, whatever ``modules_to_not_convert`` says.
    """

    method: str
    bits: int
    group_size: int
    checkpoint_format: str


def _library_group_size(group_size: int) -> int:
    if group_size == PER_CHANNEL:
        return 0
    if group_size in GROUP_SIZES and group_size != 0:
        return group_size
    accepted = ", ".join(str(size) for size in GROUP_SIZES if size)
    raise ValueError(
        f"group_size: expected {PER_CHANNEL} (per channel) or one of {accepted}, got {group_size}"
    )


def _tensor_name(name: str, part: str) -> str:
    return f"{name}.{part}" if name else part


def _check_tensor(name: str, part: str, tensor: Any, rank: int, integer: bool) -> None:
    """``tensor`` must be a ``rank``-D int32 tensor (``integer``) or floating tensor."""
    full = _tensor_name(name, part)
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{full}: expected a torch.Tensor, got {type(tensor).__name__}")
    kind = "int32" if integer else "floating"
    dtype_ok = tensor.dtype == torch.int32 if integer else tensor.dtype.is_floating_point
    if not dtype_ok or tensor.dim() != rank:
        raise ValueError(
            f"{full}: expected a {rank}-D {kind} tensor, got {tensor.dtype} of shape "
            f"{tuple(tensor.shape)}"
        )


def _check_non_empty(name: str, qweight: torch.Tensor) -> None:
    if qweight.numel() == 0:
        raise ValueError(
            f"{_tensor_name(name, 'qweight')}: expected a non-empty tensor, got shape "
            f"{tuple(qweight.shape)}"
        )


def _check_shapes(
    name: str,
    tensors: dict[str, torch.Tensor],
    claims: dict[str, tuple[int, int]],
    expected_shape: Callable[[str, int, int], tuple[int | str, int]],
) -> tuple[int, int]:
    """The ``(groups, N)`` the tensors agree on.

    ``claims[part]`` is the ``(groups, N)`` tensor ``part``'s shape implies; the value two of the
    three claim wins (the first's when all differ), and the first tensor whose shape differs from
    ``expected_shape(part, groups, N)`` is a ValueError naming it.
    """
    values = list(claims.values())
    agreed = next((value for value in values if values.count(value) >= 2), values[0])
    for part, tensor in tensors.items():
        shape = expected_shape(part, *agreed)
        if tuple(tensor.shape) != shape:
            kind = str(tensor.dtype).removeprefix("torch.")
            raise ValueError(
                f"{_tensor_name(name, part)}: expected {kind} of shape "
                f"({', '.join(map(str, shape))}), got {tuple(tensor.shape)}"
            )
    return agreed


def _unpack_last_dim(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int64 values of ``words`` (int32 ``(R, W)``) as ``(R, W * P)``: word ``j``'s value ``i``
    at column ``j * P + i``."""
    shifts = torch.arange(0, _WORD_BITS, bits, dtype=torch.int64, device=words.device)
    values = (words.to(torch.int64).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return values.flatten(-2)


def _quantized_weight(
    unsigned: torch.Tensor,
    zeros: torch.Tensor,
    scales: torch.Tensor,
    bits: int,
    group_size: int,
) -> QuantizedWeight:
    """``unsigned`` ``(N, K)`` and ``zeros`` ``(groups, N)`` (int64) as the signed contract."""
    half = 1 << (bits - 1)
    signed = unsigned - half
    qweight = pack_int4(signed) if bits == 4 else signed.to(torch.int8)
    offset = half - zeros
    return QuantizedWeight(
        qweight=qweight,
        scale=scales.contiguous(),
        offset=offset.to(scales.dtype) if bool(offset.any()) else None,
        bits=bits,
        group_size=group_size,
        in_features=unsigned.shape[1],
    )


def decode_awq_gemm(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    *,
    name: str = "",
) -> QuantizedWeight:
    """One AutoAWQ GEMM layer (4 bits) as a :class:`QuantizedWeight` (see the module docstring).

    ``qweight`` int32 ``(K, N/8)``, ``qzeros`` int32 ``(K/G, N/8)`` and ``scales`` floating
    ``(K/G, N)``, value ``i`` of each word holding column ``8*j + AWQ_PACK_ORDER[i]``;
    ``group_size``: the checkpoint's (-1 per channel). ``W^T[k, n] = (u - z) * s`` becomes
    ``q = u - 8``, ``offset = 8 - z``. Raises ValueError for an unsupported group size and for
    a tensor of the wrong dtype, rank or shape, naming it with the prefix ``name`` (TypeError
    for a part that is not a tensor).
    """
    bits, per_word = 4, 8
    library_group = _library_group_size(group_size)
    tensors = {"qweight": qweight, "qzeros": qzeros, "scales": scales}
    for part, tensor in tensors.items():
        _check_tensor(name, part, tensor, rank=2, integer=part != "scales")
    _check_non_empty(name, qweight)
    in_features = qweight.shape[0]
    group = library_group or in_features

    def expected_shape(part: str, groups: int, out_features: int) -> tuple[int, int]:
        groups = groups if library_group else 1
        words = -(-out_features // per_word)
        if part == "qweight":
            # AutoAWQ packs whole groups only: K == groups * G.
            return (groups * group, words)
        return (groups, words) if part == "qzeros" else (groups, out_features)

    claims = {
        "qweight": (-(-in_features // group), qweight.shape[1] * per_word),
        "qzeros": (qzeros.shape[0], qzeros.shape[1] * per_word),
        "scales": (scales.shape[0], scales.shape[1]),
    }
    _check_shapes(name, tensors, claims, expected_shape)

    out_features = scales.shape[1]
    slot = torch.tensor(_AWQ_SLOT_OF_COLUMN, dtype=torch.int64, device=qweight.device)
    # Column 8*j + c of the unpacked words sits at 8*j + slot[c].
    natural = torch.arange(0, out_features, per_word, device=qweight.device)[:, None] + slot
    natural = natural.flatten()
    unsigned = _unpack_last_dim(qweight, bits)[:, natural].t()
    zeros = _unpack_last_dim(qzeros, bits)[:, natural]
    return _quantized_weight(unsigned, zeros, scales, bits, library_group)


def decode_gptq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    bits: int,
    group_size: int,
    checkpoint_format: str = "gptq",
    *,
    name: str = "",
) -> QuantizedWeight:
    """One GPTQ layer (``desc_act`` False) as a :class:`QuantizedWeight` (see the module
    docstring).

    ``qweight`` int32 ``(K*bits/32, N)`` packed along K, ``qzeros`` int32 ``(ceil(K/G),
    N*bits/32)`` packed along N, ``scales`` floating ``(ceil(K/G), N)``, ``g_idx`` integer ``(K,)``
    or None; ``bits`` 4 or 8; ``group_size``: the checkpoint's (-1 per channel);
    ``checkpoint_format`` "gptq" (v1: ``z = stored + 1``) or "gptq_v2" (``z = stored``).
    ``W^T[k, n] = (u - z) * s`` becomes ``q = u - 2^(b-1)``, ``offset = 2^(b-1) - z``.

    Raises ValueError for bits other than 4 and 8 (GPTQ's 2- and 3-bit layouts are not
    supported), an unsupported group size or format, a ``g_idx`` other than ``k // G`` (act-order),
    and a tensor of the wrong dtype, rank or shape, naming it with the prefix ``name`` (TypeError
    for a part that is not a tensor).
    """
    if bits not in BITS:
        raise ValueError(
            f"bits: expected one of {BITS}, got {bits} (GPTQ 2- and 3-bit checkpoints are not "
            "supported)"
        )
    if checkpoint_format not in GPTQ_FORMATS:
        raise ValueError(
            f"checkpoint_format: expected one of {GPTQ_FORMATS}, got {checkpoint_format!r}"
        )
    library_group = _library_group_size(group_size)
    per_word = _WORD_BITS // bits
    tensors = {"qweight": qweight, "qzeros": qzeros, "scales": scales}
    for part, tensor in tensors.items():
        _check_tensor(name, part, tensor, rank=2, integer=part != "scales")
    _check_non_empty(name, qweight)
    in_features = qweight.shape[0] * per_word
    group = library_group or in_features
    groups_held = -(-in_features // group)

    def expected_shape(part: str, groups: int, out_features: int) -> tuple[int | str, int]:
        groups = groups if library_group else 1
        if part == "qweight":
            if groups == groups_held:
                return (qweight.shape[0], out_features)
            # Any K in ((groups - 1) * G, groups * G] fits: the last group may be partial.
            return (
                f"{(groups - 1) * group // per_word + 1}..{groups * group // per_word}",
                out_features,
            )
        return (
            (groups, -(-out_features // per_word))
            if part == "qzeros"
            else (
                groups,
                out_features,
            )
        )

    claims = {
        "qweight": (groups_held, qweight.shape[1]),
        "qzeros": (qzeros.shape[0], qzeros.shape[1] * per_word),
        "scales": (scales.shape[0], scales.shape[1]),
    }
    _, out_features = _check_shapes(name, tensors, claims, expected_shape)
    if g_idx is not None:
        _check_g_idx(name, g_idx, in_features, group, bits)

    unsigned = _unpack_last_dim(qweight.t(), bits)  # (N, K): row r's values are columns r*P + i
    zeros = _unpack_last_dim(qzeros, bits)[:, :out_features]
    if checkpoint_format == "gptq":
        zeros = zeros + 1
    return _quantized_weight(unsigned, zeros, scales, bits, library_group)


def _check_g_idx(name: str, g_idx: Any, in_features: int, group: int, bits: int) -> None:
    """``g_idx`` must be ``k // group`` for each of the ``in_features`` columns."""
    full = _tensor_name(name, "g_idx")
    if not isinstance(g_idx, torch.Tensor):
        raise TypeError(f"{full}: expected a torch.Tensor, got {type(g_idx).__name__}")
    if g_idx.dtype.is_floating_point or g_idx.dtype.is_complex or g_idx.dim() != 1:
        raise ValueError(
            f"{full}: expected a 1-D integer tensor, got {g_idx.dtype} of shape "
            f"{tuple(g_idx.shape)}"
        )
    if g_idx.shape[0] != in_features:
        raise ValueError(
            f"{full}: expected shape ({in_features},) for the {in_features} input features "
            f"{_tensor_name(name, 'qweight')} holds at {bits} bits, got {tuple(g_idx.shape)}"
        )
    trivial = torch.arange(in_features, device=g_idx.device) // group
    differs = (g_idx.to(torch.int64) != trivial).nonzero()
    if differs.numel():
        k = int(differs[0, 0])
        raise ValueError(
            f"{full}: expected g_idx[k] == k // {group} (no act-order), got g_idx[{k}] == "
            f"{int(g_idx[k])}: act-order (desc_act=True) checkpoints permute the input features "
            "and are not supported"
        )


def read_quantization_config(config: Mapping[str, Any]) -> ForeignQuantConfig:
    """The :class:`ForeignQuantConfig` of a config.json's ``quantization_config`` dict.

    AWQ: ``quant_method`` "awq", ``version`` (or transformers' newer ``format``; default "gemm")
    "gemm", ``bits`` 4 (default), ``group_size`` (default 128), ``zero_point`` True (default).
    GPTQ: ``quant_method`` "gptq", ``bits`` 4 or 8, ``group_size`` (default 128), ``desc_act``
    False (default), ``sym`` (default True), ``checkpoint_format`` (or ``format``; default "gptq")
    "gptq" or "gptq_v2", no per-module ``dynamic`` overrides, int32 ``pack_dtype``.

    Raises TypeError when ``config`` is not a mapping and ValueError naming the field for
    anything else: an unknown ``quant_method`` (listing the accepted ones), another AWQ layout
    (gemv, gemv_fast, marlin, exllama, llm-awq), act-order, unsupported bits or group size.
    """
    if not isinstance(config, Mapping):
        raise TypeError(f"config: expected a quantization_config dict, got {type(config).__name__}")
    method = config.get("quant_method")
    method = method.lower() if isinstance(method, str) else method
    if method == "awq":
        return _awq_config(config)
    if method == "gptq":
        return _gptq_config(config)
    raise ValueError(
        f"quantization_config.quant_method: expected one of {FOREIGN_METHODS} (or "
        f"{QUANT_METHOD!r}, this library's own), got {config.get('quant_method')!r}"
    )


def _group_size(config: Mapping[str, Any]) -> int:
    group_size = config.get("group_size", 128)
    try:
        _library_group_size(group_size)
    except ValueError as error:
        raise ValueError(f"quantization_config.{error}") from None
    return group_size


def _awq_config(config: Mapping[str, Any]) -> ForeignQuantConfig:
    # transformers writes the legacy ``version`` beside ``format`` and lets ``version`` win; its
    # ``backend`` "llm-awq" means the llm-awq layout.
    version = config.get("version") or config.get("format") or "gemm"
    if str(config.get("backend", "")).lower() == "llm-awq":
        version = "llm-awq"
    version = str(version).lower()
    if version not in AWQ_VERSIONS:
        raise ValueError(
            f"quantization_config.version: expected one of {AWQ_VERSIONS} (AutoAWQ GEMM), got "
            f"{version!r}: other AWQ layouts pack their words differently and are not supported"
        )
    bits = config.get("bits", 4)
    if bits != 4:
        raise ValueError(f"quantization_config.bits: expected 4 for AutoAWQ GEMM, got {bits}")
    if not config.get("zero_point", True):
        raise ValueError(
            "quantization_config.zero_point: expected True (AutoAWQ GEMM layers always store "
            "zero points), got False"
        )
    return ForeignQuantConfig(
        method="awq",
        bits=4,
        group_size=_group_size(config),
        checkpoint_format=version,
    )


def _gptq_config(config: Mapping[str, Any]) -> ForeignQuantConfig:
    if "bits" not in config:
        raise ValueError("quantization_config.bits: expected 4 or 8, got no bits field")
    bits = config["bits"]
    if bits not in BITS:
        raise ValueError(
            f"quantization_config.bits: expected one of {BITS}, got {bits} (GPTQ 2- and 3-bit "
            "checkpoints are not supported)"
        )
    if config.get("desc_act", False):
        raise ValueError(
            "quantization_config.desc_act: expected False, got True: act-order checkpoints "
            "permute the input features (g_idx) and are not supported"
        )
    # GPTQModel's per-module overrides can change bits or group size, or skip layers.
    if config.get("dynamic"):
        raise ValueError(
            "quantization_config.dynamic: expected no per-module overrides, got "
            f"{sorted(config['dynamic'])}"
        )
    pack_dtype = str(config.get("pack_dtype", "int32")).removeprefix("torch.")
    if pack_dtype != "int32":
        raise ValueError(f"quantization_config.pack_dtype: expected int32, got {pack_dtype}")
    # transformers' legacy ``checkpoint_format`` wins over ``format`` when both are set.
    checkpoint_format = str(
        config.get("checkpoint_format") or config.get("format") or "gptq"
    ).lower()
    if checkpoint_format not in GPTQ_FORMATS:
        raise ValueError(
            f"quantization_config.checkpoint_format: expected one of {GPTQ_FORMATS}, got "
            f"{checkpoint_format!r}"
        )
    return ForeignQuantConfig(
        method="gptq",
        bits=bits,
        group_size=_group_size(config),
        checkpoint_format=checkpoint_format,
    )
