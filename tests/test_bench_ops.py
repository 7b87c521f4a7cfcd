"""scripts/bench_ops.py end to end: every op against transformers' composite with an A/A twin."""

from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="module")
def bench(script_module):
    return script_module("bench_ops")


def test_every_op_is_timed_beside_its_a_a_twin_and_recorded(bench, tmp_path, capsys):
    out = tmp_path / "ops.json"
    bench.main(["--repeats", "1", "--threads", "1", "--json", str(out)])
    record = json.loads(out.read_text())
    assert record["header"] == bench.HEADER
    labels = [row[0] for row in record["rows"]]
    assert labels[0].startswith("fused_attention") and "swiglu 4x512x5632" in labels
    for row in record["rows"]:
        ours, theirs, twin, aa, ratio = map(float, row[1:])
        assert min(ours, theirs, twin) > 0
        assert aa == pytest.approx(twin / theirs, rel=0.01, abs=0.006)
        assert ratio == pytest.approx(ours / theirs, rel=0.01, abs=0.006)
    assert "torch.ops" in capsys.readouterr().out  # the custom-op boundary table


def test_bad_arguments_are_refused(bench, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--repeats", "0"])
    assert exit_info.value.code == 2
    assert "--repeats, --threads: expected ints >= 1" in capsys.readouterr().err
