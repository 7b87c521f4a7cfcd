"""JSON Lines / JSON array / LLaVA record loading (multi-turn and text-only included),
bad-record handling, and answer-only supervision."""

from __future__ import annotations

import json

import pytest
import torch

from ascend_vlm.data.shapes_vqa import render_scene
from ascend_vlm.data.vqa import (
    IGNORE_INDEX,
    BadRecordError,
    JsonlVQA,
    VQASample,
    answer_text,
    collate,
    encode_sample,
    normalise_answer,
    pad_token_id_of,
)


@pytest.fixture
def image_folder(tmp_path):
    image, _ = render_scene(1)
    image.save(tmp_path / "scene.png")
    (tmp_path / "broken.png").write_bytes(b"not a png at all")
    return tmp_path


def _write_jsonl(folder, records) -> str:
    path = folder / "data.jsonl"
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    path.write_text("\n".join(lines) + "\n")
    return path


GOOD_FLAT = {"image": "scene.png", "question": "How many shapes are there?", "answer": "2"}
GOOD_LLAVA = {
    "image": "scene.png",
    "conversations": [
        {"from": "human", "value": "<image>\nWhat colour is the circle?"},
        {"from": "gpt", "value": "red"},
        {"from": "human", "value": "What shape is red?"},
        {"from": "gpt", "value": "circle"},
    ],
}
BAD_RECORDS = [
    ({"image": "missing.png", "question": "q?", "answer": "a"}, "does not exist"),
    ({"image": "broken.png", "question": "q?", "answer": "a"}, "unreadable"),
    ({"image": "scene.png", "question": "q?", "answer": "  "}, "empty answer"),
    ("{not json", "Expecting property name"),
    ({"image": "scene.png", "question": "q?"}, "missing key"),
    ({**GOOD_FLAT, "type": 3}, "type: expected a non-empty string, got 3"),
]


def test_flat_and_llava_records_load_with_relative_images(image_folder):
    dataset = JsonlVQA(_write_jsonl(image_folder, [GOOD_FLAT, GOOD_LLAVA]))
    samples = [dataset[i] for i in range(len(dataset))]
    assert [(s.history, s.question, s.answer) for s in samples] == [
        ((), "How many shapes are there?", "2"),
        ((("What colour is the circle?", "red"),), "What shape is red?", "circle"),
    ]
    assert dataset.records == 2
    assert dataset[0].image.mode == "RGB"
    assert dataset[0].image.tobytes() == render_scene(1)[0].tobytes()


def test_a_json_array_file_reads_as_its_lines_would(image_folder):
    records = [GOOD_FLAT, GOOD_LLAVA, {"question": "Say hi.", "answer": "hi"}]
    array = image_folder / "data.json"
    array.write_text(json.dumps(records, indent=2))
    from_array, from_lines = JsonlVQA(array), JsonlVQA(_write_jsonl(image_folder, records))
    assert len(from_array) == len(from_lines) == 3
    for index in range(3):
        assert from_array[index] == from_lines[index]
    assert from_array[2].image is None  # a text-only record
    (image_folder / "bad.json").write_text(json.dumps([GOOD_FLAT, {"question": "q?"}]))
    with pytest.raises(BadRecordError, match=r"bad\.json: record 2: missing key"):
        JsonlVQA(image_folder / "bad.json", on_bad_record="fail")


def test_every_assistant_turn_of_a_conversation_is_supervised(processor, image_folder):
    dataset = JsonlVQA(_write_jsonl(image_folder, [GOOD_LLAVA]))
    encoded = encode_sample(processor, dataset[0])
    supervised = (encoded["labels"] != IGNORE_INDEX).int()
    # Two answer spans: where supervision starts after a prompt, and where it stops.
    starts = (supervised[1:] - supervised[:-1] == 1).nonzero().flatten() + 1
    assert len(starts) == 2
    spans = [
        processor.tokenizer.decode(encoded["input_ids"][start:][supervised[start:].cumprod(0) == 1])
        for start in starts.tolist()
    ]
    assert [span.split("<")[0] for span in spans] == ["red", "circle"]
    text = processor.tokenizer.decode(encoded["input_ids"])
    assert text.count("<|image_pad|>") > 0 and text.index("What colour") < text.index("What shape")
    # Without the answer: the whole conversation up to the last question, nothing supervised.
    prompt = encode_sample(processor, dataset[0], with_answer=False)
    assert (prompt["labels"] == IGNORE_INDEX).all()
    assert processor.tokenizer.decode(prompt["input_ids"]).rstrip().endswith("assistant")


def test_text_only_samples_batch_with_image_samples(processor):
    image_sample, text_sample = _samples()[0], VQASample(None, "Say hi.", "hi")
    text_only = encode_sample(processor, text_sample)
    assert "pixel_values" not in text_only
    assert processor.image_token_id not in text_only["input_ids"].tolist()
    with_image = encode_sample(processor, image_sample)
    batch = collate([text_only, with_image], pad_token_id_of(processor))
    assert torch.equal(batch["pixel_values"], with_image["pixel_values"])
    assert torch.equal(batch["image_grid_thw"], with_image["image_grid_thw"])
    assert batch["input_ids"].shape[0] == 2


def test_question_type_comes_from_the_record_type_field(image_folder):
    records = [{**GOOD_FLAT, "type": "count"}, {**GOOD_LLAVA, "type": " colour "}, GOOD_FLAT]
    dataset = JsonlVQA(_write_jsonl(image_folder, records))
    assert [dataset.question_type(i) for i in range(len(dataset))] == ["count", "colour", None]


