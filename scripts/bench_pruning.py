"""Visual-token pruning and SnapKV: prefill speed, peak memory and KV bytes vs keep ratio, and
held-out accuracy per method, measured side by side in one run.

Speed and memory: a Qwen2-VL model of realistic depth (``--layers``, default 28 as in Qwen2-VL
2B/7B) and a width small enough for a CPU (hidden 256, 4 heads of 64, 2 KV heads, MLP 704;
a 2-layer vision tower), random weights saved and loaded with ``from_pretrained``, one prompt
of 256, 1024 or 4096 visual tokens (one, one and four images) plus 32 text tokens. For each
size the unpruned model (twice, an A/A pair), FastV at every ``--keeps`` ratio (from layer 2),
SnapKV (compression 0.5) and both (FastV keep=0.5 + SnapKV 0.5) prefill once each to warm up,
then in ``--repeats`` interleaved rounds with a rotating order; each reports its median round:

* LM prefill: wall time from the first decoder layer's input to the final norm's output;
* prefill: the whole forward that fills the cache (vision tower included), ``logits_to_keep=1``;
* peak: the most CPU tensor memory live at once during one prefill (``torch.profiler``, in a
  separate untimed run);
* KV: bytes of keys and values in the cache after prefill.

Ratios are unpruned / pruned time (> 1: pruning is faster) and pruned / unpruned KV bytes; the
A/A column (the same for every row of a prompt size) is the unpruned prefill time over its
twin's, the noise floor of that size's speed-ups.

Accuracy (``--accuracy``, default on): the reference checkpoint
(``python -m ascend_vlm reference-model``, built on first use; 2 language layers, so pruning
starts at layer 1, 64 visual tokens per image) answers ShapesVQA's held-out split (``--limit``
samples) unpruned, then with every method at every keep ratio below 1; each row gives the
accuracy (patched, as ``python -m ascend_vlm eval`` runs it), its difference to unpruned with
a 95% paired interval (Newcombe) and McNemar's exact p on the same samples.

One table holds both: speed rows leave the accuracy columns blank and accuracy rows (visual
tokens "reference") the speed columns; ``--json`` writes it as a record (scripts/_bench_record.py).

Run: python scripts/bench_pruning.py [--visual-tokens 256 1024 4096] [--keeps 1.0 0.5 0.25 0.1]
[--repeats 3] [--limit 500] [--no-accuracy] [--json OUT]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from _bench_record import show_table
from _bench_timing import interleaved_rounds

import ascend_vlm
from ascend_vlm import pruning
from ascend_vlm.evaluation.report import accuracy_cells
from ascend_vlm.observability.memory import peak_tensor_bytes

TEXT_TOKENS = 32
TOKENS_PER_IMAGE_MAX = 1024  # larger prompts take several images (ViT attention is per image)
VOCAB = 32000
IMAGE_TOKEN, VISION_START, VISION_END = VOCAB - 3, VOCAB - 2, VOCAB - 1
FASTV_LAYER = 2


def _bench_config(layers: int):
    from transformers import Qwen2VLConfig

    text = {
        "hidden_size": 256,
        "intermediate_size": 704,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": VOCAB,
        "max_position_embeddings": 32768,
        "rope_parameters": {"rope_type": "default", "mrope_section": [8, 12, 12]},
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    vision = {
        "depth": 2,
        "embed_dim": 128,
        "hidden_size": 256,
        "num_heads": 4,
        "mlp_ratio": 2,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "in_channels": 3,
    }
    config = Qwen2VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=IMAGE_TOKEN,
        bos_token_id=1,
        eos_token_id=2,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
    )
    config._attn_implementation = "sdpa"
    return config


def load_bench_model(layers: int, folder: Path):
    """The benchmark model: random weights, saved to ``folder`` and loaded back as users do."""
    from transformers import Qwen2VLForConditionalGeneration

    torch.manual_seed(0)
    Qwen2VLForConditionalGeneration(_bench_config(layers)).save_pretrained(folder)
    model = Qwen2VLForConditionalGeneration.from_pretrained(folder, attn_implementation="sdpa")
    return model.eval()


def prompt_inputs(model, visual_tokens: int) -> dict[str, torch.Tensor]:
    """One row: ``visual_tokens`` image tokens in square images of at most 1024 tokens each,
    then TEXT_TOKENS text tokens; pixels random."""
    vision = model.config.vision_config
    per_image = min(visual_tokens, TOKENS_PER_IMAGE_MAX)
    images = visual_tokens // per_image
    side = int(per_image**0.5) * vision.spatial_merge_size
    grid = torch.tensor([[1, side, side]] * images)
    patch = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    generator = torch.Generator().manual_seed(visual_tokens)
    pixels = torch.randn(int(grid.prod(-1).sum()), patch, generator=generator)
    ids = [1]
    for _ in range(images):
        ids += [VISION_START] + [IMAGE_TOKEN] * per_image + [VISION_END]
    ids += torch.randint(3, VOCAB - 3, (TEXT_TOKENS,), generator=generator).tolist()
    input_ids = torch.tensor([ids])
    return {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "mm_token_type_ids": (input_ids == IMAGE_TOKEN).int(),
        "pixel_values": pixels,
        "image_grid_thw": grid,
    }


class _LanguageModelClock:
    """Wall time from the first decoder layer's input to the final norm's output."""

    def __init__(self, model) -> None:
        language = model.model.language_model
        self.start = self.end = 0.0
        self.handles = [
            language.layers[0].register_forward_pre_hook(self._begin),
            language.norm.register_forward_hook(self._finish),
        ]

    def _begin(self, module, args) -> None:
        self.start = time.perf_counter()

    def _finish(self, module, args, output) -> None:
        self.end = time.perf_counter()

    @property
    def seconds(self) -> float:
        return self.end - self.start

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _configure(model, setting: tuple) -> None:
    pruning.disable_token_pruning(model)
    kind, value = setting
    prune = pruning.PruneConfig("fastv", FASTV_LAYER, value) if "fastv" in kind else None
    kv = pruning.SnapKVConfig(compression_ratio=0.5) if "snapkv" in kind else None
    if prune is not None or kv is not None:
        pruning.enable_token_pruning(model, prune, kv=kv)


def _prefill(model, inputs) -> tuple[float, float, int]:
    """(prefill s, LM prefill s, KV bytes) of one cache-filling forward."""
    clock = _LanguageModelClock(model)
    try:
        with torch.no_grad():
            start = time.perf_counter()
            output = model(**inputs, use_cache=True, logits_to_keep=1)
            seconds = time.perf_counter() - start
    finally:
        clock.remove()
    cache = output.cache if hasattr(output, "cache") else output.past_key_values
    kv = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    return seconds, clock.seconds, kv


def _peak(model, inputs) -> int:
    with torch.no_grad():
        return peak_tensor_bytes(lambda: model(**inputs, use_cache=True, logits_to_keep=1))


HEADER = [
    "visual tokens", "setting", "LM prefill s", "LM speed-up", "prefill s", "speed-up", "KV MiB",
    "KV ratio", "peak MiB", "peak ratio", "A/A", "accuracy", "vs unpruned, 95% paired CI",
    "McNemar p",
]  # fmt: skip
_ACCURACY_COLUMNS = 3


def _setting_label(kind: str, value: float | None) -> str:
    if kind == "fastv":
        return f"FastV keep={value:g}"
    if kind == "snapkv":
        return f"SnapKV ratio={value:g}"
    if kind == "fastv+snapkv":
        return f"FastV keep={value:g} + SnapKV 0.5"
    return kind


def bench_speed(model, visual_tokens: int, keeps: list[float], repeats: int) -> list[list[str]]:
    """Rows under :data:`HEADER` of one prompt size (see the module docstring), medians of
    ``repeats`` interleaved rounds after a warm-up."""
    inputs = prompt_inputs(model, visual_tokens)
    settings = [("unpruned", None), ("unpruned (A/A)", None)]
    settings += [("fastv", keep) for keep in keeps if keep < 1.0]
    settings += [("snapkv", 0.5), ("fastv+snapkv", 0.5)]

    def prefill(setting: tuple) -> tuple[float, float, int]:
        _configure(model, setting)
        return _prefill(model, inputs)

    calls = {setting: (lambda s=setting: prefill(s)) for setting in settings}
    runs = interleaved_rounds(calls, repeats)
    measured = {}
    for setting in settings:
        _configure(model, setting)
        measured[setting] = (
            statistics.median(run[0] for run in runs[setting]),
            statistics.median(run[1] for run in runs[setting]),
            runs[setting][0][2],
            _peak(model, inputs),
        )
    pruning.disable_token_pruning(model)
    base, twin = measured[settings[0]], measured[settings[1]]
    rows = []
    for setting in settings:
        seconds, lm_seconds, kv, peak = measured[setting]
        rows.append(
            [
                str(visual_tokens),
                _setting_label(*setting),
                f"{lm_seconds:.3f}",
                f"{base[1] / lm_seconds:.2f}x",
                f"{seconds:.3f}",
                f"{base[0] / seconds:.2f}x",
                f"{kv / 2**20:.1f}",
                f"{kv / base[2]:.3f}",
                f"{peak / 2**20:.0f}",
                f"{peak / base[3]:.2f}",
                f"{base[0] / twin[0]:.2f}",
                *[""] * _ACCURACY_COLUMNS,
            ]
        )
    return rows


# --------------------------------------------------------------------------- accuracy


def bench_accuracy(
    keeps: list[float], methods: list[str], limit: int, batch_size: int
) -> list[list[str]]:
    """Rows under :data:`HEADER` of the reference checkpoint's held-out accuracy, unpruned and
    per (method, keep); the speed columns are blank."""
    from ascend_vlm.commands.checkpoints import load_model_and_processor
    from ascend_vlm.data.answer_metrics import normalised_match
    from ascend_vlm.data.datasets import shapes_vqa
    from ascend_vlm.data.statistics import paired_accuracies
    from ascend_vlm.evaluation.runner import generate_answers
    from ascend_vlm.finetune.reference_model import RECIPE, reference_model_path

    model, processor = load_model_and_processor(reference_model_path(), "reference")
    ascend_vlm.patch(model)
    dataset = shapes_vqa(limit, image_size=RECIPE.image_size)

    def correct(description: str) -> list[bool]:
        result = generate_answers(
            model,
            processor,
            dataset,
            batch_size=batch_size,
            max_new_tokens=8,
            description=description,
        )
        return [normalised_match(p.prediction, p.answer) for p in result.predictions]

    baseline = correct("unpruned")
    results = [("unpruned", {"accuracy": sum(baseline) / len(baseline)})]
    for keep in keeps:
        if keep >= 1.0:
            continue
        for method in methods:
            pruning.enable_token_pruning(model, pruning.PruneConfig(method, 1, keep))
            answers = correct(f"{method} keep={keep:g}")
            pruning.disable_token_pruning(model)
            paired = paired_accuracies(baseline, answers)
            row = {
                "accuracy": paired["second_accuracy"],
                "difference": paired["difference"],
                "interval": tuple(paired["ci95"]),
                "mcnemar_p": paired["mcnemar_p"],
            }
            results.append((f"{method} keep={keep:g}", row))
    blank = [""] * (len(HEADER) - 2 - _ACCURACY_COLUMNS)
    return [["reference", label, *blank, *accuracy_cells(row)] for label, row in results]


def _valid_prompt_size(tokens: int) -> bool:
    """Square counts up to TOKENS_PER_IMAGE_MAX (one image), or multiples of it."""
    if tokens > TOKENS_PER_IMAGE_MAX:
        return tokens % TOKENS_PER_IMAGE_MAX == 0
    return tokens >= 1 and round(tokens**0.5) ** 2 == tokens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--visual-tokens", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--keeps", type=float, nargs="+", default=[1.0, 0.5, 0.25, 0.1])
    parser.add_argument("--layers", type=int, default=28, help="language-model depth")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds per setting")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--accuracy", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--methods", nargs="+", default=["fastv", "divprune", "random", "uniform"])
    parser.add_argument("--limit", type=int, default=500, help="held-out samples")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--json", type=Path, help="also write the table to this file")
    args = parser.parse_args(argv)
    for flag in ("layers", "repeats", "threads", "limit", "batch_size"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')}: expected an int >= 1")
    if any(not 0.0 < keep <= 1.0 for keep in args.keeps):
        parser.error(f"--keeps: expected ratios with 0 < keep <= 1, got {args.keeps}")
    if not all(map(_valid_prompt_size, args.visual_tokens)):
        parser.error(
            "--visual-tokens: expected square counts up to 1024 (256, 1024) or multiples of 1024"
        )
    if args.layers <= FASTV_LAYER:
        parser.error(f"--layers: expected > {FASTV_LAYER} (FastV prunes from there)")
    torch.set_num_threads(args.threads)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        print(f"[bench_pruning] building the {args.layers}-layer model", flush=True)
        model = load_bench_model(args.layers, Path(folder))
        for tokens in args.visual_tokens:
            print(f"[bench_pruning] {tokens} visual tokens", flush=True)
            rows += bench_speed(model, tokens, args.keeps, args.repeats)
    if args.accuracy:
        rows += bench_accuracy(args.keeps, args.methods, args.limit, args.batch_size)
    print(
        f"\nPrefill, {args.layers} language layers (hidden 256), FastV at layer {FASTV_LAYER}, "
        f"median of {args.repeats} interleaved rounds, {args.threads} threads"
        + (
            f"; held-out accuracy of the reference checkpoint ({args.limit} samples, pruning "
            "from layer 1 of 2)"
            if args.accuracy
            else ""
        )
        + ":\n"
    )
    show_table(HEADER, rows, args.json, sys.argv[0], list(sys.argv[1:] if argv is None else argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
