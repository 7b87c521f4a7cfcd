"""scripts/bench_input.py end to end with two images and one round."""

from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="module")
def bench(script_module):
    return script_module("bench_input")


def test_every_processor_is_measured_at_both_sizes(bench, tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert bench.main(["--images", "2", "--rounds", "1", "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["header"] == bench.HEADER
    groups = {}
    for family, size, processor, rate, speedup, aa in record["rows"]:
        assert float(rate) > 0 and float(speedup[:-1]) > 0 and float(aa) > 0
        groups.setdefault((family, size), []).append((processor, speedup, aa))
    assert set(groups) == {
        (family, size)
        for family in ("Qwen2-VL", "LLaVA-1.5 (CLIP 336, pad)")
        for size in ("448x448", "1344x896")
    }
    for rows in groups.values():
        assert rows[0][0] == "hugging face (PIL)" and len(rows) == 3
        assert rows[0][1] == "1.00x" and len({row[2] for row in rows}) == 1  # one A/A per group
    printed = capsys.readouterr().out
    assert "| Qwen2-VL | 1344x896 | QwenVLPixels, 2 workers |" in printed
    assert "| LLaVA-1.5 (CLIP 336, pad) | 448x448 | ResizeCropPixels, 1 worker |" in printed


def test_bad_arguments_are_refused(bench):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--images", "0"])
    assert exit_info.value.code == 2
