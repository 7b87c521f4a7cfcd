"""ShapesVQA: deterministic by seed, and every answer re-derived from the pixels alone."""

from __future__ import annotations

import numpy as np
import pytest

from ascend_vlm.finetune.shapes_vqa import (
    BACKGROUND,
    COLOURS,
    QUESTION_TYPES,
    ShapesVQA,
    describe_scene,
    render_scene,
    scene_seed,
)

SEEDS = range(40)


def _colour_masks(image) -> dict[str, np.ndarray]:
    """Boolean pixel mask per colour name present in ``image``."""
    pixels = np.asarray(image)
    masks = {}
    for name, rgb in COLOURS.items():
        mask = (pixels == np.array(rgb, dtype=np.uint8)).all(axis=-1)
        if mask.any():
            masks[name] = mask
    return masks


def _kind_from_mask(mask: np.ndarray) -> str:
    """Classify a filled shape by its bounding-box fill ratio and row widths."""
    rows, cols = np.nonzero(mask)
    box = mask[rows.min() : rows.max() + 1, cols.min() : cols.max() + 1]
    fill = box.mean()
    if fill > 0.95:
        return "square"
    if fill > 0.7:
        return "circle"
    widths = box.sum(axis=1)
    return "triangle" if widths[-1] == widths.max() else "diamond"


def _answers_from_pixels(image, question: str) -> str:
    """Answer ``question`` by looking only at the pixels."""
    masks = _colour_masks(image)
    size = image.size[0]
    if question.startswith("How many"):
        return str(len(masks))
    if question.startswith("What colour is the "):
        kind = question.removeprefix("What colour is the ").rstrip("?")
        (colour,) = [name for name, mask in masks.items() if _kind_from_mask(mask) == kind]
        return colour
    colour = next(name for name in masks if f" {name}" in question)
    rows, cols = np.nonzero(masks[colour])
    if question.startswith("What shape is"):
        return _kind_from_mask(masks[colour])
    if "left or the right" in question:
        assert cols.max() < size // 2 or cols.min() >= size // 2, "shape crosses the midline"
        return "left" if cols.max() < size // 2 else "right"
    assert rows.max() < size // 2 or rows.min() >= size // 2, "shape crosses the midline"
    return "top" if rows.max() < size // 2 else "bottom"


@pytest.mark.parametrize("size", [56, 112])
def test_every_answer_matches_the_pixels(size):
    for seed in SEEDS:
        image, pairs = render_scene(seed, size)
        for question, answer in pairs:
            assert _answers_from_pixels(image, question) == answer, (seed, question)


def test_scene_description_matches_the_pixels():
    for seed in SEEDS:
        shapes = describe_scene(seed)
        image, _ = render_scene(seed)
        pixels = np.asarray(image)
        for shape in shapes:
            assert tuple(pixels[shape.cy, shape.cx]) == COLOURS[shape.colour]
        assert tuple(pixels[0, 0]) == BACKGROUND
        assert len({s.kind for s in shapes}) == len({s.colour for s in shapes}) == len(shapes)


def test_render_is_deterministic_by_seed_and_seeds_differ():
    image_a, pairs_a = render_scene(7)
    image_b, pairs_b = render_scene(7)
    assert pairs_a == pairs_b
    assert image_a.tobytes() == image_b.tobytes()
    assert any(render_scene(seed)[0].tobytes() != image_a.tobytes() for seed in range(8, 12))


def test_dataset_is_deterministic_balanced_and_splits_differ():
    train = ShapesVQA("train", size=50, seed=3)
    again = ShapesVQA("train", size=50, seed=3)
    evaluation = ShapesVQA("eval", size=50, seed=3)
    other_seed = ShapesVQA("train", size=50, seed=4)
    for index in range(len(train)):
        sample, repeat = train[index], again[index]
        assert (sample.question, sample.answer) == (repeat.question, repeat.answer)
        assert sample.image.tobytes() == repeat.image.tobytes()
        assert _answers_from_pixels(sample.image, sample.question) == sample.answer
    # Splits and seeds draw unrelated scenes (one-shape scenes repeat: there are few of them).
    seeds = {split: {scene_seed(3, split, i) for i in range(50)} for split in ("train", "eval")}
    assert not seeds["train"] & seeds["eval"]
    assert not seeds["train"] & {scene_seed(4, "train", i) for i in range(50)}
    train_images = [train[i].image.tobytes() for i in range(len(train))]
    assert train_images != [other_seed[i].image.tobytes() for i in range(len(other_seed))]
    assert train_images != [evaluation[i].image.tobytes() for i in range(len(evaluation))]
    counts = [sum(train[i].question.startswith(p) for i in range(50)) for p in ("How many",)]
    assert counts == [50 // len(QUESTION_TYPES)]
    assert train[-1].answer == train[49].answer


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"split": "test"}, "split: expected one of"),
        ({"size": 0}, "size: expected a positive number"),
        ({"image_size": 8}, "image_size: expected an int >= 32"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ShapesVQA(**kwargs)


def test_out_of_range_index_raises():
    with pytest.raises(IndexError, match="index: expected"):
        ShapesVQA(size=3)[3]


def test_one_shape_scenes_unless_binding_is_asked_for():
    plain = ShapesVQA("train", size=60, seed=1, image_size=56)
    binding = ShapesVQA("train", size=60, seed=1, image_size=56, binding=True)
    plain_counts, binding_counts = set(), set()
    for index in range(60):
        is_count = QUESTION_TYPES[index % len(QUESTION_TYPES)] == "count"
        shapes_plain = len(_colour_masks(plain[index].image))
        shapes_binding = len(_colour_masks(binding[index].image))
        if is_count:
            assert plain[index].answer == str(shapes_plain)
        else:
            plain_counts.add(shapes_plain)
            binding_counts.add(shapes_binding)
        for dataset in (plain, binding):
            sample = dataset[index]
            assert _answers_from_pixels(sample.image, sample.question) == sample.answer
    assert plain_counts == {1}
    assert binding_counts == {1, 2, 3, 4}


def test_describe_scene_count_is_checked():
    assert len(describe_scene(5, 56, count=3)) == 3
    with pytest.raises(ValueError, match=r"count: expected None or 1\.\.4 shapes, got 5"):
        describe_scene(5, 56, count=5)
