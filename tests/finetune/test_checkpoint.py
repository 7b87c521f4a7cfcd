"""Checkpoints: RNG state as tensors, resume without unpickling, 'latest' resolution, refusal of
a checkpoint saved by fewer ranks."""

from __future__ import annotations

import dataclasses
import os
import pickle
import random
import shutil

import numpy as np
import pytest
import torch
from tiny_finetune import tiny_config

from ascend_vlm.finetune import checkpoint
from ascend_vlm.finetune.train import train


def _draws():
    return random.random(), float(np.random.rand()), float(torch.rand(())), random.gauss(0, 1)


def test_rng_state_round_trips_through_a_safetensors_file(tmp_path):
    from safetensors.torch import load_file, save_file

    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    random.gauss(0, 1)  # python keeps the second gaussian of a pair: state beyond the ints
    save_file(checkpoint.rng_state_tensors(), tmp_path / "rng.safetensors")
    expected = _draws()
    _draws()
    checkpoint.set_rng_state_tensors(load_file(tmp_path / "rng.safetensors"))
    assert _draws() == expected


class _RunsCode:
    """Unpickling this creates ``path``: what a hostile checkpoint file could do."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory):
    """A run of 3 steps stopped after 2, with a checkpoint every step."""
    run = tmp_path_factory.mktemp("stopped")
    config = tiny_config(run, train_size=8, max_steps=3, save_every=1, stop_after_steps=2)
    train(config)
    return run, config


def test_checkpoints_hold_no_pickled_rng_state(stopped_run):
    run, _ = stopped_run
    for folder in ("checkpoint-1", "checkpoint-2"):
        names = sorted(p.name for p in (run / "checkpoints" / folder).iterdir())
        assert "rng-rank0.safetensors" in names
        assert not [name for name in names if name.startswith("rng_state")]
    assert (run / "checkpoints" / "latest").read_text() == "checkpoint-2"


def test_resume_refuses_a_checkpoint_that_would_run_code(stopped_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(stopped_run[0], run)
    marker = tmp_path / "code-ran"
    with (run / "checkpoints" / "checkpoint-2" / "optimizer.pt").open("wb") as handle:
        pickle.dump({"state": _RunsCode(str(marker))}, handle)
    config = dataclasses.replace(stopped_run[1], output_dir=str(run), resume="latest")
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        train(dataclasses.replace(config, stop_after_steps=None))
    assert not marker.exists()


def test_a_checkpoint_saved_by_fewer_ranks_is_refused(stopped_run):
    run, _ = stopped_run
    with pytest.raises(ValueError, match="RNG state for rank 1"):
        checkpoint.TensorRngCheckpoints(run, 1, run / "checkpoints" / "checkpoint-2")


def test_missing_checkpoints_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="resume: expected a checkpoint under"):
        checkpoint.resolve_checkpoint(tmp_path, "latest")
    with pytest.raises(FileNotFoundError, match="resume: expected a checkpoint folder"):
        checkpoint.resolve_checkpoint(tmp_path, os.fspath(tmp_path))
