"""Reuse across requests through the server, with the official ``openai`` client on 127.0.0.1:
a three-turn conversation with images gets the same greedy answers with every cache on (prefix
cache, vision cache, decoded images, preprocessed pixels) as with none, and ``usage``'s
``prompt_tokens_details.cached_tokens`` counts the prompt tokens the prefix cache gave each
request (OpenAI's meaning), streaming and not."""

from __future__ import annotations

import contextlib

import pytest
from PIL import Image
from served_vlm import MODEL_NAME, chat_messages, running_server

from ascend_vlm._byte_units import MIB
from ascend_vlm.reuse import VisionCache, disable_vision_cache, enable_vision_cache
from ascend_vlm.serving.images import decoded_image_cache
from ascend_vlm.vision_input.fast_processor import with_fast_pixels

TURNS = (
    ("describe both pictures", (Image.new("RGB", (96, 80), "red"), Image.new("RGB", (64, 64), "blue"))),
    ("which is larger", ()),
    ("and which colour is on the left", ()),
)  # fmt: skip


@contextlib.contextmanager
def _server(model, processor, reuse: bool):
    """A server of ``model`` with every reuse cache (``reuse``) or none; yields it and its
    caches of decoded images and preprocessed pixels (None without reuse)."""
    if not reuse:
        with running_server(model, processor, prefix_cache=False) as server:
            yield server, None, None
        return
    enable_vision_cache(model, VisionCache(max_bytes=64 * MIB))
    try:
        fast = with_fast_pixels(processor, cache_bytes=64 * MIB)
        decoded = decoded_image_cache(64 * MIB)
        with running_server(model, fast, decoded_images=decoded, prefix_cache=True) as server:
            yield server, decoded, fast.image_processor.pixel_cache
    finally:
        disable_vision_cache(model)


def _conversation(server) -> list[tuple[str, object]]:
    """Each turn's answer and usage; the last turn streamed with a usage chunk."""
    client = server.client()
    messages: list[dict] = []
    answers = []
    for index, (text, images) in enumerate(TURNS):
        messages += chat_messages(text, images)
        settings = {"model": MODEL_NAME, "messages": messages, "max_tokens": 6, "temperature": 0}
        if index < len(TURNS) - 1:
            answer = client.chat.completions.create(**settings)
            content, counts = answer.choices[0].message.content, answer.usage
        else:
            chunks = list(
                client.chat.completions.create(
                    **settings, stream=True, stream_options={"include_usage": True}
                )
            )
            content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            counts = chunks[-1].usage
        answers.append((content, counts))
        messages.append({"role": "assistant", "content": content})
    return answers


@pytest.mark.slow
def test_reuse_answers_as_no_reuse_and_counts_cached_tokens(model_and_processor):
    model, processor = model_and_processor
    with _server(model, processor, reuse=False) as (server, _, _):
        plain = _conversation(server)
    with _server(model, processor, reuse=True) as (server, decoded, pixels):
        reused = _conversation(server)
        again = _conversation(server)  # every image and turn seen before
    # Six requests each carry the same two images: decoded and preprocessed once each.
    assert (decoded.misses, decoded.hits) == (2, 10)
    assert (pixels.misses, pixels.hits) == (2, 10)
    for (text, counts), (reused_text, reused_counts) in zip(plain, reused, strict=True):
        assert reused_text == text
        assert reused_counts.prompt_tokens == counts.prompt_tokens
        assert reused_counts.completion_tokens == counts.completion_tokens
        assert counts.prompt_tokens_details.cached_tokens == 0
    assert [text for text, _ in again] == [text for text, _ in plain]
    cached = [counts.prompt_tokens_details.cached_tokens for _, counts in reused]
    # The first turn finds nothing; later turns start with the earlier turns' blocks, whole
    # 16-token blocks of the prompt, always leaving at least its last token to prefill.
    assert cached[0] == 0
    for tokens, (_, counts) in zip(cached[1:], reused[1:], strict=True):
        assert 0 < tokens < counts.prompt_tokens and tokens % 16 == 0
        assert tokens >= counts.prompt_tokens_details.image_tokens
    assert again[0][1].prompt_tokens_details.cached_tokens > 0
