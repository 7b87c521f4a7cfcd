"""scripts/bench_adapters.py end to end on a 1-layer model."""

from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="module")
def bench(script_module):
    return script_module("bench_adapters")


def test_switch_load_and_mixed_batch_are_measured(bench, tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["--layers", "1", "--new-tokens", "2", "--repeats", "1", "--switches", "5"]
    assert bench.main([*argv, "--rank", "2", "--threads", "1", "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["header"] == bench.HEADER
    rows = {row[0]: row[1:] for row in record["rows"]}
    assert float(rows["load from disk (ms, median of 32)"][0]) > 0
    for resident in (1, 8, 32):
        first, _, again, aa, _ = rows[f"switch, {resident} resident (ms, median)"]
        assert float(first) > 0 and float(aa) == pytest.approx(
            float(again) / float(first), rel=0.01, abs=0.006
        )
    mixed, switched, twin, aa, speedup = rows["8 requests x 2 tokens, 8 adapters (s)"]
    assert float(aa) == pytest.approx(float(twin) / float(switched), rel=0.01, abs=0.006)
    assert float(speedup[:-1]) == pytest.approx(float(switched) / float(mixed), rel=0.01, abs=0.006)
    assert "| switch, 32 resident (ms, median) |" in capsys.readouterr().out


def test_bad_arguments_are_refused(bench, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--rank", "0"])
    assert exit_info.value.code == 2
    assert "--rank: expected an int >= 1" in capsys.readouterr().err
