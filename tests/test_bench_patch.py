"""scripts/bench_patch.py end to end on one tiny family: patched, eager and sdpa beside the A/A
twin (a second sdpa model), recorded."""

from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="module")
def bench(script_module):
    return script_module("bench_patch")


def test_a_family_row_holds_its_ratios_and_a_a_columns(bench, tmp_path, capsys):
    out = tmp_path / "patch.json"
    argv = ["--sizes", "tiny", "--families", "qwen2_vl", "--repeats", "1", "--instances", "1"]
    assert bench.main([*argv, "--new-tokens", "2", "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["header"] == bench.HEADER
    [row] = record["rows"]
    cells = dict(zip(record["header"], row, strict=True))
    assert (cells["size"], cells["family"]) == ("tiny", "qwen2_vl")
    assert all(float(cells[column]) > 0 for column in record["header"][2:])
    assert "| tiny | qwen2_vl |" in capsys.readouterr().out


def test_bad_arguments_are_refused(bench, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--instances", "0"])
    assert exit_info.value.code == 2
    assert "--instances: expected an int >= 1, got 0" in capsys.readouterr().err
