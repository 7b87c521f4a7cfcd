"""Does the attention overlay point at what the question names? Measured on the reference
checkpoint over held-out ShapesVQA colour questions.

For each sample ("What colour is the {kind}?" about a one-shape scene of the eval split, never
seen in training; ``--binding``: one shape among one to four, which the reference model was
not trained to tell apart), ``ascend_vlm.observability.explain`` answers greedily and maps the first
answer token's attention (mean over heads and every decoder layer) onto the image exactly as
``python -m ascend_vlm explain`` draws it (``cell_pixel_map``). A sample counts as a hit when
the mean overlay value inside the shape's bounding box is higher than outside it. Prints the
hit rate with its 95% Wilson interval, the median inside/outside ratio and the answers'
accuracy; ``--save-sample PATH`` also saves the first sample's image for the CLI.

Run: python scripts/eval_attention_overlay.py [--samples 200] [--seed 0] [--binding] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

import ascend_vlm
from ascend_vlm.commands.checkpoints import load_model_and_processor
from ascend_vlm.data.shapes_vqa import ShapesVQA
from ascend_vlm.data.statistics import wilson_interval
from ascend_vlm.finetune.reference_model import RECIPE, reference_model_path
from ascend_vlm.observability.explain import explain
from ascend_vlm.observability.visual_grid import cell_pixel_map


def inside_box(shape, width: int, height: int) -> np.ndarray:
    """bool [height, width]: pixels whose centre lies in the shape's bounding box."""
    ys, xs = np.mgrid[0:height, 0:width] + 0.5
    return (np.abs(xs - shape.cx) <= shape.radius) & (np.abs(ys - shape.cy) <= shape.radius)


def overlay_contrast(model, processor, sample, shape) -> tuple[float, float, bool]:
    """(mean overlay inside the box, mean outside, answer correct) for one sample."""
    explanation = explain(model, processor, [sample.image], sample.question, max_new_tokens=4)
    overlay = cell_pixel_map(explanation.cells[0], explanation.image_weights(0)[0])
    inside = inside_box(shape, *sample.image.size)
    correct = explanation.answer.strip().lower().rstrip(".") == sample.answer
    return float(np.nanmean(overlay[inside])), float(np.nanmean(overlay[~inside])), correct


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--binding",
        action="store_true",
        help="ask about one shape among one to four (the reference model never trained so)",
    )
    parser.add_argument("--model", help="checkpoint folder (default: the reference checkpoint)")
    parser.add_argument("--no-patch", dest="patch", action="store_false")
    parser.add_argument("--save-sample", type=Path, help="save the first sample's image here")
    parser.add_argument("--json", type=Path, help="also write every figure to this file")
    args = parser.parse_args(argv)
    if args.samples < 1:
        parser.error(f"--samples: expected an int >= 1, got {args.samples}")
    model, processor = load_model_and_processor(args.model or reference_model_path(), "--model")
    if args.patch:
        ascend_vlm.patch(model)
    dataset = ShapesVQA(
        "eval",
        size=args.samples,
        seed=args.seed,
        image_size=RECIPE.image_size,
        question_types=("colour",),
        binding=args.binding,
    )
    if args.save_sample is not None:
        dataset[0].image.save(args.save_sample)
        print(f"sample 0: {dataset[0].question!r} -> {args.save_sample}")
    rows = []
    with torch.no_grad():
        for index in tqdm(range(len(dataset)), desc="samples", unit="sample"):
            shapes, target = dataset.scene(index)
            rows.append(overlay_contrast(model, processor, dataset[index], shapes[target]))
    hits = sum(inside > outside for inside, outside, _ in rows)
    low, high = wilson_interval(hits, len(rows))
    ratios = [inside / outside for inside, outside, _ in rows if outside > 0]
    ratio = statistics.median(ratios) if ratios else float("nan")
    correct = sum(answer for *_, answer in rows)
    report = {
        "binding": args.binding,
        "samples": len(rows),
        "hits": hits,
        "hit_rate": hits / len(rows),
        "hit_rate_95": [low, high],
        "median_inside_over_outside": ratio,
        "answer_accuracy": correct / len(rows),
    }
    print(
        f"\nfirst answer token's overlay, mean over all layers, {len(rows)} held-out colour "
        f"questions{' (binding scenes)' if args.binding else ''}:\n"
        f"inside the asked shape's box > outside: {hits}/{len(rows)} = {hits / len(rows):.1%} "
        f"(95% Wilson {low:.1%}-{high:.1%})\n"
        f"median inside/outside ratio: {ratio:.2f}\n"
        f"answer accuracy: {correct / len(rows):.1%}"
    )
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
