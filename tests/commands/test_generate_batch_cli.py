"""``python -m ascend_vlm generate-batch``: results in input order equal to one-request
``generate``, the summary line, and usage errors naming the option or the request line."""

from __future__ import annotations

import base64
import contextlib
import io
import json

import pytest
import torch
from PIL import Image

from ascend_vlm.__main__ import main
from ascend_vlm.data.images import ACCEPTED_IMAGES
from ascend_vlm.default_model import default_model_path

EVAL_ERROR = "python -m ascend_vlm generate-batch: error: "


def _requests(tmp_path) -> tuple:
    Image.new("RGB", (64, 64), "red").save(tmp_path / "red.png")
    lines = [
        {"id": "text", "prompt": "hello there", "max_new_tokens": 6},
        {"id": "image", "prompt": "what colour", "images": ["red.png"], "max_new_tokens": 4},
        {
            "id": "chat",
            "messages": [
                {"role": "user", "content": [
                    {"type": "image", "image": "red.png"}, {"type": "text", "text": "and now"},
                ]},
            ],
            "max_new_tokens": 5,
        },
        {"prompt": "sample", "do_sample": True, "seed": 3, "top_k": 10, "max_new_tokens": 3},
    ]  # fmt: skip
    path = tmp_path / "requests.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return path, lines


def test_results_come_in_input_order_and_equal_generate(tmp_path):
    from ascend_vlm.commands.checkpoints import load_model_and_processor

    path, _ = _requests(tmp_path)
    out = tmp_path / "results.jsonl"
    printed = io.StringIO()
    argv = ["--model", str(default_model_path()), "--requests", str(path), "--out", str(out)]
    with contextlib.redirect_stdout(printed):
        assert main(["generate-batch", *argv, "--no-patch", "--no-progress"]) == 0
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in results] == ["text", "image", "chat", "line-4"]
    assert [len(r["tokens"]) for r in results] == [6, 4, 5, 3]
    assert all(r["time_to_first_token"] <= r["latency"] for r in results)
    model, processor = load_model_and_processor(str(default_model_path()), "--model")
    image = Image.open(tmp_path / "red.png").convert("RGB")
    messages = [{"role": "user", "content": [{"type": "image", "image": image},
                                             {"type": "text", "text": "what colour"}]}]  # fmt: skip
    prompt = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = processor(text=[prompt], images=[image], return_tensors="pt")
    with torch.no_grad():
        expected = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert results[1]["tokens"] == expected[0, inputs["input_ids"].shape[1] :].tolist()
    assert "[ascend_vlm] 4 requests, 18 tokens" in printed.getvalue()


def test_images_may_be_http_and_data_urls(tmp_path, loopback_http):
    folder, url = loopback_http
    Image.new("RGB", (64, 64), "red").save(folder / "red.png")
    Image.new("RGB", (64, 64), "red").save(tmp_path / "red.png")
    data = "data:image/png;base64," + base64.b64encode((folder / "red.png").read_bytes()).decode()
    sources = {"file": "red.png", "http": f"{url}/red.png", "data": data}
    path = tmp_path / "requests.jsonl"
    path.write_text("".join(
        json.dumps({"id": key, "prompt": "what colour", "images": [source], "max_new_tokens": 3})
        + "\n" for key, source in sources.items()
    ))  # fmt: skip
    out = tmp_path / "results.jsonl"
    argv = ["--model", str(default_model_path()), "--requests", str(path), "--out", str(out)]
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["generate-batch", *argv, "--no-patch", "--no-progress"]) == 0
    results = {r["id"]: r["tokens"] for r in map(json.loads, out.read_text().splitlines())}
    assert results["http"] == results["data"] == results["file"] and len(results["file"]) == 3


def test_usage_errors_name_the_option_or_the_line(tmp_path, command_error):
    path, _ = _requests(tmp_path)
    model = ["--model", str(default_model_path())]
    taken = tmp_path / "taken.jsonl"
    taken.write_text("")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"prompt": "x", "images": ["missing.png"]}\n')
    corrupt = tmp_path / "corrupt.jsonl"
    corrupt.write_text('{"prompt": "fine"}\n{"prompt": "x", "images": ["corrupt.png"]}\n')
    (tmp_path / "corrupt.png").write_bytes((tmp_path / "red.png").read_bytes()[:-40])
    unknown = tmp_path / "unknown.jsonl"
    unknown.write_text('{"prompt": "x", "beams": 4}\n')
    cases = {
        "out exists": (
            [*model, "--requests", str(path), "--out", str(taken)],
            f"--out: {taken} exists; pass --force to replace it",
        ),
        "budget": (
            [*model, "--requests", str(path), "--out", str(tmp_path / "o"), "--max-batch-size", "0"],
            "--max-batch-size: expected an int >= 1, got 0",
        ),
        "kv block size": (
            [*model, "--requests", str(path), "--out", str(tmp_path / "o"), "--kv-block-size", "0"],
            "--kv-block-size: expected an int >= 1, got 0",
        ),
        "missing image": (
            [*model, "--requests", str(bad), "--out", str(tmp_path / "o")],
            f"{bad}: line 2: expected {ACCEPTED_IMAGES}, got '{tmp_path / 'missing.png'}' (no such file)",
        ),
        "corrupt image": (
            [*model, "--requests", str(corrupt), "--out", str(tmp_path / "o")],
            f"{corrupt}: line 2: cannot read the image's pixels (image file is truncated",
        ),
        "unknown field": (
            [*model, "--requests", str(unknown), "--out", str(tmp_path / "o")],
            f"{unknown}: line 1: unknown fields ['beams']",
        ),
    }  # fmt: skip
    for argv, message in cases.values():
        error = command_error(["generate-batch", *argv, "--no-progress"])
        assert error.startswith(EVAL_ERROR + message), error


def test_a_request_over_a_budget_is_a_usage_error_naming_it(tmp_path, capsys):
    path, _ = _requests(tmp_path)
    argv = ["--model", str(default_model_path()), "--requests", str(path)]
    argv += ["--out", str(tmp_path / "o"), "--max-batch-tokens", "5", "--no-progress"]
    with pytest.raises(SystemExit) as exit_info:
        main(["generate-batch", *argv])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.splitlines()[-1]
    assert error.startswith(EVAL_ERROR + "--max-batch-tokens: the request needs"), error
    assert error.endswith("more than the budget of 5 (request 'text')")
    assert not (tmp_path / "o").exists()
