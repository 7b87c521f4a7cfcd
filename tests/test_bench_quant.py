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
    record = json.loads(out.read_text())
    assert record["header"] == bench.HEADER
    rows = {(row[0], row[1]): dict(zip(bench.HEADER, row, strict=True)) for row in record["rows"]}
    # 7 language linears per layer; int8 plus a 2-byte scale per output channel, int4 plus a
    # 2-byte scale and offset per 128 weights
    sizes = {setting: row for (section, setting), row in rows.items() if section == "weight MB"}
    assert set(sizes) == {"w8, 7 layers", "w4g128, 7 layers"}
    assert 0.5 < float(sizes["w8, 7 layers"]["ratio"]) <= 0.52
    assert 0.25 < float(sizes["w4g128, 7 layers"]["ratio"]) <= 0.28
    decode = {
        setting: row for (section, setting), row in rows.items() if section.startswith("decode")
    }
    assert set(decode) == {
        "fp32", "fp32 (A/A)", "fp32 w8", "fp32 w4g128", "bf16", "bf16 w8", "bf16 w4g128",
    }  # fmt: skip
    assert decode["fp32"]["ratio"] == decode["bf16"]["ratio"] == "1.00"
    assert all(float(row["value"]) > 0 for row in decode.values())
    # the A/A column of every decode row is the control's ratio to fp32
    assert {row["A/A"] for row in decode.values()} == {decode["fp32 (A/A)"]["ratio"]}
    table = capsys.readouterr().out
    assert "| weight MB | w4g128, 7 layers |" in table and "| decode tokens/s | bf16 w8 |" in table


def test_bad_arguments_are_refused(bench, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--new-tokens", "1", "--no-accuracy"])
    assert exit_info.value.code == 2
    assert "--new-tokens: expected an int >= 2" in capsys.readouterr().err
