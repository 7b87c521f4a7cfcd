"""LoRA fine-tuning of a Hugging Face VLM, one process per device.

    torchrun --nproc_per_node=2 scripts/finetune_lora.py                 # ShapesVQA, tiny model
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d \\
        --rdzv-endpoint=HOST:29500 scripts/finetune_lora.py --model-path /models/Qwen2-VL-2B
    python scripts/finetune_lora.py --max-steps 20                       # single process

The last line printed (rank 0) is ``eval_accuracy: <fraction>``. See
``ascend_vlm.finetune.train`` for the loss and batching contract.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ascend_vlm.finetune.data import BAD_RECORD_POLICIES
from ascend_vlm.finetune.train import (
    COMM_HOOKS,
    DEFAULT_MODEL_BASE_TRAIN_STEPS,
    TrainConfig,
    train,
)


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    defaults = TrainConfig()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--output-dir", default=defaults.output_dir, help="checkpoints, metrics, final adapter")
    add("--model-path", default=None, help="local from_pretrained folder (default: tiny model)")
    add("--train-data", default=None, help="JSONL of VQA / LLaVA records (default: ShapesVQA)")
    add("--eval-data", default=None, help="JSONL for the final eval (default: ShapesVQA eval)")
    add("--train-size", type=int, default=defaults.train_size, help="ShapesVQA train records")
    add("--eval-size", type=int, default=defaults.eval_size, help="ShapesVQA eval records")
    add("--data-seed", type=int, default=defaults.data_seed, help="ShapesVQA generator seed")
    add("--image-size", type=int, default=defaults.image_size, help="ShapesVQA image side (px)")
    add(
        "--shapes-binding",
        action="store_true",
        help="ShapesVQA: ask colour/shape/position about 1-4-shape scenes (harder)",
    )
    add("--on-bad-record", choices=BAD_RECORD_POLICIES, default=defaults.on_bad_record)
    add("--max-steps", type=int, default=defaults.max_steps, help="optimizer steps")
    add("--batch-size", type=int, default=defaults.batch_size, help="samples per rank per micro")
    add("--grad-accum", type=int, default=defaults.grad_accum, help="micro-batches per step")
    add("--learning-rate", "--lr", type=float, default=defaults.learning_rate)
    add("--weight-decay", type=float, default=defaults.weight_decay)
    add("--warmup-steps", type=int, default=defaults.warmup_steps)
    add("--max-grad-norm", type=float, default=defaults.max_grad_norm)
    add("--seed", type=int, default=defaults.seed)
    add("--lora-r", type=int, default=defaults.lora_r)
    add("--lora-alpha", type=int, default=defaults.lora_alpha)
    add("--lora-dropout", type=float, default=defaults.lora_dropout)
    add(
        "--lora-targets",
        default=",".join(defaults.lora_targets),
        help="comma-separated language-model linear names",
    )
    add("--lora-vision", action="store_true", help="also adapt every vision-tower linear")
    add("--lora-projector", action="store_true", help="also adapt the projector's linears")
    add(
        "--modules-to-save",
        default=",".join(defaults.modules_to_save),
        help="comma-separated modules trained in full and saved with the adapter ('' for none)",
    )
    add("--full-finetune", action="store_true", help="train every weight instead of LoRA")
    add(
        "--base-train-steps",
        type=int,
        default=None,
        help="full-parameter base-training steps before LoRA (default: "
        f"{DEFAULT_MODEL_BASE_TRAIN_STEPS} for the tiny default model, 0 with --model-path)",
    )
    add("--base-learning-rate", type=float, default=defaults.base_learning_rate)
    add("--save-every", type=int, default=defaults.save_every, help="checkpoint period (steps)")
    add("--resume", default=None, help="checkpoint directory or 'latest'")
    add("--stop-after-steps", type=int, default=None, help="stop early (simulates a crash)")
    add("--no-patch", dest="patch", action="store_false", help="skip ascend_vlm.patch")
    add("--comm-hook", choices=COMM_HOOKS, default=defaults.comm_hook)
    add("--eval-batch-size", type=int, default=defaults.eval_batch_size)
    add("--max-new-tokens", type=int, default=defaults.max_new_tokens)
    add("--no-progress", dest="progress", action="store_false", help="no tqdm bar")
    values = vars(parser.parse_args(argv))
    for name in ("lora_targets", "modules_to_save"):
        values[name] = tuple(part.strip() for part in values[name].split(",") if part.strip())
    return TrainConfig(**values)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    train(parse_args(argv))


if __name__ == "__main__":
    main()
