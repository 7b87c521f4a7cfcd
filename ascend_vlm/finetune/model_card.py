"""The model card (``README.md``) written into a fine-tuned adapter or model folder.

It states what was trained (LoRA settings or every weight), on which base model, on what data,
with which optimizer settings and batch, and the result (last training loss, eval accuracy),
and how to load the folder, so the folder explains itself without the run's output directory.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from ascend_vlm.adapters.adapter_set import DEFAULT_ADAPTER_NAME
from ascend_vlm.quantization.config import DEFAULT_GROUP_SIZE

if TYPE_CHECKING:
    from ascend_vlm.finetune.config import TrainConfig


class RunOutcome(Protocol):
    """The outcome of a run a card states: the fields of
    :class:`ascend_vlm.finetune.train.TrainResult` (whose module imports this one) it reads."""

    eval_accuracy: float
    last_loss: float
    train_samples: int
    eval_samples: int


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}" + ("" if number == 1 else "s")


def _data_line(path: str | None, samples: int, split: str, config: TrainConfig) -> str:
    if path is not None:
        return f"data file `{path}`, {_count(samples, 'sample')} used (one per usable record)"
    types = config.question_types if split == "train" else config.eval_question_types
    scenes = "one to four shapes" if config.shapes_binding else "one shape (count: one to four)"
    line = (
        f"ShapesVQA {split} split (ascend_vlm.data.shapes_vqa): {samples} generated samples, "
        f"data seed {config.data_seed}, {config.image_size} px images, {', '.join(types)} "
        f"questions about scenes of {scenes}"
    )
    if config.shapes_new_kinds:
        from ascend_vlm.data.shapes_vqa import new_kind_names

        names = new_kind_names(config.new_tokens)
        named = ", ".join(k if k == n else f"{k} as `{n}`" for k, n in names.items())
        shown = "the base kinds and the new kinds" if split == "train" else "the new kinds"
        line += f"; {shown}: {named}"
    return line


def _trained_line(config: TrainConfig) -> str:
    if config.full_finetune:
        return "Every weight of the base model (full fine-tuning)."
    parts = [f"the language model's {', '.join(config.lora_targets)} linears"]
    if config.lora_vision:
        parts.append("every vision-tower linear")
    if config.lora_projector:
        parts.append("every projector linear")
    line = (
        f"LoRA (r={config.lora_r}, alpha={config.lora_alpha}, dropout={config.lora_dropout}) on "
        + " and ".join(parts)
        + "."
    )
    if config.quantize is not None:
        group_size = DEFAULT_GROUP_SIZE[config.quantize]
        group = f"g{group_size}" if group_size else "per channel"
        line += (
            f" The base's language-model linears were weight-only quantized (W{config.quantize} "
            f"{group}, RTN) and frozen (QLoRA-style)."
        )
    if config.modules_to_save:
        line += f" Trained in full and saved with the adapter: {', '.join(config.modules_to_save)}."
    if config.new_tokens:
        tokens = ", ".join(f"`{token}`" for token in config.new_tokens)
        line += (
            f" New tokens {tokens}: added to the tokenizer, embedding and output head, "
            "initialised from the mean projected visual feature of training images that mention "
            "them; only their rows trained (PEFT trainable tokens), saved with the adapter "
            "beside visual_tokens.json. Every other weight of the base stayed frozen."
        )
    return line


def _kind_header_and_loading(
    config: TrainConfig, folder: Path, base_path: str
) -> tuple[str, list[str], list[str]]:
    """What the folder holds, the card's front matter, and the Python lines that load it."""
    if config.full_finetune:
        kind = "Fully fine-tuned model"
        header = ["---", "tags: [ascend_vlm, vqa]", "---"]
        load = [
            "from transformers import AutoModelForImageTextToText",
            "from ascend_vlm.default_model import load_processor",
            "",
            f'model = AutoModelForImageTextToText.from_pretrained("{folder}")',
            f'processor = load_processor("{folder}")',
        ]
    else:
        kind = "LoRA adapter"
        header = ["---", "library_name: peft", f"base_model: {base_path}", "---"]
        load = [
            "from peft import PeftModel",
            "from transformers import AutoModelForImageTextToText",
            "",
            f'base = AutoModelForImageTextToText.from_pretrained("{base_path}")',
        ]
        if config.quantize is not None:
            # The adapter was trained on the quantized base: it is loaded onto the same.
            bits = config.quantize
            load[1:1] = ["from ascend_vlm.quantization import QuantizationConfig, quantize"]
            scheme = f"QuantizationConfig(bits={bits}, group_size={DEFAULT_GROUP_SIZE[bits]})"
            load.append(f"quantize(base, {scheme})")
        if config.new_tokens:
            load[1:1] = [
                "from ascend_vlm.adapters import load_visual_tokens",
                "from ascend_vlm.default_model import load_processor",
            ]
            load += [
                f'processor = load_processor("{base_path}")',
                f'load_visual_tokens(base, processor, "{folder}")  # the new tokens, same ids',
            ]
        named = f', adapter_name="{config.adapter_name}"'
        if config.adapter_name == DEFAULT_ADAPTER_NAME:
            named = ""
        load.append(f'model = PeftModel.from_pretrained(base, "{folder}"{named})')
    return kind, header, load


def model_card(
    config: TrainConfig,
    result: RunOutcome,
    world_size: int,
    folder: Path,
    *,
    base_path: str,
    base_description: str,
) -> str:
    """Markdown card of a finished run of ``config`` (on ``world_size`` ranks) whose final
    folder is ``folder``: the base model at ``base_path``, described by ``base_description``."""
    folder = Path(os.path.abspath(folder))
    global_batch = config.batch_size * config.grad_accum * world_size
    loss = "n/a (no step ran in the final invocation)"
    if not math.isnan(result.last_loss):
        loss = f"{result.last_loss:.4g}"
    kind, header, load = _kind_header_and_loading(config, folder, base_path)
    lines = [
        *header,
        "",
        f"# {kind} trained with ascend_vlm's `python -m ascend_vlm finetune`",
        "",
        "## Base model",
        "",
        base_description,
        "",
        "## What was trained",
        "",
        _trained_line(config),
        "",
        "## Data",
        "",
        f"- Train: {_data_line(config.train_data, result.train_samples, 'train', config)}.",
        f"- Eval: {_data_line(config.eval_data, result.eval_samples, 'eval', config)}.",
        "- Prompts use the model's chat template; the loss covers only the assistant's tokens.",
        "",
        "## Training",
        "",
        f"- {_count(config.max_steps, 'optimizer step')} of AdamW, seed {config.seed}.",
        f"- Learning rate: peak {config.learning_rate:g}, linear warm-up over "
        f"{_count(config.warmup_steps, 'step')}, then cosine decay.",
        f"- Weight decay {config.weight_decay:g}, gradient clipping at {config.max_grad_norm:g}.",
        f"- Global batch {global_batch} = {config.batch_size} per rank x "
        f"{config.grad_accum} accumulated x {_count(world_size, 'rank')}.",
        f"- Loss of the last step: {loss}.",
        "",
        "## Result",
        "",
        f"Exact-match accuracy of greedy answers (at most {config.max_new_tokens} new tokens) on "
        f"the {result.eval_samples} eval samples: {result.eval_accuracy:.4f}.",
        "",
        "## Loading",
        "",
        "```python",
        *load,
        "```",
        "",
    ]
    return "\n".join(lines)
