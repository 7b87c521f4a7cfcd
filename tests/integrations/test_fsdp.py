"""FSDP2 for a patched tiny VLM with LoRA: the units follow the family descriptor, Trainer's
arguments name them so that accelerate finds them in the PEFT-wrapped model, and at 2 gloo ranks
`shard_model` trains to DDP's losses with about half of the parameters on each rank."""

from __future__ import annotations

import json
import os
import socket
import typing
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from ascend_vlm._compat.distributed_loading import load_time_fsdp_problem
from ascend_vlm._compat.fsdp_state import FSDP_STATE_PROBES
from ascend_vlm.integrations.fsdp import (
    fsdp_distributed_config,
    fsdp_plan,
    fsdp_training_arguments,
    held_parameter_elements,
    roots_unsharded,
    shard_model,
    sharded_layer_classes,
)
from ascend_vlm.models.tiny import FAMILIES, build_model

FAMILY = "qwen2_vl"
STEPS = 3
WORLD_SIZE = 2
PER_RANK_BATCH = 2
# Per-token inputs (padded per batch) with the value padding takes; the rest is per image.
ROW_KEYS = {"input_ids": 0, "attention_mask": 0, "mm_token_type_ids": 0, "labels": -100}


def _lora_model(checkpoint: Path | None = None, **loading) -> torch.nn.Module:
    """The tiny Qwen2-VL (built, or loaded from `checkpoint` with `loading` kwargs) with
    ascend_flash attention, patched, under LoRA (seeded)."""
    import transformers
    from peft import LoraConfig, get_peft_model

    import ascend_vlm

    if checkpoint is None:
        model = build_model(FAMILY, attn_implementation="ascend_flash")
    else:
        model = getattr(transformers, FAMILIES[FAMILY].model_class).from_pretrained(
            checkpoint, attn_implementation="ascend_flash", **loading
        )
    model.train()
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


def test_fsdp_plan_has_one_rule_per_layer_list():
    model = build_model(FAMILY)
    assert fsdp_plan(type(model), model.config) == {
        "model.visual.blocks.*": "free_full_weight",
        "model.language_model.layers.*": "free_full_weight",
    }


def test_fsdp_distributed_config_or_why_not():
    model = build_model(FAMILY)
    problem = load_time_fsdp_problem()
    if problem is not None:
        with pytest.raises(RuntimeError, match="fsdp_distributed_config: transformers 5"):
            fsdp_distributed_config(model.config, model_class=type(model), fsdp_size=2)
        return
    sharding = fsdp_distributed_config(model.config, model_class=type(model), fsdp_size=2)
    assert sharding.fsdp_size == 2
    assert sharding.fsdp_plan == fsdp_plan(type(model), model.config)
    with pytest.raises(ValueError, match="fsdp_size: expected at least 2 ranks"):
        fsdp_distributed_config(model.config, model_class=type(model), fsdp_size=1)
    model.config.architectures = None
    with pytest.raises(ValueError, match="config: expected an architectures entry"):
        fsdp_distributed_config(model.config, fsdp_size=2)


