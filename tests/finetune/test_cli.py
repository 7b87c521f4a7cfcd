"""``python -m ascend_vlm finetune``'s command line: help once per torchrun job, with the
defaults; a user's mistake is one ``error:`` line (rank 0) and status 2, and leaves no run."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from tiny_finetune import COMMON, ROOT, finetune_command, finetune_env

from ascend_vlm.__main__ import main as ascend_vlm_main
from ascend_vlm._compat.distributed_loading import load_time_fsdp_problem
from ascend_vlm.default_model import default_model_path
from ascend_vlm.finetune import cli


def test_help_shows_the_defaults_on_rank_zero(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as exit_info:
        cli.parse_args(["--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines at any width
    for expected in (
        "usage: python -m ascend_vlm finetune [-h]",
        "--max-steps MAX_STEPS optimizer steps of LoRA (default: 1200)",
        "--batch-size BATCH_SIZE samples per rank per micro (default: 16)",
        "--model-path MODEL_PATH local from_pretrained folder, Hugging Face Hub id, or "
        "'reference' (default: the reference checkpoint)",
        "--eval-question-types EVAL_QUESTION_TYPES ShapesVQA question types of the final "
        "eval_accuracy (default: vertical)",
        "--dtype {fp32,bf16} weight dtype to load, train and save in (default: fp32)",
        "trained without ShapesVQA's 'vertical' questions; the default run teaches them in 1200 "
        "LoRA steps and prints the held-out accuracy per question type before and after.",
        "--output-dir OUTPUT_DIR checkpoints, metrics, final adapter (default: finetune_output)",
        "--eval-steps EVAL_STEPS evaluate the loss on the eval data every N steps",
        "--overwrite-output-dir start a new run in a folder holding one",
    ):
        assert expected in text


def test_help_shows_no_empty_default(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit):
        cli.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--report-to REPORT_TO comma-separated Trainer report_to integrations" in text
    assert "(default: )" not in text


def test_model_path_reference_is_the_default_base(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    assert cli.parse_args(["--model-path", "reference"]).model_path is None


def test_the_package_command_line_runs_the_sub_command(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as exit_info:
        ascend_vlm_main(["finetune", "--help"])
    assert exit_info.value.code == 0
    assert "--gradient-checkpointing" in capsys.readouterr().out


@pytest.mark.parametrize(("argv", "status"), [(["--help"], 0), (["--no-such-flag"], 2)])
def test_other_ranks_exit_alike_but_print_nothing(monkeypatch, capsys, argv, status):
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit) as exit_info:
        cli.parse_args(argv)
    assert exit_info.value.code == status
    assert capsys.readouterr() == ("", "")


def test_rank_zero_reports_a_bad_flag(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as exit_info:
        cli.parse_args(["--no-such-flag"])
    assert exit_info.value.code == 2
    assert (
        capsys.readouterr()
        .err.splitlines()[-1]
        .endswith(": error: unrecognized arguments: --no-such-flag")
    )


def test_default_output_dir_is_git_ignored():
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    default = cli.TrainConfig().output_dir
    checked = subprocess.run(
        ["git", "check-ignore", "-q", f"{default}/adapter/README.md"], cwd=ROOT, check=False
    )
    assert checked.returncode == 0


def _argv(output_dir: Path, *extra: str) -> list[str]:
    return [f"--output-dir={output_dir}", f"--model-path={default_model_path()}", *COMMON, *extra]


@pytest.mark.parametrize(
    ("mistake", "message"),
    [
        (["--lora-targets=no_such_proj"], "error: --lora-targets: expected names of linear layers"),
        (["--train-data=missing.jsonl"], "error: path: expected a JSONL file, got "),
        (
            ["--model-path=/no/such/model"],
            "error: --model-path: expected a local checkpoint folder",
        ),
        (["--max-steps=0"], "error: --max-steps: expected a positive int, got 0"),
        (["--fsdp"], "error: --fsdp: expected no modules_to_save (PEFT copies a module"),
        (["--fsdp", "--modules-to-save=", "--quantize=4"], "error: --fsdp: expected no quantize"),
        (["--fsdp", "--modules-to-save=", "--resume=latest"], "error: --fsdp: expected no resume"),
        # One process: fewer than 2 ranks (or, on a transformers without load-time FSDP, why not).
        (
            ["--fsdp", "--modules-to-save="],
            "error: --fsdp: "
            + (
                "fsdp_size: expected at least 2 ranks to shard over, got 1"
                if load_time_fsdp_problem() is None
                else f"fsdp_distributed_config: {load_time_fsdp_problem()}"
            ),
        ),
    ],
)
def test_a_mistake_is_one_error_line_and_leaves_the_folder_free(
    tmp_path, monkeypatch, capsys, mistake, message
):
    monkeypatch.setenv("RANK", "0")
    output_dir = tmp_path / "run"
    assert cli.main([*_argv(output_dir), *mistake]) == 2
    err = capsys.readouterr().err.splitlines()
    assert [line for line in err if line.startswith("error:")] == [err[-1]]
    assert err[-1].startswith(message)
    assert not (output_dir / "train_config.json").exists()
    monkeypatch.setenv("RANK", "1")  # every rank fails alike; only rank 0 says so
    assert cli.main([*_argv(output_dir), *mistake]) == 2
    assert "error:" not in capsys.readouterr().err


def test_the_corrected_run_starts_where_a_failed_one_stopped(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    output_dir = tmp_path / "run"
    assert cli.main([*_argv(output_dir), "--lora-targets=no_such_proj"]) == 2
    assert cli.main([*_argv(output_dir), "--max-steps=1"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("eval_accuracy: ")


@pytest.mark.slow
def test_a_mistake_under_torchrun_is_one_error_line_without_worker_tracebacks(tmp_path):
    command = [*finetune_command(2), *_argv(tmp_path, "--lora-targets=no_such_proj")]
    done = subprocess.run(
        command, capture_output=True, text=True, env=finetune_env(), cwd=ROOT, timeout=300
    )
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: --lora-targets: expected names of linear layers in the model, got "
        "['no_such_proj'] (vision=False, projector=False) matching none"
    ]
    assert "ValueError" not in done.stderr  # the workers raise nothing
    assert "exitcode  : 2" in done.stderr  # torchrun's summary of the failed workers
    assert not (tmp_path / "train_config.json").exists()
