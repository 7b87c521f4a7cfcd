"""Serving many LoRA adapters over one base (``ascend_vlm.adapters.AdapterSet``): switch latency
among resident adapters, load-from-disk latency, and a mixed-adapter batch against switching
per request, measured side by side in one run.

The model is the benchmark Qwen2-VL of ``scripts/_bench_models.py`` (8 language layers of
width 256, a 4-layer vision tower), patched; adapters are rank ``--rank`` (default 8) LoRAs on
every language-model projection (q, k, v, o, gate, up, down), random weights saved with
``save_pretrained`` (safetensors).

* load: ``AdapterSet.load`` of one adapter folder (config check, shape check, PEFT load), the
  median over the 32 loads, and the first and last (PEFT's load walks every layer's
  per-adapter containers, so it grows with the adapters resident);
* switch: ``AdapterSet.activate`` of a random resident adapter, median of ``--switches`` switches,
  with 1, 8 and 32 adapters resident (target: <= 10 ms at 32);
* mixed batch: 8 requests (one 224x224 image, ``--new-tokens`` greedy tokens each) for 8
  different adapters, as one ``AdapterSet.generate`` with one adapter per row against 8
  single-request generates each after switching to its adapter (target: >= 3x); best of
  ``--repeats`` interleaved rounds.

Run: python scripts/bench_adapters.py [--rank 8] [--new-tokens 16] [--repeats 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from _bench_models import bench_processor, load_bench_model, random_images

import ascend_vlm
from ascend_vlm.adapters.adapter_set import AdapterSet

IMAGE_SIDE = 224
RESIDENT = (1, 8, 32)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_adapters(base, folder: Path, count: int, rank: int) -> list[Path]:
    """``count`` random rank-``rank`` LoRA adapters of ``base`` saved under ``folder``."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS)
    peft_model = get_peft_model(copy.deepcopy(base), config)
    folders = []
    for index in range(count):
        torch.manual_seed(index)
        for name, parameter in peft_model.named_parameters():
            if "lora_" in name:
                torch.nn.init.normal_(parameter, std=0.02)
        folders.append(folder / f"adapter{index}")
        peft_model.save_pretrained(folders[-1])
    return folders


def _inputs(processor, rows: int):
    content = [{"type": "image"}, {"type": "text", "text": "Describe the picture."}]
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    images = random_images(rows, IMAGE_SIDE, seed=0)
    return processor(text=[prompt] * rows, images=images, return_tensors="pt")


def _seconds(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def switch_ms(served: AdapterSet, names: list[str], switches: int) -> float:
    """Median milliseconds of ``activate`` to a random other resident adapter."""
    chooser = random.Random(0)
    samples = []
    for _ in range(switches):
        name = chooser.choice([n for n in names if n != served.active] or names)
        samples.append(_seconds(lambda name=name: served.activate(name)))
    return statistics.median(samples) * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--switches", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3, help="mixed-batch rounds (best kept)")
    parser.add_argument("--layers", type=int, default=8, help="language-model depth")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--json", type=Path, help="also write every figure to this file")
    args = parser.parse_args(argv)
    for flag in ("rank", "new_tokens", "switches", "repeats", "layers", "threads"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')}: expected an int >= 1")
    torch.set_num_threads(args.threads)
    processor = bench_processor(IMAGE_SIDE)
    report: dict = {"rank": args.rank}
    with tempfile.TemporaryDirectory() as folder:
        print(f"[bench_adapters] building the {args.layers}-layer model", flush=True)
        base = load_bench_model(Path(folder) / "base", args.layers)
        ascend_vlm.patch(base)
        print(f"[bench_adapters] saving {max(RESIDENT)} adapters", flush=True)
        folders = save_adapters(base, Path(folder), max(RESIDENT), args.rank)
        served = AdapterSet(base)
        loads, switching = [], {}
        for index, path in enumerate(folders):
            loads.append(_seconds(lambda index=index, path=path: served.load(f"n{index}", path)))
            if index + 1 in RESIDENT:
                switching[index + 1] = switch_ms(served, list(served.names), args.switches)
        report["load_ms"] = statistics.median(loads) * 1e3
        report["load_ms_first_last"] = [loads[0] * 1e3, loads[-1] * 1e3]
        report["switch_ms"] = switching

        rows = 8
        names = list(served.names[:rows])
        batch = _inputs(processor, rows)
        single = _inputs(processor, 1)
        settings = {"max_new_tokens": args.new_tokens, "min_new_tokens": args.new_tokens}
        settings["do_sample"] = False

        def mixed() -> None:
            served.generate(names, **batch, **settings)

        def switched() -> None:
            for name in names:
                served.activate(name)
                served.model.generate(**single, **settings)

        print("[bench_adapters] mixed batch against switching", flush=True)
        with torch.no_grad():
            mixed(), switched()  # warm-up
            runs = {"mixed": [], "switched": []}
            for _ in range(args.repeats):
                runs["mixed"].append(_seconds(mixed))
                runs["switched"].append(_seconds(switched))
        best = {key: min(values) for key, values in runs.items()}
        report["mixed_batch_s"] = best["mixed"]
        report["switched_s"] = best["switched"]
        report["mixed_speedup"] = best["switched"] / best["mixed"]

    print(
        f"\nrank-{args.rank} adapters on 7 projections x {args.layers} layers, {args.threads} threads:\n"
    )
    first, last = report["load_ms_first_last"]
    print(
        f"load from disk (median of {len(loads)}): {report['load_ms']:.1f} ms "
        f"(the first {first:.1f} ms, the last, beside {len(loads) - 1} others, {last:.1f} ms)"
    )
    print("\n| adapters resident | switch ms (median) |")
    print("|---|---|")
    for count, value in switching.items():
        print(f"| {count} | {value:.3f} |")
    print(
        f"\n8 requests x {args.new_tokens} tokens, 8 adapters: mixed batch "
        f"{report['mixed_batch_s']:.2f} s, switched one by one {report['switched_s']:.2f} s, "
        f"{report['mixed_speedup']:.2f}x"
    )
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
