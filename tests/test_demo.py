"""`python -m ascend_vlm demo` and `python -m ascend_vlm models` end to end (in-process)."""

from __future__ import annotations

import pytest

from ascend_vlm.__main__ import main
from ascend_vlm.models import supported_model_types


@pytest.fixture(scope="module")
def default_checkpoint(tmp_path_factory):
    from ascend_vlm.default_model import build_default_model

    return build_default_model(tmp_path_factory.mktemp("default_model"))


def test_demo_answers_and_prints_report_and_stage_latency(default_checkpoint, capsys):
    assert main(["demo", "--model", str(default_checkpoint), "--max-new-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert "ascend_vlm.patch report for model_type='qwen2_vl'" in out
    assert "attention-vision" in out and "ops.varlen_attention" in out
    assert "question: How many shapes are there?" in out
    assert "answer:" in out
    for stage in ("vision encode", "prefill", "decode"):
        assert stage in out
    assert "2 tokens," in out  # 3 new tokens: the first comes out of prefill


def test_demo_takes_an_image_file_and_question(default_checkpoint, tmp_path, capsys):
    from PIL import Image

    image_path = tmp_path / "red.png"
    Image.new("RGB", (64, 64), (255, 0, 0)).save(image_path)
    argv = ["demo", "--model", str(default_checkpoint), "--image", str(image_path)]
    assert main([*argv, "--question", "What colour?", "--max-new-tokens", "1"]) == 0
    assert "question: What colour?" in capsys.readouterr().out


def test_demo_rejects_missing_checkpoint_and_bad_token_count(tmp_path):
    with pytest.raises(SystemExit, match=r"config\.json"):
        main(["demo", "--model", str(tmp_path)])
    with pytest.raises(SystemExit):
        main(["demo", "--max-new-tokens", "0"])


def test_models_table_lists_every_supported_model_type(capsys):
    assert main(["models", "--markdown"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("| model_type | tiny model tested |")
    for model_type in supported_model_types():
        assert f"| {model_type} |" in out
    assert "| ? |" not in out  # every supported model_type has a tiny model behind it
