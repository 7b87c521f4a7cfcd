"""The evaluation report: a JSON-serialisable dict, its text rendering, and the comparison of
two configurations.

Report layout (``FORMAT``)::

    {"format": "ascend_vlm.eval/2",
     "dataset": {"name": "shapes_vqa" | "jsonl", ..., "samples": N},
     "settings": {"batch_size": B, "max_new_tokens": T, "prefetch": bool},
     "configurations": [
        {"label": str, "model": str, "options": {name: {"summary": str, ...}},
         "accuracy": {metric: {"overall": CELL, "by_type": {type: CELL}}},
         "latency": {"batches": int, "vision_encode": LAT, "prefill": LAT,
                     "decode_per_token": LAT},
         "peak_memory": {"bytes": int | None, "measure": str},
         "predictions": [{"index", "type", "question", "answer", "prediction",
                          metric: bool, ...}]}],
     "comparison": None | COMPARISON}

    CELL = {"correct": int, "total": int, "accuracy": float, "ci95": [low, high]}  (Wilson)
    LAT  = {"mean_ms": float | None, "p95_ms": float | None, "count": int}   (over batches)
    COMPARISON = {"first": label, "second": label, "samples": N,
                  "identical_predictions": int,
                  "metrics": {metric: {"first_accuracy", "second_accuracy",
                                       "difference" (second - first), "ci95": [low, high],
                                       "both", "first_only", "second_only", "neither",
                                       "mcnemar_p"}}}

``by_type`` lists types in order of first appearance. Every figure is recomputable from the
``predictions``: :func:`compare` takes two configuration entries, e.g. loaded from two saved
reports.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ascend_vlm.data.answer_metrics import METRICS, score
from ascend_vlm.data.statistics import latency_summary, paired_accuracies, wilson_interval
from ascend_vlm.evaluation.runner import RunResult
from ascend_vlm.observability.memory import MEASURE

# /2: latency from ascend_vlm.trace; "vision_encode" holds the projector and "prefill" no longer
# holds the vision stages (in /1 it did).
FORMAT = "ascend_vlm.eval/2"


# (first right, second right) -> the cell of the paired 2x2 table.
def _cell(correct: int, total: int) -> dict[str, Any]:
    low, high = wilson_interval(correct, total)
    return {"correct": correct, "total": total, "accuracy": correct / total, "ci95": [low, high]}


def accuracy(predictions: list[dict[str, Any]], metric: str) -> dict[str, Any]:
    """Overall and per-type :func:`_cell` of ``metric`` over prediction records."""
    by_type: dict[str, list[bool]] = {}
    for record in predictions:
        by_type.setdefault(record["type"], []).append(record[metric])
    outcomes = [record[metric] for record in predictions]
    return {
        "overall": _cell(sum(outcomes), len(outcomes)),
        "by_type": {kind: _cell(sum(values), len(values)) for kind, values in by_type.items()},
    }


def configuration_entry(
    label: str, model: str, options: dict[str, Any], result: RunResult
) -> dict[str, Any]:
    """The report entry of one configuration's :class:`RunResult`."""
    predictions = [
        {
            "index": p.index,
            "type": p.question_type,
            "question": p.question,
            "answer": p.answer,
            "prediction": p.prediction,
            **score(p.prediction, p.answer),
        }
        for p in result.predictions
    ]
    per_token = [
        t.decode_seconds_per_token for t in result.stage_times if t.decode_seconds_per_token
    ]
    return {
        "label": label,
        "model": model,
        "options": options,
        "accuracy": {metric: accuracy(predictions, metric) for metric in METRICS},
        "latency": {
            "batches": len(result.stage_times),
            "vision_encode": latency_summary([t.vision_seconds for t in result.stage_times]),
            "prefill": latency_summary([t.prefill_seconds for t in result.stage_times]),
            "decode_per_token": latency_summary(per_token),
        },
        "peak_memory": {"bytes": result.peak_memory_bytes, "measure": MEASURE},
        "predictions": predictions,
    }


