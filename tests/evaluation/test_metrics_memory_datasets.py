"""Answer metrics, the peak-RSS measure, and the evaluation datasets."""

from __future__ import annotations

import json
import re

import pytest

from ascend_vlm.data import datasets
from ascend_vlm.data.answer_metrics import exact_match, normalised_match, score
from ascend_vlm.data.shapes_vqa import QUESTION_TYPES, ShapesVQA, render_scene
from ascend_vlm.data.vqa import BadRecordError
from ascend_vlm.observability.memory import PeakRSS


@pytest.mark.parametrize(
    ("prediction", "answer", "exact", "normalised"),
    [
        ("red", "red", True, True),
        (" red\n", "red", True, True),
        ("Red.", "red", False, True),
        ("red", "blue", False, False),
        ("reddish", "red", False, False),
    ],
)
def test_exact_and_normalised_match(prediction, answer, exact, normalised):
    assert exact_match(prediction, answer) is exact
    assert normalised_match(prediction, answer) is normalised
    assert score(prediction, answer) == {"exact": exact, "normalised": normalised}


def test_peak_rss_sees_a_block_that_is_freed_before_the_end():
    size = 64 * 2**20
    with PeakRSS() as memory:
        block = bytearray(size)
        block[::4096] = b"\x01" * len(range(0, size, 4096))  # touch every page
        del block
    assert memory.peak_bytes is not None
    # The kernel updates RSS counters in batches of up to 64 pages per thread and counter
    # (and other pages may leave meanwhile), hence the 1 MiB of slack below.
    assert size - 2**20 <= memory.peak_bytes < 2 * size


# One regular expression per question type: the templates of shapes_vqa.question_answer.
TEMPLATES = {
    "colour": r"What colour is the \w+\?",
    "shape": r"What shape is \w+\?",
    "count": r"How many shapes are there\?",
    "horizontal": r"Is the \w+ shape on the left or the right\?",
    "vertical": r"Is the \w+ shape at the top or the bottom\?",
}


def test_shapes_vqa_is_the_held_out_split_with_each_records_question_type():
    dataset = datasets.shapes_vqa(limit=10, seed=3, image_size=64)
    records = ShapesVQA(split="eval", size=10, seed=3, image_size=64)
    assert len(dataset) == 10
    assert dataset.description == {
        "name": "shapes_vqa",
        "split": "eval",
        "seed": 3,
        "image_size": 64,
        "samples": 10,
    }
    for index in range(10):
        sample, record = dataset[index], records[index]
        assert (sample.question, sample.answer) == (record.question, record.answer)
        assert sample.image.tobytes() == record.image.tobytes()
        assert re.fullmatch(TEMPLATES[dataset.question_type(index)], sample.question)
    assert [dataset.question_type(i) for i in range(5)] == list(QUESTION_TYPES)
    assert len(datasets.shapes_vqa()) == datasets.DEFAULT_SHAPES_SAMPLES


def test_jsonl_types_default_to_all_and_head_keeps_the_first_samples(tmp_path):
    render_scene(1)[0].save(tmp_path / "scene.png")
    records = [
        {"image": "scene.png", "question": "How many shapes are there?", "answer": "2"},
        {"image": "scene.png", "question": "What shape is red?", "answer": "circle", "type": "s"},
        {"image": "scene.png", "question": "What colour?", "answer": "red"},
    ]
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    dataset = datasets.jsonl(path)
    assert [dataset.question_type(i) for i in range(3)] == ["all", "s", "all"]
    assert dataset.description == {"name": "jsonl", "path": str(path), "samples": 3}
    head = dataset.head(2)
    assert [head[i].answer for i in range(2)] == ["2", "circle"]
    assert head.description["samples"] == 2
    with pytest.raises(IndexError, match=r"index: expected in \[0, 2\), got 2"):
        head[2]
    with pytest.raises(ValueError, match=r"count: expected an int in \[1, 3\], got 4"):
        dataset.head(4)
    path.write_text(path.read_text() + "{broken\n")
    with pytest.raises(BadRecordError, match="record 4"):
        datasets.jsonl(path)
