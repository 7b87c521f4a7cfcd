"""Serving a mixed workload: one request at a time, static batches and continuous batching
(``ascend_vlm.batching.BatchGenerator``), measured side by side in one run.

The model is the benchmark Qwen2-VL of ``scripts/_bench_models.py`` (8 language layers of
width 256, a 4-layer vision tower, the default model's tokenizer and chat template); images
are 224x224 (64 visual tokens each). The workload has ``--requests`` requests (default 64),
all arriving at once, in a fixed random order: 40% text only, 40% with one image, 20% with
three, prompts of 2 to 40 words, greedy answers of ``--min-new`` to ``--max-new`` tokens
(default 4 to 128: the long tail static batches wait for).

* one by one: ``generate`` per request, in arrival order;
* static: batches of ``--batch-size`` requests in arrival order, left padded, one
  ``generate`` each, running until the batch's longest answer is done (every request's answer
  is its first ``max_new_tokens`` tokens);
* continuous: ``BatchGenerator(max_batch_size=--batch-size)``.

Throughput counts the tokens requests asked for (output tokens / wall time); latency is each
request's finish time from the workload's start (p50, p95). Static and continuous run
``--repeats`` interleaved rounds (default 3) and each keeps its fastest; one by one runs once
(its answers are the reference continuous batching's answers are checked against).

Run: python scripts/bench_batching.py [--requests 64] [--batch-size 8] [--repeats 3]
[--json OUT]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from _bench_models import bench_processor, load_bench_model, random_images

from ascend_vlm.batching import BatchGenerator, GenerationRequest

IMAGE_SIDE = 224
WORDS = ["shape", "colour", "left", "right", "circle", "square", "red", "blue", "count", "where"]


def workload(count: int, min_new: int, max_new: int, seed: int) -> list[GenerationRequest]:
    """The mixed requests (see the module docstring)."""
    rng = random.Random(seed)
    requests = []
    for index in range(count):
        pictures = rng.choices([0, 1, 3], weights=[0.4, 0.4, 0.2])[0]
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 40)))
        requests.append(
            GenerationRequest.from_prompt(
                text,
                random_images(pictures, IMAGE_SIDE, seed * 1000 + index),
                max_new_tokens=rng.randint(min_new, max_new),
                request_id=f"r{index}",
            )
        )
    return requests


def _suppress_eos(model) -> None:
    """Every answer runs to its max_new_tokens, as its request asked (random weights would end
    some at random)."""
    model.generation_config.eos_token_id = None


def _prompt(processor, request: GenerationRequest) -> str:
    return processor.apply_chat_template(
        list(request.messages), tokenize=False, add_generation_prompt=True
    )


def one_by_one(model, processor, requests) -> tuple[dict[str, list[int]], dict[str, float], float]:
    answers, finished = {}, {}
    start = time.perf_counter()
    for request in requests:
        images = request.images()
        inputs = processor(
            text=[_prompt(processor, request)], images=images or None, return_tensors="pt"
        )
        with torch.no_grad():
            output = model.generate(
                **inputs, max_new_tokens=request.max_new_tokens, do_sample=False
            )
        answers[request.request_id] = output[0, inputs["input_ids"].shape[1] :].tolist()
        finished[request.request_id] = time.perf_counter() - start
    return answers, finished, time.perf_counter() - start


def static_batches(model, processor, requests, batch_size: int) -> tuple[dict[str, float], float]:
    finished = {}
    start = time.perf_counter()
    tokenizer = processor.tokenizer
    for first in range(0, len(requests), batch_size):
        batch = requests[first : first + batch_size]
        images = [image for request in batch for image in request.images()]
        tokenizer.padding_side = "left"
        inputs = processor(
            text=[_prompt(processor, request) for request in batch],
            images=images or None,
            padding=True,
            return_tensors="pt",
        )
        with torch.no_grad():
            model.generate(
                **inputs,
                max_new_tokens=max(request.max_new_tokens for request in batch),
                do_sample=False,
            )
        done = time.perf_counter() - start
        finished.update({request.request_id: done for request in batch})
    return finished, time.perf_counter() - start


def continuous(model, processor, requests, batch_size: int):
    generator = BatchGenerator(model, processor, max_batch_size=batch_size)
    start = time.perf_counter()
    results = generator.generate_many(requests)
    wall = time.perf_counter() - start
    # submissions encode prompts before the first step; finish times count from the start
    finished = {r.request_id: r.finished - results[0].submitted for r in results}
    return {r.request_id: list(r.tokens) for r in results}, finished, wall, generator.stats()


def _row(name: str, tokens: int, wall: float, finished: dict[str, float]) -> dict:
    latencies = sorted(finished.values())
    return {
        "method": name,
        "seconds": wall,
        "tokens_per_s": tokens / wall,
        "p50_s": statistics.median(latencies),
        "p95_s": latencies[min(len(latencies) - 1, round(0.95 * (len(latencies) - 1)))],
    }


def _table(rows: list[dict]) -> str:
    static = next(row for row in rows if row["method"].startswith("static"))
    lines = [
        "| method | wall s | output tokens/s | vs static | p50 latency s | p95 latency s |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['method']} | {row['seconds']:.1f} | {row['tokens_per_s']:.1f} "
            f"| {row['tokens_per_s'] / static['tokens_per_s']:.2f}x | {row['p50_s']:.1f} "
            f"| {row['p95_s']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--min-new", type=int, default=4)
    parser.add_argument("--max-new", type=int, default=128)
    parser.add_argument("--layers", type=int, default=8, help="language-model depth")
    parser.add_argument(
        "--repeats", type=int, default=3, help="rounds of static and continuous (best kept)"
    )
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write every figure to this file")
    args = parser.parse_args(argv)
    for flag in ("requests", "batch_size", "min_new", "layers", "threads", "repeats"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')}: expected an int >= 1")
    if args.max_new < args.min_new:
        parser.error(f"--max-new: expected >= --min-new ({args.min_new}), got {args.max_new}")
    torch.set_num_threads(args.threads)
    processor = bench_processor(IMAGE_SIDE)
    requests = workload(args.requests, args.min_new, args.max_new, args.seed)
    tokens = sum(request.max_new_tokens for request in requests)
    with tempfile.TemporaryDirectory() as folder:
        print(f"[bench_batching] building the {args.layers}-layer model", flush=True)
        model = load_bench_model(Path(folder), args.layers)
    _suppress_eos(model)
    print("[bench_batching] one by one", flush=True)
    answers, alone_finished, alone_wall = one_by_one(model, processor, requests)
    static_runs, continuous_runs = [], []
    for round_index in range(args.repeats):  # interleaved rounds: best of each, as the others
        print(f"[bench_batching] static batches and continuous, round {round_index + 1}")
        static_runs.append(static_batches(model, processor, requests, args.batch_size))
        continuous_runs.append(continuous(model, processor, requests, args.batch_size))
    static_finished, static_wall = min(static_runs, key=lambda run: run[1])
    batched, batched_finished, batched_wall, stats = min(continuous_runs, key=lambda run: run[2])
    mismatched = [key for key in answers if answers[key] != batched[key]]
    rows = [
        _row("one by one", tokens, alone_wall, alone_finished),
        _row(f"static, batches of {args.batch_size}", tokens, static_wall, static_finished),
        _row(f"continuous, up to {args.batch_size}", tokens, batched_wall, batched_finished),
    ]
    report = {
        "requests": args.requests,
        "output_tokens": tokens,
        "rows": rows,
        "continuous_equals_one_by_one": not mismatched,
        "budget_utilisation": stats.utilisation,
    }
    print(
        f"\n{args.requests} requests ({tokens} output tokens), {args.layers} language layers, "
        f"{args.threads} threads:\n"
    )
    print(_table(rows))
    print(
        f"\ncontinuous answers equal one-by-one generate: {not mismatched}"
        + (f" (differ: {mismatched[:5]})" if mismatched else "")
    )
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
