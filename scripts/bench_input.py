"""Image input speed: preprocessing throughput of Hugging Face's PIL image processors (Qwen2-VL;
LLaVA-1.5's CLIP 336 with padding) against ``ascend_vlm.vision_input``'s ``QwenVLPixels`` and
``ResizeCropPixels`` (1 and 2 worker threads), side by side.

For each family and input size, ``--images`` random-noise RGB images (PIL, decoded already)
are turned into ``pixel_values`` (and Qwen's ``image_grid_thw``) by each processor: a warm-up
call each, then ``--rounds`` interleaved rounds in a rotating order, medians kept. Hugging
Face's processor runs twice per round; the ratio of its twin to it (the ``A/A`` column) is the
noise floor of the speed-ups beside it.
The outputs are checked equal (bit for bit) before anything is timed. Qwen2-VL's settings are
the model's defaults (at most 1280 merged tokens' worth of pixels, so a 1344x896 image is
shrunk); LLaVA-1.5 pads to a square in the mean colour, resizes to 336 and crops.

Run: python scripts/bench_input.py [--images 16] [--rounds 5] [--json OUT]
(OUT: the preprocessing table as JSON for docs/benchmarks/, see _bench_record.py)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _bench_record import write_record
from _bench_timing import interleaved_ms
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ascend_vlm.vision_input import QwenVLPixels, ResizeCropPixels

SIZES = ((448, 448), (1344, 896))  # width x height
HUGGING_FACE = "hugging face (PIL)"
HEADER = ["model family", "input", "processor", "images/s", "vs Hugging Face", "A/A"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=16, help="images per call")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (medians kept)")
    parser.add_argument("--json", type=Path, help="also write the preprocessing table here")
    args = parser.parse_args(argv)
    for flag in ("images", "rounds"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag}: expected an int >= 1")
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    rows = []
    print(f"{args.images} images per call, median of {args.rounds} interleaved rounds\n")
    print("| " + " | ".join(HEADER) + " |")
    print("|---|---|---|" + "---:|" * (len(HEADER) - 3))
    for family, (reference, fast) in _families().items():
        candidates = {
            HUGGING_FACE: lambda images, r=reference: r(images=images, return_tensors="pt"),
            f"{fast.__name__}, 1 worker": fast(reference, workers=1),
            f"{fast.__name__}, 2 workers": fast(reference, workers=2),
        }
        for width, height in SIZES:
            images = [
                Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
                for _ in range(args.images)
            ]
            rates = _images_per_second(candidates, images, args.rounds)
            base, twin = rates[HUGGING_FACE], rates.pop(f"{HUGGING_FACE} (A/A)")
            for name, rate in rates.items():
                cells = [family, f"{width}x{height}", name, f"{rate:.1f}", f"{rate / base:.2f}x"]
                rows.append([*cells, f"{twin / base:.2f}"])
                print("| " + " | ".join(rows[-1]) + " |")
    if args.json is not None:
        write_record(args.json, sys.argv[0], list(argv or sys.argv[1:]), HEADER, rows)
    return 0


def _families() -> dict[str, tuple[Any, type]]:
    """Each model family's Hugging Face PIL processor (default settings) and our drop-in."""
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    llava = LlavaImageProcessorPil(
        do_pad=True, size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336}
    )
    return {
        "Qwen2-VL": (Qwen2VLImageProcessorPil(), QwenVLPixels),
        "LLaVA-1.5 (CLIP 336, pad)": (llava, ResizeCropPixels),
    }


def _images_per_second(
    candidates: dict[str, Any], images: list[Image.Image], rounds: int
) -> dict[str, float]:
    """Median images per second of each candidate and of Hugging Face's A/A twin, after
    checking that every candidate's pixel_values equal the first's (Hugging Face's)."""
    expected = next(iter(candidates.values()))(images)
    for name, run in candidates.items():
        if not torch.equal(run(images)["pixel_values"], expected["pixel_values"]):
            raise SystemExit(f"{name}: pixel_values differ from Hugging Face's")
    calls = {name: (lambda run=run: run(images)) for name, run in candidates.items()}
    calls[f"{HUGGING_FACE} (A/A)"] = calls[HUGGING_FACE]
    return {name: len(images) * 1e3 / ms for name, ms in interleaved_ms(calls, rounds).items()}


if __name__ == "__main__":
    sys.exit(main())
