"""The LoRA fine-tuning run: one process per device, launched by torchrun or run directly.

:func:`train` runs these parts in order, each in its own module of ``ascend_vlm.finetune``:
the process placement (:mod:`.placement`, :mod:`.restarts`), the run's settings in its folder
(:mod:`.config`, :mod:`.run_settings`), the model (:mod:`.model_setup`) and data
(:mod:`.samples`, :mod:`.micro_batches`), the optimizer steps (:mod:`.steps`, with the loss
formula, and :mod:`.schedule`, with the learning-rate formula), checkpoints
(:mod:`.checkpoint`), held-out accuracy (:mod:`.held_out`), the metrics file
(:mod:`.metrics_log`) and the saved result (:mod:`.export`, :mod:`.model_card`).

``model_path`` is the base checkpoint; ``scripts/finetune_lora.py`` makes it the reference
checkpoint by default (:func:`ascend_vlm.finetune.reference_model.base_model_path`), which
never saw ShapesVQA's ``vertical`` questions; the default settings teach that skill with LoRA
and report the held-out accuracy of every question type before and after
(``report_question_types``).

A run writes its settings to ``<output_dir>/train_config.json``; resuming checks the new
settings against them (:mod:`ascend_vlm.finetune.resume`).
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ascend_vlm.adapters.visual_vocabulary import VisualTokens
from ascend_vlm.data.vqa import (
    EncodedDataset,
    VQASample,
    pad_token_id_of,
    processor_for_another_thread,
)
from ascend_vlm.finetune import checkpoint
from ascend_vlm.finetune.communication import CommCounter, install_comm_hook, whole_table_bytes
from ascend_vlm.finetune.config import DTYPES, TrainConfig
from ascend_vlm.finetune.export import save_final, save_merged
from ascend_vlm.finetune.held_out import accuracy_per_type, accuracy_table, evaluate
from ascend_vlm.finetune.metrics_log import METRICS_FILE, MetricsLog
from ascend_vlm.finetune.model_card import model_card
from ascend_vlm.finetune.model_setup import (
    add_new_tokens,
    apply_ascend_patch,
    load_base_model,
    with_trainable_weights,
)
from ascend_vlm.finetune.placement import ProcessPlacement, init_process_placement
from ascend_vlm.finetune.restarts import resumed_after_restart
from ascend_vlm.finetune.run_settings import settle_run_config, without_missing_latest
from ascend_vlm.finetune.samples import build_samples
from ascend_vlm.finetune.steps import Learner, run_steps
from ascend_vlm.vision_input.fast_processor import with_fast_pixels

logger = logging.getLogger(__name__)


@dataclass
class TrainResult:
    """What a run leaves in memory: the trained PEFT model, its processor, the eval accuracy
    (NaN when ``stop_after_steps`` ended the run before ``max_steps``), the loss of the last
    step run (NaN when none ran), and the number of train and eval records used."""

    model: Any
    processor: Any
    eval_accuracy: float
    last_loss: float
    train_records: int
    eval_records: int


def train(config: TrainConfig) -> TrainResult:
    """Run fine-tuning per ``config`` in this process.

    Rank 0 prints ``eval_accuracy: <fraction>`` as its last line and writes a model card
    (``README.md``) into the final adapter / model folder. With ``stop_after_steps`` below
    ``max_steps`` the run stops there like a crash would (no final adapter, no eval).

    The settings are saved to ``<output_dir>/train_config.json``. Without ``resume`` the output
    folder must not hold a run already (``ResumeError``: nothing there is touched). With
    ``resume`` they are checked against the saved ones before anything is loaded
    (:func:`~ascend_vlm.finetune.resume.check_resume`): a refused change raises
    :class:`~ascend_vlm.finetune.resume.ResumeError` naming the setting and leaves the folder
    as it was; an accepted change is logged and saved. ``resume="latest"`` with nothing saved
    yet (a crash before the first checkpoint) starts from scratch with a warning, so re-running
    the same command always continues. The process group is destroyed on return.
    """
    try:
        placement = init_process_placement(config.collective_timeout)
        config = resumed_after_restart(config, placement.is_main)
        settle_run_config(config, placement)
        return _train(without_missing_latest(config))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@dataclass
class _BuiltModel:
    """The model a run trains and what building it found: its processor, the train and eval
    records, the added tokens (None: none), the whole-table bytes they would send (None: no
    tokens), and notes for the start-up log line."""

    model: Any
    processor: Any
    train_samples: Sequence[VQASample]
    eval_samples: Sequence[VQASample]
    visual: VisualTokens | None
    whole_table_bytes: int | None
    patch_note: str
    lora_targets: int


def _train(config: TrainConfig) -> TrainResult:
    placement = init_process_placement()
    output_dir = Path(config.output_dir)
    if placement.is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
    # Same seed on every rank while building: identical LoRA init everywhere.
    seed_everything(config.seed)
    built = _build_model(config, placement)
    model, processor = built.model, built.processor
    # Encoded in the prefetch thread, with its own tokenizer and the fast image processor.
    train_set = EncodedDataset(
        built.train_samples, with_fast_pixels(processor_for_another_thread(processor))
    )
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        trainable, lr=config.learning_rate, weight_decay=config.weight_decay
    )
    metrics = MetricsLog(output_dir / METRICS_FILE, placement.is_main)
    loop_state = _restored_or_seeded(config, placement, model, optimizer, metrics)

    # The base's held-out accuracy per type, measured once per run (LoRA starts as a no-op).
    report = config.report_question_types if config.eval_data is None else ()
    if report and config.resume is None:
        before = accuracy_per_type(model, processor, config, placement, report)
        metrics.write({"step": 0, "accuracy_before": before})

    learner = _learner(config, placement, built, trainable, optimizer)
    step, last_loss = run_steps(
        config, placement, learner, train_set, pad_token_id_of(processor), loop_state, metrics
    )
    result = TrainResult(
        model, processor, math.nan, last_loss, len(built.train_samples), len(built.eval_samples)
    )
    if step < config.max_steps:  # stopped early on purpose: no final adapter, no eval
        return result
    _finish(config, placement, built, result, metrics, step, report)
    return result


def _build_model(config: TrainConfig, placement: ProcessPlacement) -> _BuiltModel:
    """Load the base, quantize it when asked, read the records, add the new tokens, patch, and
    make the weights to train trainable (LoRA or all), in that order."""
    if config.model_path is None:
        raise ValueError(
            "model_path: expected a local from_pretrained folder, got None "
            "(scripts/finetune_lora.py defaults it to the reference checkpoint)"
        )
    model, processor = load_base_model(config.model_path, placement.device, DTYPES[config.dtype])
    if config.quantize is not None:
        from ascend_vlm.quantization import QuantizationConfig, quantize

        quantize(model, QuantizationConfig(bits=config.quantize), progress=False)
    train_samples, eval_samples = build_samples(config)
    visual = table_bytes = None
    if config.new_tokens:
        visual = add_new_tokens(model, processor, config.new_tokens, train_samples)
        table_bytes = whole_table_bytes(model, placement.world_size)
    patch_note = apply_ascend_patch(model, config.patch)
    model, lora_targets = with_trainable_weights(model, config, visual)
    return _BuiltModel(
        model,
        processor,
        train_samples,
        eval_samples,
        visual,
        table_bytes,
        patch_note,
        lora_targets,
    )


def _restored_or_seeded(
    config: TrainConfig,
    placement: ProcessPlacement,
    model: Any,
    optimizer: torch.optim.Optimizer,
    metrics: MetricsLog,
) -> dict[str, Any]:
    """The loop state to start from: restored with weights, optimizer and RNG from the
    checkpoint ``config.resume`` names, or step 0 with this rank's own seed. ``metrics`` keeps
    only the records of the steps before it."""
    if config.resume is None:
        seed_everything(config.seed + placement.rank)
        metrics.truncate_after(0)
        return {"step": 0, "epoch": 0, "next_index": 0}
    path = checkpoint.resolve_checkpoint(config.output_dir, config.resume)
    loop_state = checkpoint.load_training_state(
        path, model=model, optimizer=optimizer, rank=placement.rank
    )
    if placement.is_main:
        logger.info("resume: continuing after step %d from %s", loop_state["step"], path)
    metrics.truncate_after(loop_state["step"])
    return loop_state


def _learner(
    config: TrainConfig,
    placement: ProcessPlacement,
    built: _BuiltModel,
    trainable: list[torch.nn.Parameter],
    optimizer: torch.optim.Optimizer,
) -> Learner:
    """What the steps work on: with more than one rank the model in DDP (with the sparse hook
    when asked for); logs the run's placement and trainable size on rank 0."""
    from torch.nn.parallel import DistributedDataParallel

    model = ddp_model = built.model
    hook_state = None
    if placement.world_size > 1:
        ddp_model = DistributedDataParallel(model, device_ids=None)
        hook_state = install_comm_hook(config, ddp_model, placement)
    comm = CommCounter(hook_state, trainable, placement.world_size)
    if placement.is_main:
        logger.info(
            "world=%d device=%s patch=%s lora_targets=%d modules trainable=%d params",
            placement.world_size,
            placement.device,
            built.patch_note,
            built.lora_targets,
            sum(p.numel() for p in trainable),
        )
    return Learner(model, ddp_model, trainable, optimizer, comm, built.whole_table_bytes)


