"""What each torch_npu kernel ascend_vlm calls accepts: every documented limit declared once,
with its source, for both readers.

* The ops' NPU paths ask the ``*_refusal`` functions before a call: ``None`` means the kernel
  takes it; otherwise the op pads the call into the limits or runs its reference, as its
  docstring says (``ops.chunk_gated_delta_rule`` pads head dims below 128; the rest route).
* The mock torch_npu (:mod:`ascend_vlm.testing.mock_ops`) asks the same functions and raises
  the refusal as the real kernel fails (``testing._checks.refuse``), so a test on the mock
  catches a call the hardware would reject.

Sources. ``DOCS``: the ``torch_npu/_op_plugin_docs.py`` docstring of the kernel ("约束说明" and
"参数说明"); the wording changes across the torch-npu wheels 2.6.0.post5 to 2.14.0, the limits
quoted here do not, except npu_fused_causal_conv1d's (see its constants); the older wheels state
topK <= 512 on npu_moe_token_permute, 2.14.0 on npu_moe_token_unpermute too
(``shared/reference/npu_api.md`` §1 sums the docs up). ``FA_ACLNN``: hicann/ops-transformer
``attention/flash_attention_score/docs/aclnnFlashAttention{Score,VarLenScore}.md`` (the aclnn
APIs ``npu_fusion_attention`` calls), whose tiling
(``op_host/flash_attention_score_tiling_general.cpp``) checks ``0 < D <= 768`` and nothing
else about D (its error text still says "(0, 512]"): npu_fusion_attention takes every head dim
up to 768 without alignment, so the ViT head dims 72 and 80 and the tiny models' 8 reach it as
they are. The TND head dims 64/128/192 of vllm-ascend issue #8045 are
``npu_fused_infer_attention_score``'s (aclnnFusedInferAttentionScoreV3; the check is in
``attention/prompt_flash_attention/op_host/prompt_flash_attention_tiling.cpp``), a kernel
ascend_vlm does not call.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

DOCS = "torch_npu/_op_plugin_docs.py"
FA_ACLNN = "aclnnFlashAttentionScore/VarLenScore docs (hicann/ops-transformer)"

# --- every kernel -----------------------------------------------------------------------------
# The head dims the supported families use, which the limits below were read against: the
# tiny models' 8, the small ones' 64, SigLIP's and Qwen3-VL's ViT 72, Qwen2/2.5-VL's ViT 80, 96
# (a multiple of 16, not a power of two), decoders' 128 and 256 (Gemma 3), Gemma 4's global 512.
FAMILY_HEAD_DIMS = (8, 64, 72, 80, 96, 128, 256, 512)
NPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# The names torch_npu.npu.get_device_name() gives Atlas A2/A3 SoCs, the products the
# npu_weight_quant_batchmatmul per-group/int4 modes and the MoE kernels are documented for.
A2_A3_SOC_PREFIXES = ("Ascend910B", "Ascend910_93")

# --- npu_fusion_attention (BSH/SBH/BSND/BNSD and the varlen TND layout) -----------------------
FUSION_ATTENTION_LAYOUTS = ("BSH", "SBH", "BSND", "BNSD", "TND")
FUSION_ATTENTION_MAX_QUERY_HEADS = 256  # Nq in [1, 256], Nq / Nkv a non-zero integer
FUSION_ATTENTION_MAX_HEAD_DIM = 768  # D in [1, 768], Dq = Dk >= Dv
FUSION_ATTENTION_MAX_SEQUENCE = 1 << 20  # S in [1, 1M]
FUSION_ATTENTION_MAX_BATCH = 2 << 20  # B in [1, 2M] (not varlen)
FUSION_ATTENTION_MAX_TOKENS = 1 << 20  # TND: T in [1, 1M]
FUSION_ATTENTION_MAX_SEGMENTS = 1024  # TND: actual_seq_qlen has at most 1K entries
FUSION_ATTENTION_MASK_DTYPES = (torch.bool, torch.uint8)  # 1/True = not computed
FUSION_ATTENTION_MASK_SHAPES = ("BNSS", "B1SS", "11SS", "SS")  # TND: SS (maxSq, maxSkv) only
FUSION_ATTENTION_COMPRESSED_MASK = 2048  # sparse_mode 2/3/4: triu(ones(2048, 2048), 1)

# --- npu_rotary_mul ---------------------------------------------------------------------------
ROTARY_MUL_MAX_HEAD_DIM = 896  # D < 896 and even
ROTARY_MUL_MAX_BN = 1000  # "half": B, N < 1000; "interleave": B * N < 1000

# --- npu_rms_norm and npu_swiglu --------------------------------------------------------------
RMS_NORM_RANKS = (2, 8)  # self has 2-8 dims
RMS_NORM_DTYPE_PAIRS = frozenset(  # (x, gamma): gamma like x, or fp32 for fp16/bf16 x (A2/A3)
    {
        (torch.float16, torch.float32),
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.float16),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.float32),
    }
)
SWIGLU_RANKS = (1, 8)  # x has 1-8 dims, split in two halves along dim

# --- npu_chunk_gated_delta_rule / npu_recurrent_gated_delta_rule ------------------------------
GATED_DELTA_DTYPE = torch.bfloat16  # q/k/v/beta/state; g is float32
CHUNK_GATED_DELTA_HEAD_DIM = 128  # Dk = Dv = 128
CHUNK_GATED_DELTA_MAX_HEADS = 64  # Nk, Nv <= 64, Nv a multiple of Nk
RECURRENT_GATED_DELTA_MAX_SIZE = 256  # Nk, Nv, Dk, Dv <= 256
RECURRENT_GATED_DELTA_MAX_TOKENS = 8  # L_i <= 8 per sequence
# The chunk kernel's doc also says L_i <= 8, which its own example (100 tokens) contradicts:
# that limit is recorded here and not applied to the chunk kernel.

# --- npu_fused_causal_conv1d ------------------------------------------------------------------
CAUSAL_CONV1D_DTYPES = (torch.float16, torch.bfloat16)
CAUSAL_CONV1D_WIDTH = 3  # K is fixed at 3
CAUSAL_CONV1D_CHANNEL_MULTIPLE = 128  # dim % 128 == 0 (2.7.1.post11, 2.9.0.post9, 2.10+ docs)
CAUSAL_CONV1D_MAX_CHANNELS = 16384  # 2.8.0.post5 / 2.9.1 docs: 64 <= dim <= 16384
CAUSAL_CONV1D_MAX_TOKENS = 65536  # 2.8.0.post5 / 2.9.1 docs: cu_seq_len <= 65536
CAUSAL_CONV1D_MAX_BATCH = 256  # 2.8.0.post5 / 2.9.1 docs: batch <= 256
CAUSAL_CONV1D_SOCS = ("Ascend950", "Ascend910_95")  # name prefixes of the SoC the docs list

# --- npu_grouped_matmul, npu_moe_token_permute / unpermute ------------------------------------
GROUPED_MATMUL_MAX_GROUPS = 1024  # group_list length with a 3-D weight
GROUPED_MATMUL_INNER_LIMIT = 65536  # A2: the last dim of each x and weight stays below it
MOE_PERMUTE_MAX_TOP_K = 512  # A2/A3: topK <= 512
MOE_PERMUTE_MAX_INDEX = 16777215  # indices' element count and values stay below it

# --- npu_weight_quant_batchmatmul -------------------------------------------------------------
# --- npu_fused_infer_attention_score, paged decode (Q_S = 1, block_table given, DOCS) ---------
PAGED_ATTENTION_DTYPES = (torch.float16, torch.bfloat16)  # query, key, value (int8 unused here)
PAGED_ATTENTION_MAX_BLOCK_SIZE = 512  # block_size non-zero, <= 512
PAGED_ATTENTION_BLOCK_ALIGN = 16  # block_size a multiple of 16 for float16/bfloat16 KV
PAGED_ATTENTION_MAX_HEADS = 256  # Q_S = 1: N <= 256, D <= 512, B <= 65536
PAGED_ATTENTION_MAX_HEAD_DIM = 512
PAGED_ATTENTION_MAX_BATCH = 65536
PAGED_ATTENTION_MAX_GROUP = 64  # num_heads / num_key_value_heads <= 64

WEIGHT_QUANT_X_DTYPES = (torch.float16, torch.bfloat16)
WEIGHT_QUANT_MAX_DIM = 65535  # K and N
WEIGHT_QUANT_GROUP_STEP = 32  # per-group: a multiple of 32 in [32, K - 1]
INT4_PER_INT32 = 8  # npu_convert_weight_to_int4pack: 8 int4 values per int32, last dim % 8 == 0


class KernelRefusal(NamedTuple):
    """Why a kernel refuses a call: the argument, what its docs allow, what came, and where
    the limit is documented."""

    argument: str
    expected: str
    got: object
    source: str


def _dtype_refusal(
    argument: str, dtype: torch.dtype, allowed: tuple[torch.dtype, ...], source: str
) -> KernelRefusal | None:
    if dtype in allowed:
        return None
    names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
    return KernelRefusal(argument, f"dtype in ({names})", dtype, source)


def _attention_heads_refusal(
    dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, source: str
) -> KernelRefusal | None:
    """The dtype, head and head-dim limits every npu_fusion_attention layout shares."""
    refusal = _dtype_refusal("query", dtype, NPU_DTYPES, source)
    if refusal is not None:
        return refusal
    if not 1 <= heads <= FUSION_ATTENTION_MAX_QUERY_HEADS:
        expected = f"an int in [1, {FUSION_ATTENTION_MAX_QUERY_HEADS}] (query heads)"
        return KernelRefusal("head_num", expected, heads, source)
    if kv_heads < 1 or heads % kv_heads:
        expected = f"a head count dividing Nq={heads} (Nq/Nkv integer)"
        return KernelRefusal("key", expected, kv_heads, source)
    if not 1 <= head_dim <= FUSION_ATTENTION_MAX_HEAD_DIM:
        expected = f"head dim D in [1, {FUSION_ATTENTION_MAX_HEAD_DIM}]"
        return KernelRefusal("query", expected, head_dim, source)
    return None


def fusion_attention_refusal(
    dtype: torch.dtype,
    batch: int,
    heads: int,
    kv_heads: int,
    q_len: int,
    kv_len: int,
    head_dim: int,
) -> KernelRefusal | None:
    """npu_fusion_attention in a batched layout (BSH/SBH/BSND/BNSD), or None when it takes it
    (DOCS "约束说明", FA_ACLNN)."""
    source = f"{DOCS} npu_fusion_attention; {FA_ACLNN}"
    refusal = _attention_heads_refusal(dtype, heads, kv_heads, head_dim, source)
    if refusal is not None:
        return refusal
    if not 1 <= batch <= FUSION_ATTENTION_MAX_BATCH:
        return KernelRefusal(
            "query", f"batch B in [1, {FUSION_ATTENTION_MAX_BATCH}]", batch, source
        )
    if not (
        1 <= q_len <= FUSION_ATTENTION_MAX_SEQUENCE and 1 <= kv_len <= FUSION_ATTENTION_MAX_SEQUENCE
    ):
        expected = f"sequence lengths S in [1, {FUSION_ATTENTION_MAX_SEQUENCE}]"
        return KernelRefusal("query/key", expected, (q_len, kv_len), source)
    return None


def fusion_attention_varlen_refusal(
    dtype: torch.dtype,
    heads: int,
    kv_heads: int,
    head_dim: int,
    tokens: tuple[int, int],
    segments: int,
) -> KernelRefusal | None:
    """npu_fusion_attention in the TND layout with ``tokens`` = (T query rows, T key rows) in
    ``segments`` sequences, or None when it takes it (DOCS "约束说明", FA_ACLNN)."""
    source = f"{DOCS} npu_fusion_attention (varlen); {FA_ACLNN}"
    refusal = _attention_heads_refusal(dtype, heads, kv_heads, head_dim, source)
    if refusal is not None:
        return refusal
    if not all(1 <= t <= FUSION_ATTENTION_MAX_TOKENS for t in tokens):
        expected = f"T in [1, {FUSION_ATTENTION_MAX_TOKENS}] for input_layout 'TND'"
        return KernelRefusal("query/key", expected, tokens, source)
    if not 1 <= segments <= FUSION_ATTENTION_MAX_SEGMENTS:
        expected = f"1 to {FUSION_ATTENTION_MAX_SEGMENTS} sequences in varlen"
        return KernelRefusal("actual_seq_qlen", expected, f"{segments} entries", source)
    return None


def fusion_attention_varlen_rows_refusal(
    q_len: int, kv_len: int, masked_rows: bool
) -> KernelRefusal | None:
    """npu_fusion_attention in TND on one segment of ``q_len`` queries and ``kv_len`` keys whose
    mask leaves ``masked_rows`` (a query row with no key to attend), or None when it takes it:
    varlen's atten_mask may not mask a whole row (DOCS "约束说明", FA_ACLNN; with sparse_mode 3
    that means Sq <= Skv per segment)."""
    if not masked_rows:
        return None
    source = f"{DOCS} npu_fusion_attention (varlen); {FA_ACLNN}"
    got = f"a segment of {q_len} queries x {kv_len} keys with such rows"
    return KernelRefusal("atten_mask", "no fully masked row in varlen (TND) mode", got, source)


def rotary_mul_refusal(
    dtype: torch.dtype, head_dim: int, batch: int, heads: int, rotary_mode: str, layout: str
) -> KernelRefusal | None:
    """npu_rotary_mul on a 4-D ``layout`` input of this B, N and D, or None when it takes it
    (DOCS npu_rotary_mul, jit_compile=False)."""
    source = f"{DOCS} npu_rotary_mul"
    refusal = _dtype_refusal("input", dtype, NPU_DTYPES, source)
    if refusal is not None:
        return refusal
    if head_dim % 2 or head_dim >= ROTARY_MUL_MAX_HEAD_DIM:
        return KernelRefusal(
            "input", f"an even last dim D < {ROTARY_MUL_MAX_HEAD_DIM}", f"D={head_dim}", source
        )
    interleave = rotary_mode == "interleave"
    if (batch * heads if interleave else max(batch, heads)) >= ROTARY_MUL_MAX_BN:
        limit = "B * N" if interleave else "B and N"
        expected = f"{limit} < {ROTARY_MUL_MAX_BN} in {rotary_mode!r} mode"
        return KernelRefusal("input", expected, f"({layout}: B={batch}, N={heads})", source)
    return None


def rms_norm_refusal(
    x_dtype: torch.dtype, gamma_dtype: torch.dtype, rank: int
) -> KernelRefusal | None:
    """npu_rms_norm on an x of this rank, or None when it takes it (DOCS npu_rms_norm)."""
    source = f"{DOCS} npu_rms_norm"
    if (x_dtype, gamma_dtype) not in RMS_NORM_DTYPE_PAIRS:
        pairs = sorted(map(str, RMS_NORM_DTYPE_PAIRS))
        return KernelRefusal(
            "input/gamma", f"a dtype pair in {pairs}", (x_dtype, gamma_dtype), source
        )
    low, high = RMS_NORM_RANKS
    if not low <= rank <= high:
        return KernelRefusal("input", f"{low} to {high} dims", f"{rank} dims", source)
    return None


def swiglu_refusal(dtype: torch.dtype, rank: int) -> KernelRefusal | None:
    """npu_swiglu on an x of this rank, or None when it takes it (DOCS npu_swiglu)."""
    source = f"{DOCS} npu_swiglu"
    refusal = _dtype_refusal("input", dtype, NPU_DTYPES, source)
    if refusal is not None:
        return refusal
    low, high = SWIGLU_RANKS
    if not low <= rank <= high:
        return KernelRefusal("input", f"{low} to {high} dims", f"{rank} dims", source)
    return None


def chunk_gated_delta_rule_refusal(
    dtype: torch.dtype, key_heads: int, value_heads: int, key_dim: int, value_dim: int
) -> KernelRefusal | None:
    """npu_chunk_gated_delta_rule on this geometry, or None when it takes it (DOCS
    npu_chunk_gated_delta_rule "约束说明")."""
    source = f"{DOCS} npu_chunk_gated_delta_rule"
    refusal = _dtype_refusal("query", dtype, (GATED_DELTA_DTYPE,), source)
    if refusal is not None:
        return refusal
    if key_dim != CHUNK_GATED_DELTA_HEAD_DIM or value_dim != CHUNK_GATED_DELTA_HEAD_DIM:
        expected = f"head dims Dk = Dv = {CHUNK_GATED_DELTA_HEAD_DIM}"
        return KernelRefusal("query/value", expected, (key_dim, value_dim), source)
    if max(key_heads, value_heads) > CHUNK_GATED_DELTA_MAX_HEADS:
        expected = f"Nk, Nv <= {CHUNK_GATED_DELTA_MAX_HEADS}"
        return KernelRefusal("value", expected, (key_heads, value_heads), source)
    return None


def recurrent_gated_delta_rule_refusal(
    dtype: torch.dtype, sizes: tuple[int, int, int, int], lengths: list[int]
) -> KernelRefusal | None:
    """npu_recurrent_gated_delta_rule on ``sizes`` = (Nk, Nv, Dk, Dv) over sequences of these
    lengths, or None when it takes it (DOCS npu_recurrent_gated_delta_rule "约束说明")."""
    source = f"{DOCS} npu_recurrent_gated_delta_rule"
    refusal = _dtype_refusal("query", dtype, (GATED_DELTA_DTYPE,), source)
    if refusal is not None:
        return refusal
    if max(sizes) > RECURRENT_GATED_DELTA_MAX_SIZE:
        expected = f"Nk, Nv, Dk, Dv <= {RECURRENT_GATED_DELTA_MAX_SIZE}"
        return KernelRefusal("query/value", expected, sizes, source)
    if max(lengths, default=0) > RECURRENT_GATED_DELTA_MAX_TOKENS:
        expected = f"L_i <= {RECURRENT_GATED_DELTA_MAX_TOKENS}"
        return KernelRefusal("actual_seq_lengths", expected, lengths, source)
    return None


def fused_causal_conv1d_refusal(
    dtype: torch.dtype, width: int, channels: int
) -> KernelRefusal | None:
    """npu_fused_causal_conv1d on this dtype, kernel width and channel count, or None when the
    newest docs take it (DOCS npu_fused_causal_conv1d; the 2.8/2.9.1 limits on channels, tokens
    and batch are the op's extra care, ``ops.causal_conv1d``)."""
    source = f"{DOCS} npu_fused_causal_conv1d"
    refusal = _dtype_refusal("x", dtype, CAUSAL_CONV1D_DTYPES, source)
    if refusal is not None:
        return refusal
    if width != CAUSAL_CONV1D_WIDTH:
        return KernelRefusal("weight", f"K={CAUSAL_CONV1D_WIDTH} taps", width, source)
    if channels % CAUSAL_CONV1D_CHANNEL_MULTIPLE:
        expected = f"dim % {CAUSAL_CONV1D_CHANNEL_MULTIPLE} == 0"
        return KernelRefusal("x", expected, f"dim={channels}", source)
    return None


def grouped_matmul_refusal(groups: int, inner: int, outer: int) -> KernelRefusal | None:
    """npu_grouped_matmul with a 3-D weight of ``groups`` (G, K=inner, N=outer), or None when
    it takes it (DOCS npu_grouped_matmul "约束说明", Atlas A2)."""
    source = f"{DOCS} npu_grouped_matmul"
    if max(inner, outer) >= GROUPED_MATMUL_INNER_LIMIT:
        expected = f"K and N below {GROUPED_MATMUL_INNER_LIMIT}"
        return KernelRefusal("x/weight", expected, (inner, outer), source)
    if groups > GROUPED_MATMUL_MAX_GROUPS:
        expected = f"at most {GROUPED_MATMUL_MAX_GROUPS} groups"
        return KernelRefusal("group_list", expected, groups, source)
    return None


def moe_token_permute_refusal(top_k: int, index_count: int) -> KernelRefusal | None:
    """npu_moe_token_permute with ``index_count`` expert indices, ``top_k`` per token, or None
    when it takes them (DOCS npu_moe_token_permute)."""
    if top_k > MOE_PERMUTE_MAX_TOP_K or index_count >= MOE_PERMUTE_MAX_INDEX:
        source = f"{DOCS} npu_moe_token_permute"
        expected = f"topK <= {MOE_PERMUTE_MAX_TOP_K} and < {MOE_PERMUTE_MAX_INDEX} elements"
        return KernelRefusal("indices", expected, (top_k, index_count), source)
    return None


def moe_token_unpermute_refusal(top_k: int) -> KernelRefusal | None:
    """npu_moe_token_unpermute with this topK, or None when it takes it (DOCS
    npu_moe_token_unpermute "约束说明", A2/A3)."""
    if top_k > MOE_PERMUTE_MAX_TOP_K:
        source = f"{DOCS} npu_moe_token_unpermute"
        return KernelRefusal("probs", f"topK <= {MOE_PERMUTE_MAX_TOP_K}", top_k, source)
    return None


def convert_weight_to_int4pack_refusal(last_dim: int) -> KernelRefusal | None:
    """npu_convert_weight_to_int4pack on a 2-D int32 weight with this last dim, or None when it
    takes it (DOCS npu_convert_weight_to_int4pack)."""
    if last_dim % INT4_PER_INT32:
        source = f"{DOCS} npu_convert_weight_to_int4pack"
        expected = f"a last dim that is a multiple of {INT4_PER_INT32}"
        return KernelRefusal("weight", expected, last_dim, source)
    return None


def weight_quant_batchmatmul_refusal(
    x_dtype: torch.dtype, in_features: int, out_features: int
) -> KernelRefusal | None:
    """npu_weight_quant_batchmatmul on an (M, K) x and a (K, N) weight, or None when it takes
    them (DOCS npu_weight_quant_batchmatmul)."""
    source = f"{DOCS} npu_weight_quant_batchmatmul"
    refusal = _dtype_refusal("x", x_dtype, WEIGHT_QUANT_X_DTYPES, source)
    if refusal is not None:
        return refusal
    if not (1 <= in_features <= WEIGHT_QUANT_MAX_DIM and 1 <= out_features <= WEIGHT_QUANT_MAX_DIM):
        expected = f"K, N in [1, {WEIGHT_QUANT_MAX_DIM}]"
        return KernelRefusal("x/weight", expected, (in_features, out_features), source)
    return None


class KernelLimits(NamedTuple):
    """One row of the README's kernel-limits table: a kernel, its limits as prose built from
    the constants above, what the ops do with a call outside them, and the source."""

    kernel: str
    limits: str
    outside: str
    source: str


def _dims(low_high: tuple[int, int]) -> str:
    return f"{low_high[0]}-{low_high[1]} dims"


def paged_attention_refusal(
    dtype: torch.dtype, batch: int, heads: int, kv_heads: int, head_dim: int, block_size: int
) -> KernelRefusal | None:
    """npu_fused_infer_attention_score on a paged decode call (one query token per row, KV in
    blocks of ``block_size`` read through ``block_table``), or None when it takes it (DOCS
    npu_fused_infer_attention_score, "当Q_S等于1时" and "page attention场景")."""
    source = f"{DOCS} npu_fused_infer_attention_score"
    refusal = _dtype_refusal("query", dtype, PAGED_ATTENTION_DTYPES, source)
    if refusal is not None:
        return refusal
    if not 1 <= batch <= PAGED_ATTENTION_MAX_BATCH:
        return KernelRefusal("query", f"B in [1, {PAGED_ATTENTION_MAX_BATCH}]", batch, source)
    if not 1 <= heads <= PAGED_ATTENTION_MAX_HEADS:
        expected = f"an int in [1, {PAGED_ATTENTION_MAX_HEADS}] (query heads)"
        return KernelRefusal("num_heads", expected, heads, source)
    if kv_heads < 1 or heads % kv_heads or heads // kv_heads > PAGED_ATTENTION_MAX_GROUP:
        expected = f"a head count dividing num_heads={heads}, ratio <= {PAGED_ATTENTION_MAX_GROUP}"
        return KernelRefusal("num_key_value_heads", expected, kv_heads, source)
    if not 1 <= head_dim <= PAGED_ATTENTION_MAX_HEAD_DIM:
        expected = f"head dim D in [1, {PAGED_ATTENTION_MAX_HEAD_DIM}]"
        return KernelRefusal("query", expected, head_dim, source)
    if (
        not 0 < block_size <= PAGED_ATTENTION_MAX_BLOCK_SIZE
        or block_size % PAGED_ATTENTION_BLOCK_ALIGN
    ):
        expected = (
            f"a multiple of {PAGED_ATTENTION_BLOCK_ALIGN} in "
            f"[{PAGED_ATTENTION_BLOCK_ALIGN}, {PAGED_ATTENTION_MAX_BLOCK_SIZE}]"
        )
        return KernelRefusal("block_size", expected, block_size, source)
    return None


KERNEL_LIMITS = (
    KernelLimits(
        "npu_fusion_attention (BSH/SBH/BSND/BNSD)",
        f"fp16/bf16/fp32; Nq 1-{FUSION_ATTENTION_MAX_QUERY_HEADS}, Nq/Nkv integer; head dim "
        f"1-{FUSION_ATTENTION_MAX_HEAD_DIM}, Dq = Dk >= Dv, no alignment; S 1-1M; B 1-2M; mask "
        f"bool/uint8 {'/'.join(FUSION_ATTENTION_MASK_SHAPES)}, sparse modes 2/3/4 take the "
        f"{FUSION_ATTENTION_COMPRESSED_MASK}x{FUSION_ATTENTION_COMPRESSED_MASK} triu mask",
        f"family head dims {'/'.join(map(str, FAMILY_HEAD_DIMS))} unpadded; the rest: reference",
        f"{DOCS} npu_fusion_attention; {FA_ACLNN}",
    ),
    KernelLimits(
        "npu_fusion_attention (TND varlen)",
        f"as above, plus T 1-1M, at most {FUSION_ATTENTION_MAX_SEGMENTS} segments, SS mask "
        "(maxSq, maxSkv) only, no fully masked row (sparse_mode 3: Sq <= Skv per segment)",
        "unpadded; segments with rows that see no key, and the rest: reference",
        f"{DOCS} npu_fusion_attention; {FA_ACLNN}",
    ),
    KernelLimits(
        "npu_fused_infer_attention_score (page-attention decode)",
        f"fp16/bf16; one query token per row, BNSD; KV blocks (blocknum, KV_N, blocksize, D); "
        f"block_size a multiple of {PAGED_ATTENTION_BLOCK_ALIGN} up to "
        f"{PAGED_ATTENTION_MAX_BLOCK_SIZE}; N <= {PAGED_ATTENTION_MAX_HEADS}, N/KV_N <= "
        f"{PAGED_ATTENTION_MAX_GROUP}; D <= {PAGED_ATTENTION_MAX_HEAD_DIM}; B <= "
        f"{PAGED_ATTENTION_MAX_BATCH}; int32 block_table and actual_seq_lengths_kv required",
        "reference (gather the blocks, then fused attention)",
        f"{DOCS} npu_fused_infer_attention_score",
    ),
    KernelLimits(
        "npu_rotary_mul",
        f"4-D fp16/bf16/fp32 BNSD/BSND/SBND; even D < {ROTARY_MUL_MAX_HEAD_DIM}; half: B, N < "
        f"{ROTARY_MUL_MAX_BN}, 11SD/B1SD/BNSD tables; interleave: B * N < {ROTARY_MUL_MAX_BN}, "
        "11SD tables; tables in [-1, 1]",
        "unpadded; the rest: reference",
        f"{DOCS} npu_rotary_mul",
    ),
    KernelLimits(
        "npu_rms_norm",
        f"x fp16/bf16/fp32 with gamma alike (fp32 gamma for fp16/bf16 x); {_dims(RMS_NORM_RANKS)}",
        "other ranks as [rows, H]; float64: reference",
        f"{DOCS} npu_rms_norm",
    ),
    KernelLimits(
        "npu_swiglu",
        f"fp16/bf16/fp32; {_dims(SWIGLU_RANKS)}; contiguous; even size along dim",
        "reference",
        f"{DOCS} npu_swiglu",
    ),
    KernelLimits(
        "npu_chunk_gated_delta_rule",
        f"bf16 (g fp32); Dk = Dv = {CHUNK_GATED_DELTA_HEAD_DIM}; Nk, Nv <= "
        f"{CHUNK_GATED_DELTA_MAX_HEADS}, Nv a multiple of Nk (its L_i <= 8 contradicts its "
        "own example: not applied)",
        f"head dims below {CHUNK_GATED_DELTA_HEAD_DIM} zero-padded; the rest: reference",
        f"{DOCS} npu_chunk_gated_delta_rule",
    ),
    KernelLimits(
        "npu_recurrent_gated_delta_rule",
        f"bf16 (g fp32); Nk, Nv, Dk, Dv <= {RECURRENT_GATED_DELTA_MAX_SIZE}; L_i <= "
        f"{RECURRENT_GATED_DELTA_MAX_TOKENS}",
        "one step per call (L_i = 1); the rest: reference",
        f"{DOCS} npu_recurrent_gated_delta_rule",
    ),
    KernelLimits(
        "npu_fused_causal_conv1d",
        f"fp16/bf16; K = {CAUSAL_CONV1D_WIDTH}; dim % {CAUSAL_CONV1D_CHANNEL_MULTIPLE} == 0, dim "
        f"<= {CAUSAL_CONV1D_MAX_CHANNELS}; cu_seq_len <= {CAUSAL_CONV1D_MAX_TOKENS}; batch <= "
        f"{CAUSAL_CONV1D_MAX_BATCH}; Ascend 950 only",
        "reference (every Atlas A2/A3, Qwen3.5's K = 4)",
        f"{DOCS} npu_fused_causal_conv1d (2.8.0.post5 to 2.14.0)",
    ),
    KernelLimits(
        "npu_grouped_matmul",
        f"fp16/bf16/fp32; K, N < {GROUPED_MATMUL_INNER_LIMIT} (A2); at most "
        f"{GROUPED_MATMUL_MAX_GROUPS} groups",
        "reference",
        f"{DOCS} npu_grouped_matmul",
    ),
    KernelLimits(
        "npu_moe_token_permute / npu_moe_token_unpermute",
        f"tokens 2-D; topK <= {MOE_PERMUTE_MAX_TOP_K} (A2/A3); fewer than "
        f"{MOE_PERMUTE_MAX_INDEX} indices; padded_mode False",
        "reference",
        f"{DOCS} npu_moe_token_permute, npu_moe_token_unpermute",
    ),
    KernelLimits(
        "npu_convert_weight_to_int4pack",
        f"2-D int32 of int4 values in [-8, 7]; last dim a multiple of {INT4_PER_INT32}",
        "the op packs only what the matmul kernel then takes",
        f"{DOCS} npu_convert_weight_to_int4pack",
    ),
    KernelLimits(
        "npu_weight_quant_batchmatmul",
        f"x fp16/bf16 (M, K); K, N <= {WEIGHT_QUANT_MAX_DIM}; per-group size a multiple of "
        f"{WEIGHT_QUANT_GROUP_STEP} in [{WEIGHT_QUANT_GROUP_STEP}, K - 1]; per-group and int4 on "
        "Atlas A2/A3 only",
        "reference",
        f"{DOCS} npu_weight_quant_batchmatmul",
    ),
)


def kernel_limits_markdown() -> str:
    """:data:`KERNEL_LIMITS` as the README's markdown table."""
    lines = [
        "| Kernel | Documented limits | Outside them, ascend_vlm | Source |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| `{row.kernel}` | {row.limits} | {row.outside} | {row.source} |" for row in KERNEL_LIMITS
    ]
    return "\n".join(lines)
