"""The LoRA fine-tuning loop: one process per device, launched by torchrun or run directly.

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
import dataclasses
import importlib
import importlib.util
import json
import logging
import math
import os
import random
import shutil
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ascend_vlm.finetune import checkpoint
from ascend_vlm.finetune.data import (
    IGNORE_INDEX,
    EncodedDataset,
    JsonlVQA,
    VQASample,
    collate,
    normalise_answer,
    pad_token_id_of,
)
from ascend_vlm.finetune.shapes_vqa import ShapesVQA

logger = logging.getLogger(__name__)

LANGUAGE_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Module-path components that mark the vision tower / the vision-to-text projector in the
# families transformers ships (Qwen2/2.5-VL, LLaVA(-Next), Idefics3/SmolVLM, PaliGemma).
VISION_MARKERS = ("visual", "vision_tower", "vision_model", "vision_encoder")
PROJECTOR_MARKERS = ("merger", "multi_modal_projector", "connector", "mm_projector")
COMM_HOOKS = ("sparse", "none")
METRICS_FILE = "metrics.jsonl"
FINAL_ADAPTER = "adapter"


@dataclass
class TrainConfig:
    """Everything a run depends on; the CLI maps one flag to each field."""

    output_dir: str = "finetune_output"
    model_path: str | None = None
    train_data: str | None = None
    eval_data: str | None = None
    train_size: int = 4000
    eval_size: int = 200
    data_seed: int = 0
    on_bad_record: str = "skip"
    max_steps: int = 300
    batch_size: int = 8
    grad_accum: int = 1
    learning_rate: float = 2e-3
    weight_decay: float = 0.0
    warmup_steps: int = 20
    max_grad_norm: float = 1.0
    seed: int = 0
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    lora_targets: Sequence[str] = field(default_factory=lambda: LANGUAGE_PROJECTIONS)
    lora_vision: bool = False
    lora_projector: bool = False
    save_every: int = 100
    resume: str | None = None
    stop_after_steps: int | None = None
    patch: bool = True
    comm_hook: str = "sparse"
    eval_batch_size: int = 16
    max_new_tokens: int = 6
    progress: bool = True

    def __post_init__(self) -> None:
        positive = ("train_size", "eval_size", "max_steps", "batch_size", "grad_accum")
        for name in (*positive, "save_every", "eval_batch_size", "max_new_tokens", "lora_r"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if self.comm_hook not in COMM_HOOKS:
            raise ValueError(f"comm_hook: expected one of {COMM_HOOKS}, got {self.comm_hook!r}")
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate: expected > 0, got {self.learning_rate}")
        if self.warmup_steps < 0 or self.warmup_steps > self.max_steps:
            raise ValueError(
                f"warmup_steps: expected in [0, max_steps={self.max_steps}], got {self.warmup_steps}"
            )


@dataclass(frozen=True)
class Runtime:
    """Where this process runs: its rank among ``world_size``, device and autocast dtype."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    autocast_dtype: torch.dtype | None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()

    def all_reduce_sum(self, values: Sequence[float]) -> list[float]:
        """Element-wise sum of ``values`` over ranks (float64 on the CPU for gloo)."""
        tensor = torch.tensor(list(values), dtype=torch.float64)
        if dist.is_initialized():
            tensor = tensor.to(self.device)
            dist.all_reduce(tensor)
        return tensor.cpu().tolist()

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)


def _npu_available() -> bool:
    """True when torch_npu imports and sees at least one device."""
    if importlib.util.find_spec("torch_npu") is None:
        return False
    importlib.import_module("torch_npu")
    return hasattr(torch, "npu") and torch.npu.is_available() and torch.npu.device_count() > 0


