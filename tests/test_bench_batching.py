"""scripts/bench_batching.py end to end on a small workload and a 1-layer model."""

from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="module")
def bench(script_module):
    return script_module("bench_batching")


def _cells(record: dict) -> dict[str, list[str]]:
    """The record's rows by their measure."""
    return {row[1]: row[2:] for row in record["rows"]}


def test_the_three_methods_are_measured_and_continuous_answers_are_exact(bench, tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["--requests", "6", "--batch-size", "3", "--max-new", "6", "--layers", "1"]
    argv += ["--repeats", "2", "--sections", "throughput"]
    assert bench.main([*argv, "--threads", "1", "--json", str(out)]) == 0
    cells = _cells(json.loads(out.read_text()))
    methods = ["one by one", "static, batches of 3", "continuous, up to 3"]
    methods.append("static, batches of 3 (A/A)")
    assert [m for m in cells if m.endswith("output tokens/s")] == [
        f"{method}: output tokens/s" for method in methods
    ]
    # The A/A column is static's best against its twin's, on every speed row.
    noise = {cells[f"{method}: output tokens/s"][3] for method in methods}
    assert len(noise) == 1 and float(noise.pop()) > 0
    assert cells["continuous answers equal one by one"][0] == "True"
    for method in methods:
        assert float(cells[f"{method}: output tokens/s"][0]) > 0
        p50, p95 = cells[f"{method}: p50, p95 latency s"][:2]
        assert float(p50) <= float(p95)
    assert 0 < float(cells["max_batch_size utilisation"][0]) <= 1
    assert "| continuous, up to 3 |" in capsys.readouterr().out


def test_kv_memory_and_prefix_reuse_are_measured(bench, tmp_path):
    out = tmp_path / "bench.json"
    argv = ["--requests", "4", "--max-new", "6", "--layers", "1", "--repeats", "1"]
    argv += ["--sections", "memory", "prefix", "--turn-words", "30", "--turn-images", "1"]
    assert bench.main([*argv, "--threads", "1", "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert "A/A" in record["header"] and record["command"].endswith(str(out))
    cells = _cells(record)
    held, needed, ratio = cells["KV bytes, blocks vs needed"][:3]
    assert int(needed) <= int(held) and float(ratio) >= 1
    assert float(cells["KV bytes, blocks vs padded"][2]) <= 1
    reuse, fresh = cells["second-turn TTFT ms, reuse vs none"][:2]
    assert float(reuse) > 0 and float(fresh) > 0


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
