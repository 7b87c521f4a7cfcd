"""AscendVLMCallback under transformers' Trainer and TRL's SFTTrainer: the same losses as a model
patched by hand and as stock, a saved adapter stock PEFT loads, and at 2 gloo ranks the sparse
all-reduce hook active under Trainer, training as the default hook does."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import pytest
import torch
from tiny_finetune import run_checked
from tiny_trainer import STEPS, arguments, lora_model, shapes_data

from ascend_vlm.data.shapes_vqa import ShapesVQA
from ascend_vlm.data.vqa import EncodedDataset, collate, pad_token_id_of
from ascend_vlm.default_model import default_model_path, load_processor
from ascend_vlm.finetune.held_out import model_inputs
from ascend_vlm.integrations import AscendVLMCallback
from ascend_vlm.patching import is_patched, patch, unpatch

# Fused kernels sum in another order than stock: a few fp32 ulps of the loss per step.
LOSS_TOLERANCE = 1e-5
# TRL's loss path (its own cross entropy, entropy and accuracy metrics) carries those ulps into
# larger AdamW updates: the first step agrees as under Trainer, later ones within 1e-3.
TRL_LOSS_TOLERANCE = 1e-3


def _train(output_dir: Path, how: str, trl: bool = False, **extra) -> tuple[list[float], object]:
    """Losses of STEPS LoRA steps on the tiny model: ``how`` is "stock", "by hand" (patched
    before training) or "callback"."""
    processor = load_processor(default_model_path())
    model = lora_model()
    if how == "by hand":
        patch(model)
    callbacks = [AscendVLMCallback()] if how == "callback" else []
    dataset = shapes_data(processor)
    collator = lambda features: collate(features, pad_token_id_of(processor))  # noqa: E731
    kwargs = {
        "model": model,
        "args": arguments(output_dir, trl, **extra),
        "train_dataset": dataset,
        "data_collator": collator,
        "callbacks": callbacks,
    }
    if trl:
        from datasets import Dataset
        from trl import SFTTrainer

        # TRL takes a datasets.Dataset: the same encoded samples, read back as tensors.
        rows = [dataset[i] for i in range(len(dataset))]
        kwargs["train_dataset"] = Dataset.from_list(rows).with_format("torch")
        trainer = SFTTrainer(**kwargs, processing_class=processor)
    else:
        from transformers import Trainer

        trainer = Trainer(**kwargs)
    trainer.train()
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    assert len(losses) == STEPS
    return losses, model


@pytest.mark.slow
@pytest.mark.parametrize("trl", [False, True], ids=["Trainer", "SFTTrainer"])
def test_the_callback_trains_as_patching_by_hand_and_as_stock(tmp_path, trl):
    runs = {
        how: _train(tmp_path / how.replace(" ", "_"), how, trl)
        for how in ("stock", "by hand", "callback")
    }
    assert not is_patched(runs["stock"][1])
    assert is_patched(runs["callback"][1])
    stock = runs["stock"][0]
    for how in ("by hand", "callback"):
        losses = runs[how][0]
        assert losses[0] == pytest.approx(stock[0], rel=LOSS_TOLERANCE), how
        later = TRL_LOSS_TOLERANCE if trl else LOSS_TOLERANCE
        assert losses[1:] == pytest.approx(stock[1:], rel=later), how
    # Patching by hand and by the callback run the same kernels on the same model.
    assert runs["callback"][0] == runs["by hand"][0]


@pytest.mark.slow
def test_what_trainer_saves_under_the_callback_loads_in_stock_peft(tmp_path, processor):
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    _, trained = _train(tmp_path, "callback")
    saved = tmp_path / f"checkpoint-{STEPS}"
    base = AutoModelForImageTextToText.from_pretrained(default_model_path())
    loaded = PeftModel.from_pretrained(base, saved).eval()
    assert not is_patched(loaded)
    trained_weights = {k: v for k, v in trained.state_dict().items() if "lora_" in k}
    loaded_weights = {k: v for k, v in loaded.state_dict().items() if "lora_" in k}
    assert trained_weights.keys() == loaded_weights.keys() and trained_weights
    assert all(torch.equal(trained_weights[k], loaded_weights[k]) for k in trained_weights)
    dataset = EncodedDataset(ShapesVQA("eval", 2, image_size=56), processor)
    inputs = model_inputs(collate([dataset[0], dataset[1]], pad_token_id_of(processor)), "cpu")
    unpatch(trained)
    with torch.no_grad():
        assert torch.equal(loaded(**inputs).logits, trained.eval()(**inputs).logits)


def test_bad_sparse_allreduce_settings_are_named():
    with pytest.raises(TypeError, match="sparse_allreduce: expected None, a bool or a Sparse"):
        AscendVLMCallback(sparse_allreduce="yes")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _two_ranks(output_dir: Path, hook: str) -> dict:
    """Run tiny_trainer.py as 2 gloo ranks on 127.0.0.1; rank 0's result."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2"]
    launcher += ["--master_addr=127.0.0.1", f"--master_port={_free_port()}"]
    script = Path(__file__).with_name("tiny_trainer.py")
    run_checked([*launcher, str(script), str(output_dir), hook])
    return json.loads((output_dir / "result.json").read_text())


@pytest.mark.slow
def test_at_two_gloo_ranks_the_sparse_hook_runs_under_trainer_as_the_default_hook(tmp_path):
    default = _two_ranks(tmp_path / "default", "default")
    sparse = _two_ranks(tmp_path / "sparse", "sparse")
    assert default["bytes_dense"] is None
    # The hook saw every step's gradient buckets: LoRA gradients are dense, so it sent them all.
    assert sparse["bytes_dense"] > 0 and sparse["bytes_sent"] >= sparse["bytes_dense"]
    assert sparse["losses"] == pytest.approx(default["losses"], rel=LOSS_TOLERANCE)
    for record in sparse["logs"]:
        assert record["comm_bytes_saved"] <= 0 and 0 < record["comm_density"] <= 1