def test_bad_records_are_skipped_and_reported_by_number(image_folder, caplog):
    records = [GOOD_FLAT, *(record for record, _ in BAD_RECORDS)]
    dataset = JsonlVQA(_write_jsonl(image_folder, records), on_bad_record="skip")
    assert len(dataset) == 1
    assert [number for number, _ in dataset.bad_records] == [2, 3, 4, 5, 6, 7]
    for (_, reason), (_, expected) in zip(dataset.bad_records, BAD_RECORDS, strict=True):
        assert expected in reason
    assert "record 4: empty answer" in caplog.text


@pytest.mark.parametrize(("record", "expected"), BAD_RECORDS)
def test_bad_record_fails_fast_naming_its_number(image_folder, record, expected):
    path = _write_jsonl(image_folder, [GOOD_FLAT, GOOD_FLAT, record])
    with pytest.raises(BadRecordError, match=rf"data\.jsonl: record 3: .*{expected}"):
        JsonlVQA(path, on_bad_record="fail")


def test_a_truncated_image_is_a_bad_record_naming_it(image_folder):
    # The header reads, the pixel data ends early: refused at load, not mid-evaluation.
    (image_folder / "truncated.png").write_bytes((image_folder / "scene.png").read_bytes()[:-40])
    path = _write_jsonl(image_folder, [{"image": "truncated.png", "question": "q?", "answer": "a"}])
    message = rf"data\.jsonl: record 1: image '{image_folder / 'truncated.png'}' is unreadable"
    with pytest.raises(BadRecordError, match=message):
        JsonlVQA(path, on_bad_record="fail")


def test_bad_arguments_are_named(image_folder):
    with pytest.raises(ValueError, match="on_bad_record: expected one of"):
        JsonlVQA(_write_jsonl(image_folder, [GOOD_FLAT]), on_bad_record="ignore")
    with pytest.raises(FileNotFoundError, match="path: expected a JSONL file"):
        JsonlVQA(image_folder / "nope.jsonl")
    with pytest.raises(BadRecordError, match="no usable records"):
        JsonlVQA(_write_jsonl(image_folder, [BAD_RECORDS[0][0]]))


def _samples():
    image, pairs = render_scene(5)
    return [VQASample(image, question, answer) for question, answer in pairs[:3]]


def test_only_answer_tokens_are_supervised(processor):
    for sample in _samples():
        encoded = encode_sample(processor, sample)
        supervised = encoded["labels"] != IGNORE_INDEX
        assert torch.equal(encoded["labels"][supervised], encoded["input_ids"][supervised])
        text = processor.tokenizer.decode(encoded["input_ids"][supervised])
        assert text == answer_text(processor, sample.question, sample.answer)
        assert text.startswith(sample.answer)
        # The supervised span is the tail: everything before it is the prompt.
        first = int(supervised.nonzero()[0])
        assert supervised[first:].all()
        image_tokens = int((encoded["input_ids"] == processor.image_token_id).sum())
        grid = encoded["image_grid_thw"]
        assert image_tokens == int(grid.prod()) // processor.image_processor.merge_size**2
        assert len(encoded["mm_token_type_ids"]) == len(encoded["input_ids"])


@pytest.mark.parametrize("side", ["right", "left"])
def test_collate_pads_tokens_and_concatenates_pixels(processor, side):
    encoded = [encode_sample(processor, sample) for sample in _samples()]
    pad_id = pad_token_id_of(processor)
    batch = collate(encoded, pad_id, padding_side=side)
    lengths = [len(item["input_ids"]) for item in encoded]
    assert batch["input_ids"].shape == (len(encoded), max(lengths))
    assert batch["pixel_values"].shape[0] == sum(len(e["pixel_values"]) for e in encoded)
    for row, (item, length) in enumerate(zip(encoded, lengths, strict=True)):
        kept = slice(0, length) if side == "right" else slice(max(lengths) - length, None)
        assert torch.equal(batch["input_ids"][row, kept], item["input_ids"])
        assert torch.equal(batch["labels"][row, kept], item["labels"])
        assert int(batch["attention_mask"][row].sum()) == length
        pad = batch["attention_mask"][row] == 0
        assert (batch["labels"][row][pad] == IGNORE_INDEX).all()
        assert (batch["input_ids"][row][pad] == pad_id).all()
    with pytest.raises(ValueError, match="padding_side: expected 'left' or 'right'"):
        collate(encoded, pad_id, padding_side="middle")


def test_normalise_answer():
    assert normalise_answer("  Red. ") == "red"
    assert normalise_answer("blue") == normalise_answer("BLUE")


def test_collate_into_a_staging_slot_equals_plain_collate():
    from ascend_vlm.vision_input.staging import StagingPool

    parts = [
        {"input_ids": torch.tensor([1, 2]), "pixel_values": torch.rand(4, 6)},
        {"input_ids": torch.tensor([3]), "pixel_values": torch.rand(2, 6, dtype=torch.float64)},
    ]
    plain = collate(parts, pad_token_id=0)
    with StagingPool(slots=1) as pool:
        staged = collate(parts, pad_token_id=0, staging=pool)
        assert staged["pixel_values"].dtype == torch.float64  # promoted, as torch.cat does
        assert torch.equal(staged["pixel_values"], plain["pixel_values"])
        assert torch.equal(staged["input_ids"], plain["input_ids"])
        assert pool.in_use == 1
        del staged
        assert pool.in_use == 0


def test_processor_for_another_thread_owns_its_tokenizer():
    from ascend_vlm.data.vqa import processor_for_another_thread
    from ascend_vlm.default_model import default_model_path, load_processor

    processor = load_processor(default_model_path())
    copy = processor_for_another_thread(processor)
    assert copy.tokenizer is not processor.tokenizer
    assert copy.image_processor is processor.image_processor
    assert (
        copy.tokenizer("a red square")["input_ids"]
        == processor.tokenizer("a red square")["input_ids"]
    )
