"""scripts/bench_gdn.py end to end: every case against transformers' function with an A/A twin."""

from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="module")
def bench(script_module):
    return script_module("bench_gdn")


def test_every_case_is_timed_beside_its_a_a_twin_and_recorded(bench, tmp_path, capsys):
    out = tmp_path / "gdn.json"
    bench.main(["--rounds", "1", "--tokens", "16", "--json", str(out)])
    record = json.loads(out.read_text())
    assert record["header"] == bench.HEADER
    assert [row[0] for row in record["rows"]] == [
        "chunk_gated_delta_rule T=16",
        "recurrent_gated_delta_rule T=16",
        "causal_conv1d silu T=16",
    ]
    for row in record["rows"]:
        ours, theirs, twin, aa, ratio = map(float, row[1:])
        assert min(ours, theirs, twin) > 0
        assert aa == pytest.approx(twin / theirs, rel=0.02, abs=0.006)
        assert ratio == pytest.approx(ours / theirs, rel=0.02, abs=0.006)
    assert "| causal_conv1d silu T=16 |" in capsys.readouterr().out


def test_bad_arguments_are_refused(bench, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--rounds", "0"])
    assert exit_info.value.code == 2
    assert "--threads, --rounds, --tokens: expected ints >= 1" in capsys.readouterr().err
