"""Weight-only quantization: weight bytes, decode speed and held-out accuracy, measured side by
side in one run.

Bytes and speed: a Qwen2-VL of the library's "small" width (hidden 512, MLP 1408, 8 heads of
64, 2 KV heads) and ``--layers`` language layers (default 20: 225 MB of fp32 language-model
weights, past the CPU caches), random weights saved and loaded with ``from_pretrained``.

* bytes: the quantized linear layers' integers, scales and offsets against the same weights
  in fp16, for the model in bf16 (the NPU's dtype, so scales are 2 bytes);
* decode: tokens per second of greedy ``generate`` (one 224x224 image and 16 text tokens,
  ``--new-tokens`` tokens, the time from the first to the last decode step) of the
  unquantized model, W8 per channel and W4 g128, each with fp32 and with bf16 weights and
  activations (fp32 unquantized twice: the second run is the A/A control, and its ratio to the
  first, the A/A column, is the noise floor), a warm-up generation each, then ``--repeats``
  interleaved rounds with a rotating order, median round each. The ratio is quantized /
  unquantized tokens per second in the same dtype (> 1: faster). CPU kernels are
  what torch offers (``torch._weight_int8pack_mm`` for bf16 W8, dequantize-and-matmul
  otherwise): a CPU number says nothing about the NPU's ``npu_weight_quant_batchmatmul``.

Accuracy (``--accuracy``, default on): the reference checkpoint (``python -m ascend_vlm
reference-model``, built on first use) answers ShapesVQA's held-out split (``--limit``
samples) in fp32, then W8 RTN, W4 g128 RTN and W4 g128 AWQ (calibrated on 32 training
records), each patched as ``python -m ascend_vlm eval`` runs it; each row gives the accuracy,
its difference to fp32 with a 95% paired interval (Newcombe) and McNemar's exact p on the
same samples.

One table holds all three (a "section" column names which; cells a section does not use are
blank); ``--json`` writes it as a record (scripts/_bench_record.py).

Run: python scripts/bench_quant.py [--layers 20] [--new-tokens 32] [--repeats 3]
[--limit 500] [--no-accuracy] [--json OUT]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from _bench_record import show_table
from _bench_timing import interleaved_rounds

import ascend_vlm
from ascend_vlm.evaluation.report import accuracy_cells
from ascend_vlm.quantization import QuantizationConfig, quantize

SCHEMES = {
    "w8": QuantizationConfig(bits=8, group_size=0),
    "w4g128": QuantizationConfig(bits=4, group_size=128),
}


def load_bench_model(layers: int, folder: Path):
    """The benchmark model: random weights, saved to ``folder`` and loaded back as users do."""
    from transformers import Qwen2VLForConditionalGeneration

    from ascend_vlm.models import tiny

    tiny.build_model("qwen2_vl", size="small", layers=layers).save_pretrained(folder)
    model = Qwen2VLForConditionalGeneration.from_pretrained(folder, attn_implementation="sdpa")
    return model.eval()


class _StepClock(torch.nn.Module):
    """A logits processor that timestamps each generation step and changes nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.stamps.append(time.perf_counter())
        return scores


def decode_tokens_per_second(model, inputs: dict, new_tokens: int) -> float:
    """Decode steps per second of one greedy generation of exactly ``new_tokens`` tokens."""
    from transformers import LogitsProcessorList

    clock = _StepClock()
    with torch.no_grad():
        model.generate(
            **inputs,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            logits_processor=LogitsProcessorList([clock]),
        )
    return (len(clock.stamps) - 1) / (clock.stamps[-1] - clock.stamps[0])


HEADER = [
    "section", "setting", "value", "baseline", "ratio", "A/A", "vs fp32, 95% paired CI",
    "McNemar p",
]  # fmt: skip


def bench_bytes(model) -> list[list[str]]:
    """Rows under :data:`HEADER`: each scheme's quantized layers' MB against fp16, for a bf16
    copy."""
    rows = []
    for name, scheme in SCHEMES.items():
        copied = copy.deepcopy(model).to(torch.bfloat16)
        report = quantize(copied, scheme, progress=False)
        rows.append(
            [
                "weight MB",
                f"{name}, {len(report.modules)} layers",
                f"{report.quantized_bytes / 1e6:.1f}",
                f"{report.fp16_bytes / 1e6:.1f}",
                f"{report.ratio_to_fp16:.3f}",
                "",
                "",
                "",
            ]
        )
        del copied
    return rows


