"""scripts/bench_patch_instructions.py: reading callgrind's totals (valgrind itself is not
needed here; the script is run by hand where it is installed)."""

from __future__ import annotations

import json
import shutil

import pytest


@pytest.fixture(scope="module")
def bench(script_module):
    return script_module("bench_patch_instructions")


LOG = """==123== Callgrind, a call-graph generating cache profiler
==123== Events    : Ir Dr Dw I1mr D1mr D1mw ILmr DLmr DLmw Bc Bcm Bi Bim
==123== Collected : 300 90 60 30 12 6 3 3 3 45 9 15 6
"""


def test_counts_are_per_forward_sums_of_the_named_events(bench) -> None:
    counts = bench._parse_counts(LOG, forwards=3)
    assert counts == {"Ir": 100, "I1 miss": 10, "D1 miss": 6, "mispredicts": 5}


def test_a_log_without_totals_is_an_error_that_shows_the_log(bench) -> None:
    with pytest.raises(RuntimeError, match=r"(?s)no callgrind totals.*failed to start tool"):
        bench._parse_counts("valgrind: failed to start tool\n", forwards=1)


def test_missing_valgrind_is_a_usage_error_naming_it(bench, monkeypatch, capsys) -> None:
    monkeypatch.setattr(shutil, "which", lambda tool: None)
    with pytest.raises(SystemExit):
        bench.main(["--families", "qwen2_vl"])
    assert "needs valgrind and callgrind_control on PATH" in capsys.readouterr().err


def test_a_family_row_holds_each_ratio_and_the_a_a_count_furthest_from_one(
    bench, monkeypatch, tmp_path, capsys
) -> None:
    counts = {
        "sdpa": {"Ir": 1000e3, "I1 miss": 100e3, "D1 miss": 50e3, "mispredicts": 20e3},
        "sdpa (A/A)": {"Ir": 1001e3, "I1 miss": 100e3, "D1 miss": 49.5e3, "mispredicts": 20e3},
        "patched": {"Ir": 990e3, "I1 miss": 90e3, "D1 miss": 50e3, "mispredicts": 21e3},
    }
    monkeypatch.setattr(shutil, "which", lambda tool: f"/usr/bin/{tool}")
    monkeypatch.setattr(bench, "count", lambda family, size, name, forwards: counts[name])
    out = tmp_path / "patch_instructions.json"
    assert bench.main(["--families", "qwen2_vl", "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["header"] == ["family", "Ir", "I1 miss", "D1 miss", "mispredicts", "A/A"]
    assert record["rows"] == [
        [
            "qwen2_vl",
            "1000k -> 990k (0.99)",
            "100k -> 90k (0.90)",
            "50k -> 50k (1.00)",
            "20k -> 21k (1.05)",
            "0.990",
        ]
    ]
    assert "| qwen2_vl | 1000k -> 990k (0.99) |" in capsys.readouterr().out
