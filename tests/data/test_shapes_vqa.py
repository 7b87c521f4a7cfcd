"""ShapesVQA: deterministic by seed, and every answer re-derived from the pixels alone."""

from __future__ import annotations

import hashlib
import itertools

import numpy as np
import pytest

from ascend_vlm.data.shapes_vqa import (
    BACKGROUND,
    COLOURS,
    KINDS,
    NEW_SHAPE_KINDS,
    QUESTION_TYPES,
    Shape,
    ShapesVQA,
    describe_scene,
    draw_scene,
    render_scene,
    scene_key,
    scene_seed,
    scene_split,
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


def _scenes(dataset: ShapesVQA) -> set[tuple[str, str]]:
    """(scene key, SHA-256 of the image bytes) of every record of ``dataset``."""
    scenes = set()
    for index in range(len(dataset)):
        key = scene_key(dataset.scene(index)[0])
        image = dataset[index].image.tobytes()
        scenes.add((key, hashlib.sha256(image).hexdigest()))
    return scenes


def _shapes_of_key(key: str) -> list[Shape]:
    """The shapes a :func:`scene_key` names (its inverse)."""
    canvas, shapes = key.split(":")
    fields = [part.split(",") for part in shapes.split(";")]
    return [Shape(k, c, int(x), int(y), int(r), int(canvas)) for k, c, x, y, r in fields]


@pytest.mark.parametrize("image_size", [56, 112, 224])
def test_no_eval_scene_is_ever_drawn_for_training(image_size):
    evaluation, training = set(), set()
    for seed, binding in itertools.product(range(3), (False, True)):
        evaluation |= _scenes(ShapesVQA("eval", 150, seed, image_size, binding))
        training |= _scenes(ShapesVQA("train", 400, seed + 7, image_size, binding))
    # 2 x 3 x 550 records; one-shape scenes repeat (there are few), so compare distinct ones.
    assert len(evaluation) > 100 and len(training) > 400
    assert not {key for key, _ in evaluation} & {key for key, _ in training}
    assert not {image for _, image in evaluation} & {image for _, image in training}
    assert {scene_split(_shapes_of_key(key)) for key, _ in evaluation} == {"eval"}


def _one_shape_scenes(size: int) -> list[list[Shape]]:
    """Every one-shape scene :func:`describe_scene` can draw on a ``size`` canvas."""
    quarter = size // 4
    offset = quarter // 3
    max_radius = quarter - offset - 1
    scenes = []
    for kind, colour, quadrant in itertools.product(KINDS, COLOURS, range(4)):
        right, bottom = quadrant % 2, quadrant // 2
        cx = right * size // 2 + quarter + (offset if right else -offset)
        cy = bottom * size // 2 + quarter + (offset if bottom else -offset)
        for radius in range((3 * max_radius + 3) // 4, max_radius + 1):
            scenes.append([Shape(kind, colour, cx, cy, radius, size)])
    return scenes


def test_split_predicate_is_a_fixed_function_of_the_scene():
    scenes = _one_shape_scenes(56)
    assert len(scenes) == 240
    # Fixed values: a change of the predicate would move scenes between the splits.
    assert sum(scene_split(scene) == "eval" for scene in scenes) == 52
    assert [scene_split(scene) for scene in scenes[:3]] == ["train", "eval", "train"]
    assert scene_key(scenes[1]) == "56:circle,red,10,10,8"
    pair = describe_scene(11, 112, count=2)
    assert scene_key(pair) == scene_key(pair[::-1])
    assert draw_scene(pair, 112).tobytes() == draw_scene(pair[::-1], 112).tobytes()
    # A split draws only its own scenes: the records of seed 0 at 56 px cover every one-shape
    # eval scene and no train scene.
    drawn = {scene_key(ShapesVQA("eval", 2000, 0, 56).scene(i)[0]) for i in range(2000)}
    eval_keys = {scene_key(scene) for scene in scenes if scene_split(scene) == "eval"}
    assert {key for key in drawn if key.count(";") == 0} == eval_keys


def test_question_types_choose_the_questions_asked():
    dataset = ShapesVQA("eval", 6, image_size=56, question_types=("vertical", "count"))
    questions = [dataset[i].question for i in range(6)]
    assert [q.startswith("How many") for q in questions] == [False, True] * 3
    assert all(dataset[i].answer in ("top", "bottom") for i in (0, 2, 4))
    for bad in ((), ("vertical", "vertical"), ("size",), "count"):
        with pytest.raises(ValueError, match="question_types: expected distinct names"):
            ShapesVQA(question_types=bad)


def test_the_base_kinds_records_are_the_ones_the_reference_was_trained_on():
    # The digest of these records as ShapesVQA drew them before the new kinds existed: adding
    # kinds must not move a pixel or a word of the base-kind data.
    digest = hashlib.sha256()
    for split, binding in itertools.product(("train", "eval"), (False, True)):
        records = ShapesVQA(split, 40, 3, 56, binding)
        for index in range(40):
            sample = records[index]
            digest.update(sample.image.tobytes())
            digest.update(sample.question.encode())
            digest.update(sample.answer.encode())
    assert digest.hexdigest() == "f0eed896831ea844e8e43375731ca47839ff6e7972f660ac2a9682f008414279"


def _new_kind_from_mask(mask: np.ndarray) -> str:
    """Classify a new-kind shape: a hole in the middle (ring), then by bounding-box fill."""
    rows, cols = np.nonzero(mask)
    box = mask[rows.min() : rows.max() + 1, cols.min() : cols.max() + 1]
    if not box[box.shape[0] // 2, box.shape[1] // 2]:
        return "ring"
    fill = box.mean()
    return "hexagon" if fill > 0.65 else "cross" if fill > 0.45 else "star"


def test_new_kinds_are_drawn_told_apart_and_named_by_their_names():
    names = dict(zip(NEW_SHAPE_KINDS, ("<star>", "<cross>", "<hexagon>", "<ring>"), strict=True))
    records = ShapesVQA("train", 60, 1, 112, False, ("shape",), NEW_SHAPE_KINDS, names)
    seen = set()
    for index in range(len(records)):
        sample = records[index]
        (mask,) = _colour_masks(sample.image).values()
        kind = _new_kind_from_mask(mask)
        assert sample.answer == names[kind], index
        seen.add(kind)
    assert seen == set(NEW_SHAPE_KINDS)
    colour = ShapesVQA("train", 4, 1, 112, False, ("colour",), NEW_SHAPE_KINDS, names)
    assert all(colour[i].question.split("the ")[1].rstrip("?") in names.values() for i in range(4))


def test_a_kind_subset_limits_the_shapes_per_scene():
    counts = {len(describe_scene(seed, 56, kinds=NEW_SHAPE_KINDS[:2])) for seed in SEEDS}
    assert counts == {1, 2}
    with pytest.raises(ValueError, match=r"count: expected None or 1\.\.2 shapes, got 3"):
        describe_scene(0, 56, count=3, kinds=NEW_SHAPE_KINDS[:2])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kinds": ("star", "blob")}, "kinds: expected distinct names from"),
        ({"kinds": ("star", "star")}, "kinds: expected distinct names from"),
        ({"kinds": ()}, "kinds: expected distinct names from"),
        ({"kinds": KINDS, "kind_names": {"star": "<star>"}}, "kind_names: expected distinct"),
        ({"kind_names": {"circle": "a", "square": "a"}}, "kind_names: expected distinct"),
        ({"kind_names": {"circle": " "}}, "kind_names: expected distinct non-empty"),
    ],
)
def test_bad_kinds_and_names_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ShapesVQA(**kwargs)
