"""VQA data: samples, JSON Lines / JSON / LLaVA record loading, and processor collation.

A data file is JSON Lines (one JSON object per line) or, as LLaVA's own data is written, one
JSON array of objects (a file whose first character is ``[``). Image paths are relative to the
file's folder unless absolute. Record formats accepted by :class:`JsonlVQA`:

* flat: ``{"image": "a.png", "question": "What colour is it?", "answer": "red"}``;
* LLaVA conversation: ``{"image": "a.png", "conversations": [{"from": "human", "value":
  "<image>\\nWhat colour is it?"}, {"from": "gpt", "value": "red"}, ...]}`` -- the whole
  conversation is one sample (its earlier turns in ``history``), the loss covers every
  assistant turn, the ``<image>`` marker is dropped;
* either without ``"image"``: a text-only sample.

Either format may carry a ``"type"`` (a non-empty string naming the question type, e.g.
``"colour"``), which the record's sample reports through :meth:`JsonlVQA.question_type`.

Collation renders each sample with the processor's own chat template (user turns, the first
holding the image, each followed by the assistant's answer) and supervises only the answer
tokens.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from PIL import Image, UnidentifiedImageError
from torch.nn.utils.rnn import pad_sequence

from ascend_vlm.data.images import load_image

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100
BAD_RECORD_POLICIES = ("skip", "fail")
LLAVA_IMAGE_MARKER = "<image>"
# Keys of a processor's output that run along the token axis and are padded per sample; all
# other tensor keys (pixel values, grids) are concatenated along dim 0.
SEQUENCE_KEYS = ("input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids")
# The key of the batch's pixels, the bulk of its bytes.
PIXEL_KEY = "pixel_values"
# What the sequence keys besides input_ids hold at tokens appended after a prompt (an answer).
APPENDED_TOKEN_VALUES = {"attention_mask": 1, "mm_token_type_ids": 0, "token_type_ids": 0}


class PixelStaging(Protocol):
    """Where :func:`collate` may put a batch's pixels for an upload: page-locked slots such as
    :class:`~ascend_vlm.vision_input.staging.StagingPool`."""

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A tensor of ``shape`` and ``dtype`` in a slot, taken while the tensor lives."""
        ...


@dataclass(frozen=True)
class VQASample:
    """A question with its gold ``answer`` about ``image`` (RGB; None: a text-only sample),
    after the ``history`` of earlier (question, answer) turns of the same conversation."""

    image: Image.Image | None
    question: str
    answer: str
    history: tuple[tuple[str, str], ...] = ()


class BadRecordError(ValueError):
    """A data record cannot be used; the message names the file and 1-based record number."""


@dataclass(frozen=True)
class _PendingSample:
    image_path: Path | None
    turns: tuple[tuple[str, str], ...]
    question_type: str | None


def _record_pairs(record: Any) -> list[tuple[str, str]]:
    """The (question, answer) pairs of one parsed record; raises ``ValueError`` saying why not."""
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    if "conversations" in record:
        turns = record["conversations"]
        if not isinstance(turns, list) or len(turns) < 2:
            raise ValueError("conversations: expected a list of at least 2 turns")
        pairs = []
        if len(turns) % 2:
            raise ValueError("conversations: expected human/gpt turn pairs, got an odd count")
        for human, gpt in zip(turns[0::2], turns[1::2], strict=True):
            if not isinstance(human, dict) or not isinstance(gpt, dict):
                raise ValueError("conversations: expected turns as JSON objects")
            roles = (human.get("from"), gpt.get("from"))
            if roles != ("human", "gpt"):
                raise ValueError(f"conversations: expected human/gpt turn pairs, got {roles}")
            question = str(human.get("value", "")).replace(LLAVA_IMAGE_MARKER, "").strip()
            pairs.append((question, str(gpt.get("value", "")).strip()))
    else:
        missing = [key for key in ("question", "answer") if key not in record]
        if missing:
            raise ValueError(f"missing key(s) {missing}")
        pairs = [(str(record["question"]).strip(), str(record["answer"]).strip())]
    for question, answer in pairs:
        if not question:
            raise ValueError("empty question")
        if not answer:
            raise ValueError("empty answer")
    return pairs


