"""AutoAWQ GEMM and GPTQ decoding against packers written here from the published formats and a
float64 dequantization computed straight from the unsigned integers, hand-built words with known
values, and the errors for what the decoders refuse."""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest
import torch
from _foreign_packers import (
    int32_word,
    pack_awq,
    pack_gptq_columns,
    pack_gptq_rows,
    reference_weight,
)

from ascend_vlm.quantization.foreign_formats import (
    ForeignQuantConfig,
    decode_awq_gemm,
    decode_gptq,
    read_quantization_config,
)

NAME = "model.layers.0.self_attn.q_proj"


# ---- samples ----


@dataclass(frozen=True)
class Sample:
    format: str  # "awq", "gptq" (v1) or "gptq_v2"
    bits: int
    in_features: int
    out_features: int
    group_size: int  # the checkpoint's: -1 per channel
    scale_dtype: torch.dtype = torch.float16

    @property
    def group(self) -> int:
        return self.in_features if self.group_size == -1 else self.group_size

    def __str__(self) -> str:
        dtype = str(self.scale_dtype).removeprefix("torch.")
        return (
            f"{self.format}-w{self.bits}-K{self.in_features}-N{self.out_features}-"
            f"g{self.group_size}-{dtype}"
        )


SAMPLES = [
    Sample("awq", 4, 256, 64, 128),
    Sample("awq", 4, 128, 32, 32, torch.bfloat16),
    Sample("awq", 4, 96, 16, -1),
    Sample("gptq", 4, 256, 64, 128),
    Sample("gptq_v2", 4, 256, 64, 128),
    Sample("gptq", 4, 200, 24, 64),  # K not a multiple of G: a partial last group
    Sample("gptq_v2", 4, 96, 40, -1, torch.bfloat16),
    Sample("gptq", 8, 256, 64, 128),
    Sample("gptq_v2", 8, 192, 12, 32),
    Sample("gptq", 8, 200, 8, 64, torch.float32),
    Sample("gptq", 8, 64, 20, -1),
]


@dataclass
class Checkpoint:
    unsigned: torch.Tensor  # (K, N)
    zeros: torch.Tensor  # (groups, N), the true zero points
    scales: torch.Tensor
    qweight: torch.Tensor
    qzeros: torch.Tensor
    g_idx: torch.Tensor | None


