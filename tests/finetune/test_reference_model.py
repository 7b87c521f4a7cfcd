"""The reference checkpoint: built once per recipe, reused, loadable with plain transformers.

Only tiny recipes are built here (a few steps at 56 px); the real one takes minutes."""

from __future__ import annotations

import json

import pytest

from ascend_vlm.data.shapes_vqa import QUESTION_TYPES, render_scene
from ascend_vlm.finetune import reference_model
from ascend_vlm.finetune.reference_model import (
    HELD_OUT_SKILL,
    RECIPE,
    Recipe,
    read_stamp,
    reference_model_path,
)

TINY = Recipe(image_size=56, steps=2, batch_size=2, train_size=8, eval_size=2, warmup_steps=1)


@pytest.fixture(scope="module")
def tiny_reference(tmp_path_factory):
    return reference_model_path(out=tmp_path_factory.mktemp("ref") / "model", recipe=TINY)


@pytest.mark.slow
def test_tiny_reference_is_a_plain_checkpoint_with_its_stamp(tiny_reference):
    from transformers import AutoModelForImageTextToText

    from ascend_vlm.default_model import load_processor

    stamp = read_stamp(tiny_reference)
    assert stamp["digest"] == TINY.digest()
    assert stamp["recipe"]["steps"] == 2
    assert stamp["held_out_question_types"] == [HELD_OUT_SKILL]
    assert list(stamp["eval_accuracy"]) == list(QUESTION_TYPES)
    assert all(0.0 <= value <= 1.0 for value in stamp["eval_accuracy"].values())
    assert stamp["visual_tokens_per_image"] == 4
    for name in ("model.safetensors", "tokenizer.json", "processor_config.json", "README.md"):
        assert (tiny_reference / name).is_file(), name
    model = AutoModelForImageTextToText.from_pretrained(tiny_reference)
    processor = load_processor(tiny_reference)
    image, _ = render_scene(0, 56)
    grid = processor.image_processor(images=[image], return_tensors="pt")["image_grid_thw"]
    assert grid.tolist() == [[1, 4, 4]]
    assert type(model).__name__ == "Qwen2VLForConditionalGeneration"


@pytest.mark.slow
def test_a_built_reference_is_reused_and_another_recipe_is_not(tiny_reference, monkeypatch):
    def no_build(*args):
        raise AssertionError("rebuilt a complete reference checkpoint")

    monkeypatch.setattr(reference_model, "_build", no_build)
    assert reference_model_path(out=tiny_reference, recipe=TINY) == tiny_reference
    other = Recipe(image_size=56, steps=3, batch_size=2, train_size=8, eval_size=2)
    assert other.digest() != TINY.digest()
    with pytest.raises(FileNotFoundError, match=f"recipe {other.digest()} in {tiny_reference}"):
        reference_model_path(build=False, out=tiny_reference, recipe=other)


def test_a_build_says_what_it_trains_and_for_how_long(tmp_path, monkeypatch, capsys):
    built = []
    monkeypatch.setattr(reference_model, "_build", lambda *args: built.append(args))
    reference_model_path(out=tmp_path / "model", recipe=TINY, progress=False)
    assert len(built) == 1
    notice = capsys.readouterr().err
    assert f"building the reference checkpoint (recipe {TINY.digest()})" in notice
    assert "2 training steps" in notice and str(tmp_path / "model") in notice
    assert "roughly 15-25 minutes" in reference_model.build_notice(tmp_path, RECIPE)


@pytest.mark.slow
def test_command_prints_accuracy_per_type_and_the_folder_last(tiny_reference, monkeypatch, capsys):
    from ascend_vlm.__main__ import main

    monkeypatch.setattr(reference_model, "RECIPE", TINY)
    assert main(["reference-model", "--out", str(tiny_reference)]) == 0
    lines = capsys.readouterr().out.splitlines()
    accuracy = read_stamp(tiny_reference)["eval_accuracy"]
    assert lines[:5] == [f"held-out accuracy {t:<10} {accuracy[t]:.4f}" for t in QUESTION_TYPES]
    assert lines[-1] == str(tiny_reference)


def test_default_recipe_images_carry_64_visual_tokens_and_leave_out_one_skill(tmp_path):
    from ascend_vlm.default_model import load_processor

    assert RECIPE.visual_tokens >= 64
    assert HELD_OUT_SKILL not in RECIPE.question_types
    assert set(RECIPE.question_types) | {HELD_OUT_SKILL} == set(QUESTION_TYPES)
    reference_model._initial_checkpoint(tmp_path / "init", RECIPE)
    processor = load_processor(tmp_path / "init")
    image, _ = render_scene(0, RECIPE.image_size)
    inputs = processor(text=["<|image_pad|>"], images=[image], return_tensors="pt")
    image_token = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert int((inputs["input_ids"] == image_token).sum()) == RECIPE.visual_tokens
    assert inputs["pixel_values"].shape == (4 * RECIPE.visual_tokens, 3 * 2 * 14 * 14)
    config = json.loads((tmp_path / "init" / "config.json").read_text())
    assert config["vision_config"]["patch_size"] == 14


def test_bad_recipe_and_torchrun_build_are_refused(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="image_size: expected a multiple of 28 pixels, got 100"):
        Recipe(image_size=100)
    with pytest.raises(ValueError, match="question_types: expected distinct names"):
        Recipe(question_types=("up",))
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="cannot run inside a torchrun job"):
        reference_model_path(out=tmp_path / "ref", recipe=TINY)
    assert not (tmp_path / "ref").exists()
