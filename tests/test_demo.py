"""`python -m ascend_vlm demo` and `python -m ascend_vlm models` end to end (in-process)."""

from __future__ import annotations

import io
import re
import shutil

import pytest
import torch
from PIL import Image

from ascend_vlm.__main__ import main
from ascend_vlm.data.images import ACCEPTED_IMAGES
from ascend_vlm.models import supported_model_types

DEMO_ERROR = "python -m ascend_vlm demo: error: "


@pytest.fixture(scope="module")
def default_checkpoint(tmp_path_factory):
    from ascend_vlm.default_model import build_default_model

    return build_default_model(tmp_path_factory.mktemp("default_model"))


def _stock_answer(checkpoint, image, question: str, max_new_tokens: int) -> tuple[str, int]:
    """Greedy answer of the unpatched model and the prompt length, computed independently."""
    from ascend_vlm.default_model import load_default_model

    model, processor = load_default_model(checkpoint)
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}
    ]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=prompt, images=[image], return_tensors="pt")
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    prompt_tokens = inputs["input_ids"].shape[1]
    return processor.decode(output[0, prompt_tokens:], skip_special_tokens=True), prompt_tokens


def _patch_report(checkpoint) -> list[str]:
    import ascend_vlm
    from ascend_vlm.default_model import load_default_model

    model, _ = load_default_model(checkpoint)
    return str(ascend_vlm.patch(model)).splitlines()


def test_demo_prints_report_answer_and_stage_latency(default_checkpoint, capsys):
    from ascend_vlm.data.shapes_vqa import render_scene

    assert main(["demo", "--model", str(default_checkpoint), "--max-new-tokens", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    image, pairs = render_scene(seed=0)
    question = pairs[0][0]
    answer, prompt_tokens = _stock_answer(default_checkpoint, image, question, 3)
    head = [
        f"[ascend_vlm] loading {default_checkpoint} ...",
        "[ascend_vlm] patching with ascend_vlm.patch(model) ...",
        *_patch_report(default_checkpoint),
        "",
        f"question: {question}",
        f"answer:   {answer!r}",
        "",
        "stage          calls   total ms   mean ms    p50 ms    max ms   share",
    ]
    assert question == "How many shapes are there?"
    assert lines[: len(head)] == head
    row = r" +\d+\.\d\d" * 4 + r" +\d+\.\d%"
    table = [
        r"vision_encode +1" + row,
        r"projector +1" + row,
        r"prefill +1" + row,
        r"decode +2" + row,  # the first token comes out of prefill
        r"other +\d+\.\d\d +\d+\.\d%",
        r"1 request\(s\), \d+\.\d\d ms traced, host clock; other: .*",
        rf"prompt         {prompt_tokens} tokens",
        r"decode rate    \d+\.\d tokens/s over 2 decode steps",
        r"backend        cpu",
    ]
    rest = lines[len(head) :]
    assert len(rest) == len(table)
    for pattern, line in zip(table, rest, strict=True):
        assert re.fullmatch(pattern, line), line


def test_demo_takes_an_image_file_and_question(default_checkpoint, tmp_path, capsys):
    from PIL import Image

    image_path = tmp_path / "red.png"
    image = Image.new("RGB", (64, 64), (255, 0, 0))
    image.save(image_path)
    argv = ["demo", "--model", str(default_checkpoint), "--image", str(image_path)]
    assert main([*argv, "--question", "What colour?", "--max-new-tokens", "1"]) == 0
    answer, _ = _stock_answer(default_checkpoint, image, "What colour?", 1)
    lines = capsys.readouterr().out.splitlines()
    question_at = lines.index("question: What colour?")
    assert lines[question_at + 1] == f"answer:   {answer!r}"
    assert "decode rate    no decode step" in lines[question_at:]
    assert not any(re.match(r"decode +\d", line) for line in lines[question_at:])


def _model_without_processor(default_checkpoint, folder):
    folder.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(default_checkpoint / name, folder / name)
    return folder


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("empty", "--model: expected a local checkpoint directory with config.json, got {dir}"),
        (
            "weights only",
            "--model: expected a checkpoint folder with a tokenizer (one of tokenizer.json, "
            "tokenizer.model, spiece.model, vocab.json, vocab.txt) and an image processor "
            "(preprocessor_config.json or processor_config.json), {dir} has none; "
            "model.save_pretrained does not write them. Save the processor of the model it came "
            "from into it: ascend_vlm.default_model.load_processor(BASE).save_pretrained('{dir}')",
        ),
        ("no image", f"--image: expected {ACCEPTED_IMAGES}, got '{{dir}}/none.png' (no such file)"),
        ("zero tokens", "--max-new-tokens: expected >= 1, got 0"),
        ("corrupt image", "--image: cannot read the image's pixels (image file is truncated"),
    ],
)
def test_demo_bad_input_exits_2_naming_the_option(
    default_checkpoint, tmp_path, command_error, case, message
):
    folder = tmp_path / "checkpoint"
    argv = {
        "empty": ["--model", str(folder)],
        "weights only": ["--model", str(folder)],
        "no image": ["--model", str(default_checkpoint), "--image", str(folder / "none.png")],
        "zero tokens": ["--max-new-tokens", "0"],
        "corrupt image": ["--image", str(tmp_path / "corrupt.png")],
    }[case]
    if case == "corrupt image":  # the header reads, the pixel data ends early
        buffer = io.BytesIO()
        Image.new("RGB", (64, 64), "red").save(buffer, format="PNG")
        (tmp_path / "corrupt.png").write_bytes(buffer.getvalue()[:-40])
    if case == "empty":
        folder.mkdir()
    elif case == "weights only":
        _model_without_processor(default_checkpoint, folder)
    assert command_error(["demo", *argv]).startswith(DEMO_ERROR + message.format(dir=folder))


def test_models_table_lists_every_supported_model_type(capsys):
    assert main(["models", "--markdown"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("| model_type | tiny model tested |")
    for model_type in supported_model_types():
        assert f"| {model_type} |" in out
    assert "| ? |" not in out  # every supported model_type has a tiny model behind it
