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
``--repeats`` interleaved rotating rounds (default 3) and each keeps its fastest; static runs a
second time in every round (the A/A row: its ratio to the first is the noise floor of every
ratio, in the A/A column); one by one runs once
(its answers are the reference continuous batching's answers are checked against).

Two more sections (``--sections``, all by default):

* memory: the continuous run of the workload, sampled at every token: KV bytes the running
  sequences hold in blocks (``--block-size``) against the bytes their tokens need, and against
  the right-aligned shared cache batching used before (rows x longest row), summed over steps;
* prefix: a conversation's second turn (the first turn's ``--turn-images`` 224x224 images
  and ``--turn-words``-word question and its 16-token answer repeated, then a short question): time to first token
  with the prefix cache (after the first turn ran) and without, ``--repeats`` interleaved
  rounds after a warm-up, medians, and an A/A row (without against without).

Run: python scripts/bench_batching.py [--requests 64] [--batch-size 8] [--repeats 3]
[--sections throughput memory prefix] [--json OUT]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from _bench_models import bench_processor, load_bench_model, random_images
from _bench_record import write_record

from ascend_vlm.batching import BatchGenerator, GenerationRequest
from ascend_vlm.batching.budgets import kv_bytes_per_token

IMAGE_SIDE = 224
SECTIONS = ("throughput", "memory", "prefix")
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


def kv_memory(model, processor, requests, batch_size: int, block_size: int) -> dict[str, float]:
    """KV bytes summed over every token event of a continuous run: ``held`` in blocks,
    ``needed`` by the tokens, ``padded`` in a right-aligned shared cache (rows x longest)."""
    generator = BatchGenerator(
        model, processor, max_batch_size=batch_size, kv_block_size=block_size, prefix_cache=False
    )
    for request in requests:
        generator.submit(request)
    per_token = kv_bytes_per_token(model)
    totals = {"held": 0.0, "needed": 0.0, "padded": 0.0}
    for _ in generator.run():
        lengths = generator.running_kv_tokens()
        if lengths:
            totals["held"] += generator.kv_bytes()
            totals["needed"] += sum(lengths) * per_token
            totals["padded"] += len(lengths) * max(lengths) * per_token
    return totals


def conversation(images: int, words: int, seed: int) -> tuple[GenerationRequest, list[dict]]:
    """A first turn (``images`` images and a ``words``-word question) and the messages of its second
    turn without the first answer (see the module docstring)."""
    rng = random.Random(seed)
    question = " ".join(rng.choice(WORDS) for _ in range(words))
    parts = [{"type": "image", "image": image} for image in random_images(images, IMAGE_SIDE, seed)]
    first = [{"role": "user", "content": [*parts, {"type": "text", "text": question}]}]
    return GenerationRequest(first, max_new_tokens=16), first


def second_turn_ttft(
    model, processor, images: int, words: int, rounds: int
) -> dict[str, list[float]]:
    """Seconds to the second turn's first token, per round: "reuse" (a prefix-cached
    generator that ran the first turn), "fresh" and "fresh (A/A)" (generators without)."""
    samples: dict[str, list[float]] = {"reuse": [], "fresh": [], "fresh (A/A)": []}
    for round_index in range(rounds + 1):  # round 0 warms up
        first, messages = conversation(images, words, round_index)
        cached = BatchGenerator(model, processor)
        reply = cached.generate_many([first])[0].text
        second = GenerationRequest(
            [*messages, {"role": "assistant", "content": [{"type": "text", "text": reply}]},
             {"role": "user", "content": [{"type": "text", "text": "and what else?"}]}],
            max_new_tokens=1,
        )  # fmt: skip
        runs = {
            "reuse": cached,
            "fresh": BatchGenerator(model, processor, prefix_cache=False),
            "fresh (A/A)": BatchGenerator(model, processor, prefix_cache=False),
        }
        for name, generator in runs.items():
            result = generator.generate_many([second])[0]
            if round_index:
                samples[name].append(result.time_to_first_token)
        if round_index == 1:
            print(
                f"[bench_batching] second turn: {result.prompt_tokens} prompt tokens, "
                f"{cached.stats().reused_tokens} reused",
                flush=True,
            )
    return samples


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
    parser.add_argument(
        "--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS), help="what to run"
    )
    parser.add_argument("--block-size", type=int, default=16, help="KV block size (memory)")
    parser.add_argument("--turn-words", type=int, default=200, help="first-turn words (prefix)")
    parser.add_argument("--turn-images", type=int, default=4, help="first-turn images (prefix)")
    parser.add_argument("--json", type=Path, help="also write every figure to this file")
    args = parser.parse_args(argv)
    for flag in ("requests", "batch_size", "min_new", "layers", "threads", "repeats",
                 "block_size", "turn_words", "turn_images"):  # fmt: skip
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
    header = ["section", "measure", "ours", "baseline", "ours/baseline", "A/A"]
    records: list[list[str]] = []
    if "throughput" in args.sections:
        records += throughput(model, processor, requests, tokens, args)
    if "memory" in args.sections:
        totals = kv_memory(model, processor, requests, args.batch_size, args.block_size)
        print(f"\nKV bytes per running row, blocks of {args.block_size} (summed over steps):")
        for baseline in ("needed", "padded"):
            ratio = totals["held"] / totals[baseline]
            print(f"  blocks / {baseline}: {ratio:.3f}")
            records.append(["memory", f"KV bytes, blocks vs {baseline}", f"{totals['held']:.0f}",
                            f"{totals[baseline]:.0f}", f"{ratio:.3f}", "-"])  # fmt: skip
    if "prefix" in args.sections:
        samples = second_turn_ttft(
            model, processor, args.turn_images, args.turn_words, args.repeats
        )
        ttft = {name: statistics.median(times) for name, times in samples.items()}
        speedup, noise = ttft["fresh"] / ttft["reuse"], ttft["fresh"] / ttft["fresh (A/A)"]
        print(
            f"\nsecond-turn time to first token (median of {args.repeats}): with reuse "
            f"{ttft['reuse'] * 1e3:.1f} ms, without {ttft['fresh'] * 1e3:.1f} ms: "
            f"{speedup:.1f}x faster (A/A {noise:.2f})"
        )
        records.append(["prefix", "second-turn TTFT ms, reuse vs none",
                        f"{ttft['reuse'] * 1e3:.1f}", f"{ttft['fresh'] * 1e3:.1f}",
                        f"{1 / speedup:.3f}", f"{noise:.2f}"])  # fmt: skip
    if args.json is not None:
        write_record(args.json, sys.argv[0], list(argv or sys.argv[1:]), header, records)
    return 0


