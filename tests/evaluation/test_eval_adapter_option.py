"""The "adapter" feature option of eval: a named adapter (with its new tokens) answers exactly
as the fine-tuned model does, the base answers with ``__base__``, bad flags are named."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
from pathlib import Path

import pytest
import torch
from tiny_finetune import tiny_config

from ascend_vlm.__main__ import main
from ascend_vlm.commands.adapter_option import named_path
from ascend_vlm.data.datasets import shapes_vqa
from ascend_vlm.evaluation.runner import generate_answers

EVAL_ERROR = "python -m ascend_vlm eval: error: "
TOKENS = ("<star>", "<cross>")
ARGS = ["--limit", "6", "--max-new-tokens", "2", "--image-size", "56"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A three-step tiny run teaching two new kinds as new tokens, adapter named "shapes"."""
    from ascend_vlm.finetune.train import train

    output_dir = tmp_path_factory.mktemp("adapter_option")
    config = tiny_config(
        output_dir,
        adapter_name="shapes",
        new_tokens=TOKENS,
        shapes_new_kinds=True,
        modules_to_save=(),
        question_types=("shape", "colour"),
        learning_rate=5e-2,
    )
    return train(config), output_dir / "adapter"


def _eval(argv: list[str], out: Path) -> dict:
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["eval", *argv, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def _predictions(entry: dict) -> list[str]:
    return [record["prediction"] for record in entry["predictions"]]


def test_a_named_adapter_answers_as_the_fine_tuned_model(trained, tiny_model_path, tmp_path):
    result, adapter = trained
    report = _eval(
        [
            "--model",
            str(tiny_model_path),
            "--no-patch",
            "--new-kinds",
            ",".join(TOKENS),
            "--adapter",
            f"shapes={adapter}",
            *ARGS,
        ],
        tmp_path / "report.json",
    )
    (entry,) = report["configurations"]
    option = entry["options"]["adapter"]
    assert option["active"] == "shapes" and option["new_tokens"] == list(TOKENS)
    assert (
        option["summary"] == "adapter shapes active (resident: shapes, new tokens <star> <cross>)"
    )
    assert report["dataset"]["kind_names"] == {"star": "<star>", "cross": "<cross>"}

    dataset = shapes_vqa(6, 0, 56, TOKENS)
    with torch.no_grad():
        expected = generate_answers(
            result.model.eval(),
            result.processor,
            dataset,
            batch_size=8,
            max_new_tokens=2,
            progress=False,
        )
    assert _predictions(entry) == [p.prediction for p in expected.predictions]


def test_the_base_answers_with_base_active_among_loaded_adapters(
    trained, tiny_model_path, tmp_path
):
    _, adapter = trained
    model = ["--model", str(tiny_model_path), "--no-patch", *ARGS]
    plain = _eval(model, tmp_path / "plain.json")
    # Without new tokens: a LoRA-only adapter keeps the base vocabulary.
    lora_only = tmp_path / "lora_only"
    lora_only.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (lora_only / name).write_bytes((adapter / name).read_bytes())
    _strip_token_rows(lora_only)
    loaded = _eval(
        [*model, "--adapter", f"a1={lora_only}", "--use-adapter", "__base__"],
        tmp_path / "base.json",
    )
    active = _eval(
        [
            *model,
            "--adapter",
            f"a1={lora_only}",
            "--adapter",
            f"a2={lora_only}",
            "--use-adapter",
            "a1",
        ],
        tmp_path / "active.json",
    )
    (plain_entry,), (loaded_entry,) = plain["configurations"], loaded["configurations"]
    assert loaded_entry["options"]["adapter"]["active"] == "__base__"
    assert _predictions(loaded_entry) == _predictions(plain_entry)
    # The same adapter active does answer differently, so the equality above means something.
    assert _predictions(active["configurations"][0]) != _predictions(plain_entry)


def _strip_token_rows(folder: Path) -> None:
    """Keep only the LoRA tensors and config of an adapter folder (no trainable tokens)."""
    from safetensors.torch import load_file, save_file

    weights = folder / "adapter_model.safetensors"
    save_file({k: v for k, v in load_file(weights).items() if "lora_" in k}, weights)
    config = json.loads((folder / "adapter_config.json").read_text())
    config["trainable_token_indices"] = None
    (folder / "adapter_config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("shapes", "expected NAME=PATH"),
        ("=folder", "name: expected an adapter name of letters, digits"),
        ("__base__=folder", "name: expected an adapter name of letters, digits"),
    ],
)
def test_bad_adapter_flags_name_what_is_accepted(text, message):
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        named_path(text)


def _refused(argv: list[str], capsys) -> str:
    """The ``error:`` line of an eval run the loaded model refuses (exit status 2)."""
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", *argv])
    assert exit_info.value.code == 2
    return capsys.readouterr().err.splitlines()[-1]


def test_an_unknown_active_adapter_is_a_usage_error(trained, tiny_model_path, capsys):
    _, adapter = trained
    argv = ["--model", str(tiny_model_path), "--adapter", f"shapes={adapter}"]
    error = _refused([*argv, "--use-adapter", "other", *ARGS], capsys)
    assert error == (
        EVAL_ERROR
        + f"{tiny_model_path}: --use-adapter: expected one of __base__, shapes, got 'other'"
    )


def test_a_folder_without_an_adapter_is_a_usage_error(tiny_model_path, capsys, tmp_path):
    argv = ["--model", str(tiny_model_path), "--adapter", f"x1={tmp_path}", *ARGS]
    error = _refused(argv, capsys)
    assert error.startswith(
        EVAL_ERROR + f"{tiny_model_path}: --adapter x1={tmp_path}: path: expected a PEFT"
    )


def test_more_new_kind_names_than_new_kinds_is_a_usage_error(tiny_model_path, command_error):
    names = "<a>,<b>,<c>,<d>,<e>"
    error = command_error(["eval", "--model", str(tiny_model_path), "--new-kinds", names])
    assert error == EVAL_ERROR + (
        "--new-kinds: new kind names: expected at most 4 names for the new shape kinds "
        "('star', 'cross', 'hexagon', 'ring'), got 5"
    )


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["--adapter", "a1={adapter}", "--adapter", "a1={adapter}"],
            "--adapter: expected each NAME once",
        ),
        (
            ["--adapter", "t1={adapter}", "--adapter", "a2={adapter}"],
            "--adapter: expected an adapter with new tokens (t1) alone",
        ),
    ],
)
def test_repeated_names_and_token_adapters_beside_others_are_refused(
    trained, tiny_model_path, capsys, extra, message
):
    _, adapter = trained
    argv = ["--model", str(tiny_model_path), *[part.format(adapter=adapter) for part in extra]]
    assert message in _refused([*argv, "--use-adapter", "__base__", *ARGS], capsys)


def test_empty_new_kinds_is_a_usage_error(tiny_model_path, command_error):
    error = command_error(["eval", "--model", str(tiny_model_path), "--new-kinds", ","])
    assert error == EVAL_ERROR + "--new-kinds: expected comma-separated names, got ','"
