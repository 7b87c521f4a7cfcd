"""The training data of one rank: micro-batches in ``DistributedSampler`` order, resumable at a
saved position, collated (and uploaded) ahead of the loop in a background thread."""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from ascend_vlm.data.vqa import IGNORE_INDEX, EncodedDataset, collate

if TYPE_CHECKING:
    from ascend_vlm.finetune.config import TrainConfig
    from ascend_vlm.finetune.placement import ProcessPlacement


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


class MicroBatch(NamedTuple):
    """One micro-batch and what the loop needs of it, counted on the CPU before any upload
    (so the loop reads no count back from the device)."""

    epoch: int
    next_index: int
    batch: dict[str, torch.Tensor]
    answer_tokens: int  # supervised tokens (labels after the first position)
    seen_tokens: int  # attended tokens


def prefetched_micro_batches(
    indices: Iterator[tuple[int, int, list[int]]],
    train_set: EncodedDataset,
    pad_id: int,
    device: torch.device,
    config: TrainConfig,
) -> Generator[MicroBatch, None, None]:
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
            yield MicroBatch(
                batch.pop("_epoch"),
                batch.pop("_next_index"),
                batch,
                batch.pop("_answer_tokens"),
                batch.pop("_seen_tokens"),
            )


def model_inputs(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {key: value.to(device) for key, value in batch.items() if key != "labels"}
