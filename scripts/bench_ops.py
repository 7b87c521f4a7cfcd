"""Benchmark: each ascend_vlm op (registered custom op, CPU reference path) against the eager
composite transformers runs for the same math, plus the cost of the custom-op boundary itself.

Prints a table of times and ratios (ours / transformers; < 1 is faster). Per case, each
contender is called once to warm up, then ``--repeats`` interleaved rounds in a rotating order
time one call each; medians count. "transformers (A/A)" is the transformers composite timed a
second time as its own contender: its ratio to "transformers" is the noise floor of the ratio
beside it. A benchmark, not a test: numbers depend on the machine and its load. Usage::

    python scripts/bench_ops.py [--threads N] [--repeats R] [--dtype float32|bfloat16]
        [--json PATH]  (PATH: the op table as JSON for docs/benchmarks/, see _bench_record.py)
"""

from __future__ import annotations

import argparse
import importlib
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a source checkout

import torch
import torch.nn.functional as F
from _bench_record import write_record
from _bench_timing import interleaved_ms
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

from ascend_vlm import ops
from ascend_vlm.ops._attention_args import check_attention_args

# ascend_vlm.ops re-exports functions under their modules' names; fetch the modules themselves.
fused_attention_module = importlib.import_module("ascend_vlm.ops.fused_attention")
rms_norm_module = importlib.import_module("ascend_vlm.ops.rms_norm")


def attention_cases(dtype: torch.dtype) -> list[tuple[str, Callable, Callable]]:
    """(label, ours, transformers) for prefill and decode, GQA 16/2 heads, D=64."""
    cases = []
    for label, q_len, kv_len in (("prefill S=512", 512, 512), ("decode 1x1024", 1, 1024)):
        q = torch.randn(1, 16, q_len, 64, dtype=dtype)
        k = torch.randn(1, 2, kv_len, 64, dtype=dtype)
        v = torch.randn(1, 2, kv_len, 64, dtype=dtype)
        module = SimpleNamespace(num_key_value_groups=8, is_causal=True)
        cases.append(
            (
                f"fused_attention {label}",
                lambda q=q, k=k, v=v: ops.fused_attention(q, k, v, causal=True),
                lambda q=q, k=k, v=v, m=module: sdpa_attention_forward(m, q, k, v, None),
            )
        )
    return cases


def varlen_case(dtype: torch.dtype) -> tuple[str, Callable, Callable]:
    """Qwen2-VL vision attention: 4 images of 256 patches, 16 heads, D=80."""
    lengths = [256] * 4
    cu = torch.tensor([0, 256, 512, 768, 1024], dtype=torch.int32)
    q, k, v = (torch.randn(1024, 16, 80, dtype=dtype) for _ in range(3))
    module = SimpleNamespace(num_key_value_groups=1, is_causal=False)

    def transformers_split_loop() -> torch.Tensor:
        # transformers' Qwen2-VL VisionAttention (non-flash): split by cu_seqlens, attend per chunk
        splits = [torch.split(t.transpose(0, 1)[None], lengths, dim=2) for t in (q, k, v)]
        outs = [
            sdpa_attention_forward(module, *chunk, None, is_causal=False)[0]
            for chunk in zip(*splits, strict=True)
        ]
        return torch.cat(outs, dim=1)

    return (
        "varlen_attention 4x256 ViT",
        lambda: ops.varlen_attention(q, k, v, cu, cu),
        transformers_split_loop,
    )


