"""A few LoRA steps of the tiny model under transformers' Trainer, shared by the callback tests;
run as a script under torchrun (``tiny_trainer.py OUTPUT_DIR sparse|default``) it is one of the
ranks, and rank 0 writes the losses, logs and the sparse hook's byte counts to
``OUTPUT_DIR/result.json``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from ascend_vlm.data.shapes_vqa import ShapesVQA
from ascend_vlm.data.vqa import EncodedDataset, collate, pad_token_id_of
from ascend_vlm.default_model import default_model_path, load_processor
from ascend_vlm.integrations import AscendVLMCallback

STEPS = 3


def lora_model():
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_pretrained(default_model_path())
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=targets))


def arguments(output_dir: Path, trl: bool = False, **extra):
    """Trainer's (or TRL's) arguments for STEPS steps of batch 4 per rank, a log every step and
    a checkpoint after the last."""
    settings = {
        "output_dir": str(output_dir),
        "per_device_train_batch_size": 4,
        "max_steps": STEPS,
        "learning_rate": 5e-3,
        "logging_steps": 1,
        "save_strategy": "steps",
        "save_steps": STEPS,
        "report_to": "none",
        "use_cpu": True,
        "disable_tqdm": True,
        "remove_unused_columns": False,
        "seed": 0,
        **extra,
    }
    if not trl:
        from transformers import TrainingArguments

        return TrainingArguments(**settings)
    from trl import SFTConfig

    return SFTConfig(**settings, dataset_kwargs={"skip_prepare_dataset": True})


def shapes_data(processor, size: int = 16) -> EncodedDataset:
    return EncodedDataset(ShapesVQA("train", size, image_size=56), processor)


def main(output_dir: str, hook: str) -> None:
    """One rank of a torchrun job: Trainer with the callback, ``hook`` "sparse" or "default"."""
    import torch.distributed as dist
    from transformers import Trainer

    torch.set_num_threads(1)
    callback = AscendVLMCallback(patch=False, sparse_allreduce=hook == "sparse" or None)
    processor = load_processor(default_model_path())
    extra = {"ddp_backend": "gloo", "ddp_find_unused_parameters": False}
    trainer = Trainer(
        model=lora_model(),
        args=arguments(Path(output_dir), save_strategy="no", **extra),
        train_dataset=shapes_data(processor),
        data_collator=lambda features: collate(features, pad_token_id_of(processor)),
        callbacks=[callback],
    )
    # First among the callbacks, so the logs Trainer keeps carry the hook's fields.
    trainer.callback_handler.callbacks.insert(0, trainer.pop_callback(callback))
    trainer.train()
    if dist.get_rank() == 0:
        stats = callback.sparse_state.stats if callback.hook_registered else None
        result = {
            "losses": [r["loss"] for r in trainer.state.log_history if "loss" in r],
            "logs": [r for r in trainer.state.log_history if "loss" in r],
            "bytes_dense": None if stats is None else stats.bytes_dense,
            "bytes_sent": None if stats is None else stats.bytes_sent,
        }
        (Path(output_dir) / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:])
