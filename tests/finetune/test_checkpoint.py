"""Atomic checkpoints: RNG and weight restore, 'latest' resolution, refusal of mismatches."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from ascend_vlm.finetune import checkpoint


def _parts(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    model[0].requires_grad_(False)  # frozen: not part of the checkpoint
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    return model, optimizer, scheduler


def _draws():
    return random.random(), float(np.random.rand()), float(torch.rand(()))


def test_save_then_load_restores_weights_optimizer_scheduler_and_rng(tmp_path):
    model, optimizer, scheduler = _parts(0)
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    scheduler.step()
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    path = checkpoint.save_checkpoint(
        tmp_path,
        7,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        loop_state={"epoch": 2, "next_index": 5},
        rank=0,
        barrier=lambda: None,
    )
    expected_draws = _draws()
    expected_weight = model[1].weight.detach().clone()

    other, other_optimizer, other_scheduler = _parts(1)
    assert checkpoint.resolve_checkpoint(tmp_path, "latest") == path
    loop = checkpoint.load_checkpoint(
        path, model=other, optimizer=other_optimizer, scheduler=other_scheduler, rank=0
    )
    assert loop == {"epoch": 2, "next_index": 5, "step": 7}
    assert _draws() == expected_draws
    assert torch.equal(other[1].weight, expected_weight)
    assert not torch.equal(other[0].weight, model[0].weight)  # frozen weights are not saved
    assert other_scheduler.get_last_lr() == scheduler.get_last_lr()
    assert other_optimizer.state_dict()["state"][0]["step"] == 1
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "latest",
        "step-00000007",
    ]


def test_mismatches_and_missing_checkpoints_are_refused(tmp_path):
    model, optimizer, scheduler = _parts(0)
    with pytest.raises(FileNotFoundError, match="resume: expected a checkpoint under"):
        checkpoint.resolve_checkpoint(tmp_path, "latest")
    with pytest.raises(FileNotFoundError, match="resume: expected a checkpoint directory"):
        checkpoint.resolve_checkpoint(tmp_path, str(tmp_path))
    kwargs = {"model": model, "optimizer": optimizer, "scheduler": scheduler}
    path = checkpoint.save_checkpoint(
        tmp_path, 1, **kwargs, loop_state={}, rank=0, barrier=lambda: None
    )
    with pytest.raises(ValueError, match="RNG state for rank 1"):
        checkpoint.load_checkpoint(path, **kwargs, rank=1)
    model[0].requires_grad_(True)
    with pytest.raises(ValueError, match="expected the checkpoint to hold this run's 4"):
        checkpoint.load_checkpoint(path, **kwargs, rank=0)
