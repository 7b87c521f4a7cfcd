"""scripts/bench_batching.py end to end on a small workload and a 1-layer model."""

from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="module")
def bench(script_module):
    return script_module("bench_batching")


def test_the_three_methods_are_measured_and_continuous_answers_are_exact(bench, tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["--requests", "6", "--batch-size", "3", "--max-new", "6", "--layers", "1"]
    argv += ["--repeats", "2"]
    assert bench.main([*argv, "--threads", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [row["method"] for row in report["rows"]] == [
        "one by one", "static, batches of 3", "continuous, up to 3",
    ]  # fmt: skip
    assert report["continuous_equals_one_by_one"] is True
    assert all(row["tokens_per_s"] > 0 and row["p50_s"] <= row["p95_s"] for row in report["rows"])
    assert 0 < report["budget_utilisation"]["max_batch_size"] <= 1
    assert "| continuous, up to 3 |" in capsys.readouterr().out


def test_the_workload_mixes_images_and_lengths(bench):
    requests = bench.workload(40, 4, 64, seed=0)
    counts = {len(request.images()) for request in requests}
    assert counts == {0, 1, 3}
    lengths = [request.max_new_tokens for request in requests]
    assert min(lengths) >= 4 and max(lengths) <= 64 and len(set(lengths)) > 10


def test_bad_arguments_are_refused(bench, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--min-new", "8", "--max-new", "4"])
    assert exit_info.value.code == 2
    assert "--max-new: expected >= --min-new (8), got 4" in capsys.readouterr().err
