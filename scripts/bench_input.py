"""Image input speed: preprocessing throughput of Hugging Face's PIL image processors (Qwen2-VL;
LLaVA-1.5's CLIP 336 with padding) against ``ascend_vlm.vision_input``'s ``QwenVLPixels`` and
``ResizeCropPixels`` (1 and 2 worker threads), and the fine-tune script's step time with and
without the prefetcher, side by side.

For each family and input size, ``--images`` random-noise RGB images (PIL, decoded already)
are turned into ``pixel_values`` (and Qwen's ``image_grid_thw``) by each processor: a warm-up
call each, then ``--rounds`` interleaved rounds in a rotating order, medians kept. Hugging
Face's processor runs twice per round; the ratio of its twin to it (the ``A/A`` column) is the
noise floor of the speed-ups beside it.
The outputs are checked equal (bit for bit) before anything is timed. Qwen2-VL's settings are
the model's defaults (at most 1280 merged tokens' worth of pixels, so a 1344x896 image is
shrunk); LLaVA-1.5 pads to a square in the mean colour, resizes to 336 and crops.

Fine-tune step time: the fine-tune loop (``ascend_vlm.finetune.train``, one process, the
embedded default model, LoRA, ShapesVQA scenes of ``--finetune-image-size`` pixels, every
sample new so each step encodes its batch) with ``prefetch=0`` (batches made in the loop) and
``prefetch=2`` (made ahead in a thread), in interleaved rounds; the median step time of each
run after its first step, the best run kept. ``--finetune-steps 0`` skips it.

Run: python scripts/bench_input.py [--images 16] [--rounds 5] [--finetune-steps 12] [--json OUT]
(OUT: the preprocessing table as JSON for docs/benchmarks/, see _bench_record.py)
"""

from __future__ import annotations

import argparse
import json
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
    parser.add_argument(
        "--finetune-steps", type=int, default=12, help="fine-tune steps per run (0: skip)"
    )
    parser.add_argument("--finetune-batch", type=int, default=8, help="fine-tune batch size")
    parser.add_argument(
        "--finetune-image-size", type=int, default=448, help="ShapesVQA scene size in pixels"
    )
    parser.add_argument("--json", type=Path, help="also write the preprocessing table here")
    args = parser.parse_args(argv)
    for flag in ("images", "rounds", "finetune_batch", "finetune_image_size"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')}: expected an int >= 1")
    if args.finetune_steps < 0 or args.finetune_steps == 1:
        parser.error("--finetune-steps: expected 0 (skip) or an int >= 2 (the first is warm-up)")
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
    if args.finetune_steps:
        _finetune_step_times(args)
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


def _finetune_step_times(args: argparse.Namespace) -> dict[str, float]:
    """Best-of-rounds median step time (seconds) of the fine-tune loop per prefetch depth."""
    import logging
    import statistics
    import tempfile

    from transformers.utils import logging as transformers_logging

    from ascend_vlm.default_model import default_model_path
    from ascend_vlm.finetune.config import TrainConfig
    from ascend_vlm.finetune.metrics_log import METRICS_FILE
    from ascend_vlm.finetune.train import train

    logging.getLogger("ascend_vlm").setLevel(logging.WARNING)
    transformers_logging.set_verbosity_error()
    transformers_logging.disable_progress_bar()
    depths = {"in the loop (prefetch=0)": 0, "prefetched (prefetch=2)": 2}
    best = dict.fromkeys(depths, float("inf"))
    print(
        f"\nfine-tune step time: {args.finetune_steps} steps of batch {args.finetune_batch}, "
        f"{args.finetune_image_size}px scenes, median after the first step, best of "
        f"{args.rounds} interleaved rounds\n"
    )
    for _ in range(args.rounds):
        for name, depth in depths.items():
            with tempfile.TemporaryDirectory() as folder:
                config = TrainConfig(
                    output_dir=folder,
                    model_path=str(default_model_path()),
                    image_size=args.finetune_image_size,
                    train_size=args.finetune_steps * args.finetune_batch,
                    eval_size=1,
                    report_question_types=(),
                    max_steps=args.finetune_steps + 1,
                    stop_after_steps=args.finetune_steps,
                    save_every=10**6,
                    batch_size=args.finetune_batch,
                    warmup_steps=1,
                    prefetch=depth,
                    progress=False,
                )
                train(config)
                lines = (Path(folder) / METRICS_FILE).read_text().splitlines()
            times = [json.loads(line).get("step_time_s") for line in lines]
            times = [time for time in times if time is not None][1:]
            best[name] = min(best[name], statistics.median(times))
    base = best["in the loop (prefetch=0)"]
    print("| batches | step time (ms) | vs in the loop |")
    print("|---|---|---|")
    for name, seconds in best.items():
        print(f"| {name} | {seconds * 1e3:.1f} | {base / seconds:.2f}x |")
    return best


if __name__ == "__main__":
    sys.exit(main())
