"""The request body of ``POST /v1/chat/completions``, as pydantic models (FastAPI validates
it and publishes it in the OpenAPI schema).

The fields are OpenAI's chat-completion fields the server honours; any other field is refused
(400 naming it) rather than silently ignored, except the few that clients send at their neutral
value (``frequency_penalty`` / ``presence_penalty`` 0, ``logprobs`` false, ``user``).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

# torch.Generator.manual_seed's range.
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)
MAX_STOP_STRINGS = 4


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ImageUrl(_Strict):
    """An image: a ``data:image/...;base64,`` URL, an http(s) URL or a ``file://`` / plain
    path (the last two only when the server allows them); ``detail`` "low" shrinks it to
    OpenAI's low resolution (:mod:`~ascend_vlm.serving.conversion`)."""

    url: str = Field(min_length=1)
    detail: Literal["auto", "low", "high"] | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImagePart(_Strict):
    type: Literal["image_url"]
    image_url: ImageUrl


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class ChatMessage(_Strict):
    """One turn: ``content`` is a string or a list of text and image parts; ``name`` is
    accepted and not shown to the model (as vLLM does)."""

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart]
    name: str | None = None


class StreamOptions(_Strict):
    include_usage: bool = False


class ChatCompletionRequest(_Strict):
    """OpenAI's chat-completion request, as far as the server implements it: ``model`` is the
    served model's name or one of its adapters' (``GET /v1/models``); greedy decoding with
    ``temperature`` 0, else sampling (``temperature`` default 1, ``top_p``, ``seed``);
    ``max_completion_tokens`` (or the older ``max_tokens``) caps the answer; ``stop`` ends it
    before a string; ``n`` must be 1."""

    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = Field(default=None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stop: str | list[str] | None = None
    n: int | None = Field(default=None, ge=1, le=1)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = Field(default=None, ge=0, le=0)
    presence_penalty: float | None = Field(default=None, ge=0, le=0)
    logprobs: Literal[False] | None = None
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, stop: str | list[str] | None) -> str | list[str] | None:
        strings = [stop] if isinstance(stop, str) else stop or []
        if len(strings) > MAX_STOP_STRINGS or not all(strings):
            raise ValueError(f"expected up to {MAX_STOP_STRINGS} non-empty strings, got {stop!r}")
        return stop
