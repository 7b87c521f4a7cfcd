"""Image input speed: preprocessing throughput of Hugging Face's Qwen2-VL PIL image processor
against ``ascend_vlm.vision_input.QwenVLPixels`` (1 and 2 worker threads), and the fine-tune
script's step time with and without the prefetcher, side by side.

For each input size, ``--images`` random-noise RGB images (PIL, decoded already) are turned
into ``pixel_values`` and ``image_grid_thw`` by each processor, in interleaved rounds; the
best round's images per second is kept (contention only adds time). The outputs are checked
equal (bit for bit) before anything is timed. The processor settings are the model's
defaults (at most 1280 merged tokens' worth of pixels), so a 1344x896 image is shrunk.

Fine-tune step time: the fine-tune loop (``ascend_vlm.finetune.train``, one process, the
embedded default model, LoRA, ShapesVQA scenes of ``--finetune-image-size`` pixels, every
sample new so each step encodes its batch) with ``prefetch=0`` (batches made in the loop) and
``prefetch=2`` (made ahead in a thread), in interleaved rounds; the median step time of each
run after its first step, the best run kept. ``--finetune-steps 0`` skips it.

Run: python scripts/bench_input.py [--images 16] [--rounds 5] [--finetune-steps 12] [--json OUT]
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
    parser.add_argument(
        "--finetune-steps", type=int, default=12, help="fine-tune steps per run (0: skip)"
    )
    parser.add_argument("--finetune-batch", type=int, default=8, help="fine-tune batch size")
    parser.add_argument(
        "--finetune-image-size", type=int, default=448, help="ShapesVQA scene size in pixels"
    )
    parser.add_argument("--json", type=Path, help="also write every figure to this file")
    args = parser.parse_args(argv)
    for flag in ("images", "rounds", "finetune_batch", "finetune_image_size"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')}: expected an int >= 1")
    if args.finetune_steps < 0 or args.finetune_steps == 1:
        parser.error("--finetune-steps: expected 0 (skip) or an int >= 2 (the first is warm-up)")
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
    if args.finetune_steps:
        report["finetune_step_s"] = _finetune_step_times(args)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


def _finetune_step_times(args: argparse.Namespace) -> dict[str, float]:
    """Best-of-rounds median step time (seconds) of the fine-tune loop per prefetch depth."""
    import logging
    import statistics
    import tempfile

    from ascend_vlm.default_model import default_model_path
    from ascend_vlm.finetune.train import METRICS_FILE, TrainConfig, train

    from transformers.utils import logging as transformers_logging

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
