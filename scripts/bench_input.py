"""Image preprocessing throughput: Hugging Face's Qwen2-VL PIL image processor against
``ascend_vlm.vision_input.QwenVLPixels`` with 1 and 2 worker threads, side by side.

For each input size, ``--images`` random-noise RGB images (PIL, decoded already) are turned
into ``pixel_values`` and ``image_grid_thw`` by each processor, in interleaved rounds; the
best round's images per second is kept (contention only adds time). The outputs are checked
equal (bit for bit) before anything is timed. The processor settings are the model's
defaults (at most 1280 merged tokens' worth of pixels), so a 1344x896 image is shrunk.

Run: python scripts/bench_input.py [--images 16] [--rounds 5] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ascend_vlm.vision_input import QwenVLPixels

SIZES = ((448, 448), (1344, 896))  # width x height


def main(argv: list[str] | None = None) -> int:
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=16, help="images per call")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (best kept)")
    parser.add_argument("--json", type=Path, help="also write every figure to this file")
    args = parser.parse_args(argv)
    for flag in ("images", "rounds"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag}: expected an int >= 1")
    torch.set_num_threads(1)
    reference = Qwen2VLImageProcessorPil()
    candidates = {
        "hugging face (PIL)": lambda images: reference(images=images, return_tensors="pt"),
        "QwenVLPixels, 1 worker": QwenVLPixels(reference, workers=1),
        "QwenVLPixels, 2 workers": QwenVLPixels(reference, workers=2),
    }
    rng = np.random.default_rng(0)
    report = {}
    print(f"{args.images} images per call, best of {args.rounds} interleaved rounds\n")
    print("| input | processor | images/s | vs Hugging Face |")
    print("|---|---|---|---|")
    for width, height in SIZES:
        images = [
            Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
            for _ in range(args.images)
        ]
        expected = candidates["hugging face (PIL)"](images)
        for name, run in candidates.items():
            got = run(images)
            if not torch.equal(got["pixel_values"], expected["pixel_values"]):
                raise SystemExit(f"{name}: pixel_values differ from Hugging Face's")
        best = dict.fromkeys(candidates, float("inf"))
        for _ in range(args.rounds):
            for name, run in candidates.items():
                start = time.perf_counter()
                run(images)
                best[name] = min(best[name], time.perf_counter() - start)
        rates = {name: args.images / seconds for name, seconds in best.items()}
        base = rates["hugging face (PIL)"]
        for name, rate in rates.items():
            print(f"| {width}x{height} | {name} | {rate:.1f} | {rate / base:.2f}x |")
        report[f"{width}x{height}"] = rates
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