def init_runtime() -> Runtime:
    """Join torchrun's process group (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` from its env).

    NPU: backend ``hccl`` on ``npu:<local_rank>`` with bf16 autocast (torch_npu registers the
    "hccl" backend on import, Ascend/pytorch ``torch_npu/_init/registry/distributed.py``).
    Otherwise ``gloo`` on the CPU in fp32. A single process needs no process group.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if _npu_available():
        torch.npu.set_device(local_rank)
        device, backend, dtype = torch.device("npu", local_rank), "hccl", torch.bfloat16
    else:
        device, backend, dtype = torch.device("cpu"), "gloo", None
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend=backend)
    return Runtime(rank, local_rank, world_size, device, dtype)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def lora_target_modules(
    model: torch.nn.Module,
    language_targets: Sequence[str] = LANGUAGE_PROJECTIONS,
    vision: bool = False,
    projector: bool = False,
) -> list[str]:
    """Full names of the ``nn.Linear`` modules LoRA should wrap.

    Language-model linears whose last name part is in ``language_targets``; with ``vision``
    every linear of the vision tower; with ``projector`` every linear of the projector. Parts
    are recognised by ``VISION_MARKERS`` / ``PROJECTOR_MARKERS`` in the module path (a
    projector nested in the tower, like Qwen2-VL's ``visual.merger``, counts as projector).
    """
    names = []
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        parts = name.split(".")
        if any(marker in parts for marker in PROJECTOR_MARKERS):
            selected = projector
        elif any(marker in parts for marker in VISION_MARKERS):
            selected = vision
        else:
            selected = parts[-1] in language_targets
        if selected:
            names.append(name)
    if not names:
        raise ValueError(
            f"lora_targets: expected names of linear layers in the model, got "
            f"{list(language_targets)} (vision={vision}, projector={projector}) matching none"
        )
    return names


def load_base_model(model_path: str | None, device: torch.device) -> tuple[Any, Any]:
    """``(model, processor)`` from a local ``from_pretrained`` path, or the default tiny model."""
    from ascend_vlm.default_model import load_default_model, load_processor

    if model_path is None:
        model, processor = load_default_model()
    else:
        from transformers import AutoModelForImageTextToText

        if not (Path(model_path) / "config.json").is_file():
            raise FileNotFoundError(
                f"model_path: expected a local checkpoint folder with config.json, "
                f"got {model_path!r}"
            )
        model = AutoModelForImageTextToText.from_pretrained(model_path)
        processor = load_processor(model_path)
    return model.to(device), processor


def apply_ascend_patch(model: torch.nn.Module, enabled: bool) -> str:
    """Run ``ascend_vlm.patch`` on ``model`` when enabled and available; say what happened."""
    if not enabled:
        return "disabled (--no-patch)"
    if importlib.util.find_spec("ascend_vlm.patching") is None:
        return "unavailable (ascend_vlm.patching not installed)"
    import ascend_vlm

    return f"applied: {ascend_vlm.patch(model)}"


def build_samples(config: TrainConfig) -> tuple[Sequence[VQASample], Sequence[VQASample]]:
    """Train and eval samples: JSONL files when given, else ShapesVQA splits."""
    if config.train_data is not None:
        train = JsonlVQA(config.train_data, config.on_bad_record)
    else:
        train = ShapesVQA("train", config.train_size, config.data_seed)
    if config.eval_data is not None:
        evaluation = JsonlVQA(config.eval_data, config.on_bad_record)
    else:
        evaluation = ShapesVQA("eval", config.eval_size, config.data_seed)
    return train, evaluation


def micro_batches(
    dataset_size: int,
    runtime: Runtime,
    batch_size: int,
    seed: int,
    start_epoch: int = 0,
    start_index: int = 0,
) -> Iterator[tuple[int, int, list[int]]]:
    """Endless ``(epoch, next_index, sample_indices)`` micro-batches of this rank.

    Epoch ``e`` follows ``DistributedSampler(shuffle=True, seed=seed, drop_last=True)`` after
    ``set_epoch(e)``; an incomplete last micro-batch is dropped. ``(epoch, next_index)`` is the
    position right after the batch, so a resumed run continues from the saved pair without
    touching earlier data.
    """
    from torch.utils.data import DistributedSampler

    sampler = DistributedSampler(
        range(dataset_size),
        num_replicas=runtime.world_size,
        rank=runtime.rank,
        shuffle=True,
        seed=seed,
        drop_last=True,
    )
    per_epoch = len(sampler) // batch_size
    if per_epoch == 0:
        raise ValueError(
            f"batch_size: expected at most {len(sampler)} (samples per rank), got {batch_size}"
        )
    epoch, index = start_epoch, start_index
    while True:
        if index >= per_epoch:
            epoch, index = epoch + 1, 0
        sampler.set_epoch(epoch)
        order = list(sampler)
        while index < per_epoch:
            batch = order[index * batch_size : (index + 1) * batch_size]
            index += 1
            yield epoch, index, batch


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


def model_inputs(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {key: value.to(device) for key, value in batch.items() if key != "labels"}


def _comm_hook(config: TrainConfig, ddp_model: Any, runtime: Runtime) -> Any:
    """Register the sparse-mask AllReduce hook when asked for and available; return its state."""
    if config.comm_hook == "none" or runtime.world_size == 1:
        return None
    try:
        from ascend_vlm.distributed import SparseAllReduceState, sparse_allreduce_hook
    except ImportError:
        logger.warning("comm_hook=sparse: ascend_vlm.distributed has no hook yet; plain DDP")
        return None
    state = SparseAllReduceState()
    ddp_model.register_comm_hook(state, sparse_allreduce_hook)
    return state


def _comm_bytes_saved(state: Any) -> int:
    return int(getattr(state, "bytes_saved", 0)) if state is not None else 0


def evaluate(
    model: Any,
    processor: Any,
    samples: Sequence[VQASample],
    runtime: Runtime,
    batch_size: int,
    max_new_tokens: int,
) -> float:
    """Exact-match accuracy of greedy answers over ``samples``, sharded across ranks.

    Rank r answers samples r, r + world, ...; correct and total counts are summed over ranks.
    """
    encoded = EncodedDataset(samples, processor, with_answer=False)
    pad_id = pad_token_id_of(processor)
    indices = list(range(runtime.rank, len(samples), runtime.world_size))
    correct = 0
    model.eval()
    with torch.no_grad(), runtime.autocast():
        for start in range(0, len(indices), batch_size):
            chunk = indices[start : start + batch_size]
            batch = collate([encoded[i] for i in chunk], pad_id, padding_side="left")
            inputs = model_inputs(batch, runtime.device)
            output = model.generate(
                **inputs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad_id
            )
            answers = processor.batch_decode(
                output[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True
            )
            correct += sum(
                normalise_answer(answer) == normalise_answer(samples[i].answer)
                for answer, i in zip(answers, chunk, strict=True)
            )
    total_correct, total = runtime.all_reduce_sum([correct, len(indices)])
    return total_correct / total


class MetricsLog:
    """Rank 0's JSON-lines metrics file, one object per optimizer step."""

    def __init__(self, path: Path, enabled: bool):
        self.path = path
        self.enabled = enabled

    def truncate_after(self, step: int) -> None:
        """Drop records of steps after ``step`` (written by a run that crashed later)."""
        if not self.enabled or not self.path.is_file():
            return
        kept = [
            line
            for line in self.path.read_text(encoding="utf-8").splitlines()
            if line.strip() and json.loads(line).get("step", 0) <= step
        ]
        checkpoint.atomic_write_text(self.path, "".join(f"{line}\n" for line in kept))

    def write(self, record: dict[str, Any]) -> None:
        if self.enabled:
            with self.path.open("a", encoding="utf-8") as handle:
                handle.write(json.dumps(record) + "\n")


def train(config: TrainConfig) -> float:
    """Run fine-tuning per ``config`` in this process and return the final eval accuracy.

    Rank 0 prints ``eval_accuracy: <fraction>`` as its last line. With ``stop_after_steps``
    below ``max_steps`` the run stops there like a crash would (no final adapter or eval) and
    returns NaN. The process group is destroyed on return.
    """
    try:
        return _train(config)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _train(config: TrainConfig) -> float:
    from peft import LoraConfig, get_peft_model
    from torch.nn.parallel import DistributedDataParallel
    from transformers import get_cosine_schedule_with_warmup

    runtime = init_runtime()
    output_dir = Path(config.output_dir)
    if runtime.is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
        checkpoint.atomic_write_text(
            output_dir / "train_config.json",
            json.dumps(dataclasses.asdict(config), indent=2, default=list),
        )
    # Same seed on every rank while building: identical LoRA init everywhere.
    seed_everything(config.seed)
    model, processor = load_base_model(config.model_path, runtime.device)
    patch_note = apply_ascend_patch(model, config.patch)
    targets = lora_target_modules(
        model, config.lora_targets, config.lora_vision, config.lora_projector
    )
    lora = LoraConfig(
        r=config.lora_r,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        target_modules=targets,
    )
    model = get_peft_model(model, lora)
    train_samples, eval_samples = build_samples(config)
    train_set = EncodedDataset(train_samples, processor)
    pad_id = pad_token_id_of(processor)

    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        trainable, lr=config.learning_rate, weight_decay=config.weight_decay
    )
    scheduler = get_cosine_schedule_with_warmup(optimizer, config.warmup_steps, config.max_steps)
    metrics = MetricsLog(output_dir / METRICS_FILE, runtime.is_main)

    loop_state = {"step": 0, "epoch": 0, "next_index": 0}
    if config.resume is not None:
        path = checkpoint.resolve_checkpoint(output_dir, config.resume)
        loop_state = checkpoint.load_checkpoint(
            path, model=model, optimizer=optimizer, scheduler=scheduler, rank=runtime.rank
        )
        metrics.truncate_after(loop_state["step"])
    else:
        seed_everything(config.seed + runtime.rank)
        metrics.truncate_after(0)

    ddp_model = model
    hook_state = None
    if runtime.world_size > 1:
        ddp_model = DistributedDataParallel(model, device_ids=None)
        hook_state = _comm_hook(config, ddp_model, runtime)

    if runtime.is_main:
        logger.info(
            "world=%d device=%s patch=%s lora_targets=%d modules trainable=%d params",
            runtime.world_size,
            runtime.device,
            patch_note,
            len(targets),
            sum(p.numel() for p in trainable),
        )
    batches = micro_batches(
        len(train_set),
        runtime,
        config.batch_size,
        config.seed,
        loop_state["epoch"],
        loop_state["next_index"],
    )
    step = loop_state["step"]
    stop_at = config.max_steps
    if config.stop_after_steps is not None:
        stop_at = min(stop_at, config.stop_after_steps)
    progress = _progress_bar(config, runtime, initial=step)
    model.train()
    while step < stop_at:
        started = time.perf_counter()
        micro = []
        for _ in range(config.grad_accum):
            epoch, next_index, indices = next(batches)
            micro.append(collate([train_set[i] for i in indices], pad_id))
        local_tokens = sum(int((b["labels"][:, 1:] != IGNORE_INDEX).sum()) for b in micro)
        (global_answer_tokens,) = runtime.all_reduce_sum([local_tokens])
        local_loss = 0.0
        for position, batch in enumerate(micro):
            last = position == len(micro) - 1
            sync = contextlib.nullcontext() if last or ddp_model is model else ddp_model.no_sync()
            with sync, runtime.autocast():
                logits = ddp_model(**model_inputs(batch, runtime.device)).logits
                loss_sum = answer_token_loss_sum(logits, batch["labels"].to(runtime.device))
                (loss_sum * runtime.world_size / global_answer_tokens).backward()
            local_loss += float(loss_sum.detach())
        grad_norm = torch.nn.utils.clip_grad_norm_(trainable, config.max_grad_norm)
        learning_rate = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        local_seen = sum(int(b["attention_mask"].sum()) for b in micro)
        loss_total, tokens_seen = runtime.all_reduce_sum([local_loss, local_seen])
        elapsed = time.perf_counter() - started
        record = {
            "step": step,
            "loss": loss_total / global_answer_tokens,
            "lr": learning_rate,
            "grad_norm": float(grad_norm),
            "tokens_per_s": tokens_seen / elapsed,
            "comm_bytes_saved": _comm_bytes_saved(hook_state),
            "epoch": epoch,
        }
        metrics.write(record)
        if progress is not None:
            progress.update(1)
            progress.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{learning_rate:.2e}")
        if step % config.save_every == 0 or step == config.max_steps:
            checkpoint.save_checkpoint(
                output_dir,
                step,
                model=model,
                optimizer=optimizer,
                scheduler=scheduler,
                loop_state={"epoch": epoch, "next_index": next_index},
                rank=runtime.rank,
                barrier=runtime.barrier,
            )
    if progress is not None:
        progress.close()
    if step < config.max_steps:  # stopped early on purpose: no final adapter, no eval
        return math.nan
    _save_final_adapter(model, output_dir, runtime)
    accuracy = evaluate(
        model, processor, eval_samples, runtime, config.eval_batch_size, config.max_new_tokens
    )
    metrics.write({"step": step, "eval_accuracy": accuracy})
    if runtime.is_main:
        print(f"eval_accuracy: {accuracy:.4f}", flush=True)
    return accuracy


def _progress_bar(config: TrainConfig, runtime: Runtime, initial: int) -> Any:
    if not (config.progress and runtime.is_main):
        return None
    from tqdm import tqdm

    return tqdm(total=config.max_steps, initial=initial, desc="finetune", dynamic_ncols=True)


def _save_final_adapter(model: Any, output_dir: Path, runtime: Runtime) -> None:
    """Rank 0 writes the adapter to ``<output_dir>/adapter`` via a staging dir + rename."""
    if runtime.is_main:
        staging = output_dir / f".{FINAL_ADAPTER}.staging"
        final = output_dir / FINAL_ADAPTER
        shutil.rmtree(staging, ignore_errors=True)
        model.save_pretrained(staging, safe_serialization=True)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(staging, final)
    runtime.barrier()