def _record_type(record: dict[str, Any]) -> str | None:
    """The record's ``"type"``, None when absent; raises ``ValueError`` when it is not a
    non-empty string."""
    if "type" not in record:
        return None
    kind = record["type"]
    if not isinstance(kind, str) or not kind.strip():
        raise ValueError(f"type: expected a non-empty string, got {kind!r}")
    return kind.strip()


def _check_image(path: Path) -> None:
    if not path.is_file():
        raise ValueError(f"image {str(path)!r} does not exist")
    try:
        with Image.open(path) as image:
            image.verify()
    except (UnidentifiedImageError, OSError, SyntaxError) as error:
        raise ValueError(f"image {str(path)!r} is unreadable ({error})") from error


def _read_records(path: Path) -> list[tuple[int, str | Any]]:
    """``(number, record)`` of a JSON Lines file (``record`` still text, numbered by non-blank
    line from 1) or of a JSON array file (parsed, numbered by position from 1)."""
    text = path.read_text(encoding="utf-8")
    if not text.lstrip().startswith("["):
        lines = (line for line in text.splitlines() if line.strip())
        return list(enumerate(lines, start=1))
    try:
        records = json.loads(text)
    except ValueError as error:
        raise BadRecordError(f"{path}: expected a JSON array of records ({error})") from None
    return list(enumerate(records, start=1))


def _pending_sample(folder: Path, raw: str | Any) -> _PendingSample:
    """The sample of one record; ``ValueError`` saying why the record cannot be used."""
    record = json.loads(raw) if isinstance(raw, str) else raw
    turns = tuple(_record_pairs(record))
    question_type = _record_type(record)
    image_path = None
    if "image" in record:
        image_path = folder / str(record["image"])
        _check_image(image_path)
    return _PendingSample(image_path, turns, question_type)


class JsonlVQA:
    """VQA samples from a JSON Lines or JSON array file, one per record, validated up front;
    images load on access.

    Every record is parsed and its image (if it names one) opened and verified at construction.
    A bad record (invalid JSON, missing or unreadable image, empty question or answer, malformed
    conversation, a ``"type"`` that is not a non-empty string) is logged as
    ``"<file>: record <n>: <reason>"`` and skipped when ``on_bad_record="skip"``, or raised as
    :class:`BadRecordError` when ``"fail"``. ``bad_records`` lists the skipped ``(n, reason)``
    pairs; ``records`` counts the records read, good and bad.
    """

    def __init__(self, path: str | os.PathLike, on_bad_record: str = "skip"):
        if on_bad_record not in BAD_RECORD_POLICIES:
            raise ValueError(
                f"on_bad_record: expected one of {BAD_RECORD_POLICIES}, got {on_bad_record!r}"
            )
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"path: expected a JSONL file, got {str(self.path)!r}")
        self.bad_records: list[tuple[int, str]] = []
        self._samples: list[_PendingSample] = []
        numbered = _read_records(self.path)
        self.records = len(numbered)
        for number, raw in numbered:
            try:
                self._samples.append(_pending_sample(self.path.parent, raw))
            except ValueError as error:  # json.JSONDecodeError is a ValueError too
                message = f"{self.path}: record {number}: {error}"
                if on_bad_record == "fail":
                    raise BadRecordError(message) from error
                logger.warning("skipping bad record: %s", message)
                self.bad_records.append((number, str(error)))
        if not self._samples:
            raise BadRecordError(f"{self.path}: no usable records")

    def __len__(self) -> int:
        return len(self._samples)

    def __getitem__(self, index: int) -> VQASample:
        pending = self._samples[index]
        image = None
        if pending.image_path is not None:
            image = load_image(pending.image_path, name=f"image {str(pending.image_path)!r}")
        *history, (question, answer) = pending.turns
        return VQASample(image, question, answer, tuple(history))

    def question_type(self, index: int) -> str | None:
        """The ``"type"`` of the record sample ``index`` came from; None when it has none."""
        return self._samples[index].question_type


def user_turn(question: str, with_image: bool = True) -> list[dict[str, Any]]:
    """The chat messages asking ``question`` (about one image unless not ``with_image``),
    question first.

    Question before image lets the image tokens attend to the question (the language model is
    causal) and keeps the image at a fixed distance from the answer, whatever the question's
    length.
    """
    content: list[dict[str, Any]] = [{"type": "text", "text": question}]
    if with_image:
        content.append({"type": "image"})
    return [{"role": "user", "content": content}]


