"""What tracing costs: a forward and a generation with ``ascend_vlm.trace`` on and off, side
by side in one run, with an A/A pair (off against off) for the noise.

The model is the benchmark Qwen2-VL of ``scripts/_bench_models.py`` (8 language layers of
width 256, a 4-layer vision tower), patched; the prompt holds one 224x224 image (64 visual
tokens). Workloads: one forward over the prompt (vision, prefill); ``generate`` of
``--new-tokens`` tokens (default 32: every decode step crosses the stage hooks). Each round
times every configuration ``--calls`` times, interleaved in rotating order, and keeps the median; the
table shows the median over ``--rounds`` rounds (default 5) and the ratios to "off".

Run: python scripts/bench_trace.py [--rounds 5] [--calls 5] [--new-tokens 32] [--json OUT]
(OUT: the table as JSON for docs/benchmarks/, see _bench_record.py)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from _bench_models import bench_processor, load_bench_model, random_images
from _bench_record import show_table

import ascend_vlm

IMAGE_SIDE = 224
CONFIGS = ("off", "on", "off again")


def _prompt_inputs(processor):
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe."}]}
    ]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return processor(text=prompt, images=random_images(1, IMAGE_SIDE, 0), return_tensors="pt")


def _seconds(model, call, traced: bool) -> float:
    start = time.perf_counter()
    if traced:
        with ascend_vlm.trace(model):
            call()
    else:
        call()
    return time.perf_counter() - start


def measure(model, call, rounds: int, calls: int) -> dict[str, float]:
    """Median over rounds of each configuration's per-round median seconds."""
    medians: dict[str, list[float]] = {name: [] for name in CONFIGS}
    for _ in range(rounds):
        samples: dict[str, list[float]] = {name: [] for name in CONFIGS}
        for index in range(calls):
            # interleaved, and the order rotated each call: drift and position in the
            # sequence hit every configuration alike
            for name in CONFIGS[index % 3 :] + CONFIGS[: index % 3]:
                samples[name].append(_seconds(model, call, name == "on"))
        for name in CONFIGS:
            medians[name].append(statistics.median(samples[name]))
    return {name: statistics.median(values) for name, values in medians.items()}


HEADER = ["workload", "off ms", "on ms", "off again ms", "on / off", "A/A"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=5, help="timed calls per round")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--layers", type=int, default=8, help="language-model depth")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--json", type=Path, help="also write the table to this file")
    args = parser.parse_args(argv)
    for flag in ("rounds", "calls", "new_tokens", "layers", "threads"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')}: expected an int >= 1")
    torch.set_num_threads(args.threads)
    processor = bench_processor(IMAGE_SIDE)
    with tempfile.TemporaryDirectory() as folder:
        print(f"[bench_trace] building the {args.layers}-layer model", flush=True)
        model = load_bench_model(Path(folder), args.layers)
    ascend_vlm.patch(model)
    inputs = _prompt_inputs(processor)
    settings = {"max_new_tokens": args.new_tokens, "min_new_tokens": args.new_tokens}
    workloads = {
        "forward (prompt with 1 image)": lambda: model(**inputs),
        f"generate {args.new_tokens} tokens": lambda: model.generate(
            **inputs, **settings, do_sample=False
        ),
    }
    rows = []
    with torch.no_grad():
        for name, call in workloads.items():
            call()  # warm-up
            print(f"[bench_trace] {name}", flush=True)
            ms = {
                config: seconds * 1e3
                for config, seconds in measure(model, call, args.rounds, args.calls).items()
            }
            rows.append(
                [
                    name,
                    f"{ms['off']:.4g}",
                    f"{ms['on']:.4g}",
                    f"{ms['off again']:.4g}",
                    f"{ms['on'] / ms['off']:.3f}x",
                    f"{ms['off again'] / ms['off']:.3f}x",
                ]
            )
    print(
        f"\n{args.layers} language layers, {args.threads} threads, median of {args.rounds} rounds:\n"
    )
    show_table(HEADER, rows, args.json, sys.argv[0], list(argv or sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
