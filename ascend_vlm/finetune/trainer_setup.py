"""The ``transformers.Trainer`` of a fine-tuning run: its arguments from the run's settings, the
AdamW optimizer with the run's learning-rate schedule, the data, and the callbacks.

Trainer runs the steps: ``batch_size`` samples per rank per micro-batch, ``grad_accum``
micro-batches per optimizer step, DDP across ranks. The loss is the model's token-level cross
entropy over the answer tokens of the whole global step (Trainer passes the step's supervised
token count, summed over micro-batches and ranks, as ``num_items_in_batch``), so the result does
not depend on how the step is split across ranks or micro-batches.

Per step the ranks meet only where the run needs it: the step's token count, the gradient
all-reduce, the logged loss (and the signal check of :mod:`.interruption`, which does not wait).
DDP does not broadcast buffers a model never changes, and the floating-point-operation count is
summed over ranks only when a checkpoint is saved or training ends (:class:`FineTuneTrainer`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from transformers import PrinterCallback, Trainer, TrainerCallback, TrainingArguments

from ascend_vlm.data.vqa import EncodedDataset, VQASample, collate, pad_token_id_of
from ascend_vlm.finetune.checkpoint import checkpoint_root
from ascend_vlm.finetune.schedule import scheduled_lr
from ascend_vlm.vision_input.fast_processor import with_fast_pixels

if TYPE_CHECKING:
    from ascend_vlm.finetune.config import TrainConfig
    from ascend_vlm.finetune.placement import ProcessPlacement


def training_arguments(
    config: TrainConfig, placement: ProcessPlacement, broadcast_buffers: bool = True
) -> TrainingArguments:
    """Trainer's arguments for ``config``: checkpoints every ``save_every`` steps (and at the
    last) under ``<output_dir>/checkpoints``, a log record every step; DDP broadcasts rank 0's
    buffers before every forward only with ``broadcast_buffers``."""
    on_cpu = placement.device.type == "cpu"
    return TrainingArguments(
        output_dir=str(checkpoint_root(config.output_dir)),
        per_device_train_batch_size=config.batch_size,
        per_device_eval_batch_size=config.batch_size,
        gradient_accumulation_steps=config.grad_accum,
        max_steps=config.max_steps,
        learning_rate=config.learning_rate,
        weight_decay=config.weight_decay,
        max_grad_norm=config.max_grad_norm,
        seed=config.seed,
        data_seed=config.seed,
        logging_steps=1,
        save_strategy="steps",
        save_steps=config.save_every,
        # Trainer checkpoints no optimizer state of a model sharded while loading (--fsdp).
        save_only_model=config.fsdp,
        eval_strategy="steps" if config.eval_steps else "no",
        eval_steps=config.eval_steps,
        report_to=list(config.report_to) or "none",
        activation_checkpointing=config.gradient_checkpointing,
        activation_checkpointing_kwargs={"use_reentrant": False},
        bf16=config.bf16,
        use_cpu=on_cpu,
        # One process has no process group; accelerate wants no backend named then.
        ddp_backend=None if placement.world_size == 1 else "gloo" if on_cpu else "hccl",
        ddp_find_unused_parameters=False,
        ddp_broadcast_buffers=broadcast_buffers,
        ddp_timeout=int(config.collective_timeout),
        dataloader_drop_last=True,
        remove_unused_columns=False,
        label_names=["labels"],
        disable_tqdm=not config.progress,
        restore_callback_states_from_checkpoint=False,
    )


def changes_buffers(model: torch.nn.Module) -> bool:
    """True when ``model`` has a persistent buffer (one its ``state_dict`` saves, such as a
    norm's running statistics), which training may change; the VLMs' rotary frequencies are
    non-persistent constants made from the config, the same on every rank."""
    saved = set(model.state_dict())
    return any(name in saved for name, _ in model.named_buffers())


class FineTuneTrainer(Trainer):
    """Trainer, with the count of floating-point operations (``state.total_flos``) made cheaper
    and its collective rarer, the counts unchanged:

    - Trainer's count of a batch is ``6 x input tokens x non-embedding parameters``, and it
      walks every module and parameter of the model for the parameter count at each step;
      training changes no parameter's size, so the count per input token is taken from
      Trainer's first count and multiplied by each later batch's token count.
    - It is summed over ranks only when a checkpoint is saved or training ends, instead of by an
      all-gather at every log: with a log every step that collective would make the ranks wait
      for each other once more per step. The flags read are the same on every rank, so every
      rank takes part."""

    _unsummed_flos = 0.0
    # (the model counted, its count per input token): Trainer may swap in another model.
    _flos_per_input_token: tuple[torch.nn.Module, int] | None = None

    def floating_point_ops(self, inputs: dict[str, Any]) -> int:
        """Trainer's count for ``inputs``, which is linear in the input tokens for a given
        model (``6 x tokens x non-embedding parameters``): the factor is taken from Trainer's
        first count with tokens and reused while the model is the same."""
        main_input = inputs.get(getattr(self.model, "main_input_name", "input_ids"))
        tokens = main_input.numel() if isinstance(main_input, torch.Tensor) else 0
        memo = self._flos_per_input_token
        if memo is not None and memo[0] is self.model and tokens:
            return memo[1] * tokens
        flos = super().floating_point_ops(inputs)
        if tokens and flos % tokens == 0:
            self._flos_per_input_token = (self.model, flos // tokens)
        return flos

    def store_flos(self) -> None:
        self._unsummed_flos += self.current_flos
        self.current_flos = 0
        if self.control.should_save or self.control.should_training_stop:
            self.current_flos, self._unsummed_flos = self._unsummed_flos, 0.0
            super().store_flos()


class ScheduleFromStep(TrainerCallback):
    """Sets the learning rate of a resumed run's first step from the schedule of this run's
    ``max_steps``: the optimizer state Trainer restores carries the rate the saved run's
    schedule gave, which differs when the step count changed."""

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        schedule = kwargs["lr_scheduler"]
        if state.global_step > 0:
            schedule.last_epoch -= 1
            schedule.step()  # recomputes every group's rate at the same step


def build_trainer(
    config: TrainConfig,
    placement: ProcessPlacement,
    model: Any,
    processor: Any,
    samples: tuple[Sequence[VQASample], Sequence[VQASample]],
    callbacks: Sequence[TrainerCallback],
) -> FineTuneTrainer:
    """A Trainer for ``model`` on the (train, eval) ``samples``: AdamW over the trainable
    parameters with :func:`~ascend_vlm.finetune.schedule.scheduled_lr`, the eval set used only
    with ``eval_steps``, and ``callbacks`` in their order; without ``progress`` Trainer prints
    nothing per step."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        trainable, lr=config.learning_rate, weight_decay=config.weight_decay
    )
    peak, warmup, steps = config.learning_rate, config.warmup_steps, config.max_steps
    # LambdaLR's index counts the steps taken, so step index + 1 is the one about to run.
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda index: scheduled_lr(index + 1, peak, warmup, steps) / peak
    )
    train_samples, eval_samples = samples
    encoding = with_fast_pixels(processor)  # the same tensors, made faster
    trainer = FineTuneTrainer(
        model=model,
        args=training_arguments(config, placement, changes_buffers(model)),
        train_dataset=EncodedDataset(train_samples, encoding),
        eval_dataset=EncodedDataset(eval_samples, encoding) if config.eval_steps else None,
        data_collator=functools.partial(collate, pad_token_id=pad_token_id_of(processor)),
        optimizers=(optimizer, schedule),
        callbacks=[ScheduleFromStep(), *callbacks],
    )
    if not config.progress:  # no bar, and no log line per step in its place
        trainer.remove_callback(PrinterCallback)
    return trainer
