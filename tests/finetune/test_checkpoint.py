"""Atomic checkpoints: RNG and weight restore, 'latest' resolution, refusal of mismatches."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from ascend_vlm.finetune import checkpoint


def _parts(seed: int, hidden: int = 3):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.Linear(hidden, 2))
    model[0].requires_grad_(False)  # frozen: not part of the checkpoint
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    return model, optimizer


def _draws():
    return random.random(), float(np.random.rand()), float(torch.rand(()))


def test_save_then_load_restores_weights_optimizer_and_rng(tmp_path):
    model, optimizer = _parts(0)
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    path = checkpoint.save_checkpoint(
        tmp_path,
        7,
        model=model,
        optimizer=optimizer,
        loop_state={"epoch": 2, "next_index": 5},
        rank=0,
        barrier=lambda: None,
    )
    expected_draws = _draws()
    expected_weight = model[1].weight.detach().clone()

    other, other_optimizer = _parts(1)
    assert checkpoint.resolve_checkpoint(tmp_path, "latest") == path
    assert checkpoint.saved_step(path) == 7
    loop = checkpoint.load_training_state(path, model=other, optimizer=other_optimizer, rank=0)
    assert loop == {"epoch": 2, "next_index": 5, "step": 7}
    assert _draws() == expected_draws
    assert torch.equal(other[1].weight, expected_weight)
    assert not torch.equal(other[0].weight, model[0].weight)  # frozen weights are not saved
    assert other_optimizer.state_dict()["state"][0]["step"] == 1
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "latest",
        "step-00000007",
    ]


def test_mismatches_and_missing_checkpoints_are_refused(tmp_path):
    model, optimizer = _parts(0)
    with pytest.raises(FileNotFoundError, match="resume: expected a checkpoint under"):
        checkpoint.resolve_checkpoint(tmp_path, "latest")
    with pytest.raises(FileNotFoundError, match="resume: expected a checkpoint directory"):
        checkpoint.resolve_checkpoint(tmp_path, str(tmp_path))
    kwargs = {"model": model, "optimizer": optimizer}
    path = checkpoint.save_checkpoint(
        tmp_path, 1, **kwargs, loop_state={}, rank=0, barrier=lambda: None
    )
    with pytest.raises(ValueError, match="RNG state for rank 1"):
        checkpoint.load_training_state(path, **kwargs, rank=1)
    model[0].requires_grad_(True)
    with pytest.raises(ValueError, match="expected the checkpoint to hold this run's 4"):
        checkpoint.load_training_state(path, **kwargs, rank=0)


def test_same_names_with_other_shapes_are_refused_before_anything_is_restored(tmp_path):
    model, optimizer = _parts(0, hidden=3)
    path = checkpoint.save_checkpoint(
        tmp_path, 1, model=model, optimizer=optimizer, loop_state={}, rank=0, barrier=lambda: None
    )
    wider, wider_optimizer = _parts(1, hidden=5)
    before = wider[1].weight.detach().clone()
    with pytest.raises(
        ValueError,
        match=r"resume: expected 1\.weight of shape \(2, 5\) as this run builds it, the "
        r"checkpoint .* holds \(2, 3\)",
    ):
        checkpoint.load_training_state(path, model=wider, optimizer=wider_optimizer, rank=0)
    assert torch.equal(wider[1].weight, before)
