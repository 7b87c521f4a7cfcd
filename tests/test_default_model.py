"""The embedded default model: seeded build, from_pretrained round trip, processor contract."""

import importlib.util
import shutil
import subprocess
import sys

import pytest
import torch
from PIL import Image

from ascend_vlm.default_model import (
    IMAGE_TOKEN,
    ImageTextProcessor,
    build_default_model,
    default_model_path,
    load_default_model,
    load_processor,
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_default_model(tmp_path_factory.mktemp("default"), seed=0)


def _state(path):
    model, _ = load_default_model(path)
    return model.state_dict()


def test_build_is_deterministic_by_seed(checkpoint, tmp_path):
    again = build_default_model(tmp_path / "again", seed=0)
    other = build_default_model(tmp_path / "other", seed=1)
    first, second, third = _state(checkpoint), _state(again), _state(other)
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert any(not torch.equal(first[k], third[k]) for k in first)
    assert (checkpoint / "tokenizer.json").read_text() == (again / "tokenizer.json").read_text()


def test_processor_expands_each_image_to_its_grid(checkpoint):
    model, _ = load_default_model(checkpoint)
    processor = ImageTextProcessor.from_pretrained(checkpoint)
    conversation = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour?"}]}
    ]
    prompt = processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    assert prompt.count(IMAGE_TOKEN) == 1 and prompt.endswith("<|im_start|>assistant\n")
    small, large = Image.new("RGB", (56, 56), "red"), Image.new("RGB", (112, 112), "blue")
    batch = processor(text=[prompt, prompt], images=[small, large])
    image_id = model.config.image_token_id
    per_row = (batch["input_ids"] == image_id).sum(-1).tolist()
    grid = batch["image_grid_thw"].prod(-1) // processor.image_processor.merge_size**2
    assert per_row == grid.tolist() == [4, 16]
    assert torch.equal(batch["mm_token_type_ids"].bool(), batch["input_ids"] == image_id)
    # left padding: the shorter row is padded at the front
    assert batch["attention_mask"][0, 0] == 0 and batch["attention_mask"][0, -1] == 1
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape[:2] == batch["input_ids"].shape and torch.isfinite(logits).all()


def test_auto_processor_loads_the_folder_without_torchvision(checkpoint):
    from transformers import AutoProcessor

    assert importlib.util.find_spec("torchvision") is None  # the CPU venv has none
    processor = AutoProcessor.from_pretrained(checkpoint)
    assert type(processor).__name__ == "PaddleOCRVLProcessor"
    assert type(load_default_model(checkpoint)[1]) is type(processor)
    conversation = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour?"}]}
    ]
    prompt = processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    images = [Image.new("RGB", (56, 56), "red"), Image.new("RGB", (112, 84), "blue")]
    ours = ImageTextProcessor.from_pretrained(checkpoint)(text=[prompt, prompt], images=images)
    auto = processor(text=[prompt, prompt], images=images, padding=True, return_tensors="pt")
    assert sorted(auto) == sorted(ours)
    for key in ours:
        assert torch.equal(auto[key], ours[key]), key


def test_load_processor_says_what_a_weights_only_folder_lacks(checkpoint, tmp_path):
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(checkpoint / name, tmp_path / name)
    with pytest.raises(
        FileNotFoundError,
        match=r"^path: expected a checkpoint folder with an image processor "
        r"\(preprocessor_config\.json or processor_config\.json\), .* has none; ",
    ):
        load_processor(tmp_path)
    (tmp_path / "tokenizer.json").unlink()
    shutil.copy(checkpoint / "processor_config.json", tmp_path)
    with pytest.raises(
        FileNotFoundError,
        match=r"^path: expected a checkpoint folder with a tokenizer \(one of tokenizer\.json, "
        r"tokenizer\.model, spiece\.model, vocab\.json, vocab\.txt\), .* has none; ",
    ):
        load_processor(tmp_path)


def test_processor_rejects_image_count_mismatch(checkpoint):
    processor = ImageTextProcessor.from_pretrained(checkpoint)
    with pytest.raises(ValueError, match="images: expected one image per"):
        processor(text=f"{IMAGE_TOKEN} twice {IMAGE_TOKEN}", images=[Image.new("RGB", (56, 56))])


def test_default_model_path_builds_once_into_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ASCEND_VLM_CACHE", str(tmp_path))
    path = default_model_path()
    assert (path / "config.json").is_file() and path.parent == tmp_path
    mtime = (path / "config.json").stat().st_mtime_ns
    assert default_model_path() == path
    assert (path / "config.json").stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no staging directory left


def test_load_default_model_rejects_missing_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        load_default_model(tmp_path)


def test_loading_the_default_model_prints_no_deprecation_notice():
    code = "from ascend_vlm.default_model import load_default_model; load_default_model()"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    assert "deprecated" not in result.stdout + result.stderr
