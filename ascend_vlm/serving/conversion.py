"""From an OpenAI chat-completion request to a
:class:`~ascend_vlm.batching.GenerationRequest`, and from the generator's results to OpenAI's
response objects (``chat.completion`` and ``chat.completion.chunk``).

Settings: ``temperature`` 0 decodes greedily, anything else samples (OpenAI's default
temperature is 1) with ``top_p`` and ``seed`` (a fresh random seed when none is given);
``max_completion_tokens`` (or ``max_tokens``) defaults to, and may not pass, the server's
``--max-completion-tokens``. An image part's ``detail`` "low" gives the model the image shrunk
to fit :data:`LOW_DETAIL_SIDE` pixels a side (aspect kept), as OpenAI's low-resolution mode
does, so it costs fewer image tokens; "high" and "auto" give it as sent (the processor's own
size rules apply to every image). A message's ``name`` is accepted and not shown to the model
(the chat templates have no place for it), as vLLM does. ``usage`` counts ``prompt_tokens``
(text and image tokens), ``completion_tokens`` and ``total_tokens``;
``prompt_tokens_details.cached_tokens`` is the prompt tokens whose prefill the prefix cache
skipped (OpenAI's meaning), and ``prompt_tokens_details.image_tokens`` the image tokens among
the prompt's, an extra field OpenAI's clients keep.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Any

from PIL import Image

from ascend_vlm.batching import GenerationRequest, RequestResult
from ascend_vlm.data.content_keys import (
    derived_content_key,
    vouch_content_key,
    vouched_content_key,
)
from ascend_vlm.serving.engine import Admitted
from ascend_vlm.serving.errors import ApiError
from ascend_vlm.serving.images import read_image
from ascend_vlm.serving.limits import LIMIT_FLAGS, ServingLimits
from ascend_vlm.serving.protocol import ChatCompletionRequest, ImagePart
from ascend_vlm.vision_input.content_cache import ContentCache

# The generator's finish reasons as OpenAI names them ("cancelled" and "error" never reach a
# client as a finish reason).
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}
# The longest side of an image sent with detail "low" (OpenAI's low-resolution mode: 512 x 512).
LOW_DETAIL_SIDE = 512


@dataclass(frozen=True)
class ServedModels:
    """What ``GET /v1/models`` lists: the base model's ``name`` and the resident adapters'
    names; ``base_adapter`` is the adapter name that means the base (None without adapters)."""

    name: str
    adapters: tuple[str, ...] = ()
    base_adapter: str | None = None

    def adapter_for(self, model: str) -> str | None:
        """The adapter a request's ``model`` picks; ApiError 404 naming ``model`` when it is
        not served."""
        if model == self.name:
            return self.base_adapter
        if model in self.adapters:
            return model
        served = ", ".join([self.name, *self.adapters])
        raise ApiError(
            404,
            f"model: expected one of the served models ({served}), got {model!r}",
            param="model",
            code="model_not_found",
        )

    def listing(self, created: int) -> dict[str, Any]:
        """The ``GET /v1/models`` body."""
        cards = [{"id": self.name, "object": "model", "created": created, "owned_by": "ascend_vlm"}]
        cards += [
            {"id": name, "object": "model", "created": created, "owned_by": "ascend_vlm",
             "parent": self.name}
            for name in self.adapters
        ]  # fmt: skip
        return {"object": "list", "data": cards}


def _low_detail(image: Image.Image) -> Image.Image:
    """``image`` shrunk to fit :data:`LOW_DETAIL_SIDE` pixels a side (aspect kept, never
    enlarged): a copy, since the image read may be the decoded cache's, shared by requests,
    vouched with the key the shrinking derives from ``image``'s."""
    if max(image.size) <= LOW_DETAIL_SIDE:
        return image
    shrunk = image.copy()
    shrunk.thumbnail((LOW_DETAIL_SIDE, LOW_DETAIL_SIDE))
    key = vouched_content_key(image)
    if key is not None:  # thumbnail is deterministic: equal images shrink to equal images
        vouch_content_key(shrunk, derived_content_key(key, f"thumbnail {LOW_DETAIL_SIDE}"))
    return shrunk


