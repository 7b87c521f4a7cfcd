"""save_attention_overlay / save_stage_heatmap write PNGs that show what they are given."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from PIL import Image

from ascend_vlm.observability.pictures import _set_ticks, save_attention_overlay, save_stage_heatmap
from ascend_vlm.observability.visual_grid import ImageCells


def _raster_cells(width: int, height: int, rows: int, cols: int, covered_width=None) -> ImageCells:
    """A rows x cols raster over the left `covered_width` pixels (default: all) of the image."""
    covered = width if covered_width is None else covered_width
    r, c = np.divmod(np.arange(rows * cols), cols)
    boxes = np.stack(
        [c * covered / cols, r * height / rows, (c + 1) * covered / cols, (r + 1) * height / rows],
        axis=1,
    ).astype(np.float64)
    return ImageCells(0, rows, cols, boxes, (width, height))


def _png(path) -> np.ndarray:
    with Image.open(path) as picture:
        assert picture.format == "PNG"
        return np.asarray(picture.convert("RGB")).astype(np.int64)


def _centroid(mask: np.ndarray) -> np.ndarray:
    ys, xs = np.nonzero(mask)
    return np.array([xs.mean(), ys.mean()])


def test_overlay_is_a_png_with_the_heat_where_the_weight_is(tmp_path):
    image = Image.new("RGB", (112, 112), (128, 128, 128))
    cells = _raster_cells(112, 112, 4, 4)
    top_left, bottom_right = np.zeros(16), np.zeros(16)
    top_left[0], bottom_right[15] = 1.0, 1.0

    path = save_attention_overlay(tmp_path / "a.png", image, cells, top_left, title="top left")
    assert path == tmp_path / "a.png"
    first = _png(path)
    second = _png(save_attention_overlay(tmp_path / "b.png", image, cells, bottom_right))
    assert first.shape == second.shape
    assert 300 <= first.shape[0] <= 2000 and 300 <= first.shape[1] <= 2000

    # Hot colours are bright: where the first picture is brighter than the second lies up-left
    # of where the second is brighter than the first.
    difference = first.sum(axis=2) - second.sum(axis=2)
    hotter_first, hotter_second = difference > 150, difference < -150
    assert hotter_first.sum() > 1000 and hotter_second.sum() > 1000
    dx, dy = _centroid(hotter_second) - _centroid(hotter_first)
    assert dx > 100 and dy > 100


def test_overlay_leaves_pixels_outside_every_box_uncoloured(tmp_path):
    red = (255, 0, 0)
    image = Image.new("RGB", (112, 112), red)
    weights = np.linspace(0.0, 1.0, 4)

    def red_pixels(cells) -> int:
        picture = _png(save_attention_overlay(tmp_path / "p.png", image, cells, weights))
        overlay = picture[:, picture.shape[1] // 2 :]  # the left panel is the plain image
        return int((np.abs(overlay - red).sum(axis=2) < 10).sum())

    assert red_pixels(_raster_cells(112, 112, 2, 2)) == 0
    picture = _png(tmp_path / "p.png")
    plain = picture[:, : picture.shape[1] // 2]
    assert (np.abs(plain - red).sum(axis=2) < 10).sum() > 40_000  # the image, uncovered
    assert red_pixels(_raster_cells(112, 112, 2, 2, covered_width=56)) > 10_000


def test_overlay_refuses_bad_arguments(tmp_path):
    image = Image.new("RGB", (112, 112))
    cells = _raster_cells(112, 112, 4, 4)
    with pytest.raises(ValueError, match=r"weights: expected a 1-D array of 16 values"):
        save_attention_overlay(tmp_path / "x.png", image, cells, np.zeros(15))
    with pytest.raises(ValueError, match=r"image: expected the 112 x 112 image .* got 100 x 112"):
        save_attention_overlay(
            tmp_path / "x.png", Image.new("RGB", (100, 112)), cells, np.zeros(16)
        )
    assert not (tmp_path / "x.png").exists()


def test_stage_heatmap_draws_absent_stages_blank(tmp_path):
    rows, columns = ["request 0"], ["vision", "prefill", "decode 0"]
    present = _png(save_stage_heatmap(tmp_path / "a.png", rows, columns, [[4.0, 0.0, 4.0]]))
    absent = _png(save_stage_heatmap(tmp_path / "b.png", rows, columns, [[np.nan, 0.0, 4.0]]))
    assert present.shape == absent.shape
    changed = np.abs(present - absent).sum(axis=2) > 30
    assert changed.sum() > 1000
    # Only the first cell changes, and there the blank picture is white (but for the
    # anti-aliased axes frame the cell's colour covers in the other picture).
    assert (absent[changed] >= 245).all(axis=1).mean() > 0.95
    assert np.nonzero(changed)[1].max() < present.shape[1] / 2


def test_stage_heatmap_many_columns_and_nans(tmp_path):
    values = np.random.default_rng(0).uniform(0.1, 300.0, size=(5, 64))
    values[0, 3:] = np.nan
    values[:, 0] = np.nan
    path = save_stage_heatmap(
        tmp_path / "wide.png",
        [f"row {i}" for i in range(5)],
        ["vision", "prefill", *[f"decode {i}" for i in range(62)]],
        values,
        title="stages",
    )
    picture = _png(path)
    assert 200 <= picture.shape[0] <= 1500 and 500 <= picture.shape[1] <= 2000
    all_absent = _png(save_stage_heatmap(tmp_path / "empty.png", ["r"], ["s"], [[np.nan]]))
    filled = _png(save_stage_heatmap(tmp_path / "one.png", ["r"], ["s"], [[5.0]]))
    white = lambda picture: float((picture >= 245).all(axis=2).mean())  # noqa: E731
    assert white(all_absent) > white(filled) + 0.1  # the absent cell is left blank


def test_tick_labels_are_thinned():
    recorded = {}

    def set_ticks(positions, labels, **text):
        recorded.update(positions=positions, labels=labels)

    _set_ticks(set_ticks, [f"decode {i}" for i in range(100)])
    assert recorded["positions"] == list(range(0, 100, 4))
    assert recorded["labels"][1] == "decode 4"
    _set_ticks(set_ticks, ["a", "b"])
    assert recorded["labels"] == ["a", "b"]


def test_stage_heatmap_refuses_bad_arrays(tmp_path):
    with pytest.raises(ValueError, match=r"milliseconds: expected shape \(2, 3\).* got \(3, 2\)"):
        save_stage_heatmap(tmp_path / "x.png", ["a", "b"], ["s", "t", "u"], np.zeros((3, 2)))
    with pytest.raises(ValueError, match=r"expected shape \(0, 1\).*both > 0"):
        save_stage_heatmap(tmp_path / "x.png", [], ["s"], np.zeros((0, 1)))
    with pytest.raises(ValueError, match="negative or infinite"):
        save_stage_heatmap(tmp_path / "x.png", ["a"], ["s"], [[-1.0]])
    with pytest.raises(ValueError, match="negative or infinite"):
        save_stage_heatmap(tmp_path / "x.png", ["a"], ["s"], [[np.inf]])
    assert not (tmp_path / "x.png").exists()


def test_missing_matplotlib_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"install ascend_vlm\[plots\] \(matplotlib\)"):
        save_stage_heatmap(tmp_path / "x.png", ["a"], ["s"], [[1.0]])
