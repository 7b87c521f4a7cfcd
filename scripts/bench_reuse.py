"""Reuse across turns and requests: the vision-feature cache and chat sessions, measured side by
side in one run.

The model is Qwen2-VL-shaped with the embedded default model's tokenizer and chat template, at a
size where the vision tower is a realistic share of prefill (as in Qwen2-VL-2B, where a 448x448
image's 1024 patches cost the 675M-parameter tower about as much as the language model's
prefill): a 4-layer vision tower of width 256 and an 8-layer language model of width 256, random
weights saved and loaded with ``from_pretrained``; images are 448x448 (1024 patches, 256
visual tokens each). Timings are the best of ``--repeats`` interleaved rounds (after a warm-up
call of each), greedy decoding; every stock run is timed twice, and the A/A column (stock /
its twin) is the noise floor the speed-ups should be read against.

* hash: the cache's key of one 448x448 image's pixels (XXH3-128 over 4.8 MB), median;
* repeated image across requests: time to first token of a second request showing the same
  image with another question, with the cache (the image encoded by the first request) vs
  without;
* turn 2 of a chat: time to first token and the whole turn (``--new-tokens`` tokens) of the
  second question about 1 or 4 images, with a ChatSession + cache (``session.ask``, from a fork
  of the session after turn 1) vs stock ``generate`` over the whole conversation from scratch.

Run: python scripts/bench_reuse.py [--repeats 5] [--new-tokens 16] [--json OUT]
(OUT: the second-turn table as JSON for docs/benchmarks/, see _bench_record.py)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from _bench_models import bench_processor, load_bench_model, random_images
from _bench_record import show_table

from ascend_vlm.reuse import ChatSession, VisionCache, disable_vision_cache, enable_vision_cache
from ascend_vlm.reuse.vision_cache import content_key

IMAGE_SIDE = 448


def prompt_inputs(processor, conversation: list[dict], pictures: list) -> dict:
    """Processor inputs of ``conversation`` (chat-template messages) with ``pictures``."""
    text = processor.apply_chat_template(conversation, add_generation_prompt=True)
    return dict(processor(text=[text], images=pictures or None, return_tensors="pt"))


def user(question: str, pictures: int = 0) -> dict:
    content = [{"type": "image"}] * pictures + [{"type": "text", "text": question}]
    return {"role": "user", "content": content}


def _best(
    functions: dict[str, Callable[[], Callable[[], object]]], rounds: int
) -> dict[str, float]:
    """Best seconds per function over ``rounds`` interleaved rounds (after one warm-up each).
    Each entry makes, untimed, the call to time (so a session is forked outside the clock)."""
    for prepare in functions.values():
        prepare()()
    names = list(functions)
    best = dict.fromkeys(names, float("inf"))
    for round_index in range(rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            call = functions[name]()
            start = time.perf_counter()
            call()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def _generate(model, inputs: dict, new_tokens: int):
    with torch.no_grad():
        return model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False)


def bench_hash(processor, repeats: int = 50) -> float:
    """Median milliseconds of the cache key of one 448x448 image's pixels."""
    inputs = prompt_inputs(processor, [user("x", 1)], random_images(1, IMAGE_SIDE, 0))
    pixels, grid = inputs["pixel_values"], tuple(inputs["image_grid_thw"][0].tolist())
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        content_key(pixels, grid)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def bench_repeated_image(model, processor, rounds: int) -> dict[str, float]:
    """Time to first token of a second request showing the first request's image."""
    picture = random_images(1, IMAGE_SIDE, 1)
    first = prompt_inputs(processor, [user("What is in the picture?", 1)], picture)
    second = prompt_inputs(processor, [user("Which colour dominates?", 1)], picture)
    cache = VisionCache(max_bytes=256 << 20)

    def cached():
        enable_vision_cache(model, cache)
        _generate(model, second, 1)
        disable_vision_cache(model)

    enable_vision_cache(model, cache)
    _generate(model, first, 1)
    disable_vision_cache(model)
    calls = {
        "stock": lambda: lambda: _generate(model, second, 1),
        "stock_aa": lambda: lambda: _generate(model, second, 1),
        "cached": lambda: cached,
    }
    best = _best(calls, rounds)
    return {"stock_s": best["stock"], "stock_aa_s": best["stock_aa"], "cached_s": best["cached"]}