def bench_decode(model, new_tokens: int, repeats: int) -> list[list[str]]:
    """Rows under :data:`HEADER`: median decode tokens/s over ``repeats`` interleaved rounds of
    the unquantized model and each scheme, with fp32 and with bf16 weights and activations
    (fp32 twice: the A/A control), against the unquantized model in the same dtype."""
    from ascend_vlm.models import tiny

    inputs = tiny.make_inputs("qwen2_vl", model, n_images=1, text_len=16)
    variants = {}
    for dtype_name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        base = model if dtype == torch.float32 else copy.deepcopy(model).to(dtype)
        variants[dtype_name] = (base, dtype)
        if dtype == torch.float32:
            variants["fp32 (A/A)"] = (base, dtype)
        for name, scheme in SCHEMES.items():
            quantized = copy.deepcopy(base)
            quantize(quantized, scheme, progress=False)
            variants[f"{dtype_name} {name}"] = (quantized, dtype)

    def decode(variant, dtype: torch.dtype) -> float:
        cast = {**inputs, "pixel_values": inputs["pixel_values"].to(dtype)}
        return decode_tokens_per_second(variant, cast, new_tokens)

    calls = {name: (lambda pair=pair: decode(*pair)) for name, pair in variants.items()}
    speed = {
        name: statistics.median(runs) for name, runs in interleaved_rounds(calls, repeats).items()
    }
    noise = speed["fp32 (A/A)"] / speed["fp32"]
    rows = []
    for name, tokens_per_s in speed.items():
        baseline = speed[name.split(" ")[0]]
        rows.append(
            [
                "decode tokens/s",
                name,
                f"{tokens_per_s:.1f}",
                f"{baseline:.1f}",
                f"{tokens_per_s / baseline:.2f}",
                f"{noise:.2f}",
                "",
                "",
            ]
        )
    return rows


def bench_accuracy(limit: int, batch_size: int) -> list[list[str]]:
    """Rows under :data:`HEADER`: held-out accuracy of the reference checkpoint in fp32 and per
    quantization."""
    from ascend_vlm.commands.checkpoints import load_model_and_processor
    from ascend_vlm.data.answer_metrics import normalised_match
    from ascend_vlm.data.datasets import shapes_vqa
    from ascend_vlm.data.statistics import paired_accuracies
    from ascend_vlm.evaluation.runner import generate_answers
    from ascend_vlm.finetune.reference_model import RECIPE, reference_model_path
    from ascend_vlm.quantization.calibration import shapes_calibration

    dataset = shapes_vqa(limit, image_size=RECIPE.image_size)
    path = reference_model_path()

    def correct(label: str, scheme: QuantizationConfig | None = None) -> list[bool]:
        model, processor = load_model_and_processor(path, "reference")
        if scheme is not None:
            calibration = None
            if scheme.method == "awq":
                calibration = shapes_calibration(processor, image_size=RECIPE.image_size)
            quantize(model, scheme, calibration=calibration, progress=False)
        ascend_vlm.patch(model)
        result = generate_answers(
            model, processor, dataset, batch_size=batch_size, max_new_tokens=8, description=label
        )
        return [normalised_match(p.prediction, p.answer) for p in result.predictions]

    baseline = correct("fp32")
    base_row = {"accuracy": sum(baseline) / len(baseline)}
    results = [("fp32", base_row)]
    settings = {
        "w8 rtn": SCHEMES["w8"],
        "w4g128 rtn": SCHEMES["w4g128"],
        "w4g128 awq": QuantizationConfig(bits=4, group_size=128, method="awq"),
    }
    for label, scheme in settings.items():
        paired = paired_accuracies(baseline, correct(label, scheme))
        row = {
            "accuracy": paired["second_accuracy"],
            "difference": paired["difference"],
            "interval": tuple(paired["ci95"]),
            "mcnemar_p": paired["mcnemar_p"],
        }
        results.append((label, row))
    section = f"accuracy, {limit} samples"
    rows = []
    for label, row in results:
        accuracy, interval, p_value = accuracy_cells(row)
        rows.append(
            [section, label, accuracy, f"{base_row['accuracy']:.3f}", "", "", interval, p_value]
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=20, help="language-model depth")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens per generation")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds per variant")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--accuracy", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--limit", type=int, default=500, help="held-out samples")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--json", type=Path, help="also write the table to this file")
    args = parser.parse_args(argv)
    for flag in ("layers", "repeats", "threads", "limit", "batch_size"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')}: expected an int >= 1")
    if args.new_tokens < 2:
        parser.error("--new-tokens: expected an int >= 2 (decode speed needs two steps)")
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as folder:
        print(f"[bench_quant] building the {args.layers}-layer model", flush=True)
        model = load_bench_model(args.layers, Path(folder))
        rows = bench_bytes(model)
        print("[bench_quant] decode", flush=True)
        rows += bench_decode(model, args.new_tokens, args.repeats)
    if args.accuracy:
        rows += bench_accuracy(args.limit, args.batch_size)
    print(
        f"\nWeight MB of the quantized layers ({args.layers} language layers, bf16 model) against "
        f"fp16; greedy decode of {args.new_tokens} tokens, median of {args.repeats} interleaved "
        f"rounds, {args.threads} threads"
        + ("; held-out accuracy of the reference checkpoint" if args.accuracy else "")
        + ":\n"
    )
    show_table(HEADER, rows, args.json, sys.argv[0], list(sys.argv[1:] if argv is None else argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
