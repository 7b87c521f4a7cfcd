"""scripts/finetune_lora.py's command line: help once per torchrun job, with the defaults."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cli(script_module):
    return script_module("finetune_lora")


def test_help_shows_the_defaults_on_rank_zero(cli, monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as exit_info:
        cli.parse_args(["--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines at any width
    for expected in (
        "--max-steps MAX_STEPS optimizer steps of LoRA (default: 1200)",
        "--batch-size BATCH_SIZE samples per rank per micro (default: 16)",
        "--model-path MODEL_PATH local from_pretrained folder (default: the reference checkpoint)",
        "--eval-question-types EVAL_QUESTION_TYPES ShapesVQA question types of the final "
        "eval_accuracy (default: vertical)",
        "--dtype {fp32,bf16} weight dtype to load, train and save in (default: fp32)",
        "trained without ShapesVQA's 'vertical' questions; the default run teaches them in 1200 "
        "LoRA steps and prints the held-out accuracy per question type before and after.",
        "--output-dir OUTPUT_DIR checkpoints, metrics, final adapter (default: finetune_output)",
    ):
        assert expected in text


@pytest.mark.parametrize(("argv", "status"), [(["--help"], 0), (["--no-such-flag"], 2)])
def test_other_ranks_exit_alike_but_print_nothing(cli, monkeypatch, capsys, argv, status):
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit) as exit_info:
        cli.parse_args(argv)
    assert exit_info.value.code == status
    assert capsys.readouterr() == ("", "")


def test_rank_zero_reports_a_bad_flag(cli, monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as exit_info:
        cli.parse_args(["--no-such-flag"])
    assert exit_info.value.code == 2
    assert (
        capsys.readouterr()
        .err.splitlines()[-1]
        .endswith(": error: unrecognized arguments: --no-such-flag")
    )


def test_default_output_dir_is_git_ignored(cli):
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    default = cli.TrainConfig().output_dir
    checked = subprocess.run(
        ["git", "check-ignore", "-q", f"{default}/adapter/README.md"], cwd=ROOT, check=False
    )
    assert checked.returncode == 0
