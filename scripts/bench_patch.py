"""Patched vs unpatched (eager and sdpa) forward/generate latency and peak memory on CPU.

For each family (`ascend_vlm.models.tiny`, one image + text, batch 1) and each size (`tiny`: pure
per-call overhead; `small`: 4 decoder layers of width 512, a 2-layer width-512 vision tower, one
224x224 image, so compute matters) measures, in one run and on the same weights:

* forward: best wall time of one full forward (vision tower + language model);
* generate: best wall time of greedy `generate` with a KV cache;
* peak memory: the highest live CPU tensor memory during one forward, from torch.profiler
  (`profile_memory=True`): running sum, in start-time order, of each op's net self allocation.

The models (eager, sdpa, an identical second sdpa model as an A/A control, and sdpa +
`ascend_vlm.patch`) are timed in interleaved rounds with a rotating order, so machine-load drift
hits all alike, and each reports its best (least disturbed) round: on a shared machine medians
move by tens of percent between runs. Each implementation is built `--instances` times (same
weights, different places in memory, built in an order rotated per instance) and its time is
the mean of its instances' bests: one instance alone carries a placement bias of several percent
that no number of rounds removes (the A/A column shows what is left: with 3 instances it moved by
up to 12% at the tiny size on a 2-core VM, with 8 by up to 3%, one row 6%). Ratios are unpatched
/ patched time (> 1 means patched is faster) and patched / sdpa memory. torch runs with a fixed
thread count (`--threads`, default 1). The defaults are a quick look; docs/benchmarks.md's
records use `--sizes tiny --repeats 20 --instances 4` and `--sizes small --repeats 10
--instances 2` (each record names its command).
Run: python scripts/bench_patch.py [--sizes tiny small] [--families qwen2_vl llava_clip]
[--repeats 20] [--instances 2] [--json OUT]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
from _bench_record import show_table
from _bench_timing import interleaved_ms

import ascend_vlm
from ascend_vlm.kernel_backend import active_backend
from ascend_vlm.models.tiny import FAMILIES, SIZES, build_model, make_inputs
from ascend_vlm.observability.memory import peak_tensor_bytes

# "sdpa_again" is an A/A control: a second, identical unpatched sdpa model. Its ratio to "sdpa"
# is the noise floor of the table (weight placement in memory and machine load alone).
IMPLEMENTATIONS = ("eager", "sdpa", "sdpa_again", "patched")
# Rounds per size relative to --repeats: a small model's forward takes far longer than a tiny one's.
REPEAT_SCALE = {"tiny": 1.0, "small": 0.5}


def _generate_rounds(forward_rounds: int) -> int:
    """Generate rounds for `forward_rounds` forward rounds: a generate costs ~new_tokens
    forwards, but fewer than 8 rounds left the small-size A/A generate column at 0.93-1.04x."""
    return max(8, forward_rounds // 2)


def _mean_over_instances(best: dict[tuple[str, int], float]) -> dict[str, float]:
    """{(implementation, instance): ms} -> {implementation: mean ms}."""
    return {
        implementation: statistics.mean(
            t for (name, _), t in best.items() if name == implementation
        )
        for implementation in IMPLEMENTATIONS
    }


def bench_family(
    name: str, size: str, rounds: int, new_tokens: int, instances: int
) -> dict[str, dict]:
    """{implementation: {"forward": ms, "generate": ms, "peak": bytes}} for one family and size;
    a time is the best of the interleaved rounds (after a warm-up call each), averaged over the
    instances."""
    models = {}
    for instance in range(instances):
        # Build order rotates per instance: where a model is built in the process moves its
        # time by a few percent, and a fixed order would hand that to one implementation.
        shift = instance % len(IMPLEMENTATIONS)
        for implementation in IMPLEMENTATIONS[shift:] + IMPLEMENTATIONS[:shift]:
            attention = "eager" if implementation == "eager" else "sdpa"  # patched: sdpa + patch
            model = build_model(name, attn_implementation=attention, size=size)
            if implementation == "patched":
                ascend_vlm.patch(model)
            models[implementation, instance] = model
    inputs = make_inputs(name, models["sdpa", 0], n_images=1)
    settings = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    forwards = {k: (lambda m=m: m(**inputs)) for k, m in models.items()}
    generates = {k: (lambda m=m: m.generate(**inputs, **settings)) for k, m in models.items()}
    with torch.no_grad():
        forward = _mean_over_instances(interleaved_ms(forwards, rounds, summary=min))
        generate_rounds = _generate_rounds(rounds)
        generate = _mean_over_instances(interleaved_ms(generates, generate_rounds, summary=min))
        return {
            k: {
                "forward": forward[k],
                "generate": generate[k],
                "peak": peak_tensor_bytes(forwards[k, 0]),
            }
            for k in IMPLEMENTATIONS
        }


HEADER = [
    "size", "family", "fwd ms", "fwd x eager", "fwd x sdpa", "gen ms", "gen x eager",
    "gen x sdpa", "peak KiB", "mem/sdpa", "A/A", "A/A gen",
]  # fmt: skip


def family_row(size: str, name: str, times: dict[str, dict]) -> list[str]:
    """Cells under :data:`HEADER` of one :func:`bench_family` result."""
    patched, eager, sdpa, again = (times[k] for k in ("patched", "eager", "sdpa", "sdpa_again"))
    return [
        size,
        name,
        f"{patched['forward']:.2f}",
        f"{eager['forward'] / patched['forward']:.2f}",
        f"{sdpa['forward'] / patched['forward']:.2f}",
        f"{patched['generate']:.1f}",
        f"{eager['generate'] / patched['generate']:.2f}",
        f"{sdpa['generate'] / patched['generate']:.2f}",
        f"{patched['peak'] / 1024:.1f}",
        f"{patched['peak'] / max(sdpa['peak'], 1):.2f}",
        f"{sdpa['forward'] / again['forward']:.2f}",
        f"{sdpa['generate'] / again['generate']:.2f}",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--repeats", type=int, default=20, help="forward rounds for tiny models")
    parser.add_argument(
        "--instances", type=int, default=2, help="models built per implementation (>= 1)"
    )
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, help="also write the table to this file")
    args = parser.parse_args(argv)
    if args.instances < 1:
        parser.error(f"--instances: expected an int >= 1, got {args.instances}")
    torch.set_num_threads(args.threads)
    argv = list(sys.argv[1:] if argv is None else argv)
    print("command: python scripts/bench_patch.py " + " ".join(argv))
    print(
        f"backend={active_backend()} torch={torch.__version__} threads={torch.get_num_threads()} "
        f"repeats={args.repeats} instances={args.instances} new_tokens={args.new_tokens}"
    )
    rows = []
    for size in args.sizes:
        rounds = max(3, round(args.repeats * REPEAT_SCALE[size]))
        print(
            f"size={size} ({SIZES[size]}), forward rounds={rounds}, "
            f"generate rounds={_generate_rounds(rounds)}",
            flush=True,
        )
        for name in args.families:
            print(f"[bench_patch] {size} {name}", flush=True)
            times = bench_family(name, size, rounds, args.new_tokens, args.instances)
            rows.append(family_row(size, name, times))
    print()
    show_table(HEADER, rows, args.json, sys.argv[0], argv)
    print(
        "\nfwd/gen ms: best of the interleaved rounds, mean over instances; x eager / x sdpa: "
        "unpatched time / patched time (>= 1 means patched is as fast or faster)"
    )
    print("mem/sdpa: patched peak / sdpa peak (torch.profiler CPU allocation events, one forward)")
    print(
        "A/A, A/A gen: sdpa time / time of an identical second sdpa model (forward, generate): "
        "how far ratios move with no code difference at all"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
