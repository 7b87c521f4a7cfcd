"""`python -m ascend_vlm verify` end to end (in-process, on the tiny default checkpoint) and its
errors: each a single ``error:`` line naming the option, exit status 2."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from ascend_vlm.__main__ import main
from ascend_vlm.testing import faults

pytestmark = pytest.mark.usefixtures("single_threaded_torch")


def test_verify_prints_the_report_and_writes_json_and_plot(tiny_model_path, tmp_path, capsys):
    out, plot = tmp_path / "verify.json", tmp_path / "depth.png"
    argv = ["verify", "--model", str(tiny_model_path), "--limit", "1"]
    assert main([*argv, "--json", str(out), "--plot", str(plot)]) == 0
    printed = capsys.readouterr().out
    assert "no module exceeds 4 x its noise floor" in printed
    assert "peak host memory rise during verify:" in printed
    assert "end to end over 1 samples: top-1 agreement" in printed
    assert "accuracy (normalised): reference" in printed
    report = json.loads(out.read_text())
    assert report["patched"] and report["dtype"] == "bfloat16" and report["inputs"] == 1
    assert report["first_flagged"] is None and report["repro"] is None
    accuracy = report["end_to_end"]["accuracy"]
    assert sum(accuracy[cell] for cell in ("both", "first_only", "second_only", "neither")) == 1
    kinds = {module["kind"] for module in report["modules"]}
    assert kinds >= {"vision-block", "projector", "decoder-layer", "rope", "attention-text"}
    with Image.open(plot) as image:
        assert image.format == "PNG" and image.size[0] > 500


@pytest.mark.mock_npu
def test_verify_exits_1_naming_the_module_a_fault_breaks_and_its_repro_replays_it(
    tiny_model_path, tmp_path, capsys
):
    argv = ["verify", "--model", str(tiny_model_path), "--limit", "1"]
    with faults.rms_norm_eps_scaled() as fault:
        assert main([*argv, "--replay", str(tmp_path / "repros")]) == 1
    assert fault.calls > 0
    printed = capsys.readouterr().out
    first = "model.language_model.layers.0.input_layernorm"
    assert f"first module over 4 x its noise floor: {first} (norm)" in printed
    repro = tmp_path / "repros" / f"{first}.pt"
    assert f"repro of the first flagged module: {repro}" in printed
    assert f"python -m ascend_vlm verify --replay {repro.name}" in printed
    out = tmp_path / "replay.json"
    with faults.rms_norm_eps_scaled():
        assert main(["verify", "--replay", str(repro), "--json", str(out)]) == 0
    assert f"replay of {first} (norm: module" in capsys.readouterr().out
    faulty = json.loads(out.read_text())["errors"]["rel_l2"]
    assert main(["verify", "--replay", str(repro), "--json", str(out), "--force"]) == 0
    assert faulty > 100 * json.loads(out.read_text())["errors"]["rel_l2"]


def _jsonl_without_images(tmp_path):
    path = tmp_path / "questions.jsonl"
    path.write_text(json.dumps({"question": "What shape?", "answer": "a circle"}) + "\n")
    return path


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--limit", "0"], "--limit: expected an int >= 1, got 0"),
        (["--k", "0"], "--k: expected a number > 0, got 0.0"),
        (["--data", "missing.jsonl"], "--data: expected a JSONL file or shapes-vqa, got"),
        (["--device", "npu"], "--device: expected an NPU (torch_npu with a device) for npu"),
    ],
)
def test_bad_options_are_one_error_line(tiny_model_path, command_error, extra, message):
    line = command_error(["verify", "--model", str(tiny_model_path), *extra])
    assert message in line


def test_data_without_images_is_refused(tiny_model_path, tmp_path, command_error):
    argv = ["verify", "--model", str(tiny_model_path), "--data"]
    line = command_error([*argv, str(_jsonl_without_images(tmp_path))])
    assert "--data: sample 1 of" in line and "has no image" in line


def test_a_missing_model_and_an_existing_json_are_refused(tiny_model_path, tmp_path, command_error):
    line = command_error(["verify", "--model", str(tmp_path / "nowhere")])
    assert line.startswith("python -m ascend_vlm verify: error: --model: expected")
    assert "--model: expected a checkpoint folder" in command_error(["verify"])
    existing = tmp_path / "old.json"
    existing.write_text("{}")
    line = command_error(["verify", "--model", str(tiny_model_path), "--json", str(existing)])
    assert f"--json: {existing} exists; pass --force" in line


def test_replay_options_are_checked(tiny_model_path, tmp_path, command_error):
    repro = tmp_path / "module.pt"
    line = command_error(["verify", "--model", str(tiny_model_path), "--replay", str(repro)])
    assert "--replay: a FILE.pt re-runs one repro; give it without --model" in line
    assert "--replay:" in command_error(["verify", "--replay", str(repro)])
    repro.write_bytes(b"not a repro")
    assert "expected a repro .pt file" in command_error(["verify", "--replay", str(repro)])
    taken = tmp_path / "taken"
    taken.write_text("")
    line = command_error(["verify", "--model", str(tiny_model_path), "--replay", str(taken)])
    assert "--replay: expected a folder for the repro or a FILE.pt" in line