def _content(content: Any, where: str, limits: ServingLimits, decoded: ContentCache | None) -> Any:
    if isinstance(content, str):
        return content
    parts = []
    for index, part in enumerate(content):
        if isinstance(part, ImagePart):
            param = f"{where}.{index}.image_url.url"
            image = read_image(part.image_url.url, param, limits, decoded)
            if part.image_url.detail == "low":
                image = _low_detail(image)
            parts.append({"type": "image", "image": image})
        else:
            parts.append({"type": "text", "text": part.text})
    return parts


def _max_new_tokens(body: ChatCompletionRequest, limits: ServingLimits) -> int:
    name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    asked = getattr(body, name)
    if asked is None:
        return limits.max_completion_tokens
    if asked > limits.max_completion_tokens:
        raise ApiError(
            400,
            f"{name}: expected at most {limits.max_completion_tokens} (the server's "
            f"{LIMIT_FLAGS['max_completion_tokens']}), got {asked}",
            param=name,
            code="budget_exceeded",
        )
    return asked


def generation_request(
    body: ChatCompletionRequest,
    adapter: str | None,
    limits: ServingLimits,
    request_id: str,
    decoded: ContentCache | None = None,
) -> GenerationRequest:
    """The generator's request for ``body`` answered by ``adapter``; its images are read here
    (blocking: URL fetches and decoding, skipped for the images ``decoded`` holds). ApiError
    400 naming the field or limit at fault."""
    count = sum(
        isinstance(part, ImagePart)
        for message in body.messages
        if not isinstance(message.content, str)
        for part in message.content
    )
    if count > limits.max_images:
        raise ApiError(
            400,
            f"messages: the request has {count} images, more than {LIMIT_FLAGS['max_images']} "
            f"({limits.max_images})",
            param="messages",
            code="too_many_images",
        )
    messages = [
        {"role": message.role,
         "content": _content(message.content, f"messages.{index}.content", limits, decoded)}
        for index, message in enumerate(body.messages)
    ]  # fmt: skip
    temperature = 1.0 if body.temperature is None else body.temperature
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    return GenerationRequest(
        messages=messages,
        max_new_tokens=_max_new_tokens(body, limits),
        do_sample=temperature > 0,
        temperature=temperature if temperature > 0 else 1.0,
        top_p=body.top_p,
        seed=secrets.randbits(63) if body.seed is None else body.seed,
        stop=stop,
        adapter=adapter,
        request_id=request_id,
    )


def usage(admitted: Admitted, result: RequestResult) -> dict[str, Any]:
    """OpenAI's ``usage`` object of the finished request ``result``, with the prompt tokens the
    prefix cache gave it and the image tokens among the prompt's."""
    completion_tokens = len(result.tokens)
    return {
        "prompt_tokens": admitted.prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": admitted.prompt_tokens + completion_tokens,
        "prompt_tokens_details": {
            "cached_tokens": result.cached_tokens,
            "image_tokens": admitted.visual_tokens,
        },
    }


@dataclass(frozen=True)
class ResponseHeader:
    """What every response object of one request repeats."""

    request_id: str
    model: str
    created: int

    @classmethod
    def now(cls, request_id: str, model: str) -> ResponseHeader:
        return cls(request_id, model, int(time.time()))

    def fields(self, kind: str) -> dict[str, Any]:
        return {"id": self.request_id, "object": kind, "created": self.created, "model": self.model}


def completion(header: ResponseHeader, result: RequestResult, admitted: Admitted) -> dict:
    """The ``chat.completion`` object of a finished request."""
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": result.text},
        "finish_reason": FINISH_REASONS[result.finish_reason],
        "logprobs": None,
    }
    return {
        **header.fields("chat.completion"),
        "choices": [choice],
        "usage": usage(admitted, result),
    }


def chunk(
    header: ResponseHeader,
    delta: dict[str, Any] | None,
    finish_reason: str | None = None,
    usage_object: dict[str, Any] | None = None,
) -> dict:
    """A ``chat.completion.chunk``: one choice with ``delta`` (None: no choice, the usage
    chunk), its ``finish_reason`` and ``usage``."""
    choices = [] if delta is None else [
        {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
    ]  # fmt: skip
    return {**header.fields("chat.completion.chunk"), "choices": choices, "usage": usage_object}
