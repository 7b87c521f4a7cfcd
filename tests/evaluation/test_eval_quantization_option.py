"""The "quantize" feature option of eval: scheme parsing, argparse errors, and a run that
quantizes the loaded model (AWQ calibrated with that model's processor)."""

from __future__ import annotations

import argparse
import contextlib
import io
import json

import pytest

from ascend_vlm.__main__ import main
from ascend_vlm.commands.quantization_option import parse_scheme
from ascend_vlm.quantization import QuantizationConfig

EVAL_ERROR = "python -m ascend_vlm eval: error: "


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("none", None),
        ("w8", {"bits": 8, "group_size": 0, "method": "rtn"}),
        ("w8g128", {"bits": 8, "group_size": 128, "method": "rtn"}),
        ("w4", {"bits": 4, "group_size": 128, "method": "rtn"}),
        ("w4g32-awq", {"bits": 4, "group_size": 32, "method": "awq"}),
        ("w4g0-rtn", {"bits": 4, "group_size": 0, "method": "rtn"}),
    ],
)
def test_schemes_parse_with_defaults(text, expected):
    assert parse_scheme(text) == (None if expected is None else QuantizationConfig(**expected))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("int4", r"expected none or w<bits>\[g<group size>\]\[-<method>\]"),
        ("w3", r"bits: expected one of \(4, 8\), got 3"),
        ("w4g48", r"group_size: expected 0 \(per channel\) or a multiple of 32"),
        ("w4-gptq", r"method: expected one of \('rtn', 'awq'\), got 'gptq'"),
    ],
)
def test_bad_schemes_name_what_is_accepted(text, message):
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        parse_scheme(text)


def test_a_bad_scheme_is_a_usage_error(tiny_model_path, command_error):
    error = command_error(["eval", "--model", str(tiny_model_path), "--quantize", "w5"])
    assert error == EVAL_ERROR + "argument --quantize: bits: expected one of (4, 8), got 5"


def test_an_awq_run_quantizes_with_the_models_processor(tiny_model_path, tmp_path):
    out = tmp_path / "report.json"
    argv = ["--model", str(tiny_model_path), "--limit", "2", "--max-new-tokens", "1"]
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        assert main(["eval", *argv, "--quantize", "w4g32-awq", "--json", str(out)]) == 0
    (entry,) = json.loads(out.read_text())["configurations"]
    option = entry["options"]["quantize"]
    assert option["scheme"] == {"bits": 4, "group_size": 32, "method": "awq"}
    assert option["layers"] > 0 and option["quantized_bytes"] < option["fp16_bytes"]
    line = next(line for line in text.getvalue().splitlines() if "option   quantize:" in line)
    assert f"quantized: w4 g32 awq, {option['layers']} layers" in line
    assert len(entry["predictions"]) == 2
