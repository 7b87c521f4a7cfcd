"""The tiny fine-tune settings that fine-tune, eval and cluster tests share: an in-process
config, the command line of a few steps of ``python -m ascend_vlm finetune``, and the
environment, start and checked run of such a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from ascend_vlm.default_model import default_model_path
from ascend_vlm.finetune.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
# The sub-command as torchrun launches it (``torchrun ... -m ascend_vlm finetune``).
MODULE = ["-m", "ascend_vlm", "finetune"]
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
    "--image-size=56",
    "--report-question-types=",
]


def finetune_env() -> dict[str, str]:
    """The environment of a fine-tune subprocess: this checkout's package first, one thread
    per process, and none of a torchrun parent's rank variables."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def start_process(command: list[str]) -> subprocess.Popen:
    """Start ``command`` from this checkout in :func:`finetune_env`, its stdout and stderr piped
    as text."""
    return subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=finetune_env(),
        cwd=ROOT,
    )


def run_checked(command: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``command`` from this checkout in :func:`finetune_env`, its output captured as text;
    assert it exits 0 (showing stderr's tail) and return it. A hang fails on ``timeout``
    seconds."""
    done = subprocess.run(
        command, capture_output=True, text=True, env=finetune_env(), cwd=ROOT, timeout=timeout
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def finetune_command(nproc: int, *launcher: str) -> list[str]:
    """The interpreter, under torchrun (``launcher`` arguments, else ``--standalone
    --nproc_per_node=nproc``) when ``nproc`` > 1 or ``launcher`` is given, running the
    fine-tune sub-command."""
    if nproc == 1 and not launcher:
        return [sys.executable, *MODULE]
    launcher = launcher or ("--standalone", f"--nproc_per_node={nproc}")
    return [sys.executable, "-m", "torch.distributed.run", *launcher, *MODULE]


def tiny_config(output_dir: Path, **overrides) -> TrainConfig:
    """An in-process LoRA run of a few steps of the random tiny model on a small ShapesVQA
    slice, without the per-type report."""
    settings = {
        "output_dir": str(output_dir),
        "model_path": str(default_model_path()),
        "image_size": 56,
        "report_question_types": (),
        "train_size": 16,
        "eval_size": 4,
        "max_steps": 3,
        "warmup_steps": 1,
        "batch_size": 4,
        "learning_rate": 5e-3,
        "patch": False,
        "progress": False,
    }
    return TrainConfig(**{**settings, **overrides})
