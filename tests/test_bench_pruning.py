"""scripts/bench_pruning.py end to end on a 3-layer model and a 16-token prompt (speed part;
the accuracy part needs the reference checkpoint and is run by hand)."""

from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="module")
def bench(script_module):
    return script_module("bench_pruning")


def test_speed_rows_measure_real_removal(bench, tmp_path, capsys) -> None:
    out = tmp_path / "bench.json"
    argv = ["--layers", "3", "--visual-tokens", "16", "--keeps", "1.0", "0.5", "--repeats", "1"]
    assert bench.main([*argv, "--threads", "1", "--no-accuracy", "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["header"] == bench.HEADER
    rows = {row[1]: dict(zip(bench.HEADER, row, strict=True)) for row in record["rows"]}
    assert set(rows) == {
        "unpruned", "unpruned (A/A)", "FastV keep=0.5", "SnapKV ratio=0.5",
        "FastV keep=0.5 + SnapKV 0.5",
    }  # fmt: skip
    # prompt: BOS, vision start, 16 image tokens, vision end, 32 text tokens = 51; FastV keeps 8
    # image tokens in layer 2; SnapKV keeps max(51 - 25, window 32) = 32 positions in layers 1, 2
    assert float(rows["unpruned (A/A)"]["KV ratio"]) == 1.0
    fastv, snapkv = (
        float(rows[name]["KV ratio"]) for name in ("FastV keep=0.5", "SnapKV ratio=0.5")
    )
    assert fastv == pytest.approx((51 + 51 + 43) / (3 * 51), abs=5e-4)
    assert snapkv == pytest.approx((51 + 32 + 32) / (3 * 51), abs=5e-4)
    # the baseline is the first unpruned row; its twin's speed-up is the A/A column of every row
    assert rows["unpruned"]["speed-up"] == "1.00x"
    assert {row["A/A"] for row in rows.values()} == {rows["unpruned (A/A)"]["speed-up"][:-1]}
    assert all(row["accuracy"] == "" for row in rows.values())
    table = capsys.readouterr().out
    assert "| 16 | FastV keep=0.5 |" in table and "| 16 | SnapKV ratio=0.5 |" in table


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--visual-tokens", "1000"], "--visual-tokens: expected square counts"),
        (["--keeps", "0"], "--keeps: expected ratios with 0 < keep <= 1"),
        (["--layers", "2"], "--layers: expected > 2"),
    ],
)
def test_bad_arguments_are_refused(bench, argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        bench.main([*argv, "--no-accuracy"])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