def _finish(
    config: TrainConfig,
    placement: ProcessPlacement,
    built: _BuiltModel,
    result: TrainResult,
    metrics: MetricsLog,
    step: int,
    report: Sequence[str],
) -> None:
    """After the last step: save the adapter or model, report the accuracy per type, evaluate
    into ``result``, save the merged copy when asked, and write the model card."""
    model, processor, output_dir = built.model, built.processor, Path(config.output_dir)
    final = save_final(model, processor, output_dir, config, placement, built.visual)
    if report:
        after = accuracy_per_type(model, processor, config, placement, report)
        metrics.write({"step": step, "accuracy_after": after})
        if placement.is_main:
            print(accuracy_table(metrics.read_first("accuracy_before"), after), flush=True)
    result.eval_accuracy = evaluate(
        model,
        processor,
        built.eval_samples,
        placement,
        config.eval_batch_size,
        config.max_new_tokens,
    )
    metrics.write({"step": step, "eval_accuracy": result.eval_accuracy})
    base_path = config.model_path
    if config.save_merged is not None and placement.is_main:
        save_merged(base_path, final, config.save_merged, DTYPES[config.dtype])
    placement.barrier()
    if placement.is_main:
        card = model_card(
            config,
            result,
            placement.world_size,
            final,
            base_path=base_path,
            base_description=f"`{base_path}`.",
        )
        checkpoint.atomic_write_text(final / "README.md", card)
        print(f"eval_accuracy: {result.eval_accuracy:.4f}", flush=True)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
