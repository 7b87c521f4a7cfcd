"""One content hash per served image: with every reuse cache on (decoded images, preprocessed
pixels, vision features, prefix cache) a request hashes each image's bytes once, where the
server reads them, and every cache downstream keys the image by that hash (with the
processor's settings where it keys what the processor made), never hashing its pixels again;
and the keys keep apart what must stay apart."""

from __future__ import annotations

import collections

import pytest
from PIL import Image
from served_vlm import chat_messages, data_url

from ascend_vlm._byte_units import MIB
from ascend_vlm.batching import BatchGenerator, prefix_keys
from ascend_vlm.reuse import VisionCache, disable_vision_cache, enable_vision_cache, vision_cache_of
from ascend_vlm.reuse import vision_cache as vision_cache_module
from ascend_vlm.serving import images as served_images
from ascend_vlm.serving.conversion import generation_request
from ascend_vlm.serving.images import decoded_image_cache
from ascend_vlm.serving.limits import ServingLimits
from ascend_vlm.serving.protocol import ChatCompletionRequest
from ascend_vlm.vision_input import _pixels
from ascend_vlm.vision_input.fast_processor import with_fast_pixels

IMAGES = (Image.new("RGB", (96, 80), "red"), Image.new("RGB", (64, 64), "blue"))
# Each content hash of the request path: where it is looked up, its name there.
HASHES = (
    (served_images, "bytes_key"),
    (_pixels, "image_key"),
    (prefix_keys, "image_digest"),
    (vision_cache_module, "content_key"),
)


@pytest.fixture
def counted_hashes(monkeypatch) -> collections.Counter:
    """Calls of each content hash of the request path, by name."""
    calls: collections.Counter = collections.Counter()
    for module, name in HASHES:
        original = getattr(module, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    return calls


def _request(system: str, request_id: str, decoded):
    messages = [{"role": "system", "content": system}, *chat_messages("describe", IMAGES)]
    body = ChatCompletionRequest(model="m", messages=messages, max_tokens=2, temperature=0)
    return generation_request(body, None, ServingLimits(), request_id, decoded)


def test_each_image_is_hashed_once_per_request(model_and_processor, counted_hashes):
    model, processor = model_and_processor
    systems = ("be brief", "be terse")
    plain = BatchGenerator(model, processor, prefix_cache=False)
    expected = [plain.generate_many([_request(system, "p", None)])[0] for system in systems]
    counted_hashes.clear()
    enable_vision_cache(model, VisionCache(max_bytes=64 * MIB))
    try:
        fast = with_fast_pixels(processor, cache_bytes=64 * MIB)
        generator = BatchGenerator(model, fast, prefix_cache=True)
        decoded = decoded_image_cache(64 * MIB)
        # The second request's system text differs: its prefix misses and its images are
        # encoded again, answered by the vision cache.
        for index, system in enumerate(systems):
            [result] = generator.generate_many([_request(system, f"r{index}", decoded)])
            assert dict(counted_hashes) == {"bytes_key": 2 * (index + 1)}
            assert result.tokens == expected[index].tokens  # hits answer as no cache does
        assert (decoded.hits, decoded.misses) == (2, 2)
        pixels = fast.image_processor.pixel_cache
        assert (pixels.hits, pixels.misses) == (2, 2)
        stats = vision_cache_of(model).stats()
        assert (stats.hits, stats.misses) == (2, 2)
    finally:
        disable_vision_cache(model)


def _turn(images, detail: str, request_id: str, decoded):
    parts = [
        {"type": "image_url", "image_url": {"url": data_url(image), "detail": detail}}
        for image in images
    ]
    messages = [{"role": "user", "content": [*parts, {"type": "text", "text": "describe"}]}]
    body = ChatCompletionRequest(model="m", messages=messages, max_tokens=2, temperature=0)
    return generation_request(body, None, ServingLimits(), request_id, decoded)


def test_other_content_or_detail_never_shares_a_key(model_and_processor):
    model, processor = model_and_processor
    big = Image.new("RGB", (640, 480), "red")
    turns = [
        ((Image.new("RGB", (64, 64), "red"),), "auto"),
        ((Image.new("RGB", (64, 64), "blue"),), "auto"),  # same tokens, other pixels
        ((big,), "high"),
        ((big,), "low"),  # the same bytes shrunk: another image
    ]
    plain = BatchGenerator(model, processor, prefix_cache=False)
    expected = plain.generate_many(
        [_turn(images, detail, f"p{index}", None) for index, (images, detail) in enumerate(turns)]
    )
    enable_vision_cache(model, VisionCache(max_bytes=64 * MIB))
    try:
        fast = with_fast_pixels(processor, cache_bytes=64 * MIB)
        generator = BatchGenerator(model, fast, prefix_cache=True)
        decoded = decoded_image_cache(64 * MIB)
        for index, (images, detail) in enumerate(turns):
            [result] = generator.generate_many([_turn(images, detail, f"r{index}", decoded)])
            assert result.tokens == expected[index].tokens
            assert result.cached_tokens == 0  # the first image token is in the first block
        assert (decoded.hits, decoded.misses) == (1, 3)
        assert fast.image_processor.pixel_cache.hits == 0
        assert vision_cache_of(model).stats().hits == 0
    finally:
        disable_vision_cache(model)
