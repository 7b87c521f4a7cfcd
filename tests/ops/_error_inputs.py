"""Error inputs per op (OpInfo's ``error_inputs``): calls that must raise ``ValueError``.

Each table maps a case name to ``(call, message)``; ``message`` names the argument, what was
expected and what came. ``tests/ops/test_error_inputs.py`` runs them all.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ascend_vlm import ops

ErrorTable = dict[str, tuple[Callable[[], object], str]]


def _fused_attention_errors() -> ErrorTable:
    Q = torch.randn(2, 4, 5, 8)
    KV = torch.randn(2, 2, 6, 8)
    return {
        "layout": (
            lambda: ops.fused_attention(Q, KV, KV, layout="BSND"),
            "layout: expected one of",
        ),
        "rank": (lambda: ops.fused_attention(Q[0], KV, KV), "query: expected 4-D [B, Nq, Sq, D]"),
        "query_none": (
            lambda: ops.fused_attention(None, KV, KV),
            "query: expected a Tensor, got NoneType",
        ),
        "bsh_heads": (
            lambda: ops.fused_attention(Q[:, 0], KV[:, 0], KV[:, 0], layout="BSH"),
            "num_heads: expected a positive int for layout 'BSH'",
        ),
        "gqa": (lambda: ops.fused_attention(Q[:, :3], KV, KV), "num_kv_heads: expected a divisor"),
        "no_kv_heads": (
            lambda: ops.fused_attention(Q, KV[:, :0], KV[:, :0]),
            "num_kv_heads: expected a divisor of the 4 query heads (GQA/MQA), got 0",
        ),
        "batch": (
            lambda: ops.fused_attention(Q, KV[:1], KV[:1]),
            "key: expected shape (2, 2, 6, 8)",
        ),
        "scale": (
            lambda: ops.fused_attention(Q, KV, KV, scale=float("inf")),
            "scale: expected a finite float",
        ),
        "heads_arg": (
            lambda: ops.fused_attention(Q, KV, KV, num_heads=3),
            "num_heads: expected 4 (from the BNSD shapes) or None, got 3",
        ),
        "head_dim": (
            lambda: ops.fused_attention(Q, KV[..., :4], KV[..., :4]),
            "key: expected shape",
        ),
        "value": (lambda: ops.fused_attention(Q, KV, KV[:, :, :5]), "value: expected shape"),
        "dtype": (
            lambda: ops.fused_attention(Q.int(), KV.int(), KV.int()),
            "query: expected dtype",
        ),
        "mixed_dtype": (lambda: ops.fused_attention(Q, KV.double(), KV), "key: expected dtype"),
        "mask_shape": (
            lambda: ops.fused_attention(Q, KV, KV, attention_mask=torch.ones(2, 5).bool()),
            "attention_mask: expected 2-D [B, Skv]",
        ),
        "mask_4d": (
            lambda: ops.fused_attention(Q, KV, KV, attention_mask=torch.ones(2, 3, 5, 6).bool()),
            "attention_mask: expected 2-D [B, Skv] or 4-D broadcastable",
        ),
        "mask_dtype": (
            lambda: ops.fused_attention(Q, KV, KV, attention_mask=torch.ones(2, 6).int()),
            "attention_mask: expected dtype",
        ),
        "float_2d": (
            lambda: ops.fused_attention(Q, KV, KV, attention_mask=torch.zeros(2, 6)),
            "attention_mask: expected dtype bool for a 2-D",
        ),
        "dropout": (
            lambda: ops.fused_attention(Q, KV, KV, dropout_p=1.0),
            "dropout_p: expected a float in [0, 1)",
        ),
    }


def _rms_norm_errors() -> ErrorTable:
    X = torch.randn(2, 3, 8)
    return {
        "weight_shape": (
            lambda: ops.rms_norm(X, torch.ones(7)),
            "weight: expected shape (8,) matching x's last dim, got (7,)",
        ),
        "weight_rank": (lambda: ops.rms_norm(X, torch.ones(1, 8)), "weight: expected 1-D [H=8]"),
        "dtype": (lambda: ops.rms_norm(X.int(), torch.ones(8)), "x: expected dtype in"),
        "x_none": (lambda: ops.rms_norm(None, torch.ones(8)), "x: expected a Tensor, got NoneType"),
        "scalar": (
            lambda: ops.rms_norm(torch.tensor(1.0), torch.ones(1)),
            "x: expected at least 1-D",
        ),
        "eps": (lambda: ops.rms_norm(X, torch.ones(8), -1.0), "eps: expected a float >= 0"),
    }


def _rotary_embedding_errors() -> ErrorTable:
    X = torch.randn(2, 3, 5, 8)
    TABLE = torch.randn(5, 8).clamp(-1, 1)
    return {
        "x_rank": (
            lambda: ops.rotary_embedding(X[0], TABLE, TABLE),
            "x: expected 4-D [B, N, S, D]",
        ),
        "seq": (
            lambda: ops.rotary_embedding(X, TABLE[:4], TABLE[:4]),
            "cos: expected [S=5, Dr], [1, S=5, Dr] or [B=2, S=5, Dr], got shape (4, 8)",
        ),
        "seq_batch_1": (
            lambda: ops.rotary_embedding(X[:1], TABLE[:4], TABLE[:4]),
            "cos: expected [S=5, Dr] or [1, S=5, Dr], got shape (4, 8)",
        ),
        "mrope_batch": (
            lambda: ops.rotary_embedding(
                X, TABLE.expand(3, 3, 5, 8), TABLE.expand(3, 3, 5, 8), mrope_section=[1, 1, 2]
            ),
            "cos: expected [3, 1, S=5, Dr] or [3, B=2, S=5, Dr], got shape (3, 3, 5, 8)",
        ),
        "table_scale": (
            lambda: ops.rotary_embedding(X, TABLE, TABLE, table_scale=0.0),
            "table_scale: expected a finite float > 0 (a bound on |cos| and |sin|), got 0.0",
        ),
        "odd": (
            lambda: ops.rotary_embedding(X, TABLE[:, :3], TABLE[:, :3]),
            "cos: expected an even last dim Dr <= D=8",
        ),
        "sin": (lambda: ops.rotary_embedding(X, TABLE, TABLE[None]), "sin: expected shape (5, 8)"),
        "mrope_rank": (
            lambda: ops.rotary_embedding(X, TABLE, TABLE, mrope_section=[1, 1, 2]),
            "cos: expected 4-D [3, B, S, Dr] with mrope_section",
        ),
        "mrope_sum": (
            lambda: ops.rotary_embedding(
                X, TABLE.expand(3, 2, 5, 8), TABLE.expand(3, 2, 5, 8), mrope_section=[1, 1, 1]
            ),
            "mrope_section: expected positive sizes summing to Dr/2=4",
        ),
        "dtype": (lambda: ops.rotary_embedding(X.int(), TABLE, TABLE), "x: expected dtype in"),
    }


def _rotary_embedding_pair_errors() -> ErrorTable:
    Q, K = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8)
    TABLE = torch.randn(5, 8).clamp(-1, 1)
    return {
        "q_dtype": (
            lambda: ops.rotary_embedding_pair(Q.int(), K, TABLE, TABLE),
            "q: expected dtype in",
        ),
        "k_rank": (
            lambda: ops.rotary_embedding_pair(Q, K[0], TABLE, TABLE),
            "k: expected 4-D [B, N, S, D]",
        ),
        "k_seq": (
            lambda: ops.rotary_embedding_pair(Q, K[:1], TABLE, TABLE),
            "k: expected batch and sequence (dims 0, 2) of q (2, 4, 5, 8), got (1, 2, 5, 8)",
        ),
        "table": (
            lambda: ops.rotary_embedding_pair(Q, K, TABLE[:4], TABLE[:4]),
            "cos: expected [S=5, Dr], [1, S=5, Dr] or [B=2, S=5, Dr], got shape (4, 8)",
        ),
        "table_scale": (
            lambda: ops.rotary_embedding_pair(Q, K, TABLE, TABLE, table_scale=float("inf")),
            "table_scale: expected a finite float > 0 (a bound on |cos| and |sin|), got inf",
        ),
    }


def _moe_experts_errors() -> ErrorTable:
    op = ops.moe_experts
    X, W = torch.randn(3, 4), torch.rand(3, 2)
    E = torch.tensor([[0, 1], [1, 2], [2, 0]])
    GU, D = torch.randn(3, 10, 4), torch.randn(3, 4, 5)
    return {
        "hidden_rank": (
            lambda: op(X[None], W, E, GU, D),
            "hidden: expected 2-D (T, H), got shape (1, 3, 4)",
        ),
        "hidden_dtype": (lambda: op(X.int(), W, E, GU, D), "hidden: expected dtype in"),
        "weights_tokens": (
            lambda: op(X, W[:2], E, GU, D),
            "routing_weights: expected 2-D (T=3, K) with K >= 1, got shape (2, 2)",
        ),
        "weights_dtype": (lambda: op(X, W.int(), E, GU, D), "routing_weights: expected dtype"),
        "indices_shape": (
            lambda: op(X, W, E[:, :1], GU, D),
            "selected_experts: expected shape (3, 2) like routing_weights, got shape (3, 1)",
        ),
        "indices_dtype": (lambda: op(X, W, E.float(), GU, D), "selected_experts: expected dtype"),
        "gate_up_dtype": (
            lambda: op(X, W, E, GU.double(), D),
            "gate_up_proj: expected dtype torch.float32 (same as hidden), got torch.float64",
        ),
        "gate_up_hidden": (
            lambda: op(X, W, E, GU[..., :3], D),
            "gate_up_proj: expected shape (E, 2I, H) with E >= 1, H=4 and an even 2I >= 2 for "
            "transposed=False, got shape (3, 10, 3)",
        ),
        "gate_up_odd": (
            lambda: op(X, W, E, GU[:, :9], D),
            "gate_up_proj: expected shape (E, 2I, H)",
        ),
        "gate_up_transposed": (
            lambda: op(X, W, E, GU, D, transposed=True),
            "gate_up_proj: expected shape (E, H, 2I) with E >= 1, H=4",
        ),
        "down_shape": (
            lambda: op(X, W, E, GU, D.transpose(1, 2)),
            "down_proj: expected shape (3, 4, 5) for transposed=False and gate_up_proj "
            "(3, 10, 4), got shape (3, 5, 4)",
        ),
        "routing_weights_on": (
            lambda: op(X, W, E, GU, D, routing_weights_on="both"),
            "routing_weights_on: expected one of ('output', 'input'), got 'both'",
        ),
    }


def _swiglu_errors() -> ErrorTable:
    X = torch.randn(2, 6)
    return {
        "odd": (
            lambda: ops.swiglu(X[:, :5]),
            "x: expected an even size along dim -1, got shape (2, 5)",
        ),
        "dim": (lambda: ops.swiglu(X, 2), "dim: expected in [-2, 1]"),
        "dtype": (lambda: ops.swiglu(X.int()), "x: expected dtype in"),
        "scalar": (lambda: ops.swiglu(torch.tensor(1.0)), "x: expected at least 1-D"),
    }


def _varlen_attention_errors() -> ErrorTable:
    Q = torch.randn(6, 4, 8)
    KV = torch.randn(6, 2, 8)
    CU = torch.tensor([0, 2, 6])
    return {
        "rank": (lambda: ops.varlen_attention(Q[None], KV, KV, CU, CU), "query: expected 3-D"),
        "gqa": (
            lambda: ops.varlen_attention(Q[:, :3], KV, KV, CU, CU),
            "key: expected a head count >= 1 dividing the 3 query heads",
        ),
        "no_kv_heads": (
            lambda: ops.varlen_attention(Q, KV[:, :0], KV[:, :0], CU, CU),
            "key: expected a head count >= 1 dividing the 4 query heads (GQA/MQA), got shape "
            "(6, 0, 8)",
        ),
        "cu_dtype": (
            lambda: ops.varlen_attention(Q, KV, KV, CU.float(), CU),
            "cu_seqlens_q: expected dtype",
        ),
        "cu_rank": (
            lambda: ops.varlen_attention(Q, KV, KV, CU[None], CU),
            "cu_seqlens_q: expected 1-D",
        ),
        "cu_len": (
            lambda: ops.varlen_attention(Q, KV, KV, CU, torch.tensor([0, 6])),
            "cu_seqlens_k: expected shape (3,)",
        ),
        "cu_end": (
            lambda: ops.varlen_attention(Q, KV, KV, torch.tensor([0, 2, 5]), CU),
            "cu_seqlens_q: expected nondecreasing offsets from 0 to 6, got [0, 2, 5]",
        ),
        "cu_order": (
            lambda: ops.varlen_attention(
                Q, KV, KV, torch.tensor([0, 4, 2, 6]), torch.tensor([0, 2, 4, 6])
            ),
            "cu_seqlens_q: expected nondecreasing offsets",
        ),
        "max_seqlen": (
            lambda: ops.varlen_attention(Q, KV, KV, CU, CU, max_seqlen_q=3),
            "max_seqlen_q: expected >= the longest segment (4), got 3",
        ),
    }


def _weight_quant_matmul_errors() -> ErrorTable:
    X = torch.randn(2, 100)
    Q8 = torch.zeros(5, 100, dtype=torch.int8)
    Q4 = torch.zeros(5, 50, dtype=torch.uint8)
    S32 = torch.ones(4, 5)  # ceil(100 / 32) groups
    op = ops.weight_quant_matmul
    return {
        "group_48": (
            lambda: op(X, Q8, S32, group_size=48),
            "group_size: expected 0 (per channel) or a multiple of 32 in [32, 256], got 48",
        ),
        "group_512": (
            lambda: op(X, Q8, torch.ones(1, 5), group_size=512),
            "group_size: expected 0 (per channel) or a multiple of 32 in [32, 256], got 512",
        ),
        "weight_int16": (
            lambda: op(X, Q8.to(torch.int16), S32, group_size=32),
            "weight: expected int8 (N, K=100) 8-bit values, uint8 (N, ceil(K/2)=50) packed 4-bit "
            "values or int32 (N, K/8) NPU-prepacked 4-bit values, got torch.int16",
        ),
        "weight_shape": (
            lambda: op(X, Q4[:, :49], S32, group_size=32),
            "weight: expected shape (5, 50) for dtype torch.uint8",
        ),
        "int32_k": (
            lambda: op(X, torch.zeros(5, 12, dtype=torch.int32), S32, group_size=32),
            "weight: expected shape (5, 12) for dtype torch.int32: an int32 NPU-prepacked weight "
            "needs K % 8 == 0 (K=100), got shape (5, 12)",
        ),
        "scale_rows": (
            lambda: op(X, Q8, S32[:3], group_size=32),
            "scale: expected shape (4, N) with N >= 1, ceil(K=100 / group_size=32) = 4 groups, "
            "got (3, 5)",
        ),
        "scale_per_channel": (
            lambda: op(X, Q8, S32),
            "scale: expected shape (1, N) with N >= 1, per channel (group_size=0), got (4, 5)",
        ),
        "scale_rank": (
            lambda: op(X, Q8, torch.ones(5)),
            "scale: expected 2-D (ceil(K/group_size), N), or (1, N) per channel, got shape (5,)",
        ),
        "scale_dtype": (lambda: op(X, Q8, S32.int(), group_size=32), "scale: expected dtype in"),
        "offset_shape": (
            lambda: op(X, Q8, S32, torch.zeros(4, 6), group_size=32),
            "offset: expected None or the shape (4, 5) and dtype torch.float32 of scale, got "
            "shape (4, 6) of dtype torch.float32",
        ),
        "offset_dtype": (
            lambda: op(X, Q8, S32, torch.zeros(4, 5).half(), group_size=32),
            "offset: expected None or the shape (4, 5) and dtype torch.float32 of scale, got "
            "shape (4, 5) of dtype torch.float16",
        ),
        "bias_shape": (
            lambda: op(X, Q8, S32, None, torch.zeros(6), 32),
            "bias: expected None or shape (5,) (N), got (6,)",
        ),
        "x_dtype": (lambda: op(X.int(), Q8, S32, group_size=32), "x: expected dtype in"),
        "x_scalar": (
            lambda: op(torch.tensor(1.0), Q8, S32, group_size=32),
            "x: expected at least 1-D (..., K) with K >= 1, got shape ()",
        ),
    }


def _gated_delta_errors(op: Callable[..., object]) -> ErrorTable:
    """Both gated delta rule ops share one contract."""
    Q = torch.randn(2, 3, 2, 4)
    V = torch.randn(2, 3, 4, 5)
    G = torch.randn(2, 3, 4)
    return {
        "query_rank": (lambda: op(Q[0], Q[0], V, G, G), "query: expected 4-D [B, T, Hk, K]"),
        "key_shape": (lambda: op(Q, Q[:, :2], V, G, G), "key: expected shape (2, 3, 2, 4)"),
        "value_heads": (
            lambda: op(Q, Q, V[:, :, :3], G, G),
            "value: expected [B=2, T=3, Hv, V] with Hv a multiple of Hk=2",
        ),
        "g_shape": (lambda: op(Q, Q, V, G[..., :2], G), "g: expected shape (2, 3, 4) [B, T, Hv]"),
        "state_shape": (
            lambda: op(Q, Q, V, G, G, torch.zeros(2, 4, 5, 4)),
            "initial_state: expected shape (2, 4, 4, 5) [B, Hv, K, V], got (2, 4, 5, 4)",
        ),
        "no_tokens": (lambda: op(Q[:, :0], Q[:, :0], V[:, :0], G[:, :0], G[:, :0]), "T >= 1"),
        "dtype": (lambda: op(Q, Q, V.double(), G, G), "value: expected dtype torch.float32"),
        "scale": (lambda: op(Q, Q, V, G, G, scale=float("nan")), "scale: expected a finite"),
    }


def _causal_conv1d_errors() -> ErrorTable:
    X = torch.randn(2, 3, 4)
    W = torch.randn(4, 3)
    return {
        "x_rank": (lambda: ops.causal_conv1d(X[0], W), "x: expected 3-D [B, T, C]"),
        "weight": (lambda: ops.causal_conv1d(X, W.t()), "weight: expected 2-D [C=4, W >= 1]"),
        "state_len": (
            lambda: ops.causal_conv1d(X, W, torch.zeros(2, 4, 1)),
            "conv_state: expected 3-D [B=2, C=4, S >= W - 1 = 2], got shape (2, 4, 1)",
        ),
        "bias": (lambda: ops.causal_conv1d(X, W, None, torch.zeros(3)), "bias: expected shape"),
        "activation": (
            lambda: ops.causal_conv1d(X, W, activation="gelu"),
            "activation: expected one of (None, 'silu', 'swish'), got 'gelu'",
        ),
    }


ERROR_INPUTS: dict[str, ErrorTable] = {
    "causal_conv1d": _causal_conv1d_errors(),
    "chunk_gated_delta_rule": _gated_delta_errors(ops.chunk_gated_delta_rule),
    "fused_attention": _fused_attention_errors(),
    "moe_experts": _moe_experts_errors(),
    "recurrent_gated_delta_rule": _gated_delta_errors(ops.recurrent_gated_delta_rule),
    "rms_norm": _rms_norm_errors(),
    "rotary_embedding": _rotary_embedding_errors(),
    "rotary_embedding_pair": _rotary_embedding_pair_errors(),
    "swiglu": _swiglu_errors(),
    "varlen_attention": _varlen_attention_errors(),
    "weight_quant_matmul": _weight_quant_matmul_errors(),
}
