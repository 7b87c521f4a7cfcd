"""The LoRA fine-tuning run on transformers' ``Trainer``: one process per device, launched by
torchrun or run directly.

A run has two phases. :func:`prepare` places the process (:mod:`.placement`, :mod:`.restarts`),
checks the run's settings against its folder (:mod:`.run_settings`, :mod:`.resume`), builds the
model (:mod:`.model_setup`) and reads the data (:mod:`.samples`); only when all of that worked
does it save the settings to ``<output_dir>/train_config.json``, so a mistake found at start-up
leaves the folder as it was. :func:`run` trains with Trainer (:mod:`.trainer_setup`; the
learning rate of :mod:`.schedule`; the callbacks: ascend_vlm's patch and sparse all-reduce hook
from :mod:`ascend_vlm.integrations`, checkpoints from :mod:`.checkpoint`, the metrics file from
:mod:`.metrics_log`, early stops from :mod:`.interruption`), then reports held-out accuracy
(:mod:`.held_out`) and saves the result (:mod:`.export`, :mod:`.model_card`).

``model_path`` is the base checkpoint; ``python -m ascend_vlm finetune`` makes it the reference
checkpoint by default (:func:`ascend_vlm.finetune.reference_model.base_model_path`), which
never saw ShapesVQA's ``vertical`` questions; the default settings teach that skill with LoRA
and report the held-out accuracy of every question type before and after
(``report_question_types``).
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

from ascend_vlm._files import atomic_write_text
from ascend_vlm.adapters.visual_vocabulary import VisualTokens
from ascend_vlm.data.vqa import VQASample
from ascend_vlm.finetune import checkpoint
from ascend_vlm.finetune.config import DTYPES, TrainConfig
from ascend_vlm.finetune.export import save_final, save_merged
from ascend_vlm.finetune.held_out import accuracy_per_type, accuracy_table, evaluate
from ascend_vlm.finetune.interruption import RunInterruption
from ascend_vlm.finetune.metrics_log import METRICS_FILE, MetricsLog, MetricsLogCallback
from ascend_vlm.finetune.model_card import model_card
from ascend_vlm.finetune.model_setup import (
    add_new_tokens,
    load_base_model,
    whole_table_bytes,
    with_trainable_weights,
)
from ascend_vlm.finetune.placement import (
    ProcessPlacement,
    collective_failure,
    init_process_placement,
    is_communication_failure,
)
from ascend_vlm.finetune.restarts import resumed_after_restart
from ascend_vlm.finetune.run_settings import (
    check_run_folder,
    record_run_config,
    without_missing_latest,
)
from ascend_vlm.finetune.samples import build_samples
from ascend_vlm.finetune.trainer_setup import build_trainer
from ascend_vlm.integrations.callback import AscendVLMCallback
from ascend_vlm.integrations.fsdp import held_parameter_elements

logger = logging.getLogger(__name__)


@dataclass
class TrainResult:
    """What a run leaves in memory: the trained PEFT model, its processor, the eval accuracy
    (NaN when the run stopped before ``max_steps``), the loss of the last step run (NaN when
    none ran), the number of train and eval samples used, and the signal that stopped the run
    (None: none did)."""

    model: Any
    processor: Any
    eval_accuracy: float
    last_loss: float
    train_samples: int
    eval_samples: int
    stopped_by_signal: int | None = None


@dataclass
class PreparedRun:
    """A run past start-up: its settings (``resume`` resolved), placement, model, processor,
    train and eval samples, the added tokens (None: none) and the fields every step's metrics
    record carries (the whole-table bytes the added tokens' rows avoid sending)."""

    config: TrainConfig
    placement: ProcessPlacement
    model: Any
    processor: Any
    train_samples: Sequence[VQASample]
    eval_samples: Sequence[VQASample]
    visual: VisualTokens | None
    step_fields: dict[str, int]


def train(config: TrainConfig) -> TrainResult:
    """Run fine-tuning per ``config`` in this process: :func:`prepare`, then :func:`run`.

    Rank 0 prints ``eval_accuracy: <fraction>`` as its last line and writes a model card
    (``README.md``) into the final adapter / model folder. With ``stop_after_steps`` below
    ``max_steps`` the run stops there like a crash would (no final adapter, no eval).
    The process group is destroyed on return.
    """
    try:
        return run(prepare(config))
    finally:
        close_process_group()


def close_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def prepare(config: TrainConfig) -> PreparedRun:
    """Start a run: join the process group, check the settings against the output folder,
    load and set up the model and read the data; then save the settings.

    Without ``resume`` the output folder must not hold a run already (``ResumeError``; with
    ``overwrite_output_dir`` the saved run is deleted instead). With ``resume`` the settings are
    checked against the saved ones (:func:`~ascend_vlm.finetune.resume.check_resume`): a refused
    change raises :class:`~ascend_vlm.finetune.resume.ResumeError` naming the setting.
    ``resume="latest"`` with nothing saved yet starts from scratch with a warning, so re-running
    the same command always continues. Any error here (a bad setting, data file, model folder
    or LoRA target) leaves the folder as it was.
    """
    placement = init_process_placement(config.collective_timeout)
    config = without_missing_latest(resumed_after_restart(config, placement.is_main))
    check_run_folder(config, placement)
    # Same seed on every rank while building: identical LoRA init everywhere.
    seed_everything(config.seed)
    if config.model_path is None:
        raise ValueError(
            "model_path: expected a local from_pretrained folder, got None "
            "(python -m ascend_vlm finetune defaults it to the reference checkpoint)"
        )
    model, processor = load_base_model(
        config.model_path, placement.device, DTYPES[config.dtype], config.fsdp
    )
    if config.quantize is not None:
        from ascend_vlm.quantization import QuantizationConfig, quantize

        quantize(model, QuantizationConfig(bits=config.quantize), progress=False)
    train_samples, eval_samples = build_samples(config)
    visual, step_fields = None, {}
    if config.new_tokens:
        visual = add_new_tokens(model, processor, config.new_tokens, train_samples)
        step_fields["comm_bytes_whole_tables"] = whole_table_bytes(model, placement.world_size)
    model, lora_targets = with_trainable_weights(model, config, visual)
    record_run_config(config, placement)
    if placement.is_main:
        logger.info(
            "world=%d device=%s patch=%s lora_targets=%d modules trainable=%d params",
            placement.world_size,
            placement.device,
            config.patch,
            lora_targets,
            sum(p.numel() for p in model.parameters() if p.requires_grad),
        )
    if config.fsdp:
        held, whole = held_parameter_elements(model)
        logger.info("fsdp: rank %d holds %d of %d parameter elements", placement.rank, held, whole)
    return PreparedRun(
        config, placement, model, processor, train_samples, eval_samples, visual, step_fields
    )


def run(prepared: PreparedRun) -> TrainResult:
    """Train ``prepared`` with Trainer to ``max_steps`` (or an early stop), then finish: the
    final adapter or model, the per-type report, the eval accuracy and the model card.

    A collective that times out or loses its peer raises
    :class:`~ascend_vlm.finetune.placement.CollectiveFailure` naming the step and the rank that
    stopped responding.
    """
    config, placement = prepared.config, prepared.placement
    model, processor = prepared.model, prepared.processor
    output_dir = Path(config.output_dir)
    metrics = MetricsLog(output_dir / METRICS_FILE, placement.is_main)
    resume_from = None
    if config.resume is not None:
        resume_from = checkpoint.resolve_checkpoint(config.output_dir, config.resume)
    start = 0 if resume_from is None else checkpoint.saved_step(resume_from)
    metrics.truncate_after(start)
    if resume_from is not None and placement.is_main:
        logger.info("resume: continuing after step %d from %s", start, resume_from)

    # The base's held-out accuracy per type, measured once per run (LoRA starts as a no-op).
    report = config.report_question_types if config.eval_data is None else ()
    if report and resume_from is None:
        before = accuracy_per_type(model, processor, config, placement, report)
        metrics.write({"step": 0, "accuracy_before": before})

    interruption = RunInterruption(config.stop_after_steps)
    callbacks = [
        # FSDP2 reduces the gradients of its shards itself: the sparse hook is DDP's.
        AscendVLMCallback(
            patch=config.patch, sparse_allreduce=config.comm_hook == "sparse" and not config.fsdp
        ),
        checkpoint.TensorRngCheckpoints(output_dir, placement.rank, resume_from),
        MetricsLogCallback(metrics, prepared.step_fields),
        interruption,
    ]
    samples = (prepared.train_samples, prepared.eval_samples)
    trainer = build_trainer(config, placement, model, processor, samples, callbacks)
    try:
        trainer.train(resume_from_checkpoint=None if resume_from is None else str(resume_from))
    except RuntimeError as error:
        if placement.world_size > 1 and is_communication_failure(error):
            step = trainer.state.global_step + 1
            raise collective_failure(error, step, config.collective_timeout) from error
        raise
    step = trainer.state.global_step
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r and r["step"] > start]
    result = TrainResult(
        model,
        processor,
        math.nan,
        losses[-1] if losses else math.nan,
        len(prepared.train_samples),
        len(prepared.eval_samples),
        interruption.signal_number,
    )
    if step < config.max_steps:  # stopped early: no final adapter, no eval
        return result
    _finish(prepared, result, metrics, step, report)
    return result


def _finish(
    prepared: PreparedRun,
    result: TrainResult,
    metrics: MetricsLog,
    step: int,
    report: Sequence[str],
) -> None:
    """After the last step: save the adapter or model, report the accuracy per type, evaluate
    into ``result``, save the merged copy when asked, and write the model card."""
    config, placement = prepared.config, prepared.placement
    model, processor, output_dir = prepared.model, prepared.processor, Path(config.output_dir)
    final = save_final(model, processor, output_dir, config, placement, prepared.visual)
    if report:
        after = accuracy_per_type(model, processor, config, placement, report)
        metrics.write({"step": step, "accuracy_after": after})
        if placement.is_main:
            print(accuracy_table(metrics.read_first("accuracy_before"), after), flush=True)
    result.eval_accuracy = evaluate(
        model,
        processor,
        prepared.eval_samples,
        placement,
        config.eval_batch_size,
        config.max_new_tokens,
        sharded=config.fsdp,
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
        atomic_write_text(final / "README.md", card)
        print(f"eval_accuracy: {result.eval_accuracy:.4f}", flush=True)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