def _sharded_pair() -> torch.nn.Module:
    """Two linears: the first its own FSDP2 unit, the second's parameters the root's."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    fully_shard(model[0])
    fully_shard(model)
    return model


def _parameter_kinds(model: torch.nn.Module) -> list[str]:
    return [type(parameter).__name__ for parameter in model.parameters()]


def test_the_fsdp_state_probe_holds():
    assert [(probe.name, probe.check()) for probe in FSDP_STATE_PROBES] == [
        ("fsdp-lazy-init", None)
    ]


def test_roots_unsharded_gathers_the_roots_parameters_before_any_forward(single_rank_group):
    model = _sharded_pair()
    assert _parameter_kinds(model) == ["DTensor"] * 4
    with roots_unsharded(model) as gathered:
        assert gathered is model
        # the root's own parameters are whole; the inner unit gathers around its forward
        assert _parameter_kinds(model) == ["DTensor", "DTensor", "Parameter", "Parameter"]
        assert model(torch.ones(3, 4)).shape == (3, 2)
    assert _parameter_kinds(model) == ["DTensor"] * 4


def _fsdp_module() -> type:
    from torch.distributed.fsdp import FSDPModule

    return FSDPModule


def _fsdp_unit_state() -> type:
    return typing.get_type_hints(_fsdp_module()._get_fsdp_state)["return"]


@pytest.mark.parametrize(
    ("owner", "attribute", "why"),
    [
        (_fsdp_module, "_get_fsdp_state", "FSDPModule has no _get_fsdp_state"),
        (_fsdp_unit_state, "_lazy_init", "FSDPState, the FSDP2 unit state, has no _lazy_init"),
    ],
)
def test_a_torch_without_the_internal_fails_naming_the_probe(
    single_rank_group, monkeypatch, owner, attribute, why
):
    model = _sharded_pair()
    monkeypatch.delattr(owner(), attribute)
    expected = f"^roots_unsharded relies on an internal that torch .* changed: probe 'fsdp-lazy-init': {why}$"
    with pytest.raises(RuntimeError, match=expected), roots_unsharded(model):
        pass
    with roots_unsharded(torch.nn.Linear(2, 2)):  # no FSDP2 unit: nothing relies on it
        pass


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


def _trainer_run(model: torch.nn.Module, output_dir: Path) -> tuple[list[float], list[int]]:
    """Trainer's losses over STEPS steps (batch PER_RANK_BATCH per rank, logged averaged over
    the ranks) and the (held, whole) element counts of the trained model's parameters."""
    from transformers import Trainer, TrainingArguments

    arguments = TrainingArguments(
        output_dir=str(output_dir), max_steps=STEPS, per_device_train_batch_size=PER_RANK_BATCH,
        learning_rate=1e-2, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
        seed=0, remove_unused_columns=False, disable_tqdm=True, ddp_backend="gloo",
    )  # fmt: skip
    samples = _samples(STEPS * WORLD_SIZE * PER_RANK_BATCH)
    trainer = Trainer(model=model, args=arguments, train_dataset=samples, data_collator=_collate)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return losses, list(held_parameter_elements(trainer.model_wrapped))


def _rank(rank: int, world_size: int, port: int, folder: str) -> None:
    """One rank (torchrun's environment, as accelerate reads it), each run from the same LoRA
    model: Trainer with DDP, then, where transformers has it, Trainer over the model sharded at
    load time (`fsdp_distributed_config`); then a loop with DDP and one with `shard_model`.
    Writes the losses and element counts to `folder`/rank<rank>.json."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
    )  # fmt: skip
    torch.set_num_threads(1)
    from transformers import AutoConfig

    checkpoint = Path(folder) / "checkpoint"
    result = {}
    result["trainer_ddp"] = _trainer_run(_lora_model(checkpoint), Path(folder) / "ddp")
    if load_time_fsdp_problem() is None:
        sharding = fsdp_distributed_config(AutoConfig.from_pretrained(checkpoint))
        model = _lora_model(checkpoint, distributed_config=sharding)
        result["trainer_fsdp"] = _trainer_run(model, Path(folder) / "fsdp")
    batches = _batches(rank, world_size)
    ddp = torch.nn.parallel.DistributedDataParallel(_lora_model(checkpoint))
    result["loop_ddp"] = (_train(ddp, batches), list(held_parameter_elements(ddp)))
    sharded = shard_model(_lora_model(checkpoint))
    result["loop_fsdp"] = (_train(sharded, batches), list(held_parameter_elements(sharded)))
    (Path(folder) / f"rank{rank}.json").write_text(json.dumps(result))


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _assert_sharded_run_equals_ddp(sharded: list, ddp: list) -> None:
    (losses, (held, whole)), (ddp_losses, ddp_counts) = sharded, ddp
    assert len(ddp_losses) == STEPS
    torch.testing.assert_close(losses, ddp_losses, atol=1e-5, rtol=1e-5)
    assert ddp_counts == [whole, whole]  # DDP: every rank holds everything
    assert abs(held / whole - 1 / WORLD_SIZE) < 0.05, (held, whole)


@pytest.mark.slow
def test_fsdp2_with_lora_trains_to_ddps_losses_with_half_the_parameters(tmp_path):
    build_model(FAMILY).save_pretrained(tmp_path / "checkpoint")
    port = _free_port()
    mp.spawn(_rank, args=(WORLD_SIZE, port, str(tmp_path)), nprocs=WORLD_SIZE)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]
    for result in results:
        _assert_sharded_run_equals_ddp(result["loop_fsdp"], result["loop_ddp"])
        if load_time_fsdp_problem() is None:
            _assert_sharded_run_equals_ddp(result["trainer_fsdp"], result["trainer_ddp"])
        else:
            assert "trainer_fsdp" not in result
    assert results[0]["loop_ddp"][0] != results[1]["loop_ddp"][0]  # the ranks saw other batches
