"""``--model`` takes what ``from_pretrained`` takes: a local folder or a Hub id (from the
Hugging Face cache when offline), and names the id when it cannot be had."""

from __future__ import annotations

import json
import shutil

import pytest
from PIL import Image

from ascend_vlm.commands.checkpoints import resolve_model
from ascend_vlm.default_model import default_model_path
from ascend_vlm.finetune import cli as finetune_cli

HUB_ID = "ascend-vlm-tests/tiny-qwen2-vl"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def offline_hub_cache(tmp_path, monkeypatch):
    """An offline Hugging Face cache holding the default model under HUB_ID, laid out as
    huggingface_hub lays out a downloaded snapshot."""
    import huggingface_hub.constants as hub_constants

    cache = tmp_path / "hub"
    repo = cache / ("models--" + HUB_ID.replace("/", "--"))
    shutil.copytree(default_model_path(), repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))
    return cache


def test_a_cached_hub_id_resolves_to_its_snapshot_offline(offline_hub_cache):
    folder = resolve_model(HUB_ID)
    assert (
        folder
        == offline_hub_cache / ("models--" + HUB_ID.replace("/", "--")) / "snapshots" / COMMIT
    )
    assert (folder / "config.json").is_file()


def test_an_uncached_hub_id_offline_is_named(offline_hub_cache, command_error):
    error = command_error(["demo", "--model", "nobody/not-cached"])
    assert (
        "error: --model: expected a local checkpoint folder or a Hugging Face Hub id, got " in error
    )
    assert "'nobody/not-cached': no such folder, and fetching it from the Hub failed" in error


def test_a_path_that_is_no_hub_id_is_taken_as_a_path(tmp_path):
    missing = tmp_path / "nowhere"
    assert resolve_model(str(missing)) == missing  # check_checkpoint then names it


@pytest.mark.parametrize("command", ["eval", "explain", "generate-batch", "serve", "verify"])
def test_every_model_option_names_an_uncached_hub_id(
    offline_hub_cache, command_error, tmp_path, command
):
    Image.new("RGB", (8, 8), "red").save(tmp_path / "red.png")
    (tmp_path / "requests.jsonl").write_text(json.dumps({"prompt": "hi"}) + "\n")
    rest = {
        "explain": ["--image", str(tmp_path / "red.png"), "--question", "q"],
        "generate-batch": ["--requests", str(tmp_path / "requests.jsonl")],
    }.get(command, [])
    if command in ("explain", "generate-batch"):
        rest += ["--out", str(tmp_path / "out")]
    error = command_error([command, "--model", "nobody/not-cached", *rest])
    assert error.startswith(
        f"python -m ascend_vlm {command}: error: --model: expected a local checkpoint folder or "
        "a Hugging Face Hub id, got 'nobody/not-cached': no such folder"
    ), error


def test_finetune_takes_a_hub_id_and_names_an_uncached_one(
    offline_hub_cache, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("RANK", "0")
    run = ["--train-size=4", "--eval-size=2", "--max-steps=1", "--batch-size=2", "--no-progress"]
    output_dir = tmp_path / "run"
    missing = [f"--output-dir={output_dir}", "--model-path=nobody/not-cached", *run]
    assert finetune_cli.main(missing) == 2
    assert (
        capsys.readouterr()
        .err.splitlines()[-1]
        .startswith(
            "error: --model-path: expected a local checkpoint folder or a Hugging Face Hub id, got "
            "'nobody/not-cached': no such folder"
        )
    )
    assert finetune_cli.main([f"--output-dir={output_dir}", f"--model-path={HUB_ID}", *run]) == 0
    recorded = json.loads((output_dir / "train_config.json").read_text())
    assert recorded["model_path"] == str(resolve_model(HUB_ID))