def make_checkpoint(sample: Sample, seed: int = 0) -> Checkpoint:
    generator = torch.Generator().manual_seed(seed)
    top = 2**sample.bits - 1
    groups = -(-sample.in_features // sample.group)
    shape = (sample.in_features, sample.out_features)
    unsigned = torch.randint(0, top + 1, shape, generator=generator)
    # v1 stores z - 1, so its zero points start at 1 (a stored -1 would not fit the field).
    low = 1 if sample.format == "gptq" else 0
    zeros = torch.randint(low, top + 1, (groups, sample.out_features), generator=generator)
    scales = (torch.rand(groups, sample.out_features, generator=generator) * 0.1 + 1e-3).to(
        sample.scale_dtype
    )
    if sample.format == "awq":
        return Checkpoint(unsigned, zeros, scales, pack_awq(unsigned), pack_awq(zeros), None)
    stored = zeros - 1 if sample.format == "gptq" else zeros
    g_idx = (torch.arange(sample.in_features) // sample.group).to(torch.int32)
    return Checkpoint(
        unsigned,
        zeros,
        scales,
        pack_gptq_rows(unsigned, sample.bits),
        pack_gptq_columns(stored, sample.bits),
        g_idx,
    )


def decode(sample: Sample, checkpoint: Checkpoint, **overrides):
    parts = {
        "qweight": checkpoint.qweight,
        "qzeros": checkpoint.qzeros,
        "scales": checkpoint.scales,
        "g_idx": checkpoint.g_idx,
    }
    parts.update(overrides)
    if sample.format == "awq":
        return decode_awq_gemm(
            parts["qweight"], parts["qzeros"], parts["scales"], sample.group_size, name=NAME
        )
    return decode_gptq(
        parts["qweight"],
        parts["qzeros"],
        parts["scales"],
        parts["g_idx"],
        sample.bits,
        sample.group_size,
        sample.format,
        name=NAME,
    )


@pytest.mark.parametrize("sample", SAMPLES, ids=str)
def test_decoded_weight_matches_reference_dequantization(sample):
    checkpoint = make_checkpoint(sample)
    weight = decode(sample, checkpoint)

    expected = reference_weight(
        checkpoint.unsigned, checkpoint.zeros, checkpoint.scales, sample.group
    )
    # Integers and the checkpoint's own scales: the float64 dequantization is exact.
    torch.testing.assert_close(weight.dequantize(torch.float64), expected, rtol=0, atol=0)
    assert weight.bits == sample.bits
    assert weight.group_size == (0 if sample.group_size == -1 else sample.group_size)
    assert weight.in_features == sample.in_features
    assert weight.out_features == sample.out_features
    assert weight.scale.dtype == sample.scale_dtype
    assert weight.offset is not None and weight.offset.dtype == sample.scale_dtype
    half = 2 ** (sample.bits - 1)
    assert torch.equal(weight.values().long(), checkpoint.unsigned.t() - half)
    assert torch.equal(weight.offset.long(), half - checkpoint.zeros)
    storage = torch.uint8 if sample.bits == 4 else torch.int8
    width = (sample.in_features + 1) // 2 if sample.bits == 4 else sample.in_features
    assert weight.qweight.dtype == storage
    assert tuple(weight.qweight.shape) == (sample.out_features, width)


@pytest.mark.parametrize("sample", [s for s in SAMPLES if s.format != "awq"][:3], ids=str)
def test_gptq_without_g_idx_decodes_the_same(sample):
    checkpoint = make_checkpoint(sample, seed=1)
    with_g_idx = decode(sample, checkpoint)
    without = decode(sample, checkpoint, g_idx=None)
    assert torch.equal(with_g_idx.dequantize(torch.float64), without.dequantize(torch.float64))


# ---- hand-built words ----


def test_awq_word_nibble_order():
    # Columns 0..7 hold 1..8; nibble i holds column [0, 2, 4, 6, 1, 3, 5, 7][i], so the
    # nibbles from the lowest are 1, 3, 5, 7, 2, 4, 6, 8.
    qweight = torch.zeros(32, 1, dtype=torch.int32)
    qweight[0, 0] = int32_word(0x86427531)
    qzeros = torch.tensor([[int32_word(0x76543210)]], dtype=torch.int32)
    scales = torch.ones(1, 8, dtype=torch.float16)

    weight = decode_awq_gemm(qweight, qzeros, scales, 32)

    # Nibble i of the zeros word is i, so column c's zero is the nibble that holds column c.
    zero_of_column = [0, 4, 1, 5, 2, 6, 3, 7]
    assert weight.offset.tolist() == [[8.0 - z for z in zero_of_column]]
    assert weight.values()[:, 0].tolist() == [1 - 8, 2 - 8, 3 - 8, 4 - 8, 5 - 8, 6 - 8, 7 - 8, 0]
    dequantized = weight.dequantize(torch.float64)
    for column in range(8):
        assert dequantized[column, 0] == column + 1 - zero_of_column[column]
        assert dequantized[column, 1:].eq(-zero_of_column[column]).all()


@pytest.mark.parametrize(("checkpoint_format", "zero_shift"), [("gptq", 1), ("gptq_v2", 0)])
def test_gptq_word_order_and_zero_convention(checkpoint_format, zero_shift):
    # Input columns 0..7 of output row 0 hold 8..15 (nibbles in order from the lowest).
    qweight = torch.zeros(4, 8, dtype=torch.int32)
    qweight[0, 0] = int32_word(0xFEDCBA98)
    qzeros = torch.tensor([[int32_word(0x76543210)]], dtype=torch.int32)  # stored n for column n
    scales = torch.full((1, 8), 0.5, dtype=torch.float16)

    weight = decode_gptq(qweight, qzeros, scales, None, 4, 32, checkpoint_format)

    zeros = [n + zero_shift for n in range(8)]  # v1 stores z - 1
    assert weight.offset.tolist() == [[8.0 - z for z in zeros]]
    assert weight.values()[0, :8].tolist() == list(range(8))
    dequantized = weight.dequantize(torch.float64)
    assert dequantized[0, :8].tolist() == [(u - zeros[0]) * 0.5 for u in range(8, 16)]
    for n in range(8):
        expected_rest = [(0 - zeros[n]) * 0.5] * (32 - (8 if n == 0 else 0))
        assert dequantized[n, 8 if n == 0 else 0 :].tolist() == expected_rest


def test_gptq_v1_and_v2_differ_by_one_zero_step():
    sample = Sample("gptq_v2", 4, 64, 16, 32)
    checkpoint = make_checkpoint(sample, seed=3)
    v2 = decode(sample, checkpoint)
    v1 = decode(Sample("gptq", 4, 64, 16, 32), checkpoint)
    scale = checkpoint.scales.double().repeat_interleave(32, dim=0).t()
    # The same stored zeros read as v1 are one larger: W drops by one scale step everywhere.
    torch.testing.assert_close(
        v2.dequantize(torch.float64) - v1.dequantize(torch.float64), scale, rtol=0, atol=0
    )


def test_gptq_8bit_word_and_symmetric_offset():
    # Bytes from the lowest: 0x7F, 0x01, 0xFF, 0x80 -> input columns 0..3 of output row 0.
    qweight = torch.zeros(8, 4, dtype=torch.int32)
    qweight[0, 0] = int32_word(0x80FF017F)
    qzeros = torch.tensor([[int32_word(0x80808080)]], dtype=torch.int32)  # v2: zero 128 everywhere
    scales = torch.full((1, 4), 0.25, dtype=torch.float16)

    weight = decode_gptq(qweight, qzeros, scales, None, 8, 32, "gptq_v2")

    assert weight.offset is None  # every zero point is 2^(b-1): symmetric
    assert weight.qweight.dtype == torch.int8
    assert weight.values()[0, :4].tolist() == [127 - 128, 1 - 128, 255 - 128, 0]
    assert weight.dequantize(torch.float64)[0, :4].tolist() == [-0.25, -31.75, 31.75, 0.0]


def test_gptq_v1_symmetric_zero_points_give_no_offset():
    # sym=True v1 checkpoints store 2^(b-1) - 1 = 7 in every nibble.
    qweight = pack_gptq_rows(torch.arange(32).remainder(16).repeat(8, 1).t(), 4)
    qzeros = torch.tensor([[int32_word(0x77777777)]], dtype=torch.int32)
    weight = decode_gptq(qweight, qzeros, torch.ones(1, 8), None, 4, 32, "gptq")
    assert weight.offset is None
    assert weight.dequantize(torch.float64)[0].tolist() == [k % 16 - 8 for k in range(32)]


def test_gptq_v1_all_ones_zero_field_reads_as_two_to_the_bits():
    # v1 readers add 1 to each masked field: a stored 15 is a zero point of 16.
    qweight = torch.zeros(4, 8, dtype=torch.int32)
    qzeros = torch.tensor([[-1]], dtype=torch.int32)  # 0xFFFFFFFF
    weight = decode_gptq(qweight, qzeros, torch.ones(1, 8), None, 4, 32, "gptq")
    assert weight.offset.tolist() == [[-8.0] * 8]
    assert weight.dequantize(torch.float64).eq(-16).all()


# ---- errors ----

AWQ = Sample("awq", 4, 256, 64, 128)
GPTQ = Sample("gptq", 4, 256, 64, 128)


@pytest.mark.parametrize(
    ("sample", "part", "cut", "message"),
    [
        (AWQ, "qweight", (slice(0, -1),), "qweight: expected int32 of shape (256, 8), got (255, 8)"),
        (AWQ, "qweight", (slice(None), slice(0, -1)), "qweight: expected int32 of shape (256, 8), got (256, 7)"),
        (AWQ, "qzeros", (slice(None), slice(0, -1)), "qzeros: expected int32 of shape (2, 8), got (2, 7)"),
        (AWQ, "scales", (slice(0, 1),), "scales: expected float16 of shape (2, 64), got (1, 64)"),
        (GPTQ, "qweight", (slice(None), slice(0, -1)), "qweight: expected int32 of shape (32, 64), got (32, 63)"),
        (GPTQ, "qweight", (slice(0, 16),), "qweight: expected int32 of shape (17..32, 64), got (16, 64)"),
        (GPTQ, "qzeros", (slice(None), slice(0, -1)), "qzeros: expected int32 of shape (2, 8), got (2, 7)"),
        (GPTQ, "qzeros", (slice(0, 1),), "qzeros: expected int32 of shape (2, 8), got (1, 8)"),
        (GPTQ, "scales", (slice(None), slice(0, -2)), "scales: expected float16 of shape (2, 64), got (2, 62)"),
    ],
)  # fmt: skip
def test_truncated_or_mismatched_tensor_is_named(sample, part, cut, message):
    checkpoint = make_checkpoint(sample)
    truncated = getattr(checkpoint, part)[cut]
    with pytest.raises(ValueError, match=re.escape(f"{NAME}.{message}")):
        decode(sample, checkpoint, **{part: truncated})


def test_g_idx_of_another_length_is_named():
    checkpoint = make_checkpoint(GPTQ)
    with pytest.raises(ValueError, match=re.escape(f"{NAME}.g_idx: expected shape (256,)")):
        decode(GPTQ, checkpoint, g_idx=checkpoint.g_idx[:-8])


@pytest.mark.parametrize(
    ("sample", "part", "dtype", "message"),
    [
        (AWQ, "qweight", torch.int64, "qweight: expected a 2-D int32 tensor, got torch.int64"),
        (AWQ, "qzeros", torch.float16, "qzeros: expected a 2-D int32 tensor, got torch.float16"),
        (GPTQ, "scales", torch.int32, "scales: expected a 2-D floating tensor, got torch.int32"),
        (GPTQ, "g_idx", torch.float32, "g_idx: expected a 1-D integer tensor, got torch.float32"),
    ],
)
def test_wrong_dtype_is_named(sample, part, dtype, message):
    checkpoint = make_checkpoint(sample)
    with pytest.raises(ValueError, match=re.escape(f"{NAME}.{message}")):
        decode(sample, checkpoint, **{part: getattr(checkpoint, part).to(dtype)})


def test_packed_qweight_of_wrong_rank_is_named():
    checkpoint = make_checkpoint(AWQ)
    with pytest.raises(ValueError, match=re.escape(f"{NAME}.qweight: expected a 2-D int32")):
        decode(AWQ, checkpoint, qweight=checkpoint.qweight.flatten())


def test_act_order_g_idx_is_refused_even_when_the_config_says_no_act_order():
    checkpoint = make_checkpoint(GPTQ)
    g_idx = checkpoint.g_idx.clone()
    g_idx[[3, 200]] = g_idx[[200, 3]]  # act-order permutes input features across groups
    with pytest.raises(ValueError, match=r"g_idx: expected g_idx\[k\] == k // 128.*act-order"):
        decode(GPTQ, checkpoint, g_idx=g_idx)


@pytest.mark.parametrize("bits", [2, 3])
def test_gptq_bits_other_than_4_and_8_are_refused(bits):
    qweight = torch.zeros(bits * 8, 32, dtype=torch.int32)
    with pytest.raises(ValueError, match=re.escape(f"bits: expected one of (4, 8), got {bits}")):
        decode_gptq(qweight, torch.zeros(2, bits), torch.ones(2, 32), None, bits, 128)


@pytest.mark.parametrize("group_size", [512, 16, 100, 0])
@pytest.mark.parametrize("sample", [AWQ, GPTQ], ids=str)
def test_unsupported_group_size_is_refused(sample, group_size):
    checkpoint = make_checkpoint(sample)
    bad = Sample(sample.format, sample.bits, sample.in_features, sample.out_features, group_size)
    accepted = "-1 (per channel) or one of 32, 64, 96, 128, 160, 192, 224, 256"
    with pytest.raises(ValueError, match=re.escape(f"group_size: expected {accepted}, got")):
        decode(bad, checkpoint)


def test_unknown_gptq_checkpoint_format_is_refused():
    checkpoint = make_checkpoint(GPTQ)
    with pytest.raises(
        ValueError, match=r"checkpoint_format: expected one of \('gptq', 'gptq_v2'\)"
    ):
        decode(Sample("marlin", 4, 256, 64, 128), checkpoint)


# ---- quantization_config ----


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (  # as AutoAWQ writes it into config.json
            {
                "quant_method": "awq",
                "bits": 4,
                "group_size": 128,
                "zero_point": True,
                "version": "gemm",
                "modules_to_not_convert": ["visual"],
            },
            ForeignQuantConfig("awq", 4, 128, "gemm"),
        ),
        (  # transformers 5 writes format beside the legacy version
            {"quant_method": "awq", "bits": 4, "group_size": 64, "format": "gemm", "version": "GEMM"},
            ForeignQuantConfig("awq", 4, 64, "gemm"),
        ),
        (
            {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True},
            ForeignQuantConfig("gptq", 4, 128, "gptq"),
        ),
        (
            {"quant_method": "gptq", "bits": 8, "group_size": -1, "sym": False, "format": "gptq_v2"},
            ForeignQuantConfig("gptq", 8, -1, "gptq_v2"),
        ),
        (  # the legacy checkpoint_format wins over format
            {"quant_method": "gptq", "bits": 4, "checkpoint_format": "gptq_v2", "format": "gptq", "pack_dtype": "int32"},
            ForeignQuantConfig("gptq", 4, 128, "gptq_v2"),
        ),
    ],
)  # fmt: skip
def test_read_quantization_config(config, expected):
    assert read_quantization_config(config) == expected


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"quant_method": "bitsandbytes"}, "quant_method: expected one of ('awq', 'gptq') (or 'ascend_vlm', this library's own), got 'bitsandbytes'"),
        ({"bits": 4}, "quant_method: expected one of ('awq', 'gptq') (or 'ascend_vlm', this library's own), got None"),
        ({"quant_method": "awq", "version": "gemv"}, "version: expected one of ('gemm',) (AutoAWQ GEMM), got 'gemv'"),
        ({"quant_method": "awq", "version": "marlin"}, "version: expected one of ('gemm',) (AutoAWQ GEMM), got 'marlin'"),
        ({"quant_method": "awq", "version": "exllama"}, "version: expected one of ('gemm',) (AutoAWQ GEMM), got 'exllama'"),
        ({"quant_method": "awq", "format": "gemv_fast"}, "version: expected one of ('gemm',) (AutoAWQ GEMM), got 'gemv_fast'"),
        ({"quant_method": "awq", "backend": "llm-awq"}, "version: expected one of ('gemm',) (AutoAWQ GEMM), got 'llm-awq'"),
        ({"quant_method": "awq", "bits": 8}, "bits: expected 4 for AutoAWQ GEMM, got 8"),
        ({"quant_method": "awq", "zero_point": False}, "zero_point: expected True"),
        ({"quant_method": "awq", "group_size": 512}, "group_size: expected -1 (per channel) or one of 32, 64"),
        ({"quant_method": "gptq", "bits": 3}, "bits: expected one of (4, 8), got 3"),
        ({"quant_method": "gptq"}, "bits: expected 4 or 8, got no bits field"),
        ({"quant_method": "gptq", "bits": 4, "desc_act": True}, "desc_act: expected False, got True: act-order"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 16}, "group_size: expected -1 (per channel) or one of 32"),
        ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "checkpoint_format: expected one of ('gptq', 'gptq_v2'), got 'marlin'"),
        ({"quant_method": "gptq", "bits": 4, "dynamic": {"-:.*lm_head": {}}}, "dynamic: expected no per-module overrides"),
        ({"quant_method": "gptq", "bits": 4, "pack_dtype": "int64"}, "pack_dtype: expected int32, got int64"),
    ],
)  # fmt: skip
def test_read_quantization_config_refusals(config, message):
    with pytest.raises(ValueError, match=re.escape(f"quantization_config.{message}")):
        read_quantization_config(config)


def test_read_quantization_config_needs_a_mapping():
    with pytest.raises(TypeError, match="config: expected a quantization_config dict, got list"):
        read_quantization_config([("quant_method", "awq")])


def test_config_fields_drive_the_decoder():
    """What a checkpoint loader does: read the config, then decode each layer with its fields."""
    sample = Sample("gptq_v2", 8, 128, 16, 32)
    checkpoint = make_checkpoint(sample, seed=5)
    config = read_quantization_config(
        {"quant_method": "gptq", "bits": 8, "group_size": 32, "checkpoint_format": "gptq_v2"}
    )
    weight = decode_gptq(
        checkpoint.qweight,
        checkpoint.qzeros,
        checkpoint.scales,
        checkpoint.g_idx,
        config.bits,
        config.group_size,
        config.checkpoint_format,
        name=NAME,
    )
    expected = reference_weight(checkpoint.unsigned, checkpoint.zeros, checkpoint.scales, 32)
    torch.testing.assert_close(weight.dequantize(torch.float64), expected, rtol=0, atol=0)
