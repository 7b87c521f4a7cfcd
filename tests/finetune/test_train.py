"""The fine-tuning loop: rank-count invariance, exact resume, PEFT reload, bad data, targets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ascend_vlm.finetune.data import BadRecordError, EncodedDataset, collate, pad_token_id_of
from ascend_vlm.finetune.shapes_vqa import ShapesVQA
from ascend_vlm.finetune.train import (
    LANGUAGE_PROJECTIONS,
    TrainConfig,
    lora_target_modules,
    model_inputs,
    train,
)

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "finetune_lora.py"
# A few steps on a small ShapesVQA slice; global batch 4 = 2 ranks x 2 = 1 rank x 4.
COMMON = [
    "--train-size=32",
    "--eval-size=4",
    "--max-steps=4",
    "--warmup-steps=1",
    "--save-every=2",
    "--learning-rate=5e-3",
    "--batch-size=2",
    "--no-progress",
    "--no-patch",
    "--base-train-steps=0",
]


def _run(output_dir: Path, nproc: int, *extra: str) -> str:
    """Run the CLI (under torchrun when ``nproc`` > 1) and return its stdout."""
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run(
        [*launcher, str(SCRIPT), f"--output-dir={output_dir}", *COMMON, *extra],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _losses(output_dir: Path) -> dict[int, float]:
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def _tiny_config(output_dir: Path, **overrides) -> TrainConfig:
    """An in-process run of a few steps on a small ShapesVQA slice, no base phase."""
    settings = {
        "output_dir": str(output_dir),
        "train_size": 16,
        "eval_size": 4,
        "max_steps": 3,
        "warmup_steps": 1,
        "batch_size": 4,
        "learning_rate": 5e-3,
        "base_train_steps": 0,
        "patch": False,
        "progress": False,
    }
    return TrainConfig(**{**settings, **overrides})


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("two_ranks")
    stdout = _run(output_dir, 2)
    return output_dir, stdout


@pytest.mark.slow
def test_two_ranks_match_one_rank_with_the_same_global_batch(two_rank_run, tmp_path):
    two_dir, stdout = two_rank_run
    one_dir = tmp_path / "one_rank"
    _run(one_dir, 1, "--grad-accum=2")
    two, one = _losses(two_dir), _losses(one_dir)
    assert sorted(two) == sorted(one) == [1, 2, 3, 4]
    for step in one:
        assert two[step] == pytest.approx(one[step], rel=1e-4), step
    assert stdout.strip().splitlines()[-1].startswith("eval_accuracy: ")
    assert (two_dir / "adapter" / "adapter_model.safetensors").is_file()
    assert sorted(p.name for p in (two_dir / "checkpoints").iterdir()) == [
        "latest",
        "step-00000002",
        "step-00000004",
    ]


@pytest.mark.slow
def test_resume_after_a_crash_reproduces_the_uninterrupted_losses(two_rank_run, tmp_path):
    uninterrupted, _ = two_rank_run
    crashed = tmp_path / "crashed"
    stdout = _run(crashed, 2, "--stop-after-steps=3")
    assert "eval_accuracy" not in stdout
    assert sorted(_losses(crashed)) == [1, 2, 3]  # step 3 ran after checkpoint 2
    assert (crashed / "checkpoints" / "latest").read_text() == "step-00000002"
    _run(crashed, 2, "--resume=latest")
    assert _losses(crashed) == _losses(uninterrupted)


@pytest.mark.slow
def test_saved_adapter_reloads_with_plain_peft_and_gives_the_same_logits(tmp_path, processor):
    from peft import PeftModel
    from transformers import Qwen2VLForConditionalGeneration

    from ascend_vlm.default_model import default_model_path

    result = train(_tiny_config(tmp_path))
    assert 0.0 <= result.eval_accuracy <= 1.0
    eval_set = EncodedDataset(ShapesVQA("eval", 4, image_size=56), processor)
    batch = collate([eval_set[i] for i in range(4)], pad_token_id_of(processor))
    inputs = model_inputs(batch, torch.device("cpu"))
    base = Qwen2VLForConditionalGeneration.from_pretrained(default_model_path())
    with torch.no_grad():
        base_logits = base(**inputs).logits
        reloaded = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
        expected = result.model.eval()(**inputs).logits
        actual = reloaded(**inputs).logits
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    assert not torch.allclose(actual, base_logits, atol=1e-3)


def test_bad_training_record_fails_fast_with_its_number(tmp_path):
    (tmp_path / "data.jsonl").write_text(
        json.dumps({"image": "missing.png", "question": "q?", "answer": "a"}) + "\n"
    )
    config = _tiny_config(
        tmp_path / "out", train_data=str(tmp_path / "data.jsonl"), on_bad_record="fail"
    )
    with pytest.raises(BadRecordError, match=r"record 1: image .*missing\.png.* does not exist"):
        train(config)


def test_lora_targets_split_language_vision_and_projector(processor):
    from ascend_vlm.default_model import load_default_model

    model, _ = load_default_model()
    language = lora_target_modules(model)
    assert language and all(".language_model." in name for name in language)
    assert {name.rsplit(".", 1)[1] for name in language} == set(LANGUAGE_PROJECTIONS)
    with_vision = lora_target_modules(model, vision=True)
    vision = set(with_vision) - set(language)
    assert vision and all(".visual.blocks." in name for name in vision)
    projector = set(lora_target_modules(model, projector=True)) - set(language)
    assert projector and all(".visual.merger." in name for name in projector)
    with pytest.raises(ValueError, match="lora_targets: expected names of linear layers"):
        lora_target_modules(model, ("no_such_proj",))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("max_steps", 0, "max_steps: expected a positive int"),
        ("comm_hook", "dense", "comm_hook: expected one of"),
        ("warmup_steps", -1, "warmup_steps: expected an int >= 0"),
    ],
)
def test_bad_config_values_are_named(field, value, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**{field: value})


@pytest.mark.slow
def test_base_phase_trains_the_full_model_then_lora_adapts_it(tmp_path):
    from safetensors.torch import load_file

    from ascend_vlm.default_model import default_model_path

    result = train(
        _tiny_config(tmp_path, train_size=8, eval_size=2, max_steps=1, base_train_steps=2)
    )
    base_model = tmp_path / "base" / "model"
    trained = load_file(base_model / "model.safetensors")
    random_init = load_file(default_model_path() / "model.safetensors")
    changed = [k for k in random_init if not torch.equal(trained[k], random_init[k])]
    assert len(changed) == len(random_init)  # every weight trained, vision tower included
    assert (base_model / "tokenizer.json").is_file()
    adapter_config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str(base_model)
    assert sorted(_losses(tmp_path / "base")) == [1, 2]
    assert sorted(_losses(tmp_path)) == [1]
    assert 0.0 <= result.eval_accuracy <= 1.0
