"""Answer every sample of an :class:`~ascend_vlm.data.datasets.EvalDataset` with greedy
generation, batch by batch, timing each batch's stages and the run's peak memory."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from ascend_vlm.data.datasets import EvalDataset
from ascend_vlm.evaluation.stages import (
    StageTimes,
    generate_with_stage_times,
)
from ascend_vlm.observability.memory import PeakRSS
from ascend_vlm.vision_input.fast_processor import with_fast_pixels
from ascend_vlm.vision_input.prefetch import device_prefetcher
from ascend_vlm.vision_input.staging import StagingPool


@dataclass(frozen=True)
class Prediction:
    """The generated ``prediction`` for sample ``index`` (its ``question`` and gold ``answer``)."""

    index: int
    question_type: str
    question: str
    answer: str
    prediction: str


@dataclass(frozen=True)
class RunResult:
    """Predictions in sample order, the :class:`StageTimes` of each batch, and the run's peak
    memory (:class:`~ascend_vlm.observability.memory.PeakRSS`; None where not measurable)."""

    predictions: list[Prediction]
    stage_times: list[StageTimes]
    peak_memory_bytes: int | None


def _batch_inputs(
    processor: Any, dataset: EvalDataset, indices: range, staging: StagingPool | None
) -> dict[str, Any]:
    """The prompts of ``dataset[indices]`` (the fine-tune script's chat format), left-padded,
    with the samples under ``"_samples"``."""
    from ascend_vlm.data.vqa import collate, encode_sample, pad_token_id_of

    samples = [dataset[index] for index in indices]
    encoded = [encode_sample(processor, sample, with_answer=False) for sample in samples]
    batch = collate(encoded, pad_token_id_of(processor), padding_side="left", staging=staging)
    del batch["labels"]
    return {**batch, "_samples": samples}


def generate_answers(
    model: Any,
    processor: Any,
    dataset: EvalDataset,
    *,
    batch_size: int,
    max_new_tokens: int,
    progress: bool = True,
    description: str = "eval",
    prefetch: bool = True,
) -> RunResult:
    """Greedy answers of ``model`` to every sample of ``dataset``, ``batch_size`` at a time.

    Prompts are the processor's chat template over the question and image (as the fine-tune
    script trains), left-padded so every answer starts right after its prompt. Before the first
    batch is timed, a two-token generation of it (a prefill and a decode step) runs once
    untimed (first-call set-up is not latency). A tqdm bar on stderr counts samples unless
    ``progress`` is False.

    With ``prefetch`` the next batch is read, encoded (with its own tokenizer copy and the
    fast image preprocessor where one applies) and, on an NPU, uploaded in a background thread
    while the current one generates; on a CPU that thread shares the cores with the timed
    stages. Without it each batch is prepared when due, in this thread.
    """
    from tqdm import tqdm

    from ascend_vlm.data.vqa import pad_token_id_of

    if batch_size < 1 or max_new_tokens < 1:
        raise ValueError(
            f"batch_size, max_new_tokens: expected >= 1, got {batch_size}, {max_new_tokens}"
        )
    pad_id = pad_token_id_of(processor)
    device = next(model.parameters()).device
    predictions: list[Prediction] = []
    stage_times: list[StageTimes] = []
    chunks = [
        range(start, min(start + batch_size, len(dataset)))
        for start in range(0, len(dataset), batch_size)
    ]

    # The batches start last, so their preparation counts in the measured peak memory.
    with (
        torch.no_grad(),
        PeakRSS() as memory,
        tqdm(total=len(dataset), desc=description, unit="sample", disable=not progress) as bar,
        _prepared_batches(processor, dataset, chunks, device, prefetch) as prepared,
    ):
        for indices, batch in zip(chunks, prepared, strict=True):
            start = indices.start
            samples = batch.pop("_samples")
            inputs = {key: value.to(device) for key, value in batch.items()}
            del batch
            if start == 0:
                model.generate(
                    **inputs,
                    max_new_tokens=2,
                    min_new_tokens=2,
                    do_sample=False,
                    pad_token_id=pad_id,
                )
            output, times = generate_with_stage_times(
                model, inputs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad_id
            )
            stage_times.append(times)
            answers = processor.batch_decode(
                output[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True
            )
            predictions += _predictions(dataset, indices, samples, answers)
            bar.update(len(samples))
    return RunResult(predictions, stage_times, memory.peak_bytes)


def _prepared_batches(
    processor: Any, dataset: EvalDataset, chunks: list[range], device: torch.device, prefetch: bool
) -> Any:
    """A context manager over the model inputs of ``chunks`` (:func:`_batch_inputs`): prepared
    ahead in a background thread (and on an NPU uploaded) with ``prefetch``, else when due."""
    from ascend_vlm.data.vqa import processor_for_another_thread

    if not prefetch:
        encoding = with_fast_pixels(processor)
        return contextlib.nullcontext(
            _batch_inputs(encoding, dataset, indices, None) for indices in chunks
        )
    # Encoded in another thread while answers are decoded here: its own tokenizer.
    encoding = with_fast_pixels(processor_for_another_thread(processor))
    return device_prefetcher(
        chunks,
        lambda indices, staging: _batch_inputs(encoding, dataset, indices, staging),
        device,
        describe=lambda indices: f"samples {indices.start}-{indices.stop - 1}",
    )


def _predictions(
    dataset: EvalDataset, indices: range, samples: list, answers: list[str]
) -> list[Prediction]:
    """One :class:`Prediction` per sample of a batch, with its question type and answer."""
    return [
        Prediction(index, dataset.question_type(index), sample.question, sample.answer, answer)
        for index, sample, answer in zip(indices, samples, answers, strict=True)
    ]
