"""What the fine-tune gains from Trainer: evaluation during training, gradient checkpointing,
bf16, report_to, --overwrite-output-dir, and a checkpoint on SIGINT / SIGTERM that loses
nothing since the last finished step."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
from tiny_finetune import COMMON, finetune_command, run_checked, start_process, tiny_config

from ascend_vlm.default_model import default_model_path
from ascend_vlm.finetune.placement import init_process_placement
from ascend_vlm.finetune.resume import ResumeError
from ascend_vlm.finetune.train import train
from ascend_vlm.finetune.trainer_setup import training_arguments


def _records(output_dir: Path) -> list[dict]:
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def _losses(output_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in _records(output_dir) if "loss" in r}


def test_report_to_and_precision_reach_trainer(tmp_path):
    placement = init_process_placement()
    config = tiny_config(tmp_path, report_to=("tensorboard",), bf16=True, eval_steps=2)
    arguments = training_arguments(config, placement)
    assert arguments.report_to == ["tensorboard"]
    assert arguments.bf16 and arguments.eval_strategy == "steps" and arguments.eval_steps == 2
    assert training_arguments(tiny_config(tmp_path), placement).report_to == []


def test_evaluation_during_training_logs_the_eval_loss(tmp_path):
    train(tiny_config(tmp_path, eval_steps=2, max_steps=4))
    evaluations = [r for r in _records(tmp_path) if "eval_loss" in r]
    assert [r["step"] for r in evaluations] == [2, 4]
    assert all(r["eval_loss"] > 0 for r in evaluations)


def test_gradient_checkpointing_trains_as_without(tmp_path):
    plain, checkpointed = tmp_path / "plain", tmp_path / "checkpointed"
    train(tiny_config(plain))
    train(tiny_config(checkpointed, gradient_checkpointing=True))
    assert _losses(checkpointed) == pytest.approx(_losses(plain), rel=1e-5)


def test_bf16_autocast_trains(tmp_path):
    result = train(tiny_config(tmp_path, bf16=True, max_steps=2))
    assert sorted(_losses(tmp_path)) == [1, 2] and result.last_loss == result.last_loss


def test_overwrite_output_dir_replaces_a_finished_run(tmp_path):
    train(tiny_config(tmp_path, max_steps=2, save_every=1))
    with pytest.raises(ResumeError, match="--overwrite-output-dir"):
        train(tiny_config(tmp_path, max_steps=1))
    train(tiny_config(tmp_path, max_steps=1, overwrite_output_dir=True))
    assert sorted(_losses(tmp_path)) == [1]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "checkpoint-1",
        "latest",
    ]
    with pytest.raises(ValueError, match="overwrite_output_dir: expected a new run"):
        tiny_config(tmp_path, overwrite_output_dir=True, resume="latest")


def _command(output_dir: Path, nproc: int, *extra: str) -> list[str]:
    model = f"--model-path={default_model_path()}"
    return [*finetune_command(nproc), f"--output-dir={output_dir}", model, *COMMON, *extra]


LONG = ("--max-steps=12", "--save-every=100")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("nproc", "number"), [(1, signal.SIGINT), (2, signal.SIGTERM)], ids=["sigint", "sigterm"]
)
def test_a_signal_saves_the_last_finished_step_and_resume_loses_nothing(tmp_path, nproc, number):
    uninterrupted, stopped = tmp_path / "uninterrupted", tmp_path / "stopped"
    run_checked(_command(uninterrupted, nproc, *LONG))
    job = start_process(_command(stopped, nproc, *LONG))
    deadline = time.monotonic() + 240
    while not (stopped / "metrics.jsonl").is_file() or len(_losses(stopped)) < 3:
        assert job.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    job.send_signal(number)  # torchrun passes SIGTERM on to its workers
    _, err = job.communicate(timeout=120)
    assert job.returncode != 0
    saved = max(_losses(stopped))
    assert 3 <= saved < 12
    assert (stopped / "checkpoints" / "latest").read_text() == f"checkpoint-{saved}"
    assert f"{number.name}: stopped after a checkpoint of the last finished step" in err
    run_checked(_command(stopped, nproc, *LONG, "--resume=latest"))
    assert _losses(stopped) == _losses(uninterrupted)
