"""The settings of a fine-tuning run (:class:`TrainConfig`), checked when they are made.

``python -m ascend_vlm finetune`` (:mod:`ascend_vlm.finetune.cli`) maps one flag to each field. A run saves them to
``<output_dir>/train_config.json``; a resumed run is checked against them
(:mod:`ascend_vlm.finetune.resume`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ascend_vlm.adapters.adapter_set import DEFAULT_ADAPTER_NAME, check_adapter_name
from ascend_vlm.data.shapes_vqa import (
    KINDS,
    QUESTION_TYPES,
    ShapesVQA,
    check_question_types,
    new_kind_names,
)
from ascend_vlm.quantization.config import DEFAULT_GROUP_SIZE

# The folders under <output_dir> a finished LoRA / full run saves to.
FINAL_ADAPTER = "adapter"
FINAL_MODEL = "model"

# The language-model linears LoRA wraps by default (the last part of their module names).
LANGUAGE_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
COMM_HOOKS = ("sparse", "none")
# Weight dtypes a run can load, train and save the model in.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# A week: longer waits are not a timeout, and timedelta arithmetic overflows far above it.
MAX_COLLECTIVE_TIMEOUT = 7 * 24 * 3600


@dataclass
class TrainConfig:
    """Everything a run depends on; the CLI maps one flag to each field."""

    output_dir: str = "finetune_output"
    model_path: str | None = None
    train_data: str | None = None
    eval_data: str | None = None
    train_size: int = 8000
    eval_size: int = 200
    data_seed: int = 0
    image_size: int = 224
    shapes_binding: bool = False
    question_types: Sequence[str] = QUESTION_TYPES
    eval_question_types: Sequence[str] = ("vertical",)
    report_question_types: Sequence[str] = QUESTION_TYPES
    on_bad_record: str = "skip"
    max_steps: int = 1200
    batch_size: int = 16
    grad_accum: int = 1
    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 50
    max_grad_norm: float = 1.0
    seed: int = 0
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    lora_targets: Sequence[str] = field(default_factory=lambda: LANGUAGE_PROJECTIONS)
    lora_vision: bool = False
    lora_projector: bool = False
    modules_to_save: Sequence[str] = ("lm_head",)
    full_finetune: bool = False
    adapter_name: str = DEFAULT_ADAPTER_NAME
    new_tokens: Sequence[str] = ()
    shapes_new_kinds: bool = False
    quantize: int | None = None
    dtype: str = "fp32"
    save_merged: str | None = None
    save_every: int = 200
    resume: str | None = None
    stop_after_steps: int | None = None
    patch: bool = True
    comm_hook: str = "sparse"
    collective_timeout: float = 1800.0
    eval_batch_size: int = 16
    max_new_tokens: int = 6
    progress: bool = True
    report_to: Sequence[str] = ()
    eval_steps: int | None = None
    gradient_checkpointing: bool = False
    bf16: bool = False
    overwrite_output_dir: bool = False
    fsdp: bool = False

    def __post_init__(self) -> None:
        # Absolute paths: the saved adapter names its base by a path that loads from anywhere,
        # and a run resumed from another directory compares equal settings as equal.
        for name in ("model_path", "train_data", "eval_data", "save_merged"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, os.path.abspath(value))
        positive = ("train_size", "eval_size", "max_steps", "batch_size", "grad_accum")
        for name in (*positive, "save_every", "eval_batch_size", "max_new_tokens", "lora_r"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if self.eval_steps is not None and (
            not isinstance(self.eval_steps, int) or self.eval_steps < 1
        ):
            raise ValueError(
                f"eval_steps: expected a positive int or None, got {self.eval_steps!r}"
            )
        if self.overwrite_output_dir and self.resume is not None:
            raise ValueError(
                "overwrite_output_dir: expected a new run (it deletes the saved one), got "
                f"resume={self.resume!r}"
            )
        self.question_types = check_question_types(self.question_types)
        self.eval_question_types = check_question_types(
            self.eval_question_types, "eval_question_types"
        )
        if self.report_question_types:
            self.report_question_types = check_question_types(
                self.report_question_types, "report_question_types"
            )
        self._check_what_trains()
        timeout = self.collective_timeout
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, (int, float))
            or not 0 < timeout <= MAX_COLLECTIVE_TIMEOUT
        ):
            raise ValueError(
                f"collective_timeout: expected seconds in (0, {MAX_COLLECTIVE_TIMEOUT}], got "
                f"{timeout!r}"
            )
        if self.comm_hook not in COMM_HOOKS:
            raise ValueError(f"comm_hook: expected one of {COMM_HOOKS}, got {self.comm_hook!r}")
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate: expected > 0, got {self.learning_rate}")
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"warmup_steps: expected an int >= 0, got {self.warmup_steps!r}")

    def _check_what_trains(self) -> None:
        """Check the adapter name, the new tokens and the settings that combine with them,
        the dtype, the merged copy and quantization; ``ValueError`` naming the setting."""
        check_adapter_name(self.adapter_name, "adapter_name")
        self.new_tokens = _check_new_tokens(self.new_tokens)
        if self.new_tokens and self.full_finetune:
            raise ValueError(
                "new_tokens: expected LoRA training (the new rows train as PEFT trainable "
                "tokens beside the adapter), got full_finetune=True"
            )
        if self.new_tokens and self.modules_to_save:
            raise ValueError(
                "modules_to_save: expected none with new_tokens (only the new rows of the "
                "embedding and head train, every other weight of the base stays frozen), got "
                f"{list(self.modules_to_save)}; pass --modules-to-save ''"
            )
        if self.shapes_new_kinds:
            if self.train_data is not None:
                raise ValueError(
                    "shapes_new_kinds: expected ShapesVQA training data (no train_data), got "
                    f"train_data={self.train_data!r}"
                )
            try:  # the datasets' kinds and names, checked now rather than at training time
                self.shapes_dataset("train", 1, self.question_types)
            except ValueError as error:
                raise ValueError(f"new_tokens: {error}") from None
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: expected one of {tuple(DTYPES)}, got {self.dtype!r}")
        if self.save_merged is not None and self.full_finetune:
            raise ValueError(
                "save_merged: expected only with LoRA (a full fine-tune saves the whole model "
                f"in <output_dir>/{FINAL_MODEL} already), got full_finetune=True"
            )
        if self.fsdp:
            self._check_fsdp()
        if self.quantize is not None:
            if self.quantize not in DEFAULT_GROUP_SIZE:
                raise ValueError(
                    f"quantize: expected one of {tuple(DEFAULT_GROUP_SIZE)} bits, got "
                    f"{self.quantize!r}"
                )
            if self.full_finetune or self.save_merged is not None:
                raise ValueError(
                    "quantize: expected LoRA without save_merged (quantized base weights are "
                    "frozen and cannot take a merged adapter), got "
                    f"full_finetune={self.full_finetune}, save_merged={self.save_merged!r}"
                )

    def _check_fsdp(self) -> None:
        """ValueError naming the first setting ``fsdp`` cannot run with: it shards the base's
        layers while loading them, trains only LoRA beside the shards, and Trainer saves no
        optimizer state for such a model."""
        excluded = {
            "full_finetune": (self.full_finetune, "FSDP2 trains LoRA beside the shards"),
            "quantize": (self.quantize, "quantized linears are not sharded"),
            "new_tokens": (self.new_tokens, "trainable token rows live in a sharded table"),
            "modules_to_save": (
                self.modules_to_save,
                "PEFT copies a module to save whole, which FSDP2 holds as shards; pass "
                "--modules-to-save ''",
            ),
            "resume": (
                self.resume,
                "Trainer checkpoints no optimizer state of a model sharded while loading, so "
                "a run cannot continue exactly",
            ),
        }
        for name, (value, why) in excluded.items():
            if value:
                raise ValueError(f"fsdp: expected no {name} ({why}), got {name}={value!r}")

    def shapes_dataset(self, split: str, size: int, question_types: Sequence[str]) -> ShapesVQA:
        """``size`` ShapesVQA records of ``split`` asking ``question_types``, drawn as this
        config says (``data_seed``, ``image_size``, ``shapes_binding``).

        With ``shapes_new_kinds`` the new kinds are the first K of ``NEW_SHAPE_KINDS``, named by
        the K ``new_tokens`` in order (all four by their own names without tokens). Training
        scenes draw from the base kinds and the new ones together, so the base's kind words stay
        in use while the new ones are learnt; eval scenes show only the new kinds, the ones taught.
        """
        kinds, kind_names = KINDS, None
        if self.shapes_new_kinds:
            kind_names = new_kind_names(self.new_tokens)
            kinds = (*KINDS, *kind_names) if split == "train" else tuple(kind_names)
        return ShapesVQA(
            split,
            size,
            self.data_seed,
            self.image_size,
            self.shapes_binding,
            question_types,
            kinds,
            kind_names,
        )


def _check_new_tokens(tokens: Sequence[str]) -> tuple[str, ...]:
    """``tokens`` as a tuple; ``ValueError`` naming ``new_tokens`` unless they are distinct,
    non-empty strings without surrounding spaces."""
    if isinstance(tokens, str):
        raise ValueError(
            f"new_tokens: expected a sequence of token strings, got the string {tokens!r}"
        )
    chosen = tuple(tokens)
    bad = [t for t in chosen if not isinstance(t, str) or not t.strip() or t != t.strip()]
    if bad or len(set(chosen)) != len(chosen):
        raise ValueError(
            f"new_tokens: expected distinct non-empty tokens without surrounding spaces, got "
            f"{list(chosen)}"
        )
    return chosen