def bench_second_turn(model, processor, count: int, new_tokens: int, rounds: int) -> dict:
    """Turn 2 of a chat about ``count`` images: first token and whole turn, session + cache vs
    stock generate over the whole conversation."""
    pictures = random_images(count, IMAGE_SIDE, 10 + count)
    first_question, second_question = "Describe the pictures.", "And what is in the corner?"
    cache = VisionCache(max_bytes=256 << 20)
    enable_vision_cache(model, cache)
    session = ChatSession(model, processor)
    answer = session.ask(first_question, pictures, max_new_tokens=new_tokens)
    disable_vision_cache(model)
    conversation = [
        user(first_question, count),
        {"role": "assistant", "content": [{"type": "text", "text": answer}]},
        user(second_question),
    ]
    full = prompt_inputs(processor, conversation, pictures)

    def with_session(tokens: int) -> Callable[[], object]:
        fork = session.fork()

        def ask() -> None:
            enable_vision_cache(model, cache)
            fork.ask(second_question, max_new_tokens=tokens)
            disable_vision_cache(model)

        return ask

    calls = {
        "stock_first": lambda: lambda: _generate(model, full, 1),
        "stock_first_aa": lambda: lambda: _generate(model, full, 1),
        "session_first": lambda: with_session(1),
        "stock_turn": lambda: lambda: _generate(model, full, new_tokens),
        "stock_turn_aa": lambda: lambda: _generate(model, full, new_tokens),
        "session_turn": lambda: with_session(new_tokens),
    }
    best = _best(calls, rounds)
    return {"images": count, "prompt_tokens": int(full["input_ids"].shape[1]), **best}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds per setting")
    parser.add_argument("--new-tokens", type=int, default=16, help="tokens of a whole turn")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--json", type=Path, help="also write the second-turn table to this file")
    args = parser.parse_args(argv)
    for flag in ("repeats", "new_tokens", "threads"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')}: expected an int >= 1")
    torch.set_num_threads(args.threads)
    processor = bench_processor(IMAGE_SIDE)
    report: dict = {"threads": args.threads, "repeats": args.repeats}
    report["hash_ms"] = bench_hash(processor)
    print(f"hash of one {IMAGE_SIDE}x{IMAGE_SIDE} image's pixels: {report['hash_ms']:.3f} ms")
    with tempfile.TemporaryDirectory() as folder:
        model = load_bench_model(Path(folder))
    repeated = bench_repeated_image(model, processor, args.repeats)
    report["repeated_image"] = repeated
    print(
        f"repeated image, second request, time to first token: stock {repeated['stock_s']:.3f} s, "
        f"cached {repeated['cached_s']:.3f} s ({repeated['stock_s'] / repeated['cached_s']:.2f}x; "
        f"A/A stock / stock {repeated['stock_s'] / repeated['stock_aa_s']:.2f}x)"
    )
    report["second_turn"] = [
        bench_second_turn(model, processor, count, args.new_tokens, args.repeats)
        for count in (1, 4)
    ]
    print(
        f"\nturn 2 of a chat, best of {args.repeats}, {args.threads} threads "
        f"({args.new_tokens}-token turns):\n"
    )
    header, rows = _second_turn_table(report["second_turn"], args.new_tokens)
    show_table(header, rows, args.json, sys.argv[0], list(argv or sys.argv[1:]))
    return 0


def _second_turn_table(rows: list[dict], new_tokens: int) -> tuple[list[str], list[list[str]]]:
    """The second-turn figures as a header and rows of cells, each speed-up beside its A/A."""
    header = ["images", "prompt tokens", "first token: stock s", "session + cache s"]
    header += ["speed-up", "A/A", f"whole turn ({new_tokens} tokens): stock s"]
    header += ["session + cache s (turn)", "speed-up (turn)", "A/A (turn)"]
    cells = []
    for row in rows:
        cells.append(
            [
                str(row["images"]),
                str(row["prompt_tokens"]),
                f"{row['stock_first']:.3f}",
                f"{row['session_first']:.3f}",
                f"{row['stock_first'] / row['session_first']:.1f}x",
                f"{row['stock_first'] / row['stock_first_aa']:.2f}x",
                f"{row['stock_turn']:.3f}",
                f"{row['session_turn']:.3f}",
                f"{row['stock_turn'] / row['session_turn']:.1f}x",
                f"{row['stock_turn'] / row['stock_turn_aa']:.2f}x",
            ]
        )
    return header, cells


if __name__ == "__main__":
    sys.exit(main())
