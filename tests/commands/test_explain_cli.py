"""`python -m ascend_vlm explain` end to end (in-process) and its errors; `explain` itself on
two images and on Qwen2.5-VL / Qwen3-VL."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from PIL import Image

from ascend_vlm.__main__ import main
from ascend_vlm.data.images import ACCEPTED_IMAGES
from ascend_vlm.default_model import default_model_path
from ascend_vlm.observability.explain import explain, save_explanation


@pytest.fixture
def image_file(tmp_path):
    path = tmp_path / "scene.png"
    image = Image.new("RGB", (112, 84), (240, 240, 240))
    image.paste((200, 20, 20), (10, 10, 50, 40))
    image.save(path)
    return path


def _stock_answer(image_file, question, max_new_tokens):
    from ascend_vlm.default_model import load_default_model

    model, processor = load_default_model()
    content = [{"type": "image"}, {"type": "text", "text": question}]
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    inputs = processor(
        text=prompt, images=[Image.open(image_file).convert("RGB")], return_tensors="pt"
    )
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    new = output[0, inputs["input_ids"].shape[1] :]
    return processor.decode(new, skip_special_tokens=True), len(new)


def test_explain_writes_overlays_trace_and_report(
    saved_model_and_processor, image_file, tmp_path, capsys
):
    # saved_model_and_processor: skips where the checkpoint's saved processor does not load
    out = tmp_path / "explained"
    argv = ["explain", "--model", str(default_model_path()), "--image", str(image_file)]
    argv += ["--question", "What colour is the square?", "--out", str(out)]
    assert main([*argv, "--max-new-tokens", "4", "--token", "1"]) == 0
    printed = capsys.readouterr().out
    answer, count = _stock_answer(image_file, "What colour is the square?", 4)
    assert f"answer:   {answer!r}" in printed  # patched answer equals stock generate
    assert {p.name for p in out.iterdir()} == {
        "attention_image0.png",
        "stages.png",
        "trace.json",
        "report.json",
    }
    for name in ("attention_image0.png", "stages.png"):
        with Image.open(out / name) as picture:
            assert picture.format == "PNG" and min(picture.size) > 100
    report = json.loads((out / "report.json").read_text())
    assert report["answer"] == answer and len(report["tokens"]) == count
    assert all(0 <= t["visual_share"] <= 1 and t["hidden_norm"] > 0 for t in report["tokens"])
    assert report["tokens"][0]["attended"]["image"] == 0
    stages = [e["name"] for e in json.loads((out / "trace.json").read_text())["traceEvents"]]
    assert "prefill" in stages and "vision_encode" in stages
    assert "vision_encode" in printed and "wrote report" in printed
    # nothing the user saved is lost: a second run into the same folder needs --force
    error = "--out: " + str(out) + " exists and is not an empty folder; pass --force"
    with pytest.raises(SystemExit):
        main([*argv, "--max-new-tokens", "4"])
    assert error in capsys.readouterr().err
    assert main([*argv, "--max-new-tokens", "2", "--force"]) == 0


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--max-new-tokens", "0"], "--max-new-tokens: expected >= 1, got 0"),
        (
            ["--token", "3", "--max-new-tokens", "3"],
            "--token: expected 0 <= token < --max-new-tokens",
        ),
        (["--layers", "0,x"], "--layers: expected comma-separated layer indices"),
    ],
)
def test_bad_options_are_named(command_error, image_file, tmp_path, extra, message):
    argv = ["explain", "--model", str(default_model_path()), "--image", str(image_file)]
    argv += ["--question", "q", "--out", str(tmp_path / "out"), *extra]
    assert message in command_error(argv)


def test_layers_beyond_the_model_are_named_after_loading(
    saved_model_and_processor, image_file, tmp_path, capsys
):
    argv = ["explain", "--model", str(default_model_path()), "--image", str(image_file)]
    argv += ["--question", "q", "--out", str(tmp_path / "out"), "--layers", "5"]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert last.endswith("error: layers: expected indices in [0, 2), got [5]")
    assert not (tmp_path / "out").exists()


def test_bad_files_are_named(command_error, image_file, tmp_path):
    base = ["explain", "--question", "q", "--out", str(tmp_path / "out")]
    missing = tmp_path / "missing.png"
    error = command_error([*base, "--model", str(default_model_path()), "--image", str(missing)])
    assert error.endswith(f"--image: expected {ACCEPTED_IMAGES}, got '{missing}' (no such file)")
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not an image")
    error = command_error([*base, "--model", str(default_model_path()), "--image", str(broken)])
    assert f"--image: cannot read '{broken}' as an image" in error
    error = command_error([*base, "--model", str(tmp_path), "--image", str(image_file)])
    assert "--model: expected a local checkpoint directory with config.json" in error


@pytest.mark.parametrize(
    "fixture", ["model_and_processor", "qwen2_5_vl_and_processor", "qwen3_vl_and_processor"]
)
def test_two_images_get_one_overlay_each(request, fixture, tmp_path):
    model, processor = request.getfixturevalue(fixture)
    model = copy.deepcopy(model)
    images = [Image.new("RGB", (84, 56), (200, 30, 30)), Image.new("RGB", (56, 112), (9, 9, 200))]
    explanation = explain(model, processor, images, "Which is red?", max_new_tokens=3)
    assert [c.image_index for c in explanation.cells] == [0, 1]
    weights = explanation.image_weights(0)
    assert [w.numel() for w in weights] == [c.num_tokens for c in explanation.cells]
    share = float(sum(w.sum() for w in weights))
    assert share == pytest.approx(explanation.report["tokens"][0]["visual_share"], rel=1e-4)
    paths = save_explanation(explanation, images, tmp_path, token=2)
    assert {"attention_image0", "attention_image1", "stages", "trace", "report"} == set(paths)
    with pytest.raises(ValueError, match=r"token: expected an answer token index in \[0, 3\)"):
        explanation.image_weights(3)
    with pytest.raises(ValueError, match="images: expected at least one image"):
        explain(model, processor, [], "q")
