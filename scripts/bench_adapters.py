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
  single-request generates each after switching to its adapter (target: >= 3x); a warm-up
  call of each, then the median of ``--repeats`` interleaved rounds in a rotating order. The
  switching run is timed twice ("switched (A/A)"): its ratio to the first is the noise floor of
  the speed-up.

Run: python scripts/bench_adapters.py [--rank 8] [--new-tokens 16] [--repeats 3] [--json OUT]
(OUT: the table as JSON for docs/benchmarks/, see _bench_record.py)
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from _bench_models import bench_processor, load_bench_model, random_images
from _bench_record import show_table
from _bench_timing import interleaved_ms

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


HEADER = ["measurement", "ours", "switched per request", "switched (A/A)", "A/A", "speed-up"]


def mixed_batch_row(served: AdapterSet, processor, new_tokens: int, rounds: int) -> list[str]:
    """8 requests for 8 adapters as one mixed batch against switching per request, in seconds,
    with the switching run's A/A twin; cells under :data:`HEADER`."""
    rows = 8
    names = list(served.names[:rows])
    batch = _inputs(processor, rows)
    single = _inputs(processor, 1)
    settings = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False}

    def mixed() -> None:
        served.generate(names, **batch, **settings)

    def switched() -> None:
        for name in names:
            served.activate(name)
            served.model.generate(**single, **settings)

    calls = {"mixed": mixed, "switched": switched, "switched (A/A)": switched}
    with torch.no_grad():
        seconds = {name: ms / 1e3 for name, ms in interleaved_ms(calls, rounds).items()}
    return [
        f"8 requests x {new_tokens} tokens, 8 adapters (s)",
        f"{seconds['mixed']:.4g}",
        f"{seconds['switched']:.4g}",
        f"{seconds['switched (A/A)']:.4g}",
        f"{seconds['switched (A/A)'] / seconds['switched']:.2f}",
        f"{seconds['switched'] / seconds['mixed']:.2f}x",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--switches", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3, help="mixed-batch interleaved rounds")
    parser.add_argument("--layers", type=int, default=8, help="language-model depth")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--json", type=Path, help="also write the table to this file")
    args = parser.parse_args(argv)
    for flag in ("rank", "new_tokens", "switches", "repeats", "layers", "threads"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')}: expected an int >= 1")
    torch.set_num_threads(args.threads)
    processor = bench_processor(IMAGE_SIDE)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        print(f"[bench_adapters] building the {args.layers}-layer model", flush=True)
        base = load_bench_model(Path(folder) / "base", args.layers)
        ascend_vlm.patch(base)
        print(f"[bench_adapters] saving {max(RESIDENT)} adapters", flush=True)
        folders = save_adapters(base, Path(folder), max(RESIDENT), args.rank)
        served = AdapterSet(base)
        loads = []
        for index, path in enumerate(folders):
            loads.append(_seconds(lambda index=index, path=path: served.load(f"n{index}", path)))
            if index + 1 in RESIDENT:
                first, again = (switch_ms(served, list(served.names), args.switches) for _ in "ab")
                label = f"switch, {index + 1} resident (ms, median)"
                rows.append(
                    [label, f"{first:.4g}", "-", f"{again:.4g}", f"{again / first:.2f}", "-"]
                )
        load_ms = statistics.median(loads) * 1e3
        rows.insert(0, [f"load from disk (ms, median of {len(loads)})", f"{load_ms:.1f}", *"-----"])
        print("[bench_adapters] mixed batch against switching", flush=True)
        rows.append(mixed_batch_row(served, processor, args.new_tokens, args.repeats))
    print(
        f"\nrank-{args.rank} adapters on 7 projections x {args.layers} layers, {args.threads} threads"
    )
    print("(switch rows: the A/A column is the same switching measured a second time)\n")
    show_table(HEADER, rows, args.json, sys.argv[0], list(argv or sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
