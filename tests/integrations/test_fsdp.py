"""FSDP2 for a patched tiny VLM with LoRA: the units follow the family descriptor, Trainer's
arguments name them so that accelerate finds them in the PEFT-wrapped model, and at 2 gloo ranks
`shard_model` trains to DDP's losses with about half of the parameters on each rank."""

from __future__ import annotations

import datetime
import json
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ascend_vlm.integrations.fsdp import (
    fsdp_training_arguments,
    shard_model,
    sharded_layer_classes,
)
from ascend_vlm.models.tiny import build_model

FAMILY = "qwen2_vl"
STEPS = 3
WORLD_SIZE = 2
PER_RANK_BATCH = 2
# Per-token inputs (padded per batch) with the value padding takes; the rest is per image.
ROW_KEYS = {"input_ids": 0, "attention_mask": 0, "mm_token_type_ids": 0, "labels": -100}


def _lora_model() -> torch.nn.Module:
    """The tiny Qwen2-VL with ascend_flash attention, patched, under LoRA (seeded)."""
    from peft import LoraConfig, get_peft_model

    import ascend_vlm

    model = build_model(FAMILY, attn_implementation="ascend_flash").train()
    ascend_vlm.patch(model)
    torch.manual_seed(0)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj"])
    return get_peft_model(model, config)


def test_sharded_layer_classes_follow_the_family_descriptor():
    model = build_model("qwen2_5_vl")
    assert sharded_layer_classes(model) == ["Qwen2_5_VLDecoderLayer", "Qwen2_5_VLVisionBlock"]
    assert sharded_layer_classes(build_model("mllama")) == [
        "MllamaSelfAttentionDecoderLayer",
        "MllamaCrossAttentionDecoderLayer",
        "MllamaVisionEncoderLayer",
    ]


def test_a_model_no_family_describes_gets_its_no_split_modules():
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=32,
    )  # fmt: skip
    assert sharded_layer_classes(transformers.LlamaForCausalLM(config)) == ["LlamaDecoderLayer"]
    with pytest.raises(ValueError, match="model: expected a transformers model whose family"):
        sharded_layer_classes(torch.nn.Linear(2, 2))


def test_trainer_arguments_make_accelerate_wrap_the_layers_of_the_peft_model(tmp_path):
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy
    from transformers import TrainingArguments

    model = _lora_model()
    extra = fsdp_training_arguments(model, reshard_after_forward=False)
    arguments = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], **extra)
    plugin_arguments = arguments.fsdp_plugin_args
    assert plugin_arguments["fsdp_version"] == 2
    assert plugin_arguments["reshard_after_forward"] is False
    assert plugin_arguments["transformer_cls_names_to_wrap"] == (
        "Qwen2VLDecoderLayer,Qwen2VLVisionBlock"
    )
    plugin = FullyShardedDataParallelPlugin(**plugin_arguments)
    plugin.set_auto_wrap_policy(model)  # raises for a class it cannot find in the model
    policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
    wrapped = [type(module).__name__ for module in model.modules() if policy(module)]
    assert wrapped == ["Qwen2VLVisionBlock", "Qwen2VLDecoderLayer", "Qwen2VLDecoderLayer"]


def _samples(count: int) -> list[dict]:
    """`count` text-and-image training samples for the tiny Qwen2-VL (one image each)."""
    from ascend_vlm.models.tiny import make_inputs

    model = build_model(FAMILY)
    samples = []
    for index in range(count):
        torch.manual_seed(index)
        inputs = make_inputs(FAMILY, model, n_images=1, text_len=6 + index % 3)
        inputs = {k: v[0] if k in ROW_KEYS else v for k, v in inputs.items()}
        inputs["labels"] = inputs["input_ids"].clone()
        samples.append(inputs)
    return samples


def _collate(samples: list[dict]) -> dict:
    """Right-padded rows; Qwen2-VL's pixel patches and grids concatenated."""
    width = max(s["input_ids"].numel() for s in samples)
    batch = {
        key: torch.stack(
            [
                torch.nn.functional.pad(s[key], (0, width - s[key].numel()), value=fill)
                for s in samples
            ]
        )
        for key, fill in ROW_KEYS.items()
    }
    batch["pixel_values"] = torch.cat([s["pixel_values"] for s in samples])
    batch["image_grid_thw"] = torch.cat([s["image_grid_thw"] for s in samples])
    return batch


def _batches(rank: int, world_size: int) -> list[dict]:
    """This rank's STEPS batches (the samples of each step dealt out to the ranks in turn)."""
    samples = _samples(STEPS * world_size * PER_RANK_BATCH)
    per_step = world_size * PER_RANK_BATCH
    return [
        _collate(samples[step * per_step + rank :: world_size][:PER_RANK_BATCH])
        for step in range(STEPS)
    ]


def _train(model: torch.nn.Module, batches: list[dict]) -> list[float]:
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for batch in batches:
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _held(model: torch.nn.Module) -> tuple[int, int]:
    """(elements of the parameters this rank holds, elements of the whole parameters)."""
    local = sum(
        p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters()
    )
    return local, sum(p.numel() for p in model.parameters())


def _rank(rank: int, world_size: int, port: int, out: str) -> None:
    """One rank: DDP, then FSDP2 (`shard_model`), each STEPS AdamW steps over the same batches
    from the same LoRA model; writes both runs' losses and element counts to `out`."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    try:
        batches = _batches(rank, world_size)
        ddp = torch.nn.parallel.DistributedDataParallel(_lora_model())
        ddp_losses = _train(ddp, batches)
        ddp_held = _held(ddp)
        sharded = shard_model(_lora_model())
        fsdp_losses = _train(sharded, batches)
        result = {"ddp": ddp_losses, "fsdp": fsdp_losses, "ddp_held": ddp_held}
        result["fsdp_held"] = _held(sharded)
        Path(out).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _spawned(rank: int, world_size: int, port: int, outs: list[str]) -> None:
    _rank(rank, world_size, port, outs[rank])


@pytest.mark.slow
def test_shard_model_with_lora_trains_to_ddps_losses_with_half_the_parameters(tmp_path):
    outs = [str(tmp_path / f"rank{rank}.json") for rank in range(WORLD_SIZE)]
    mp.spawn(_spawned, args=(WORLD_SIZE, _free_port(), outs), nprocs=WORLD_SIZE)
    results = [json.loads(Path(out).read_text()) for out in outs]
    for result in results:
        assert len(result["ddp"]) == STEPS
        torch.testing.assert_close(result["fsdp"], result["ddp"], atol=1e-5, rtol=1e-5)
        local, total = result["fsdp_held"]
        assert result["ddp_held"] == [total, total]  # DDP: every rank holds everything
        assert abs(local / total - 1 / WORLD_SIZE) < 0.05, (local, total)
    assert results[0]["ddp"] != results[1]["ddp"]  # the ranks saw different batches
