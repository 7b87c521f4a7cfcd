"""scripts/bench_quant.py end to end on a 1-layer model (bytes and decode parts; the accuracy
part needs the reference checkpoint and is run by hand)."""

from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="module")
def bench(script_module):
    return script_module("bench_quant")


def test_bytes_and_decode_rows_are_measured(bench, tmp_path, capsys) -> None:
    out = tmp_path / "bench.json"
    argv = ["--layers", "1", "--new-tokens", "3", "--repeats", "1", "--threads", "1"]
    assert bench.main([*argv, "--no-accuracy", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    sizes = {row["scheme"]: row for row in report["bytes"]}
    # 7 language linears per layer; int8 plus a 2-byte scale per output channel, int4 plus a
    # 2-byte scale and offset per 128 weights
    assert sizes["w8"]["layers"] == sizes["w4g128"]["layers"] == 7
    assert 0.5 < sizes["w8"]["ratio"] <= 0.52
    assert 0.25 < sizes["w4g128"]["ratio"] <= 0.28
    rows = {row["variant"]: row for row in report["decode"]}
    assert set(rows) == {
        "fp32", "fp32 (A/A)", "fp32 w8", "fp32 w4g128", "bf16", "bf16 w8", "bf16 w4g128",
    }  # fmt: skip
    assert rows["fp32"]["ratio"] == rows["bf16"]["ratio"] == 1.0
    assert all(row["tokens_per_s"] > 0 for row in rows.values())
    table = capsys.readouterr().out
    assert "| w4g128 | 7 |" in table and "| bf16 w8 |" in table


def test_bad_arguments_are_refused(bench, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--new-tokens", "1", "--no-accuracy"])
    assert exit_info.value.code == 2
    assert "--new-tokens: expected an int >= 2" in capsys.readouterr().err