def throughput(model, processor, requests, tokens: int, args) -> list[list[str]]:
    """One by one, static and continuous (module docstring); the table printed, its rows."""
    print("[bench_batching] one by one", flush=True)
    answers, alone_finished, alone_wall = one_by_one(model, processor, requests)
    # Static batches run twice per round: the second ("A/A") is the noise floor of the ratios.
    runs: dict[str, list] = {"static": [], "continuous": [], "static (A/A)": []}
    contenders = {
        "static": lambda: static_batches(model, processor, requests, args.batch_size),
        "continuous": lambda: continuous(model, processor, requests, args.batch_size),
        "static (A/A)": lambda: static_batches(model, processor, requests, args.batch_size),
    }
    names = list(contenders)
    for round_index in range(args.repeats):  # interleaved rotating rounds: best of each
        print(f"[bench_batching] static batches and continuous, round {round_index + 1}")
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            runs[name].append(contenders[name]())
    static_finished, static_wall = min(runs["static"], key=lambda run: run[1])
    again_finished, again_wall = min(runs["static (A/A)"], key=lambda run: run[1])
    batched, batched_finished, batched_wall, stats = min(runs["continuous"], key=lambda run: run[2])
    mismatched = [key for key in answers if answers[key] != batched[key]]
    rows = [
        _row("one by one", tokens, alone_wall, alone_finished),
        _row(f"static, batches of {args.batch_size}", tokens, static_wall, static_finished),
        _row(f"continuous, up to {args.batch_size}", tokens, batched_wall, batched_finished),
        _row(f"static, batches of {args.batch_size} (A/A)", tokens, again_wall, again_finished),
    ]
    noise = f"{static_wall / again_wall:.2f}"
    print(
        f"\n{args.requests} requests ({tokens} output tokens), {args.layers} language layers, "
        f"{args.threads} threads:\n"
    )
    print(_table(rows))
    print(
        f"\ncontinuous answers equal one-by-one generate: {not mismatched}"
        + (f" (differ: {mismatched[:5]})" if mismatched else "")
    )
    print(f"budget utilisation: {stats.utilisation}")
    static = rows[1]["tokens_per_s"]
    records = []
    for row in rows:
        records += [
            ["throughput", f"{row['method']}: output tokens/s", f"{row['tokens_per_s']:.1f}",
             f"{static:.1f}", f"{row['tokens_per_s'] / static:.2f}", noise],
            ["throughput", f"{row['method']}: p50, p95 latency s", f"{row['p50_s']:.2f}",
             f"{row['p95_s']:.2f}", "-", "-"],
        ]  # fmt: skip
    records.append(["throughput", "continuous answers equal one by one", str(not mismatched),
                    "-", "-", "-"])  # fmt: skip
    records += [
        ["throughput", f"{name} utilisation", f"{share:.3f}", "-", "-", "-"]
        for name, share in stats.utilisation.items()
    ]
    return records


if __name__ == "__main__":
    sys.exit(main())
