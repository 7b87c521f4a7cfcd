"""scripts/bench_patch_instructions.py: reading callgrind's totals (valgrind itself is not
needed here; the script is run by hand where it is installed)."""

from __future__ import annotations

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