def prompt_text(processor: Any, question: str) -> str:
    """The processor's chat template applied to the user turn, ready for the answer."""
    return processor.apply_chat_template(
        user_turn(question), add_generation_prompt=True, tokenize=False
    )


def _reply_text(processor: Any, messages: list[dict[str, Any]], prompt: str, answer: str) -> str:
    """What the template appends after ``prompt`` (``messages`` rendered for generation) when
    the assistant replies ``answer``; ``answer + eos_token`` when it renders the prompt
    differently with and without the reply."""
    reply = {"role": "assistant", "content": [{"type": "text", "text": answer}]}
    full = processor.apply_chat_template([*messages, reply], tokenize=False)
    if full.startswith(prompt) and answer in full[len(prompt) :]:
        return full[len(prompt) :]
    return answer + (processor.tokenizer.eos_token or "")


def answer_text(processor: Any, question: str, answer: str) -> str:
    """What the template appends after the prompt for ``answer`` (e.g. ``"red<|im_end|>\\n"``).

    Falls back to ``answer + eos_token`` when the template renders the prompt differently with
    and without an assistant turn.
    """
    return _reply_text(processor, user_turn(question), prompt_text(processor, question), answer)


def conversation_segments(
    processor: Any, sample: VQASample, with_answer: bool = True
) -> list[tuple[str, bool]]:
    """The chat-template text of ``sample`` as ``(text, is_answer)`` segments in order: each
    user turn's prompt (the first holding the image, if any), then the assistant's reply; the
    last reply left out unless ``with_answer``. ``ValueError`` when the template does not render
    a conversation as the prefix of its continuation (its turns cannot be cut apart)."""
    turns = [*sample.history, (sample.question, sample.answer)]
    messages: list[dict[str, Any]] = []
    segments: list[tuple[str, bool]] = []
    rendered = ""
    for index, (question, answer) in enumerate(turns):
        messages += user_turn(question, with_image=index == 0 and sample.image is not None)
        prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        if not prompt.startswith(rendered):
            raise ValueError(
                "processor: expected a chat template that renders a conversation as the prefix "
                f"of its continuation, got another rendering at turn {index + 1}"
            )
        segments.append((prompt[len(rendered) :], False))
        if index == len(turns) - 1 and not with_answer:
            break
        reply = _reply_text(processor, messages, prompt, answer)
        segments.append((reply, True))
        messages.append({"role": "assistant", "content": [{"type": "text", "text": answer}]})
        rendered = prompt + reply
    return segments


def encode_sample(processor: Any, sample: VQASample, with_answer: bool = True) -> dict[str, Any]:
    """Tensors of one sample: the processor's output for the first prompt and the image (batch
    dim removed for token keys), with the tokens of the later segments
    (:func:`conversation_segments`) appended to ``input_ids`` and ``labels`` = the token ids on
    every answer, ``IGNORE_INDEX`` elsewhere (everywhere without ``with_answer``)."""
    (first_prompt, _), *later = conversation_segments(processor, sample, with_answer)
    images = None if sample.image is None else [sample.image]
    features = processor(text=[first_prompt], images=images, return_tensors="pt")
    encoded = {key: value for key, value in features.items() if isinstance(value, torch.Tensor)}
    for key in SEQUENCE_KEYS:
        if key in encoded:
            encoded[key] = encoded[key][0]
    labels = [torch.full_like(encoded["input_ids"], IGNORE_INDEX)]
    for text, is_answer in later:
        token_ids = torch.tensor(
            processor.tokenizer(text, add_special_tokens=False)["input_ids"],
            dtype=encoded["input_ids"].dtype,
        )
        encoded = with_appended_tokens(encoded, token_ids)
        supervised = is_answer and with_answer
        labels.append(token_ids if supervised else torch.full_like(token_ids, IGNORE_INDEX))
    encoded["labels"] = torch.cat(labels)
    return encoded


