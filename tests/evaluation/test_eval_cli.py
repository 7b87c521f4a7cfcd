"""`python -m ascend_vlm eval` end to end on the tiny untrained model (in-process).

Accuracy is chance here; the tests check the report's shape, its JSON fields exactly, that the
predictions are the stock model's greedy answers, and the argparse errors.
"""

from __future__ import annotations

import contextlib
import io
import json
import re

import pytest
import torch

from ascend_vlm.__main__ import main
from ascend_vlm.data.shapes_vqa import QUESTION_TYPES, ShapesVQA
from ascend_vlm.data.vqa import prompt_text

EVAL_ERROR = "python -m ascend_vlm eval: error: "
LIMIT, BATCH, NEW_TOKENS = 10, 4, 3


def _run(argv: list[str]) -> str:
    """stdout of ``main(["eval", *argv])``, which must return 0."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["eval", *argv]) == 0
    return out.getvalue()


def _stock_answers(checkpoint, records, max_new_tokens: int) -> list[str]:
    """Greedy answers of the unpatched model, one sample at a time, computed independently."""
    from ascend_vlm.default_model import load_default_model

    model, processor = load_default_model(checkpoint)
    answers = []
    with torch.no_grad():
        for record in records:
            features = processor(
                text=[prompt_text(processor, record.question)],
                images=[record.image],
                return_tensors="pt",
            )
            output = model.generate(**features, max_new_tokens=max_new_tokens, do_sample=False)
            new_tokens = output[0, features["input_ids"].shape[1] :]
            answers.append(processor.decode(new_tokens, skip_special_tokens=True))
    return answers


@pytest.fixture(scope="module")
def single_run(tiny_model_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("eval") / "report.json"
    argv = ["--model", str(tiny_model_path), "--limit", str(LIMIT), "--json", str(out)]
    text = _run([*argv, "--batch-size", str(BATCH), "--max-new-tokens", str(NEW_TOKENS)])
    return text, json.loads(out.read_text())


def _check_cell(cell, outcomes):
    assert cell["correct"] == sum(outcomes)
    assert cell["total"] == len(outcomes)
    assert cell["accuracy"] == sum(outcomes) / len(outcomes)
    low, high = cell["ci95"]
    assert 0.0 <= low <= cell["accuracy"] <= high <= 1.0


def test_json_report_has_every_field(single_run, tiny_model_path):
    _, report = single_run
    assert set(report) == {"format", "dataset", "settings", "configurations", "comparison"}
    assert report["format"] == "ascend_vlm.eval/2"
    assert report["dataset"] == {
        "name": "shapes_vqa",
        "split": "eval",
        "seed": 0,
        "image_size": 112,
        "samples": LIMIT,
    }
    assert report["settings"] == {
        "batch_size": BATCH,
        "max_new_tokens": NEW_TOKENS,
        "prefetch": True,
    }
    assert report["comparison"] is None
    (entry,) = report["configurations"]
    assert set(entry) == {
        "label", "model", "options", "accuracy", "latency", "peak_memory", "predictions",
    }  # fmt: skip
    assert entry["label"] == entry["model"] == str(tiny_model_path)
    patch = entry["options"]["patch"]
    assert list(entry["options"]) == ["quantize", "patch", "adapter", "prune", "vision-cache"]
    assert entry["options"]["quantize"] == {"summary": "not quantized", "scheme": None}
    assert entry["options"]["adapter"] == {
        "summary": "no adapter",
        "adapters": {},
        "active": "__base__",
        "new_tokens": [],
    }
    assert entry["options"]["prune"] == {"summary": "not pruned", "prune": None, "kv": None}
    assert entry["options"]["vision-cache"] == {"summary": "no vision cache", "max_bytes": 0}
    assert patch["patched"] is True
    assert patch["report"]["model_type"] == "qwen2_vl"
    assert re.fullmatch(r"patched: \d+ modules swapped, \d+ left alone", patch["summary"])

    records = ShapesVQA(split="eval", size=LIMIT)
    predictions = entry["predictions"]
    assert len(predictions) == LIMIT
    assert [p["index"] for p in predictions] == list(range(LIMIT))
    for p in predictions:
        record = records[p["index"]]
        assert set(p) == {
            "index",
            "type",
            "question",
            "answer",
            "prediction",
            "exact",
            "normalised",
        }
        assert (p["question"], p["answer"]) == (record.question, record.answer)
        assert p["type"] == QUESTION_TYPES[p["index"] % len(QUESTION_TYPES)]
        assert p["exact"] == (p["prediction"].strip() == p["answer"])
        assert p["normalised"] == (p["prediction"].strip().lower().rstrip(".") == p["answer"])

    for metric in ("exact", "normalised"):
        table = entry["accuracy"][metric]
        assert list(table["by_type"]) == list(QUESTION_TYPES)
        for kind, cell in table["by_type"].items():
            assert cell["total"] == LIMIT // len(QUESTION_TYPES)
            _check_cell(cell, [p[metric] for p in predictions if p["type"] == kind])
        _check_cell(table["overall"], [p[metric] for p in predictions])

    latency = entry["latency"]
    batches = -(-LIMIT // BATCH)
    assert latency["batches"] == batches
    for stage in ("vision_encode", "prefill"):
        assert latency[stage]["count"] == batches
    assert 1 <= latency["decode_per_token"]["count"] <= batches
    for stage in ("vision_encode", "prefill", "decode_per_token"):
        assert latency[stage]["mean_ms"] > 0
        assert latency[stage]["p95_ms"] > 0
    assert isinstance(entry["peak_memory"]["bytes"], int)
    assert entry["peak_memory"]["bytes"] >= 0
    assert entry["peak_memory"]["measure"].startswith("host RSS peak")


def test_predictions_are_the_stock_greedy_answers(single_run, tiny_model_path):
    """Patched, batched with left padding == unpatched, one at a time (CPU)."""
    _, report = single_run
    records = ShapesVQA(split="eval", size=LIMIT)
    expected = _stock_answers(tiny_model_path, [records[i] for i in range(LIMIT)], NEW_TOKENS)
    assert [p["prediction"] for p in report["configurations"][0]["predictions"]] == expected


def test_text_report_lists_types_stages_and_memory(single_run, tiny_model_path):
    text, report = single_run
    entry = report["configurations"][0]
    lines = text.splitlines()
    start = lines.index("dataset  ShapesVQA eval split, seed 0, 112 px images, 10 samples")
    assert lines[start + 1] == "decode   greedy, at most 3 new tokens, batches of 4"
    assert lines[start + 3 : start + 9] == [
        f"model    {tiny_model_path}",
        "option   quantize: not quantized",
        f"option   patch: {entry['options']['patch']['summary']}",
        "option   adapter: no adapter",
        "option   prune: not pruned",
        "option   vision-cache: no vision cache",
    ]
    table = lines[start + 10 : start + 17]
    assert table[0] == "type          samples  exact   95% CI          normalised  95% CI"
    cell = r"\d\.\d{3}  +\[\d\.\d{3}, \d\.\d{3}\]"
    for kind, row in zip([*QUESTION_TYPES, "overall"], table[1:], strict=True):
        total = LIMIT if kind == "overall" else 2
        assert re.fullmatch(rf"{kind} +{total}  {cell}  {cell}", row), row
    overall = entry["accuracy"]["exact"]["overall"]
    assert f"{overall['accuracy']:.3f}  [{overall['ci95'][0]:.3f}, " in table[-1]
    stages = lines[start + 18 : start + 22]
    assert stages[0].startswith("stage                   mean ms    p95 ms  (per batch, over 3)")
    names = ["vision encode", "prefill (language)", "decode per token"]
    for name, row in zip(names, stages[1:], strict=True):
        assert re.fullmatch(rf"{re.escape(name)} +\d+\.\d\d +\d+\.\d\d", row), row
    assert re.fullmatch(r"peak memory  \+\d+\.\d MiB  \(host RSS peak .*\)", lines[start + 22])
    assert lines[-1].startswith("[ascend_vlm] wrote the full report to ")


def test_compare_patched_and_unpatched_agree_sample_by_sample(tiny_model_path, tmp_path):
    out = tmp_path / "compare.json"
    argv = ["--model", str(tiny_model_path), "--limit", "6", "--batch-size", "3"]
    text = _run(
        [*argv, "--max-new-tokens", "2", "--compare", "unpatched", "patched", "--json", str(out)]
    )
    report = json.loads(out.read_text())
    first, second = report["configurations"]
    assert (first["label"], second["label"]) == ("unpatched", "patched")
    assert first["options"]["patch"] == {"summary": "not patched", "patched": False}
    assert second["options"]["patch"]["patched"] is True
    assert [p["prediction"] for p in first["predictions"]] == [
        p["prediction"] for p in second["predictions"]
    ]
    comparison = report["comparison"]
    assert comparison["first"] == "unpatched"
    assert comparison["second"] == "patched"
    assert comparison["samples"] == comparison["identical_predictions"] == 6
    for metric in ("exact", "normalised"):
        row = comparison["metrics"][metric]
        assert row["difference"] == 0.0
        assert row["first_only"] == row["second_only"] == 0
        assert row["both"] + row["neither"] == 6
        assert row["mcnemar_p"] == 1.0
        assert row["first_accuracy"] == row["second_accuracy"]
        low, high = row["ci95"]
        assert low <= 0.0 <= high
    lines = text.splitlines()
    assert "== A: unpatched ==" in lines and "== B: patched ==" in lines
    at = lines.index("comparison on the same 6 samples: A = unpatched, B = patched")
    assert re.fullmatch(
        r"exact +(\d\.\d{3}) +\1 +\+0\.000  \[-\d\.\d{3}, \+\d\.\d{3}\] +0 +0  1\.0000",
        lines[at + 2],
    ), lines[at + 2]
    assert lines[at + 4] == "identical predictions: 6/6"


def test_prune_option_is_applied_and_reported(tiny_model_path, tmp_path):
    # The tiny checkpoint's language model has 2 layers, so pruning starts at layer 1.
    out = tmp_path / "report.json"
    argv = ["--model", str(tiny_model_path), "--limit", "2", "--max-new-tokens", "1"]
    text = _run([*argv, "--prune", "random:layer=1,keep=0.5", "--json", str(out)])
    (entry,) = json.loads(out.read_text())["configurations"]
    summary = "pruned: random layer=1 keep=0.5 seed=0"
    option = entry["options"]["prune"]
    assert {key: option[key] for key in ("summary", "prune", "kv")} == {
        "summary": summary,
        "prune": {"method": "random", "layer": 1, "keep": 0.5, "seed": 0},
        "kv": None,
    }
    last = option["last_prefill"]
    assert last["kept_visual_tokens"] == [-(-count // 2) for count in last["visual_tokens"]]
    assert last["layer_tokens"][1] < last["layer_tokens"][0] and last["kv_ratio"] < 1
    assert f"option   prune: {summary}" in text.splitlines()
    assert len(entry["predictions"]) == 2


def test_vision_cache_option_reports_its_counters(tiny_model_path, tmp_path):
    out = tmp_path / "report.json"
    argv = ["--model", str(tiny_model_path), "--limit", "2", "--max-new-tokens", "1"]
    text = _run([*argv, "--vision-cache", "16:8", "--json", str(out)])
    (entry,) = json.loads(out.read_text())["configurations"]
    option = entry["options"]["vision-cache"]
    assert (option["max_bytes"], option["host_bytes"]) == (16 << 20, 8 << 20)
    stats = option["stats"]
    # the batch is generated twice (the untimed warm-up, then the timed run; the vision stage
    # times the encoder itself, past the cache): the warm-up misses, the timed run hits
    assert (stats["hits"], stats["misses"], stats["entries"]) == (2, 2, 2)
    assert stats["hashed_images"] == 4 and 0 < stats["bytes"] <= 16 << 20
    line = next(line for line in text.splitlines() if line.startswith("option   vision-cache:"))
    assert "2 hits / 2 misses (50.0%)" in line
    # 16 MiB holds both images: nothing reaches the host tier.
    assert (stats["demotions"], stats["host_entries"]) == (0, 0)
    assert line.endswith("; host tier: 0 hits, 0 demotions, 0.0 MiB held")


def test_a_model_refusing_the_prune_flags_is_a_usage_error(tiny_model_path, capsys):
    from ascend_vlm.__main__ import main

    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "--model", str(tiny_model_path), "--limit", "2", "--prune", "fastv"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.splitlines()[-1]
    assert error == (
        f"python -m ascend_vlm eval: error: {tiny_model_path}: --prune: layer: expected 1 <= "
        f"layer < 2 (the language model's decoder layers), got 2"
    ), error


def test_jsonl_data_groups_by_record_type(tiny_model_path, tmp_path):
    from ascend_vlm.data.shapes_vqa import render_scene

    render_scene(4)[0].save(tmp_path / "scene.png")
    records = [
        {
            "image": "scene.png",
            "question": "How many shapes are there?",
            "answer": "2",
            "type": "n",
        },
        {"image": "scene.png", "question": "What colour is the circle?", "answer": "Red."},
        {"image": "scene.png", "question": "What shape is red?", "answer": "circle", "type": "n"},
    ]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(record) + "\n" for record in records))
    out = tmp_path / "report.json"
    argv = ["--model", str(tiny_model_path), "--data", str(data), "--no-patch"]
    _run([*argv, "--max-new-tokens", "1", "--json", str(out)])
    report = json.loads(out.read_text())
    assert report["dataset"] == {"name": "jsonl", "path": str(data), "samples": 3}
    (entry,) = report["configurations"]
    assert entry["options"]["patch"]["patched"] is False
    by_type = entry["accuracy"]["exact"]["by_type"]
    assert {kind: cell["total"] for kind, cell in by_type.items()} == {"n": 2, "all": 1}
    assert [p["answer"] for p in entry["predictions"]] == ["2", "Red.", "circle"]


def test_model_reference_resolves_to_the_reference_checkpoint(
    tiny_model_path, tmp_path, monkeypatch
):
    from ascend_vlm.finetune import reference_model

    calls = []

    def fake_reference_model_path(build: bool = True):
        calls.append(build)
        return tiny_model_path

    monkeypatch.setattr(reference_model, "reference_model_path", fake_reference_model_path)
    out = tmp_path / "report.json"
    _run(["--model", "reference", "--limit", "1", "--max-new-tokens", "1", "--json", str(out)])
    report = json.loads(out.read_text())
    (entry,) = report["configurations"]
    assert calls == [True]
    assert entry["label"] == "reference"
    assert entry["model"] == str(tiny_model_path)
    # Held-out questions at the size the reference is trained at.
    assert report["dataset"]["image_size"] == reference_model.RECIPE.image_size


def _write(path, text):
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing model", "--model: expected a local checkpoint directory with config.json, got {dir}/none"),
        ("no model", "--model: expected a checkpoint folder or 'reference', got none"),
        ("compare no model", "--model: expected a checkpoint folder or 'reference', got none (give it once, or as model=PATH in each configuration)"),
        ("limit 0", "--limit: expected an int >= 1, got 0"),
        ("batch 0", "--batch-size: expected an int >= 1, got 0"),
        ("tiny image", "--image-size: expected an int >= 32 pixels, got 8"),
        ("seed with data", "--seed: applies to ShapesVQA only, not to --data {dir}/good.jsonl"),
        ("no data file", "--data: expected a JSONL file, got {dir}/none.jsonl (no such file)"),
        ("malformed jsonl", "--data: {dir}/bad.jsonl: record 2: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"),
        ("limit above data", "--limit: expected at most the 1 samples of --data, got 5"),
        ("json exists", "--json: {dir}/taken.json exists; pass --force to replace it"),
        ("host tier alone", "argument --vision-cache: a host tier needs a cache of MIB > 0, got '0:8'"),
        ("cache budgets", "argument --vision-cache: expected MIB or MIB:HOST_MIB (int numbers of MiB), got '1:2:3'"),
        ("unknown config", "--compare: configuration 'bogus': expected a preset (patched, unpatched), key=value, 'reference' or a checkpoint folder, got 'bogus'"),
        ("unknown flag", "--compare: configuration 'frobnicate=1': unrecognized arguments: --frobnicate 1"),
        ("config model missing", "--compare: configuration 'model={dir}/none': --model: expected a local checkpoint directory with config.json, got {dir}/none"),
    ],
)  # fmt: skip
def test_bad_input_exits_2_naming_the_option(
    tiny_model_path, tmp_path, command_error, case, message
):
    from ascend_vlm.data.shapes_vqa import render_scene

    render_scene(0)[0].save(tmp_path / "scene.png")
    good = json.dumps({"image": "scene.png", "question": "q?", "answer": "a"})
    _write(tmp_path / "good.jsonl", good + "\n")
    _write(tmp_path / "bad.jsonl", good + "\n{not json\n")
    _write(tmp_path / "taken.json", "{}")
    model = ["--model", str(tiny_model_path)]
    argv = {
        "missing model": ["--model", str(tmp_path / "none")],
        "no model": [],
        "compare no model": ["--compare", "patched", "unpatched"],
        "limit 0": [*model, "--limit", "0"],
        "batch 0": [*model, "--batch-size", "0"],
        "tiny image": [*model, "--image-size", "8"],
        "seed with data": [*model, "--data", str(tmp_path / "good.jsonl"), "--seed", "1"],
        "no data file": [*model, "--data", str(tmp_path / "none.jsonl")],
        "malformed jsonl": [*model, "--data", str(tmp_path / "bad.jsonl")],
        "limit above data": [*model, "--data", str(tmp_path / "good.jsonl"), "--limit", "5"],
        "json exists": [*model, "--json", str(tmp_path / "taken.json")],
        "host tier alone": [*model, "--vision-cache", "0:8"],
        "cache budgets": [*model, "--vision-cache", "1:2:3"],
        "unknown config": [*model, "--compare", "patched", "bogus"],
        "unknown flag": [*model, "--compare", "patched", "frobnicate=1"],
        "config model missing": [*model, "--compare", "patched", f"model={tmp_path / 'none'}"],
    }[case]
    assert command_error(["eval", *argv]) == EVAL_ERROR + message.format(dir=tmp_path)


def test_help_documents_compare_syntax_and_feature_groups(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "patch option:" in out
    assert "--patch, --no-patch" in out
    assert "--compare A B: answer the same samples with two configurations" in out
    assert "a preset        patched, unpatched" in out
