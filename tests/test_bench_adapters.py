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
    report = json.loads(out.read_text())
    assert set(report["switch_ms"]) == {"1", "8", "32"}
    assert all(value > 0 for value in report["switch_ms"].values())
    assert report["load_ms"] > 0 and report["mixed_batch_s"] > 0 and report["switched_s"] > 0
    assert report["mixed_speedup"] == pytest.approx(report["switched_s"] / report["mixed_batch_s"])
    assert "| 32 |" in capsys.readouterr().out


def test_bad_arguments_are_refused(bench, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--rank", "0"])
    assert exit_info.value.code == 2
    assert "--rank: expected an int >= 1" in capsys.readouterr().err
