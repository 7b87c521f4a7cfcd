"""`GenerationRequest` (what to generate), its state while it runs (`SequenceState`, with the
`RequestHandle` that cancels it), and `RequestResult` (what came out, with timings)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ascend_vlm.batching.budgets import RequestSize

_IDS = itertools.count()


@dataclass(frozen=True)
class GenerationRequest:
    """One conversation to continue: ``messages`` in the processor's chat format (images as
    ``{"type": "image", "image": PIL.Image}`` content parts), or :meth:`from_prompt`.

    Generation: greedy unless ``do_sample`` (then ``temperature``, ``top_k``, ``top_p``, drawn
    with a generator seeded by ``seed``, so a request samples the same tokens in any batch);
    at most ``max_new_tokens`` tokens, ending early at the model's end-of-sequence token or
    when the text contains one of ``stop`` (the text is cut before it). ``adapter`` names the
    LoRA adapter that answers (None: the generator's model as it is; a name needs a generator
    made with ``adapters``). ``request_id`` defaults to a fresh number.
    """

    messages: Sequence[dict[str, Any]]
    max_new_tokens: int = 32
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0
    stop: Sequence[str] = ()
    adapter: str | None = None
    request_id: str = field(default_factory=lambda: f"request-{next(_IDS)}")

    @classmethod
    def from_prompt(
        cls, text: str, images: Sequence[Any] = (), **settings: Any
    ) -> GenerationRequest:
        """One user turn: ``images`` then ``text``."""
        content = [{"type": "image", "image": image} for image in images]
        content.append({"type": "text", "text": text})
        return cls(messages=[{"role": "user", "content": content}], **settings)

    def __post_init__(self) -> None:
        checks = (
            ("max_new_tokens", isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1,
             "an int >= 1"),
            ("temperature", isinstance(self.temperature, (int, float)) and self.temperature > 0,
             "a number > 0"),
            ("top_k", self.top_k is None or (isinstance(self.top_k, int) and self.top_k >= 1),
             "None or an int >= 1"),
            ("top_p", self.top_p is None or (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1),
             "None or a number in (0, 1]"),
            ("seed", isinstance(self.seed, int), "an int"),
            ("stop", not isinstance(self.stop, str) and all(isinstance(s, str) and s for s in self.stop),
             "a sequence of non-empty strings"),
            ("adapter", self.adapter is None or (isinstance(self.adapter, str) and self.adapter),
             "None or an adapter name"),
            ("messages", bool(self.messages) and all(isinstance(m, dict) for m in self.messages),
             "a non-empty sequence of chat message dicts"),
        )  # fmt: skip
        for name, ok, expected in checks:
            if not ok or isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: expected {expected}, got {getattr(self, name)!r}")

    def images(self) -> list[Any]:
        """The images of ``messages``, in order."""
        return [
            part["image"]
            for message in self.messages
            if isinstance(message.get("content"), list)
            for part in message["content"]
            if isinstance(part, dict) and part.get("type") == "image"
        ]


@dataclass(frozen=True)
class RequestResult:
    """A finished request: its ``tokens`` and ``text``, why it ended (``finish_reason``:
    "length", "eos", "stop", "cancelled" or "error" (the step it was running in raised)), the
    prompt length and times in seconds since the generator started: ``submitted``,
    ``admitted`` (its prefill began; None if it never did), ``first_token`` (None if none
    came) and ``finished``; ``cached_tokens``: the prompt's leading tokens whose prefill the
    prefix cache skipped (their KV was taken from cached blocks)."""

    request_id: str
    tokens: tuple[int, ...]
    text: str
    finish_reason: str
    prompt_tokens: int
    submitted: float
    admitted: float | None
    first_token: float | None
    finished: float
    cached_tokens: int = 0

    @property
    def queue_time(self) -> float | None:
        """Seconds waiting for admission (None if never admitted)."""
        return None if self.admitted is None else self.admitted - self.submitted

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.submitted

    @property
    def latency(self) -> float:
        return self.finished - self.submitted

    @property
    def tokens_per_second(self) -> float | None:
        """Decode speed after the first token (None with fewer than two tokens)."""
        if self.first_token is None or len(self.tokens) < 2 or self.finished <= self.first_token:
            return None
        return (len(self.tokens) - 1) / (self.finished - self.first_token)


@dataclass(frozen=True)
class TokenEvent:
    """A request produced ``token``; ``text`` is what it adds to the request's text."""

    request_id: str
    token: int
    text: str


@dataclass
class SequenceState:
    """A request's state from submission to its result."""

    request: GenerationRequest
    inputs: dict[str, torch.Tensor]
    size: RequestSize
    submitted: float
    generator: torch.Generator | None
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    admitted: float | None = None
    first_token: float | None = None
    rope_delta: int = 0
    emitted: int = 0  # characters of text already streamed
    cancelled: bool = False
    finish_reason: str | None = None
    # Its own cache and the KV bytes it will reach, when its KV is not in blocks (pruning,
    # families with other than full-attention layers).
    cache: Any = None
    kv_bytes: int = 0
    # Its KV blocks in order, and the tokens they hold (batching.kv_blocks).
    blocks: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    # The prompt's leading tokens the prefix cache gave it at its prefill.
    reused_tokens: int = 0
    # The key of what the processor made of each of its images (data.content_keys), None when
    # some image has none: the prefix cache's and the vision cache's keys derive from them.
    image_keys: tuple[bytes, ...] | None = None
    # What its prompt's prefix-cache keys hash beside the tokens (batching.prefix_keys).
    image_digest: bytes = b""
    first_image: int | None = None
    # The LoRA adapter every forward of it runs with, fixed at submission (None: no adapter
    # set); its KV depends on it, so its prefix-cache keys hash it too.
    adapter: str | None = None


class RequestHandle:
    """A submitted request: its ``request_id``, its ``size`` (prompt and image tokens, as
    encoded at submission) and :meth:`cancel`."""

    def __init__(self, sequence: SequenceState) -> None:
        self._sequence = sequence
        self.request_id = sequence.request.request_id
        self.size = sequence.size

    def cancel(self) -> None:
        """Stop the request at the next step: it ends with ``finish_reason`` "cancelled" and
        frees its batch row and budget."""
        self._sequence.cancelled = True