def compare(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """The paired comparison of two configuration entries answered on the same samples.

    Per metric: both accuracies, their difference ``second - first`` with Newcombe's paired
    95% interval, the 2x2 table of outcomes and McNemar's exact p-value. Raises ``ValueError``
    when the entries' samples (index, question, answer) differ.
    """
    key = ("index", "question", "answer")
    samples = [tuple(record[k] for k in key) for record in first["predictions"]]
    if samples != [tuple(record[k] for k in key) for record in second["predictions"]]:
        raise ValueError(
            f"second: expected predictions on the same samples as {first['label']!r}, "
            f"got different samples for {second['label']!r}"
        )
    pairs = list(zip(first["predictions"], second["predictions"], strict=True))
    metrics = {
        metric: paired_accuracies([a[metric] for a, _ in pairs], [b[metric] for _, b in pairs])
        for metric in METRICS
    }
    return {
        "first": first["label"],
        "second": second["label"],
        "samples": len(pairs),
        "identical_predictions": sum(a["prediction"] == b["prediction"] for a, b in pairs),
        "metrics": metrics,
    }


def build_report(
    dataset: dict[str, Any], settings: dict[str, Any], configurations: list[dict[str, Any]]
) -> dict[str, Any]:
    """The full report; with two configurations it carries their :func:`compare`."""
    if len(configurations) not in (1, 2):
        raise ValueError(f"configurations: expected 1 or 2, got {len(configurations)}")
    comparison = compare(*configurations) if len(configurations) == 2 else None
    return {
        "format": FORMAT,
        "dataset": dataset,
        "settings": settings,
        "configurations": configurations,
        "comparison": comparison,
    }


def write_json(report: dict[str, Any], path: str | os.PathLike) -> None:
    """Write ``report`` to ``path`` atomically (a temporary sibling renamed into place)."""
    from ascend_vlm._files import atomic_write_text

    atomic_write_text(Path(path), json.dumps(report, indent=1) + "\n")


def accuracy_cells(row: dict[str, Any]) -> list[str]:
    """The three table cells of a benchmark row: its ``accuracy``, then, when it was compared
    with a baseline (:func:`paired_accuracies`: ``difference``, ``interval``, ``mcnemar_p``),
    ``+d pts [low, high]`` in percentage points and the p-value; blank cells for the baseline
    itself."""
    accuracy = f"{row['accuracy']:.3f}"
    if "difference" not in row:
        return [accuracy, "", ""]
    low, high = row["interval"]
    return [
        accuracy,
        f"{100 * row['difference']:+.1f} pts [{100 * low:+.1f}, {100 * high:+.1f}]",
        f"{row['mcnemar_p']:.3g}",
    ]


def _interval(low: float, high: float, signed: bool = False) -> str:
    spec = "+.3f" if signed else ".3f"
    return f"[{low:{spec}}, {high:{spec}}]"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _dataset_line(dataset: dict[str, Any]) -> str:
    if dataset["name"] == "shapes_vqa":
        return (
            f"ShapesVQA {dataset['split']} split, seed {dataset['seed']}, "
            f"{dataset['image_size']} px images, {dataset['samples']} samples"
        )
    return f"{dataset['path']}, {dataset['samples']} samples"


def _configuration_lines(entry: dict[str, Any]) -> list[str]:
    lines = [f"model    {entry['model']}"]
    lines += [f"option   {name}: {value['summary']}" for name, value in entry["options"].items()]
    lines += ["", "type          samples  exact   95% CI          normalised  95% CI"]
    exact, normalised = entry["accuracy"]["exact"], entry["accuracy"]["normalised"]
    rows = [*exact["by_type"].items(), ("overall", exact["overall"])]
    for kind, cell in rows:
        other = normalised["overall"] if kind == "overall" else normalised["by_type"][kind]
        lines.append(
            f"{kind:<12}  {cell['total']:7d}  {cell['accuracy']:.3f}  {_interval(*cell['ci95'])}"
            f"  {other['accuracy']:.3f}       {_interval(*other['ci95'])}"
        )
    latency = entry["latency"]
    lines += [
        "",
        f"stage                   mean ms    p95 ms  (per batch, over {latency['batches']})",
    ]
    stages = (
        ("vision encode", "vision_encode"),
        ("prefill (language)", "prefill"),
        ("decode per token", "decode_per_token"),
    )
    for name, key in stages:
        summary = latency[key]
        lines.append(f"{name:<22}  {_ms(summary['mean_ms']):>7}  {_ms(summary['p95_ms']):>8}")
    peak = entry["peak_memory"]["bytes"]
    shown = "not measured" if peak is None else f"+{peak / 2**20:.1f} MiB"
    lines.append(f"peak memory  {shown}  ({entry['peak_memory']['measure']})")
    return lines


def _comparison_lines(comparison: dict[str, Any]) -> list[str]:
    lines = [
        f"comparison on the same {comparison['samples']} samples: "
        f"A = {comparison['first']}, B = {comparison['second']}",
        "metric      A       B       B - A   95% CI            A only  B only  McNemar p",
    ]
    for metric, row in comparison["metrics"].items():
        lines.append(
            f"{metric:<10}  {row['first_accuracy']:.3f}   {row['second_accuracy']:.3f}   "
            f"{row['difference']:+.3f}  {_interval(*row['ci95'], signed=True)}  "
            f"{row['first_only']:6d}  {row['second_only']:6d}  {row['mcnemar_p']:.4f}"
        )
    lines.append(
        f"identical predictions: {comparison['identical_predictions']}/{comparison['samples']}"
    )
    return lines


def format_report(report: dict[str, Any]) -> str:
    """The text rendering of ``report`` printed by ``python -m ascend_vlm eval``."""
    settings = report["settings"]
    lines = [
        f"dataset  {_dataset_line(report['dataset'])}",
        f"decode   greedy, at most {settings['max_new_tokens']} new tokens, "
        f"batches of {settings['batch_size']}",
    ]
    configurations = report["configurations"]
    for letter, entry in zip("AB", configurations, strict=False):
        heading = [f"== {letter}: {entry['label']} =="] if len(configurations) > 1 else []
        lines += ["", *heading, *_configuration_lines(entry)]
    if report["comparison"] is not None:
        lines += ["", *_comparison_lines(report["comparison"])]
    return "\n".join(lines)