def with_appended_tokens(encoded: Any, token_ids: torch.Tensor) -> dict[str, Any]:
    """A copy of ``encoded`` (a processor's output for one prompt, sequence keys along the
    last axis: ``[S]`` or ``[1, S]``) with ``token_ids`` (same leading shape, ``[T]`` or
    ``[1, T]``) appended to ``input_ids`` and the other sequence keys extended by
    :data:`APPENDED_TOKEN_VALUES`; other keys (pixels, grids) as they are."""
    extended = dict(encoded)
    prompt_ids = encoded["input_ids"]
    extended["input_ids"] = torch.cat([prompt_ids, token_ids.to(prompt_ids)], dim=-1)
    for key, value in APPENDED_TOKEN_VALUES.items():
        if key in encoded:
            tail = torch.full(token_ids.shape, value, dtype=encoded[key].dtype)
            extended[key] = torch.cat([encoded[key], tail.to(encoded[key].device)], dim=-1)
    return extended


def collate(
    encoded: Sequence[dict[str, torch.Tensor]],
    pad_token_id: int,
    padding_side: str = "right",
    staging: PixelStaging | None = None,
) -> dict[str, torch.Tensor]:
    """Batch :func:`encode_sample` outputs: token keys and ``labels`` padded to the longest
    (``input_ids`` with ``pad_token_id``, ``labels`` with ``IGNORE_INDEX``, masks with 0) on
    ``padding_side`` ("right" for training, "left" for generation); other keys concatenated
    along dim 0 (e.g. Qwen2-VL's flattened patches and ``image_grid_thw``; text-only samples
    have none and add none). With ``staging``,
    ``pixel_values`` is concatenated into one of its page-locked slots (for an upload)."""
    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side: expected 'left' or 'right', got {padding_side!r}")
    if not encoded:
        raise ValueError("encoded: expected at least one sample, got an empty batch")
    pad_values = {"input_ids": pad_token_id, "labels": IGNORE_INDEX}
    batch: dict[str, torch.Tensor] = {}
    keys = dict.fromkeys(key for item in encoded for key in item)  # text-only samples lack pixels
    for key in keys:
        values = [item[key] for item in encoded if key in item]
        if key in (*SEQUENCE_KEYS, "labels"):
            # Every sequence key of a sample is as long as its input_ids: all pad to the longest.
            batch[key] = pad_sequence(
                values,
                batch_first=True,
                padding_value=pad_values.get(key, 0),
                padding_side=padding_side,
            )
        elif key == PIXEL_KEY and staging is not None:
            rows = sum(value.shape[0] for value in values)
            dtype = functools.reduce(torch.promote_types, [value.dtype for value in values])
            staged = staging.tensor((rows, *values[0].shape[1:]), dtype)
            batch[key] = torch.cat(values, out=staged)
        else:
            batch[key] = torch.cat(values)
    return batch


class EncodedDataset:
    """``samples`` encoded with :func:`encode_sample`, memoised (an epoch re-reads each once)."""

    def __init__(self, samples: Sequence[VQASample], processor: Any, with_answer: bool = True):
        self.samples = samples
        self.processor = processor
        self.with_answer = with_answer
        self._cache: dict[int, dict[str, torch.Tensor]] = {}

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if index not in self._cache:
            self._cache[index] = encode_sample(
                self.processor, self.samples[index], self.with_answer
            )
        return self._cache[index]


def processor_for_another_thread(processor: Any) -> Any:
    """A copy of ``processor`` sharing everything but its tokenizer, which is its own.

    A Hugging Face fast tokenizer reconfigures itself on every encode, and refuses to while
    another thread encodes or decodes with the same object (``RuntimeError: Already
    borrowed``), so a thread that encodes beside one that decodes needs its own.
    """
    clone = copy.copy(processor)
    clone.tokenizer = copy.deepcopy(processor.tokenizer)
    return clone


def pad_token_id_of(processor: Any) -> int:
    """The tokenizer's pad id, falling back to its eos id; raises if it has neither."""
    tokenizer = processor.tokenizer
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if candidate is not None:
            return int(candidate)
    raise ValueError("processor: expected a tokenizer with a pad or eos token, got neither")


def normalise_answer(text: str) -> str:
    """Exact-match form of an answer: stripped, lowercased, trailing full stop removed."""
    return text.strip().lower().removesuffix(".").strip()
