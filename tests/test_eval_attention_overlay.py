"""scripts/eval_attention_overlay.py end to end on the default model (random weights)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ascend_vlm.data.shapes_vqa import Shape
from ascend_vlm.default_model import default_model_path


@pytest.fixture(scope="module")
def overlay(script_module):
    return script_module("eval_attention_overlay")


def test_hits_are_counted_per_sample(overlay, tmp_path, capsys):
    out, sample = tmp_path / "overlay.json", tmp_path / "scene.png"
    argv = ["--samples", "3", "--model", str(default_model_path()), "--binding"]
    assert overlay.main([*argv, "--save-sample", str(sample), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["samples"] == 3 and report["binding"] is True
    assert 0 <= report["hits"] <= 3 and report["hit_rate"] == report["hits"] / 3
    low, high = report["hit_rate_95"]
    assert 0 <= low <= report["hit_rate"] <= high <= 1
    assert sample.is_file()
    assert "inside the asked shape's box > outside" in capsys.readouterr().out


def test_inside_box_holds_the_pixels_whose_centres_lie_in_the_box(overlay):
    shape = Shape(kind="square", colour="red", cx=10, cy=20, radius=4, canvas=32)
    inside = overlay.inside_box(shape, 32, 32)
    ys, xs = np.nonzero(inside)
    assert (xs.min(), xs.max(), ys.min(), ys.max()) == (6, 13, 16, 23)
    assert inside.sum() == 8 * 8


def test_bad_arguments_are_refused(overlay, capsys):
    with pytest.raises(SystemExit) as exit_info:
        overlay.main(["--samples", "0"])
    assert exit_info.value.code == 2
    assert "--samples: expected an int >= 1, got 0" in capsys.readouterr().err
