"""The LoRA fine-tuning loop: one process per device, launched by torchrun or run directly.

Per optimizer step every rank takes ``grad_accum`` micro-batches of ``batch_size`` samples from
a ``DistributedSampler`` order, so a step sees ``batch_size * grad_accum * world_size`` samples.
The loss is the token-level cross entropy over the answer tokens of the whole global step:

    loss = sum_{answer tokens t in step} -log p(t) / N,   N = answer tokens in the step (all ranks)

Each rank back-propagates ``world_size * local_sum / N``; DDP's mean over ranks then yields the
gradient of ``loss`` exactly, so the result does not depend on how the step is split across
ranks or micro-batches.

The learning rate of step s (1-based) of T = ``max_steps`` steps, with W = min(``warmup_steps``,
T) and peak ``learning_rate``, is (:func:`scheduled_lr`)

    lr(s) = peak * s / W                                        for s <= W
    lr(s) = peak * (1 + cos(pi * (s - W) / (T - W + 1))) / 2    for s > W

so no step runs at lr 0: the first warm-up step already moves the weights (peak / W), the peak
is reached at step W, and the cosine decay would reach 0 at step T + 1, one step after the last.
(transformers' ``get_cosine_schedule_with_warmup`` counts steps from 0, so its first step runs at
lr 0 whenever W > 0, a step that updates AdamW's moments but not the weights.) The rate is a
function of the step alone: a resumed run picks it up at its step, and a run resumed with a
larger ``max_steps`` follows the curve for the new count.

``model_path`` is the base checkpoint; ``scripts/finetune_lora.py`` makes it the reference
checkpoint by default (:func:`ascend_vlm.finetune.reference_model.base_model_path`), which
never saw ShapesVQA's ``vertical`` questions; the default settings teach that skill with LoRA
and report the held-out accuracy of every question type before and after
(``report_question_types``).

A run writes its settings to ``<output_dir>/train_config.json``; resuming checks the new
settings against them (:mod:`ascend_vlm.finetune.resume`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import random
import shutil
import time
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ascend_vlm.adapters.adapter_set import DEFAULT_ADAPTER_NAME, check_adapter_name
from ascend_vlm.adapters.visual_vocabulary import (
    VISUAL_TOKENS_FILE,
    VisualTokens,
    add_visual_tokens,
    load_visual_tokens,
    save_visual_tokens,
    trainable_token_indices,
)
from ascend_vlm.data.shapes_vqa import (
    KINDS,
    QUESTION_TYPES,
    ShapesVQA,
    check_question_types,
    new_kind_names,
)
from ascend_vlm.data.vqa import (
    IGNORE_INDEX,
    EncodedDataset,
    JsonlVQA,
    VQASample,
    collate,
    normalise_answer,
    pad_token_id_of,
    processor_for_another_thread,
)
from ascend_vlm.finetune import checkpoint
from ascend_vlm.finetune.model_card import model_card
from ascend_vlm.finetune.resume import CONFIG_FILE, ResumeError, check_resume
from ascend_vlm.models.parts import model_part
from ascend_vlm.quantization.config import DEFAULT_GROUP_SIZE
from ascend_vlm.vision_input.fast_processor import with_fast_pixels

logger = logging.getLogger(__name__)

LANGUAGE_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Module-path components that mark the vision tower / the vision-to-text projector in the
# families transformers ships (Qwen2/2.5-VL, LLaVA(-Next), Idefics3/SmolVLM, PaliGemma).
COMM_HOOKS = ("sparse", "none")
METRICS_FILE = "metrics.jsonl"
# The torchrun job (TORCHELASTIC_RUN_ID) that last started or continued the run in a folder.
RUN_MARKER = ".torchrun_run_id"
FINAL_ADAPTER = "adapter"
FINAL_MODEL = "model"
# Weight dtypes a run can load, train and save the model in.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# A week: longer waits are not a timeout, and timedelta arithmetic overflows far above it.
MAX_COLLECTIVE_TIMEOUT = 7 * 24 * 3600
# Training images whose mean projected visual feature initialises a new token's rows.
EXAMPLES_PER_NEW_TOKEN = 16


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
    prefetch: int = 2
    eval_batch_size: int = 16
    max_new_tokens: int = 6
    progress: bool = True

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
        if not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise ValueError(f"prefetch: expected an int >= 0, got {self.prefetch!r}")
        self.question_types = check_question_types(self.question_types)
        self.eval_question_types = check_question_types(
            self.eval_question_types, "eval_question_types"
        )
        if self.report_question_types:
            self.report_question_types = check_question_types(
                self.report_question_types, "report_question_types"
            )
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
                shapes_dataset(self, "train", 1, self.question_types)
            except ValueError as error:
                raise ValueError(f"new_tokens: {error}") from None
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: expected one of {tuple(DTYPES)}, got {self.dtype!r}")
        if self.save_merged is not None and self.full_finetune:
            raise ValueError(
                "save_merged: expected only with LoRA (a full fine-tune saves the whole model "
                f"in <output_dir>/{FINAL_MODEL} already), got full_finetune=True"
            )
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


@dataclass(frozen=True)
class ProcessPlacement:
    """Where this process runs: its rank (global and on its node) among ``world_size``
    processes, its device and its autocast dtype (None: no autocast)."""

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
        """Element-wise sum of ``values`` over ranks: float64 on the CPU (gloo); float32 on NPU,
        as HCCL's float64 all-reduce support is not confirmed in our reference notes."""
        dtype = torch.float64 if self.device.type == "cpu" else torch.float32
        tensor = torch.tensor(list(values), dtype=dtype)
        if dist.is_initialized():
            tensor = tensor.to(self.device)
            dist.all_reduce(tensor)
        return tensor.cpu().tolist()

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)


