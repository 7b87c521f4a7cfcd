"""The fine-tune's Trainer subclass counts what Trainer counts, more cheaply."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from ascend_vlm.finetune.trainer_setup import FineTuneTrainer


def _llama(layers: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=2,
        num_key_value_heads=2, vocab_size=64,
    )  # fmt: skip
    return LlamaForCausalLM(config)


@pytest.fixture
def model():
    return _llama(layers=2)


def test_the_flos_count_equals_trainers_with_one_walk_of_the_parameters(
    model, tmp_path, monkeypatch
):
    arguments = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    ours, stock = FineTuneTrainer(model=model, args=arguments), Trainer(model=model, args=arguments)
    walks = []
    counted = type(model).num_parameters

    def counting(self, *args, **kwargs):
        walks.append(kwargs)
        return counted(self, *args, **kwargs)

    monkeypatch.setattr(type(model), "num_parameters", counting)
    for rows, length in ((2, 5), (3, 9), (1, 17)):
        inputs = {"input_ids": torch.zeros(rows, length, dtype=torch.long)}
        assert ours.floating_point_ops(inputs) == stock.floating_point_ops(inputs) > 0
    assert len(walks) == 1 + 3  # ours once, Trainer at every batch
    no_tokens = {"pixel_values": torch.zeros(1, 3)}
    assert ours.floating_point_ops(no_tokens) == stock.floating_point_ops(no_tokens) == 0


def test_another_model_is_counted_afresh(model, tmp_path):
    arguments = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    ours = FineTuneTrainer(model=model, args=arguments)
    inputs = {"input_ids": torch.zeros(2, 5, dtype=torch.long)}
    first = ours.floating_point_ops(inputs)
    ours.model = _llama(layers=3)
    assert ours.floating_point_ops(inputs) == Trainer.floating_point_ops(ours, inputs) > first
