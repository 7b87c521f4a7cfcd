"""Benchmark: ``ascend_vlm.ops.moe_experts`` (CPU reference path) against transformers' experts
implementations for the same routed experts, at 8/16/64 experts with top-2 and top-8 routing.

The experts module is transformers' ``Qwen3VLMoeTextExperts`` (gate_up (E, 2I, H), down
(E, H, I), gated SiLU) with each implementation transformers offers for it
(``transformers/integrations/moe.py``): "eager" (a loop over the hit experts), "grouped_mm"
(sorted rows through ``torch.nn.functional.grouped_mm`` / ``torch._grouped_mm``) and
"batched_mm" (each (token, choice) row gathers its expert's weights). Every contender gets the
same hidden states, router weights and indices (a softmax top-k of random logits, renormalised).

Timing: per configuration, a warm-up call of each contender, then ``--rounds`` interleaved rounds
in a rotating order, each timing ``--calls`` calls of every contender; the median round counts.
"eager (A/A)" is the eager module timed a second time as its own contender: its ratio to "eager"
is the noise floor of every other ratio. Ratios are ours / theirs (< 1: the op is faster).
``--backward`` times forward + backward (gradients of hidden and both expert weights, as LoRA
training needs) instead of inference. A benchmark, not a test: numbers depend on the machine and
its load.

Usage::

    python scripts/bench_moe.py [--tokens 128] [--hidden 256] [--intermediate 128]
        [--rounds 7] [--calls 3] [--threads N] [--dtype float32|bfloat16] [--backward]
        [--json PATH]  (PATH: the table as JSON for docs/benchmarks/, see _bench_record.py)
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a source checkout

import torch
from _bench_record import write_record
from _bench_timing import interleaved_ms
from transformers.models.qwen3_vl_moe.configuration_qwen3_vl_moe import Qwen3VLMoeTextConfig
from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeTextExperts

from ascend_vlm import ops

EXPERT_COUNTS = (8, 16, 64)
TOP_KS = (2, 8)
IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm")
CONTENDERS = ("ours", *IMPLEMENTATIONS, "eager (A/A)")


def experts_module(
    implementation: str, experts: int, hidden: int, intermediate: int, dtype: torch.dtype
) -> Qwen3VLMoeTextExperts:
    """transformers' experts with ``implementation``, seeded so every module has the same
    weights."""
    config = Qwen3VLMoeTextConfig(
        hidden_size=hidden, moe_intermediate_size=intermediate, num_experts=experts
    )
    config._experts_implementation = implementation
    module = Qwen3VLMoeTextExperts(config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
    return module.to(dtype)


def routing(
    tokens: int, experts: int, top_k: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen's router on random logits: softmax, top-k, renormalised weights."""
    logits = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(1))
    weights, indices = torch.topk(logits.softmax(dim=-1), top_k, dim=-1)
    return (weights / weights.sum(dim=-1, keepdim=True)).to(dtype), indices


def contenders(
    args: argparse.Namespace, experts: int, top_k: int, dtype: torch.dtype
) -> dict[str, Callable[[], object]]:
    """One call (forward, or forward + backward with ``--backward``) of each contender."""
    shape = (experts, args.hidden, args.intermediate)
    modules = {name: experts_module(name, *shape, dtype) for name in IMPLEMENTATIONS}
    modules["eager (A/A)"] = experts_module("eager", *shape, dtype)
    ours_weights = experts_module("eager", *shape, dtype)
    hidden = torch.randn(args.tokens, args.hidden, generator=torch.Generator().manual_seed(2))
    hidden = hidden.to(dtype).requires_grad_(args.backward)
    weights, indices = routing(args.tokens, experts, top_k, dtype)

    def run(forward: Callable[[], torch.Tensor], parameters: list[torch.Tensor]) -> Callable:
        if not args.backward:
            return lambda: forward()
        return lambda: torch.autograd.grad(forward().sum(), [hidden, *parameters])

    calls = {
        "ours": run(
            lambda: ops.moe_experts(
                hidden, weights, indices, ours_weights.gate_up_proj, ours_weights.down_proj
            ),
            [ours_weights.gate_up_proj, ours_weights.down_proj],
        )
    }
    for name, module in modules.items():
        calls[name] = run(
            lambda m=module: m(hidden, indices, weights), [module.gate_up_proj, module.down_proj]
        )
    return {name: calls[name] for name in CONTENDERS}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--backward", action="store_true")
    parser.add_argument("--json", type=Path, help="also write the table to this file")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    print("$ python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv or sys.argv[1:])]))
    print(
        f"torch {torch.__version__}, {args.threads} thread(s), {args.dtype}, T={args.tokens} "
        f"tokens, H={args.hidden}, I={args.intermediate}, "
        f"{'forward + backward' if args.backward else 'forward (no grad)'}, median of "
        f"{args.rounds} interleaved rounds x {args.calls} calls, ms per call\n"
    )
    header = ["E", "K", *CONTENDERS, "A/A", *(f"ours/{name}" for name in IMPLEMENTATIONS)]
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---:" for _ in header) + "|")
    rows = []
    for experts in EXPERT_COUNTS:
        for top_k in TOP_KS:
            calls = contenders(args, experts, top_k, dtype)
            with torch.set_grad_enabled(args.backward):
                ms = interleaved_ms(calls, args.rounds, args.calls)
            cells = [str(experts), str(top_k), *(f"{ms[name]:.2f}" for name in CONTENDERS)]
            cells.append(f"{ms['eager (A/A)'] / ms['eager']:.2f}")
            cells += [f"{ms['ours'] / ms[name]:.2f}" for name in IMPLEMENTATIONS]
            print("| " + " | ".join(cells) + " |", flush=True)
            rows.append(cells)
    if args.json is not None:
        write_record(args.json, sys.argv[0], list(argv or sys.argv[1:]), header, rows)


if __name__ == "__main__":
    main()
