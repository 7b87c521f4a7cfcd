"""scripts/bench_gdn.py end to end: every case against transformers' function with an A/A twin."""

from __future__ import annotations

import pytest
from bench_beside_transformers import checked_rows


@pytest.fixture(scope="module")
def bench(script_module):
    return script_module("bench_gdn")


def test_every_case_is_timed_beside_its_a_a_twin_and_recorded(bench, tmp_path, capsys):
    argv = ["--rounds", "1", "--tokens", "16"]
    rows = checked_rows(bench, argv, tmp_path / "gdn.json", rel=0.02)
    assert [row[0] for row in rows] == [
        "chunk_gated_delta_rule T=16",
        "recurrent_gated_delta_rule T=16",
        "causal_conv1d silu T=16",
    ]
    assert "| causal_conv1d silu T=16 |" in capsys.readouterr().out


def test_bad_arguments_are_refused(bench, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--rounds", "0"])
    assert exit_info.value.code == 2
    assert "--threads, --rounds, --tokens: expected ints >= 1" in capsys.readouterr().err