def _npu_available() -> bool:
    """True when a real torch_npu sees a device (``kernel_backend.active_backend() == "npu"``)."""
    from ascend_vlm.kernel_backend import active_backend

    return active_backend() == "npu"


def init_process_placement(collective_timeout: float | None = None) -> ProcessPlacement:
    """Join torchrun's process group (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` from its env).

    NPU: backend ``hccl`` on ``npu:<local_rank>`` with bf16 autocast (torch_npu registers the
    "hccl" backend on import, Ascend/pytorch ``torch_npu/_init/registry/distributed.py``).
    Otherwise ``gloo`` on the CPU in fp32. A single process needs no process group.
    ``collective_timeout`` (seconds, None: torch's default) bounds every collective of the
    group; on NPU, HCCL's own ``HCCL_EXEC_TIMEOUT`` bounds the device side too.
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
        timeout = None if collective_timeout is None else timedelta(seconds=collective_timeout)
        dist.init_process_group(backend=backend, timeout=timeout, **_attempt_store(timeout))
    return ProcessPlacement(rank, local_rank, world_size, device, dtype)


def _restarts() -> int:
    """How often torchrun's agent on this node has restarted its workers so far."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _attempt_store(timeout: timedelta | None) -> dict[str, Any]:
    """``init_process_group`` arguments giving a restarted single-node worker group a store of
    its own.

    After ``torchrun --max-restarts`` restarts the workers they meet again in the agent's
    store, which still holds the previous attempt's keys, so the new ranks can read a dead
    peer's address and fail to connect. On one node every rank sees the same restart count, so
    a prefix per restart keeps the attempts apart. Across nodes the counts differ (an agent
    counts only its own workers' failures), so multi-node jobs set
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, which gives every round a fresh store and turns
    this off (``TORCHELASTIC_USE_AGENT_STORE`` is then not "True"). Empty (torch's own
    ``env://`` set-up) before any restart and in those cases."""
    restarts = _restarts()
    single_node = os.environ.get("LOCAL_WORLD_SIZE") == os.environ.get("WORLD_SIZE")
    if restarts == 0 or not single_node or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    agent = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ["WORLD_SIZE"]),
        is_master=False,
        timeout=timeout or timedelta(minutes=30),
    )
    return {
        "store": dist.PrefixStore(f"ascend_vlm/attempt-{restarts}", agent),
        "rank": int(os.environ["RANK"]),
        "world_size": int(os.environ["WORLD_SIZE"]),
    }


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
    are told apart by :func:`ascend_vlm.models.parts.model_part`.
    """
    names = []
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        part = model_part(name)
        if part == "projector":
            selected = projector
        elif part == "vision":
            selected = vision
        else:
            selected = name.split(".")[-1] in language_targets
        if selected:
            names.append(name)
    if not names:
        raise ValueError(
            f"lora_targets: expected names of linear layers in the model, got "
            f"{list(language_targets)} (vision={vision}, projector={projector}) matching none"
        )
    return names


def load_base_model(
    model_path: str, device: torch.device, dtype: torch.dtype = torch.float32
) -> tuple[Any, Any]:
    """``(model, processor)`` from a local ``from_pretrained`` folder, weights in ``dtype``."""
    from transformers import AutoModelForImageTextToText

    from ascend_vlm.default_model import load_processor

    if not (Path(model_path) / "config.json").is_file():
        raise FileNotFoundError(
            f"model_path: expected a local checkpoint folder with config.json, got {model_path!r}"
        )
    model = AutoModelForImageTextToText.from_pretrained(model_path, dtype=dtype)
    return model.to(device), load_processor(model_path)


def apply_ascend_patch(model: torch.nn.Module, enabled: bool) -> str:
    """Run ``ascend_vlm.patch`` on ``model`` when enabled; return a one-line note of it.

    Patching happens before LoRA wraps the linears: the patched forwards call the projection
    submodules, so PEFT's wrappers stay on the path.
    """
    if not enabled:
        return "disabled (--no-patch)"
    from ascend_vlm.patching import patch

    report = patch(model)
    return f"applied ({type(report).__name__} for {report.model_type})"


def build_samples(config: TrainConfig) -> tuple[Sequence[VQASample], Sequence[VQASample]]:
    """Train and eval samples: JSONL files when given, else ShapesVQA splits."""
    if config.train_data is not None:
        train = JsonlVQA(config.train_data, config.on_bad_record)
    else:
        train = shapes_dataset(config, "train", config.train_size, config.question_types)
    if config.eval_data is not None:
        evaluation = JsonlVQA(config.eval_data, config.on_bad_record)
    else:
        evaluation = shapes_dataset(config, "eval", config.eval_size, config.eval_question_types)
    return train, evaluation


def shapes_dataset(
    config: TrainConfig, split: str, size: int, question_types: Sequence[str]
) -> ShapesVQA:
    """``size`` ShapesVQA records of ``split`` asking ``question_types``, drawn as ``config``
    says (``data_seed``, ``image_size``, ``shapes_binding``).

    With ``shapes_new_kinds`` the new kinds are the first K of ``NEW_SHAPE_KINDS``, named by
    the K ``new_tokens`` in order (all four by their own names without tokens). Training
    scenes draw from the base kinds and the new ones together, so the base's kind words stay
    in use while the new ones are learnt; eval scenes show only the new kinds, the ones taught.
    """
    kinds, kind_names = KINDS, None
    if config.shapes_new_kinds:
        kind_names = new_kind_names(config.new_tokens)
        kinds = (*KINDS, *kind_names) if split == "train" else tuple(kind_names)
    return ShapesVQA(
        split,
        size,
        config.data_seed,
        config.image_size,
        config.shapes_binding,
        question_types,
        kinds,
        kind_names,
    )


def micro_batches(
    dataset_size: int,
    placement: ProcessPlacement,
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
        num_replicas=placement.world_size,
        rank=placement.rank,
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


class _MicroBatch(NamedTuple):
    """One micro-batch and what the loop needs of it, counted on the CPU before any upload
    (so the loop reads no count back from the device)."""

    epoch: int
    next_index: int
    batch: dict[str, torch.Tensor]
    answer_tokens: int  # supervised tokens (labels after the first position)
    seen_tokens: int  # attended tokens


def _prefetched_micro_batches(
    indices: Iterator[tuple[int, int, list[int]]],
    train_set: EncodedDataset,
    pad_id: int,
    device: torch.device,
    config: TrainConfig,
) -> Generator[_MicroBatch, None, None]:
    """The micro-batches of ``indices``, collated (and on an NPU uploaded on the runtime's
    stream) ``config.prefetch`` micro-batches ahead in a background thread, or in the loop's
    thread with ``prefetch=0``; ``close()`` stops the thread."""
    from ascend_vlm.vision_input.prefetch import device_prefetcher

    def prepare(item: tuple[int, int, list[int]], staging: Any) -> dict[str, Any]:
        epoch, next_index, chunk = item
        batch = collate([train_set[i] for i in chunk], pad_id, staging=staging)
        return {
            **batch,
            "_epoch": epoch,
            "_next_index": next_index,
            "_answer_tokens": int((batch["labels"][:, 1:] != IGNORE_INDEX).sum()),
            "_seen_tokens": int(batch["attention_mask"].sum()),
        }

    if config.prefetch == 0:
        prepared: Iterator[dict[str, Any]] = (prepare(item, None) for item in indices)
        closer = contextlib.nullcontext()
    else:
        prepared = closer = device_prefetcher(
            indices,
            prepare,
            device,
            depth=config.prefetch,
            describe=lambda item: f"epoch {item[0]}, samples {item[2]}",
        )
    with closer:
        for batch in prepared:
            yield _MicroBatch(
                batch.pop("_epoch"),
                batch.pop("_next_index"),
                batch,
                batch.pop("_answer_tokens"),
                batch.pop("_seen_tokens"),
            )


def model_inputs(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {key: value.to(device) for key, value in batch.items() if key != "labels"}


def _comm_hook(config: TrainConfig, ddp_model: Any, placement: ProcessPlacement) -> Any:
    """Register the sparse-mask AllReduce hook when asked for; return its state (or None)."""
    if config.comm_hook == "none" or placement.world_size == 1:
        return None
    from ascend_vlm.distributed import SparseAllReduceState, sparse_allreduce_hook

    state = SparseAllReduceState()  # exact mode: same averaged gradient as plain DDP
    ddp_model.register_comm_hook(state, sparse_allreduce_hook)
    return state


class CommCounter:
    """Per-step all-reduce payload of this rank, for ``metrics.jsonl``.

    ``comm_bytes_sent``: bytes this rank handed to all-reduce in the step, the sparse hook's
    chunk masks included (so a step whose gradients are all dense sends a little more than
    plain DDP). ``comm_bytes_dense``: bytes plain DDP hands over, every trainable gradient
    once. Both are 0 in a single process, where nothing is communicated.
    """

    def __init__(self, hook_state: Any, trainable: Sequence[torch.Tensor], world_size: int):
        self.hook_state = hook_state
        gradient_bytes = tensor_bytes(trainable)
        self.dense_per_step = gradient_bytes if world_size > 1 else 0
        self.counted = (0, 0)

    def step(self) -> dict[str, int]:
        """The fields of the step that just ran (call once per optimizer step)."""
        if self.hook_state is None:
            return {"comm_bytes_sent": self.dense_per_step, "comm_bytes_dense": self.dense_per_step}
        stats = self.hook_state.stats
        sent, dense = stats.bytes_sent - self.counted[0], stats.bytes_dense - self.counted[1]
        self.counted = (stats.bytes_sent, stats.bytes_dense)
        return {"comm_bytes_sent": int(sent), "comm_bytes_dense": int(dense)}


def scheduled_lr(step: int, peak: float, warmup_steps: int, max_steps: int) -> float:
    """Learning rate of optimizer step ``step`` (1-based) of ``max_steps``: linear warm-up over
    min(``warmup_steps``, ``max_steps``) steps from ``peak / warmup`` to ``peak``, then cosine
    decay towards 0 at step ``max_steps + 1`` (the module docstring's formula)."""
    warmup = min(warmup_steps, max_steps)
    if step <= warmup:
        return peak * step / warmup
    progress = (step - warmup) / (max_steps - warmup + 1)
    return peak * 0.5 * (1.0 + math.cos(math.pi * progress))


def evaluate(
    model: Any,
    processor: Any,
    samples: Sequence[VQASample],
    placement: ProcessPlacement,
    batch_size: int,
    max_new_tokens: int,
) -> float:
    """Exact-match accuracy of greedy answers over ``samples``, sharded across ranks.

    Rank r answers samples r, r + world, ...; correct and total counts are summed over ranks.
    """
    encoded = EncodedDataset(samples, processor, with_answer=False)
    pad_id = pad_token_id_of(processor)
    indices = list(range(placement.rank, len(samples), placement.world_size))
    correct = 0
    model.eval()
    with torch.no_grad(), placement.autocast():
        for start in range(0, len(indices), batch_size):
            chunk = indices[start : start + batch_size]
            batch = collate([encoded[i] for i in chunk], pad_id, padding_side="left")
            inputs = model_inputs(batch, placement.device)
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
    total_correct, total = placement.all_reduce_sum([correct, len(indices)])
    return total_correct / total


def accuracy_per_type(
    model: Any,
    processor: Any,
    config: TrainConfig,
    placement: ProcessPlacement,
    question_types: Sequence[str],
) -> dict[str, float]:
    """Held-out accuracy per ShapesVQA question type: :func:`evaluate` on ``config.eval_size``
    records of the eval split asking only that type (``data_seed``, ``image_size``,
    ``shapes_binding`` of ``config``)."""
    return {
        question_type: evaluate(
            model,
            processor,
            shapes_dataset(config, "eval", config.eval_size, (question_type,)),
            placement,
            config.eval_batch_size,
            config.max_new_tokens,
        )
        for question_type in question_types
    }


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

    def read_first(self, key: str) -> Any:
        """The value of ``key`` in the first record holding it, or None (also off rank 0)."""
        if not self.enabled or not self.path.is_file():
            return None
        for line in self.path.read_text(encoding="utf-8").splitlines():
            if line.strip() and key in (record := json.loads(line)):
                return record[key]
        return None

    def write(self, record: dict[str, Any]) -> None:
        if self.enabled:
            with self.path.open("a", encoding="utf-8") as handle:
                handle.write(json.dumps(record) + "\n")


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
        config = _resumed_after_restart(config, placement)
        _settle_run_config(config, placement)
        return _train(_without_missing_latest(config))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class CollectiveFailure(RuntimeError):
    """A training step's collective timed out or lost a peer: the job cannot go on."""


# Words of the errors gloo raises (as plain RuntimeErrors) when a collective times out or a
# peer's connection goes away. HCCL's on the NPU are not known here: they pass unchanged.
_COMMUNICATION_FAILURES = (
    "timed out",
    "connection closed",
    "connection reset",
    "broken pipe",
    "socket closed",
)


def _is_communication_failure(error: RuntimeError) -> bool:
    """True for gloo's errors of a collective that timed out or lost its peer."""
    text = str(error).lower()
    return any(marker in text for marker in _COMMUNICATION_FAILURES)


def _torchrun_job_id() -> str | None:
    """This torchrun job's id (``TORCHELASTIC_RUN_ID``: ``--rdzv-id``, a fresh one with
    ``--standalone``), or None outside torchrun or for torchrun's shared default "none"."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    return None if run_id in (None, "", "none") else run_id


def _resumed_after_restart(config: TrainConfig, placement: ProcessPlacement) -> TrainConfig:
    """``config`` resuming from the latest checkpoint when this torchrun job has already
    started the run in ``output_dir`` (its ``TORCHELASTIC_RUN_ID`` is in the folder's
    :data:`RUN_MARKER`): its workers were restarted after a failure (``--max-restarts``), on
    this node or another. A job that only finds another job's run there is refused as
    without torchrun; a restart of a run started with ``--resume PATH`` continues from the
    latest checkpoint, not from PATH again."""
    run_id = _torchrun_job_id()
    marker = Path(config.output_dir) / RUN_MARKER
    if run_id is None or not marker.is_file() or marker.read_text(encoding="utf-8") != run_id:
        return config
    if placement.is_main:
        logger.warning(
            "torchrun job %s restarted its workers (restart %d on this node): resuming from the "
            "latest checkpoint",
            run_id,
            _restarts(),
        )
    return dataclasses.replace(config, resume="latest")


def _settle_run_config(config: TrainConfig, placement: ProcessPlacement) -> None:
    """Check ``config`` against the saved settings of the run it continues; then save it."""
    output_dir = Path(config.output_dir)
    path = output_dir / CONFIG_FILE
    requested = json.loads(json.dumps(dataclasses.asdict(config), default=list))
    if path.is_file() and config.resume is None:
        raise ResumeError(
            f"output_dir: expected a folder without a saved run, {str(output_dir)!r} holds one "
            f"({CONFIG_FILE}); continue it with --resume latest, or choose another --output-dir"
        )
    saved_path = path
    if not path.is_file() and config.resume not in (None, "latest"):
        # A checkpoint of another run folder (<run>/checkpoints/step-N): that run's settings.
        saved_path = Path(config.resume).parent.parent / CONFIG_FILE
    if config.resume is not None and saved_path.is_file():
        saved = json.loads(saved_path.read_text(encoding="utf-8"))
        notes = check_resume(saved, requested, _trained_steps(config), str(saved_path))
        if placement.is_main:
            for note in notes:
                logger.info(note)
    placement.barrier()  # every rank has read the saved settings before rank 0 replaces them
    if placement.is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
        checkpoint.atomic_write_text(path, json.dumps(requested, indent=2))
        if (run_id := _torchrun_job_id()) is not None:
            checkpoint.atomic_write_text(output_dir / RUN_MARKER, run_id)


def _trained_steps(config: TrainConfig) -> dict[str, int | None]:
    """Steps the saved run has trained."""
    return {"max_steps": _checkpoint_step(config.output_dir, config.resume)}


def _checkpoint_step(output_dir: str | Path, resume: str) -> int:
    try:
        return checkpoint.saved_step(checkpoint.resolve_checkpoint(output_dir, resume))
    except FileNotFoundError:  # no checkpoint yet: nothing trained
        return 0


def _without_missing_latest(config: TrainConfig) -> TrainConfig:
    latest = checkpoint.checkpoint_root(config.output_dir) / checkpoint.LATEST
    if config.resume != "latest" or latest.is_file():
        return config
    logger.warning("resume=latest: no checkpoint under %s yet; starting fresh", config.output_dir)
    return dataclasses.replace(config, resume=None)


def _with_trainable_weights(
    model: Any, config: TrainConfig, visual: VisualTokens | None
) -> tuple[Any, int]:
    """``model`` ready to train: fully unfrozen, or wrapped in PEFT LoRA (adapter
    ``config.adapter_name``, plus the rows of ``visual``'s tokens as trainable tokens); plus
    the number of LoRA targets."""
    from peft import LoraConfig, get_peft_model

    if config.full_finetune:
        model.requires_grad_(True)
        return model, 0
    targets = lora_target_modules(
        model, config.lora_targets, config.lora_vision, config.lora_projector
    )
    token_indices = None if visual is None else trainable_token_indices(model, visual)
    lora = LoraConfig(
        r=config.lora_r,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        target_modules=targets,
        modules_to_save=list(config.modules_to_save) or None,
        trainable_token_indices=token_indices,
    )
    return get_peft_model(model, lora, adapter_name=config.adapter_name), len(targets)


def add_new_tokens(
    model: Any, processor: Any, tokens: Sequence[str], samples: Sequence[VQASample]
) -> VisualTokens:
    """Add ``tokens`` to ``processor`` and ``model`` (:func:`add_visual_tokens`), each row
    initialised from the mean projected visual feature of the images of the first
    ``EXAMPLES_PER_NEW_TOKEN`` training records whose question or answer holds the token.

    Raises ``ValueError`` naming the tokens no training record mentions."""
    examples: dict[str, list] = {token: [] for token in tokens}
    for index in range(len(samples)):
        open_tokens = [t for t in tokens if len(examples[t]) < EXAMPLES_PER_NEW_TOKEN]
        if not open_tokens:
            break
        sample = samples[index]
        for token in open_tokens:
            if token in sample.question or token in sample.answer:
                examples[token].append(sample.image)
    missing = [token for token, images in examples.items() if not images]
    if missing:
        raise ValueError(
            f"new_tokens: expected training records whose question or answer holds each new "
            f"token (their images initialise its rows), got none for {missing}"
        )
    return add_visual_tokens(model, processor, tokens, examples=examples)


def tensor_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of ``tensors``: what DDP hands to all-reduce for their gradients each step."""
    return sum(t.numel() * t.element_size() for t in tensors)


def whole_table_bytes(model: Any, world_size: int) -> int:
    """Bytes DDP would hand over per step if the input embedding (and an untied output head)
    trained whole instead of only the new rows; 0 in a single process."""
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is None or head.weight is embedding
    return tensor_bytes([embedding] + ([] if tied else [head.weight])) if world_size > 1 else 0


def _train(config: TrainConfig) -> TrainResult:
    from torch.nn.parallel import DistributedDataParallel

    placement = init_process_placement()
    output_dir = Path(config.output_dir)
    if placement.is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
    # Same seed on every rank while building: identical LoRA init everywhere.
    seed_everything(config.seed)
    if config.model_path is None:
        raise ValueError(
            "model_path: expected a local from_pretrained folder, got None "
            "(scripts/finetune_lora.py defaults it to the reference checkpoint)"
        )
    base_path = config.model_path
    model, processor = load_base_model(base_path, placement.device, DTYPES[config.dtype])
    if config.quantize is not None:
        from ascend_vlm.quantization import QuantizationConfig, quantize

        quantize(model, QuantizationConfig(bits=config.quantize), progress=False)
    train_samples, eval_samples = build_samples(config)
    visual = None
    if config.new_tokens:
        visual = add_new_tokens(model, processor, config.new_tokens, train_samples)
        table_bytes = whole_table_bytes(model, placement.world_size)
    patch_note = apply_ascend_patch(model, config.patch)
    model, lora_targets = _with_trainable_weights(model, config, visual)
    # Encoded in the prefetch thread, with its own tokenizer and the fast image processor.
    train_set = EncodedDataset(
        train_samples, with_fast_pixels(processor_for_another_thread(processor))
    )
    pad_id = pad_token_id_of(processor)

    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        trainable, lr=config.learning_rate, weight_decay=config.weight_decay
    )
    metrics = MetricsLog(output_dir / METRICS_FILE, placement.is_main)

    loop_state = {"step": 0, "epoch": 0, "next_index": 0}
    if config.resume is not None:
        path = checkpoint.resolve_checkpoint(output_dir, config.resume)
        loop_state = checkpoint.load_checkpoint(
            path, model=model, optimizer=optimizer, rank=placement.rank
        )
        if placement.is_main:
            logger.info("resume: continuing after step %d from %s", loop_state["step"], path)
        metrics.truncate_after(loop_state["step"])
    else:
        seed_everything(config.seed + placement.rank)
        metrics.truncate_after(0)

    # The base's held-out accuracy per type, measured once per run (LoRA starts as a no-op).
    report = config.report_question_types if config.eval_data is None else ()
    if report and config.resume is None:
        before = accuracy_per_type(model, processor, config, placement, report)
        metrics.write({"step": 0, "accuracy_before": before})

    ddp_model = model
    hook_state = None
    if placement.world_size > 1:
        ddp_model = DistributedDataParallel(model, device_ids=None)
        hook_state = _comm_hook(config, ddp_model, placement)
    comm = CommCounter(hook_state, trainable, placement.world_size)

    if placement.is_main:
        logger.info(
            "world=%d device=%s patch=%s lora_targets=%d modules trainable=%d params",
            placement.world_size,
            placement.device,
            patch_note,
            lora_targets,
            sum(p.numel() for p in trainable),
        )
    batches = _prefetched_micro_batches(
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
    model.train()
    running = step + 1  # the step a collective failure is reported at
    try:
        while step < stop_at:
            running = step + 1
            started = time.perf_counter()
            micro = [next(batches) for _ in range(config.grad_accum)]
            epoch, next_index = micro[-1].epoch, micro[-1].next_index
            local_tokens = sum(part.answer_tokens for part in micro)
            (global_answer_tokens,) = placement.all_reduce_sum([local_tokens])
            local_loss = 0.0
            for position, part in enumerate(micro):
                batch = part.batch
                last = position == len(micro) - 1
                sync = (
                    contextlib.nullcontext() if last or ddp_model is model else ddp_model.no_sync()
                )
                with sync, placement.autocast():
                    logits = ddp_model(**model_inputs(batch, placement.device)).logits
                    loss_sum = answer_token_loss_sum(logits, batch["labels"].to(placement.device))
                    (loss_sum * placement.world_size / global_answer_tokens).backward()
                local_loss += float(loss_sum.detach())
            grad_norm = torch.nn.utils.clip_grad_norm_(trainable, config.max_grad_norm)
            learning_rate = scheduled_lr(
                step + 1, config.learning_rate, config.warmup_steps, config.max_steps
            )
            for group in optimizer.param_groups:
                group["lr"] = learning_rate
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            local_seen = sum(part.seen_tokens for part in micro)
            loss_total, tokens_seen = placement.all_reduce_sum([local_loss, local_seen])
            elapsed = time.perf_counter() - started
            record = {
                "step": step,
                "loss": loss_total / global_answer_tokens,
                "lr": learning_rate,
                "grad_norm": float(grad_norm),
                "tokens_per_s": tokens_seen / elapsed,
                "step_time_s": elapsed,
                **comm.step(),
                **({"comm_bytes_whole_tables": table_bytes} if visual is not None else {}),
                "epoch": epoch,
            }
            last_loss = record["loss"]
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
                    loop_state={"epoch": epoch, "next_index": next_index},
                    rank=placement.rank,
                    barrier=placement.barrier,
                )
    except RuntimeError as error:
        if placement.world_size > 1 and _is_communication_failure(error):
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
    result = TrainResult(
        model, processor, math.nan, last_loss, len(train_samples), len(eval_samples)
    )
    if step < config.max_steps:  # stopped early on purpose: no final adapter, no eval
        return result
    final = _save_final(model, processor, output_dir, config, placement, visual)
    if report:
        after = accuracy_per_type(model, processor, config, placement, report)
        metrics.write({"step": step, "accuracy_after": after})
        if placement.is_main:
            print(_accuracy_table(metrics.read_first("accuracy_before"), after), flush=True)
    result.eval_accuracy = evaluate(
        model, processor, eval_samples, placement, config.eval_batch_size, config.max_new_tokens
    )
    metrics.write({"step": step, "eval_accuracy": result.eval_accuracy})
    if config.save_merged is not None and placement.is_main:
        save_merged(base_path, final, config.save_merged, DTYPES[config.dtype])
    placement.barrier()
    if placement.is_main:
        base_description = f"`{base_path}`."
        card = model_card(
            config,
            result,
            placement.world_size,
            final,
            base_path=base_path,
            base_description=base_description,
        )
        checkpoint.atomic_write_text(final / "README.md", card)
        print(f"eval_accuracy: {result.eval_accuracy:.4f}", flush=True)
    return result


def _accuracy_table(before: dict[str, float] | None, after: dict[str, float]) -> str:
    """Held-out accuracy per question type before and after training, one row per type."""
    lines = ["held-out accuracy   before    after"]
    for question_type, value in after.items():
        old = f"{before[question_type]:.4f}" if before and question_type in before else "   n/a"
        lines.append(f"{question_type:<18}  {old}   {value:.4f}")
    return "\n".join(lines)


def save_merged(
    base_path: str | os.PathLike,
    adapter: str | os.PathLike,
    out_dir: str | os.PathLike,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Merge the LoRA ``adapter`` folder into the ``base_path`` checkpoint and save the result
    to ``out_dir`` as a plain ``from_pretrained`` checkpoint: ``model.safetensors`` (weights in
    ``dtype``), tokenizer and processor config of the base.

    The base loads in fp32 and PEFT's ``merge_and_unload`` adds ``scale * B @ A`` to each
    adapted weight once, in fp32, before the cast to ``dtype``; ``modules_to_save`` copies
    replace their originals. An adapter saved with new tokens (``visual_tokens.json``) gets
    them added to the base and its tokenizer first, so the merged checkpoint and its saved
    tokenizer hold the trained rows. Written to a staging sibling and renamed into place; returns
    ``out_dir``.
    """
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    from ascend_vlm.default_model import load_processor

    out_dir = Path(out_dir)
    base = AutoModelForImageTextToText.from_pretrained(base_path, dtype=torch.float32)
    processor = load_processor(base_path)
    if (Path(adapter) / VISUAL_TOKENS_FILE).is_file():
        load_visual_tokens(base, processor, adapter)
    merged = PeftModel.from_pretrained(base, adapter).merge_and_unload()
    staging = out_dir.parent / f".{out_dir.name}.staging"
    shutil.rmtree(staging, ignore_errors=True)
    merged.to(dtype).save_pretrained(staging, safe_serialization=True)
    processor.save_pretrained(staging)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(staging, out_dir)
    return out_dir


def _progress_bar(config: TrainConfig, placement: ProcessPlacement, initial: int) -> Any:
    if not (config.progress and placement.is_main):
        return None
    from tqdm import tqdm

    return tqdm(total=config.max_steps, initial=initial, desc="finetune", dynamic_ncols=True)


def _save_final(
    model: Any,
    processor: Any,
    output_dir: Path,
    config: TrainConfig,
    placement: ProcessPlacement,
    visual: VisualTokens | None,
) -> Path:
    """Rank 0 writes the LoRA adapter to ``<output_dir>/adapter`` (PEFT format, with
    ``visual_tokens.json`` when the run added tokens) or, for full training, model + processor
    to ``<output_dir>/model``; via a staging dir + rename. Returns that folder."""
    full = config.full_finetune
    final = output_dir / (FINAL_MODEL if full else FINAL_ADAPTER)
    if placement.is_main:
        staging = output_dir / f".{final.name}.staging"
        shutil.rmtree(staging, ignore_errors=True)
        model.save_pretrained(staging, safe_serialization=True)
        saved = staging
        if not full and config.adapter_name != DEFAULT_ADAPTER_NAME:
            # PEFT writes an adapter not named "default" into a subfolder of that name.
            saved = staging / config.adapter_name
        if full:
            processor.save_pretrained(staging)
        if visual is not None:
            save_visual_tokens(visual, processor, saved)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(saved, final)
        shutil.rmtree(staging, ignore_errors=True)
    placement.barrier()
    return final
