"""scripts/bench_ops.py end to end: every op against transformers' composite with an A/A twin."""

from __future__ import annotations

import pytest
from bench_beside_transformers import checked_rows


@pytest.fixture(scope="module")
def bench(script_module):
    return script_module("bench_ops")


def test_every_op_is_timed_beside_its_a_a_twin_and_recorded(bench, tmp_path, capsys):
    argv = ["--repeats", "1", "--threads", "1"]
    labels = [row[0] for row in checked_rows(bench, argv, tmp_path / "ops.json", rel=0.01)]
    assert labels[0].startswith("fused_attention") and "swiglu 4x512x5632" in labels
    assert "torch.ops" in capsys.readouterr().out  # the custom-op boundary table


def test_bad_arguments_are_refused(bench, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--repeats", "0"])
    assert exit_info.value.code == 2
    assert "--repeats, --threads: expected ints >= 1" in capsys.readouterr().err
