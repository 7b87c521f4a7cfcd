"""The optimizer steps of a run: micro-batches in, gradients, one AdamW step, a metrics record
and periodic checkpoints out.

Per optimizer step every rank takes ``grad_accum`` micro-batches of ``batch_size`` samples from
a ``DistributedSampler`` order, so a step sees ``batch_size * grad_accum * world_size`` samples.
The loss is the token-level cross entropy over the answer tokens of the whole global step:

    loss = sum_{answer tokens t in step} -log p(t) / N,   N = answer tokens in the step (all ranks)

Each rank back-propagates ``world_size * local_sum / N``; DDP's mean over ranks then yields the
gradient of ``loss`` exactly, so the result does not depend on how the step is split across
ranks or micro-batches.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ascend_vlm.data.vqa import IGNORE_INDEX, EncodedDataset
from ascend_vlm.finetune import checkpoint
from ascend_vlm.finetune.communication import CommCounter
from ascend_vlm.finetune.config import TrainConfig
from ascend_vlm.finetune.metrics_log import MetricsLog
from ascend_vlm.finetune.micro_batches import (
    MicroBatch,
    micro_batches,
    model_inputs,
    prefetched_micro_batches,
)
from ascend_vlm.finetune.placement import (
    CollectiveFailure,
    ProcessPlacement,
    is_communication_failure,
)
from ascend_vlm.finetune.schedule import scheduled_lr


@dataclass
class Learner:
    """What every optimizer step works on: the model, the module the forward runs through (the
    model itself in one process, its ``DistributedDataParallel`` wrapper otherwise), the
    trainable parameters and their optimizer, the communication counter, and the bytes whole
    embedding tables would send (None: the run adds no tokens)."""

    model: Any
    ddp_model: Any
    trainable: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    comm: CommCounter
    whole_table_bytes: int | None


def answer_token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum over supervised positions of -log p(label): position i predicts ``labels[i + 1]``."""
    shifted_logits = logits[:, :-1].float()
    shifted_labels = labels[:, 1:]
    return F.cross_entropy(
        shifted_logits.reshape(-1, shifted_logits.shape[-1]),
        shifted_labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def run_steps(
    config: TrainConfig,
    placement: ProcessPlacement,
    learner: Learner,
    train_set: EncodedDataset,
    pad_id: int,
    loop_state: dict[str, Any],
    metrics: MetricsLog,
) -> tuple[int, float]:
    """Optimizer steps after ``loop_state["step"]`` up to ``max_steps`` (or ``stop_after_steps``
    when lower), from the data position of ``loop_state``; returns the step reached and the
    loss of the last step run (NaN when none ran).

    Each step writes its record to ``metrics`` and every ``save_every`` steps (and the last) a
    checkpoint. A collective that times out or loses its peer raises
    :class:`~ascend_vlm.finetune.placement.CollectiveFailure` naming the step and rank.
    """
    batches = prefetched_micro_batches(
        micro_batches(
            len(train_set),
            placement,
            config.batch_size,
            config.seed,
            loop_state["epoch"],
            loop_state["next_index"],
        ),
        train_set,
        pad_id,
        placement.device,
        config,
    )
    step = loop_state["step"]
    stop_at = config.max_steps
    if config.stop_after_steps is not None:
        stop_at = min(stop_at, config.stop_after_steps)
    progress = _progress_bar(config, placement, initial=step)
    last_loss = math.nan
    learner.model.train()
    running = step + 1  # the step a collective failure is reported at
    try:
        while step < stop_at:
            running = step + 1
            record, next_index = _optimizer_step(config, placement, learner, batches, running)
            step = running
            last_loss = record["loss"]
            metrics.write(record)
            if progress is not None:
                progress.update(1)
                progress.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}")
            if step % config.save_every == 0 or step == config.max_steps:
                checkpoint.save_checkpoint(
                    Path(config.output_dir),
                    step,
                    model=learner.model,
                    optimizer=learner.optimizer,
                    loop_state={"epoch": record["epoch"], "next_index": next_index},
                    rank=placement.rank,
                    barrier=placement.barrier,
                )
    except RuntimeError as error:
        if placement.world_size > 1 and is_communication_failure(error):
            raise CollectiveFailure(
                f"step {running}, rank {placement.rank}: a collective did not complete within "
                f"--collective-timeout {config.collective_timeout:g} s or lost its peer: another "
                f"rank is hung, stopped or gone ({str(error).strip().splitlines()[0]})"
            ) from error
        raise
    finally:
        batches.close()
    if progress is not None:
        progress.close()
    return step, last_loss


def _optimizer_step(
    config: TrainConfig,
    placement: ProcessPlacement,
    learner: Learner,
    batches: Iterator[MicroBatch],
    step: int,
) -> tuple[dict[str, Any], int]:
    """Run optimizer step ``step`` (1-based) on the next ``grad_accum`` micro-batches; returns
    its metrics record and the data position (within its epoch) right after it."""
    started = time.perf_counter()
    micro = [next(batches) for _ in range(config.grad_accum)]
    local_tokens = sum(part.answer_tokens for part in micro)
    (global_answer_tokens,) = placement.all_reduce_sum([local_tokens])
    local_loss = 0.0
    for position, part in enumerate(micro):
        batch = part.batch
        last = position == len(micro) - 1
        model, ddp_model = learner.model, learner.ddp_model
        sync = contextlib.nullcontext() if last or ddp_model is model else ddp_model.no_sync()
        with sync, placement.autocast():
            logits = ddp_model(**model_inputs(batch, placement.device)).logits
            loss_sum = answer_token_loss_sum(logits, batch["labels"].to(placement.device))
            (loss_sum * placement.world_size / global_answer_tokens).backward()
        local_loss += float(loss_sum.detach())
    grad_norm = torch.nn.utils.clip_grad_norm_(learner.trainable, config.max_grad_norm)
    learning_rate = scheduled_lr(step, config.learning_rate, config.warmup_steps, config.max_steps)
    for group in learner.optimizer.param_groups:
        group["lr"] = learning_rate
    learner.optimizer.step()
    learner.optimizer.zero_grad(set_to_none=True)
    local_seen = sum(part.seen_tokens for part in micro)
    loss_total, tokens_seen = placement.all_reduce_sum([local_loss, local_seen])
    elapsed = time.perf_counter() - started
    whole_tables = learner.whole_table_bytes
    record = {
        "step": step,
        "loss": loss_total / global_answer_tokens,
        "lr": learning_rate,
        "grad_norm": float(grad_norm),
        "tokens_per_s": tokens_seen / elapsed,
        "step_time_s": elapsed,
        **learner.comm.step(),
        **({"comm_bytes_whole_tables": whole_tables} if whole_tables is not None else {}),
        "epoch": micro[-1].epoch,
    }
    return record, micro[-1].next_index


def _progress_bar(config: TrainConfig, placement: ProcessPlacement, initial: int) -> Any:
    if not (config.progress and placement.is_main):
        return None
    from tqdm import tqdm

    return tqdm(total=config.max_steps, initial=initial, desc="finetune", dynamic_ncols=True)
