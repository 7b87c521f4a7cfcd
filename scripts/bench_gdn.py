"""Benchmark: Qwen3.5's linear-attention ops (CPU reference path) against transformers' torch
implementation of the same math, at 1k and 8k tokens with small heads.

Rows: prefill (``ops.chunk_gated_delta_rule`` vs ``torch_chunk_gated_delta_rule``), a token by
token scan (``ops.recurrent_gated_delta_rule`` vs ``torch_recurrent_gated_delta_rule``), the
conv (``ops.causal_conv1d`` vs ``causal_conv1d_fn`` on the state and input concatenated, as
with a cache), and an A/A row (transformers' chunk function against itself) that shows the
noise. Each pair is warmed up, then timed in interleaved rounds (ours, theirs, ours, ...) so
load changes hit both; the table gives medians and ratios (ours / transformers; < 1 is
faster). A benchmark, not a test. Usage::

    python scripts/bench_gdn.py [--threads N] [--rounds R] [--tokens 1024 8192]
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a source checkout

import torch
from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen3_5

from ascend_vlm import ops

KEY_HEADS, VALUE_HEADS, HEAD_DIM, CONV_WIDTH = 2, 4, 32, 4


def interleaved_medians(
    first: Callable[[], object], second: Callable[[], object], rounds: int
) -> tuple[float, float]:
    """Median ms of each after one warm-up call each, timed alternately for ``rounds``."""
    first(), second()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(rounds):
        for samples, fn in zip(times, (first, second), strict=True):
            start = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[0]), statistics.median(times[1])


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
            f"A/A: transformers chunk T={tokens}",
            lambda: qwen3_5.torch_chunk_gated_delta_rule(q, k, v, g, beta, **theirs),
            lambda: qwen3_5.torch_chunk_gated_delta_rule(q, k, v, g, beta, **theirs),
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192])
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print("$ python scripts/bench_gdn.py " + shlex.join(argv or sys.argv[1:]))
    print(
        f"torch {torch.__version__}, {args.threads} thread(s), {args.rounds} interleaved rounds, "
        f"Hk={KEY_HEADS} Hv={VALUE_HEADS} D={HEAD_DIM} conv width {CONV_WIDTH}, float32, CPU"
    )
    print(f"| {'case':<38} | ours ms | transformers ms | ratio |")
    print(f"|{'-' * 40}|---------|-----------------|-------|")
    with torch.inference_mode():
        for tokens in args.tokens:
            for label, ours, theirs in cases(tokens):
                ours_ms, theirs_ms = interleaved_medians(ours, theirs, args.rounds)
                print(
                    f"| {label:<38} | {ours_ms:7.1f} | {theirs_ms:15.1f} | "
                    f"{ours_ms / theirs_ms:5.2f} |"
                )


if __name__ == "__main__":
    main()