def small_op_cases(dtype: torch.dtype) -> list[tuple[str, Callable, Callable]]:
    hidden = torch.randn(4, 512, 2048, dtype=dtype)
    norm = Qwen2RMSNorm(2048, eps=1e-6).to(dtype)
    weight = norm.weight.detach()
    q = torch.randn(4, 16, 512, 128, dtype=dtype)
    k = torch.randn(4, 2, 512, 128, dtype=dtype)
    cos, sin = torch.randn(4, 512, 128, dtype=dtype), torch.randn(4, 512, 128, dtype=dtype)
    gate_up = torch.randn(4, 512, 2 * 5632, dtype=dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    with torch.no_grad():
        return [
            ("rms_norm 4x512x2048", lambda: ops.rms_norm(hidden, weight), lambda: norm(hidden)),
            (
                "rotary_embedding_pair q+k",
                lambda: ops.rotary_embedding_pair(q, k, cos, sin),
                lambda: apply_rotary_pos_emb(q, k, cos, sin),
            ),
            ("swiglu 4x512x5632", lambda: ops.swiglu(gate_up), lambda: F.silu(gate) * up),
        ]


def checked_reference(check: Callable, reference: Callable, *args: object) -> object:
    """An op's check and reference on ``args`` (all of the op's, in spec order): what the op's
    kernel runs, without the dispatcher or the public function around it."""
    return reference(check(*args), *args)


def dispatch_overhead(repeats: int) -> list[tuple[str, float, float, float]]:
    """Per-call cost on tiny inputs (microseconds): the checked reference alone, the public
    wrapper (eager fast path) and the registered op through the dispatcher."""
    x, w = torch.randn(1, 8), torch.randn(8)
    w_parameter = torch.nn.Parameter(w.clone())  # what a patched norm hands the op
    q = torch.randn(1, 1, 1, 8)
    attention_args = (q, q, q, None, "BNSD", None, None, False, None, 0.0, None)  # spec order
    rows = []
    for label, direct_call, wrapper_call, op_call in (
        (
            "rms_norm [1, 8]",
            lambda: checked_reference(
                rms_norm_module._check, rms_norm_module._reference, x, w, 1e-6, 0.0
            ),
            lambda: ops.rms_norm(x, w),
            lambda: torch.ops.ascend_vlm.rms_norm(x, w),
        ),
        (
            "rms_norm [1, 8] Parameter weight",
            lambda: checked_reference(
                rms_norm_module._check, rms_norm_module._reference, x, w_parameter, 1e-6, 0.0
            ),
            lambda: ops.rms_norm(x, w_parameter),
            lambda: torch.ops.ascend_vlm.rms_norm(x, w_parameter),
        ),
        (
            "fused_attention [1,1,1,8]",
            lambda: checked_reference(
                check_attention_args, fused_attention_module._reference, *attention_args
            ),
            lambda: ops.fused_attention(q, q, q),
            lambda: torch.ops.ascend_vlm.fused_attention(q, q, q),
        ),
    ):
        calls = {"reference": direct_call, "wrapper": wrapper_call, "torch.ops": op_call}
        ms = interleaved_ms(calls, repeats, per_round=100, warmup=2)
        rows.append((label, *(ms[name] * 1e3 for name in calls)))
    return rows


HEADER = ["op / shape", "ours ms", "transformers ms", "transformers (A/A) ms", "A/A", "ratio"]


def op_rows(dtype: torch.dtype, repeats: int) -> list[list[str]]:
    """One row of cells under :data:`HEADER` per case, printed as it is measured."""
    rows = []
    cases = [*attention_cases(dtype), varlen_case(dtype), *small_op_cases(dtype)]
    for label, ours, theirs in cases:
        calls = {"ours": ours, "transformers": theirs, "transformers (A/A)": theirs}
        ms = interleaved_ms(calls, repeats, warmup=2)
        rows.append(
            [
                label,
                *(f"{ms[name]:.4g}" for name in calls),
                f"{ms['transformers (A/A)'] / ms['transformers']:.2f}",
                f"{ms['ours'] / ms['transformers']:.2f}",
            ]
        )
        print("| " + " | ".join(rows[-1]) + " |", flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--json", type=Path, help="also write the op table to this file")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.threads < 1:
        parser.error("--repeats, --threads: expected ints >= 1")
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    print("$ python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv or sys.argv[1:])]))
    print(
        f"torch {torch.__version__}, {args.threads} thread(s), {args.dtype}, "
        f"median of {args.repeats} interleaved rounds, backend=cpu reference\n"
    )
    print("| " + " | ".join(HEADER) + " |")
    print("|---|" + "---:|" * (len(HEADER) - 1))
    with torch.no_grad():
        rows = op_rows(dtype, args.repeats)
        print(
            "\nCustom-op boundary per call, us (wrapper = eager fast path; torch.ops = full "
            "dispatcher + autograd wrapper, the path under grad/compile):\n"
        )
        print(f"| {'op / shape':<32} | {'reference':>9} | {'wrapper':>9} | {'torch.ops':>9} |")
        print(f"|{'-' * 34}|{'-' * 10}:|{'-' * 10}:|{'-' * 10}:|")
        for label, direct_us, wrapper_us, op_us in dispatch_overhead(args.repeats):
            print(f"| {label:<32} | {direct_us:>9.1f} | {wrapper_us:>9.1f} | {op_us:>9.1f} |")
    if args.json is not None:
        write_record(args.json, sys.argv[0], list(argv or sys.argv[1:]), HEADER, rows)


if __name__ == "__main__":
    main()
