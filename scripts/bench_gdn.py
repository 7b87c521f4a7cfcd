"""Benchmark: Qwen3.5's linear-attention ops (CPU reference path) against transformers' torch
implementation of the same math, at 1k and 8k tokens with small heads.

Rows: prefill (``ops.chunk_gated_delta_rule`` vs ``torch_chunk_gated_delta_rule``), a token by
token scan (``ops.recurrent_gated_delta_rule`` vs ``torch_recurrent_gated_delta_rule``), the
conv (``ops.causal_conv1d`` vs ``causal_conv1d_fn`` on the state and input concatenated, as
with a cache). Each row times ours, transformers' and transformers' again (the A/A twin) after a
warm-up, in interleaved rounds with a rotating order so load changes hit all three; the table
gives medians, the A/A ratio (twin / transformers: the noise floor) and the ratio (ours /
transformers; < 1 is faster). A benchmark, not a test. Usage::

    python scripts/bench_gdn.py [--threads N] [--rounds R] [--tokens 1024 8192] [--json OUT]
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a source checkout

import torch
from _bench_record import show_table
from _bench_timing import interleaved_ms
from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen3_5

from ascend_vlm import ops

KEY_HEADS, VALUE_HEADS, HEAD_DIM, CONV_WIDTH = 2, 4, 32, 4


def cases(tokens: int) -> list[tuple[str, Callable[[], object], Callable[[], object]]]:
    """(label, ours, transformers) at ``tokens`` tokens, batch 1."""
    generator = torch.Generator().manual_seed(tokens)
    q = torch.randn(1, tokens, KEY_HEADS, HEAD_DIM, generator=generator)
    k = torch.randn(1, tokens, KEY_HEADS, HEAD_DIM, generator=generator)
    v = torch.randn(1, tokens, VALUE_HEADS, HEAD_DIM, generator=generator)
    g = -torch.nn.functional.softplus(torch.randn(1, tokens, VALUE_HEADS, generator=generator))
    beta = torch.sigmoid(torch.randn(1, tokens, VALUE_HEADS, generator=generator))
    state = torch.randn(1, VALUE_HEADS, HEAD_DIM, HEAD_DIM, generator=generator)
    theirs = {"initial_state": state, "output_final_state": True, "use_qk_l2norm_in_kernel": True}
    channels = 2 * KEY_HEADS * HEAD_DIM + VALUE_HEADS * HEAD_DIM
    x = torch.randn(1, tokens, channels, generator=generator)
    weight = torch.randn(channels, CONV_WIDTH, generator=generator)
    conv_state = torch.zeros(1, channels, CONV_WIDTH - 1)
    rows = [
        (
            f"chunk_gated_delta_rule T={tokens}",
            lambda: ops.chunk_gated_delta_rule(q, k, v, g, beta, state, use_qk_l2norm=True),
            lambda: qwen3_5.torch_chunk_gated_delta_rule(q, k, v, g, beta, **theirs),
        ),
        (
            f"recurrent_gated_delta_rule T={tokens}",
            lambda: ops.recurrent_gated_delta_rule(q, k, v, g, beta, state, use_qk_l2norm=True),
            lambda: qwen3_5.torch_recurrent_gated_delta_rule(q, k, v, g, beta, **theirs),
        ),
        (
            f"causal_conv1d silu T={tokens}",
            lambda: ops.causal_conv1d(x, weight, conv_state, activation="silu"),
            # with a cache, transformers' layer concatenates the state and the input first
            lambda: qwen3_5.causal_conv1d_fn(
                torch.cat((conv_state, x.transpose(1, 2)), dim=-1), weight, None, activation="silu"
            ),
        ),
    ]
    return rows


HEADER = ["case", "ours ms", "transformers ms", "transformers (A/A) ms", "A/A", "ratio"]


def case_rows(tokens: int, rounds: int) -> list[list[str]]:
    """One row of cells under :data:`HEADER` per case at ``tokens`` tokens."""
    rows = []
    for label, ours, theirs in cases(tokens):
        calls = {"ours": ours, "transformers": theirs, "transformers (A/A)": theirs}
        ms = interleaved_ms(calls, rounds)
        rows.append(
            [
                label,
                *(f"{ms[name]:.3g}" for name in calls),
                f"{ms['transformers (A/A)'] / ms['transformers']:.2f}",
                f"{ms['ours'] / ms['transformers']:.2f}",
            ]
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192])
    parser.add_argument("--json", type=Path, help="also write the table to this file")
    args = parser.parse_args(argv)
    if args.threads < 1 or args.rounds < 1 or min(args.tokens) < 1:
        parser.error("--threads, --rounds, --tokens: expected ints >= 1")
    torch.set_num_threads(args.threads)
    argv = list(sys.argv[1:] if argv is None else argv)
    print("$ python scripts/bench_gdn.py " + shlex.join(argv))
    print(
        f"torch {torch.__version__}, {args.threads} thread(s), median of {args.rounds} "
        f"interleaved rounds, Hk={KEY_HEADS} Hv={VALUE_HEADS} D={HEAD_DIM} conv width "
        f"{CONV_WIDTH}, float32, CPU\n"
    )
    with torch.inference_mode():
        rows = [row for tokens in args.tokens for row in case_rows(tokens, args.rounds)]
    show_table(HEADER, rows, args.json, sys.argv[0], argv)


if __name__ == "__main__":
    main()
