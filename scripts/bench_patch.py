"""Patched vs unpatched (eager and sdpa) forward/generate latency and peak memory on CPU.

For each family's tiny model (`ascend_vlm.models.tiny`, one image + text, batch 1) measures, in
one run and on the same weights:

* forward: median wall time of one full forward (vision tower + language model);
* generate: median wall time of greedy `generate` with a KV cache;
* peak memory: the highest live CPU tensor memory during one forward, from torch.profiler
  (`profile_memory=True`): running sum, in start-time order, of each op's net self allocation.

Ratios are unpatched / patched time (> 1 means patched is faster) and patched / unpatched
memory. Run: python scripts/bench_patch.py [--families qwen2_vl llava_clip] [--repeats 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import ascend_vlm
from ascend_vlm.device import backend
from ascend_vlm.models.tiny import FAMILIES, build_model, make_inputs


def _median_seconds(function, repeats: int) -> float:
    function()  # warm-up
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _peak_bytes(function) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        function()
    live = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += event.self_cpu_memory_usage  # net bytes this op allocated (frees are negative)
        peak = max(peak, live)
    return peak


def _measure(model, inputs, repeats: int, new_tokens: int) -> dict[str, float]:
    settings = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)

    def forward():
        model(**inputs)

    def generate():
        model.generate(**inputs, **settings)

    with torch.no_grad():
        return {
            "forward": _median_seconds(forward, repeats),
            "generate": _median_seconds(generate, max(1, repeats // 4)),
            "peak": _peak_bytes(forward),
        }


def bench_family(name: str, repeats: int, new_tokens: int) -> dict[str, dict[str, float]]:
    results = {}
    for implementation in ("eager", "sdpa"):
        model = build_model(name, attn_implementation=implementation)
        inputs = make_inputs(name, model, n_images=1)
        results[implementation] = _measure(model, inputs, repeats, new_tokens)
    ascend_vlm.patch(model)
    results["patched"] = _measure(model, inputs, repeats, new_tokens)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(
        "command: python scripts/bench_patch.py " + " ".join(sys.argv[1:] if argv is None else argv)
    )
    print(
        f"backend={backend()} torch={torch.__version__} "
        f"threads={args.threads} repeats={args.repeats} new_tokens={args.new_tokens}\n"
    )
    header = (
        f"{'family':16} {'fwd ms':>8} {'fwd x eager':>11} {'fwd x sdpa':>10} "
        f"{'gen ms':>8} {'gen x eager':>11} {'gen x sdpa':>10} {'peak KiB':>9} {'mem/sdpa':>8}"
    )
    print(header)
    print("-" * len(header))
    for name in args.families:
        r = bench_family(name, args.repeats, args.new_tokens)
        patched, eager, sdpa = r["patched"], r["eager"], r["sdpa"]
        print(
            f"{name:16} {patched['forward'] * 1e3:8.2f} "
            f"{eager['forward'] / patched['forward']:11.2f} {sdpa['forward'] / patched['forward']:10.2f} "
            f"{patched['generate'] * 1e3:8.1f} "
            f"{eager['generate'] / patched['generate']:11.2f} {sdpa['generate'] / patched['generate']:10.2f} "
            f"{patched['peak'] / 1024:9.1f} {patched['peak'] / max(sdpa['peak'], 1):8.2f}",
            flush=True,
        )
    print(
        "\nx eager / x sdpa: unpatched time / patched time (>= 1 means patched is as fast or faster)"
    )
    print("mem/sdpa: patched peak / sdpa peak (torch.profiler CPU allocation events, one forward)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
