"""The vision-feature cache: exact reuse per family, invalidation, LRU under a byte bound,
threads, named keys, the mock NPU, and bad input."""

from __future__ import annotations

import contextvars
import threading
from collections import OrderedDict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ascend_vlm
from ascend_vlm.models import tiny
from ascend_vlm.reuse.cache_entry import CachedFeatures
from ascend_vlm.reuse.cached_features import (
    disable_vision_cache,
    enable_vision_cache,
    vision_cache_of,
)
from ascend_vlm.reuse.vision_cache import VisionCache

FAMILIES = [
    "qwen2_vl",
    "qwen2_5_vl",
    "qwen3_vl",
    "qwen3_vl_moe",
    "llava_clip",
    "glm4v",
    "glm4v_moe",
    "qwen3_5",
    "qwen3_5_moe",
    "paddleocr_vl",
]


def _model(name: str = "qwen2_vl"):
    return tiny.build_model(name, attn_implementation="sdpa")


def _logits(model, inputs):
    with torch.no_grad():
        return model(**inputs).logits


def _encoder_calls(model):
    """A list that grows by the number of images at each vision-tower call."""
    calls = []
    tower = getattr(model.model, "visual", None) or model.model.vision_tower
    tower.register_forward_pre_hook(lambda module, args: calls.append(1))
    return calls


@pytest.mark.parametrize("name", FAMILIES)
def test_cached_features_give_the_uncached_outputs(name):
    model = _model(name)
    inputs = tiny.make_inputs(name, model, n_images=2)
    expected = _logits(model, inputs)
    cache = VisionCache(max_bytes=1 << 20)
    enable_vision_cache(model, cache)
    calls = _encoder_calls(model)
    first, second = _logits(model, inputs), _logits(model, inputs)
    torch.testing.assert_close(first, expected, rtol=0, atol=0)
    torch.testing.assert_close(second, expected, rtol=0, atol=0)
    assert len(calls) == 1  # the second forward encoded nothing
    stats = cache.stats()
    assert (stats.hits, stats.misses, stats.entries) == (2, 2, 2) and stats.hit_rate == 0.5
    with torch.no_grad():
        generated = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    disable_vision_cache(model)
    with torch.no_grad():
        assert torch.equal(model.generate(**inputs, max_new_tokens=3, do_sample=False), generated)


def _first_image_only(inputs):
    """``inputs`` (Qwen2-VL, several images) cut down to its first image and the text."""
    ids = inputs["input_ids"][0].tolist()
    tokens = int(inputs["image_grid_thw"][0].prod()) // 4
    start = ids.index(tiny.IMAGE_TOKEN)
    end = len(ids) - ids[::-1].index(tiny.IMAGE_TOKEN)
    kept = ids[: start + tokens] + ids[end:]
    input_ids = torch.tensor([kept])
    patches = int(inputs["image_grid_thw"][0].prod())
    return {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "mm_token_type_ids": (input_ids == tiny.IMAGE_TOKEN).int(),
        "pixel_values": inputs["pixel_values"][:patches],
        "image_grid_thw": inputs["image_grid_thw"][:1],
    }


def test_only_the_missing_images_are_encoded():
    model = _model()
    expected = _logits(model, three := tiny.make_inputs("qwen2_vl", model, n_images=3))
    cache = VisionCache(max_bytes=1 << 20)
    enable_vision_cache(model, cache)
    _logits(model, _first_image_only(three))
    seen = []
    model.model.visual.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape))
    # Encoding 2 images instead of 3 changes the vision tower's matmul shapes, which may
    # change how the CPU kernels block their sums: equal up to rounding, not bit for bit.
    torch.testing.assert_close(_logits(model, three), expected)
    patches = int(three["image_grid_thw"][0].prod())
    assert seen == [torch.Size([2 * patches, three["pixel_values"].shape[1]])]


def test_a_changed_quantized_vision_weight_misses():
    from ascend_vlm.quantization import QuantizationConfig, QuantLinear, quantize

    model = _model()
    quantize(model, QuantizationConfig(bits=8, group_size=128, include=("vision",)), progress=False)
    cache = VisionCache(max_bytes=1 << 20)
    enable_vision_cache(model, cache)
    inputs = tiny.make_inputs("qwen2_vl", model, n_images=1)
    before = _logits(model, inputs)
    layer = next(m for m in model.model.visual.modules() if isinstance(m, QuantLinear))
    with torch.no_grad():
        layer.scale.mul_(2)  # the quantized weights live in buffers
    after = _logits(model, inputs)
    assert cache.stats().hits == 0 and not torch.equal(before, after)


@pytest.mark.parametrize("change", ["load_state_dict", "optimizer_step", "dtype"])
def test_changed_vision_weights_miss_and_give_the_new_result(change):
    model = _model()
    inputs = tiny.make_inputs("qwen2_vl", model, n_images=1)
    cache = VisionCache(max_bytes=1 << 20)
    enable_vision_cache(model, cache)
    before = _logits(model, inputs)
    if change == "load_state_dict":
        state = model.model.visual.state_dict()
        state = {key: value + 0.05 for key, value in state.items()}
        model.model.visual.load_state_dict(state)
    elif change == "optimizer_step":
        optimizer = torch.optim.SGD(model.model.visual.parameters(), lr=0.5)
        model.model.visual.merger.mlp[0].weight.grad = torch.ones_like(
            model.model.visual.merger.mlp[0].weight
        )
        optimizer.step()
    else:
        model.to(torch.float64)
        inputs = {
            key: value.double() if value.is_floating_point() else value
            for key, value in inputs.items()
        }
    after = _logits(model, inputs)
    assert cache.stats().misses == 2 and cache.stats().entries == 2  # the stale one stays
    disable_vision_cache(model)
    torch.testing.assert_close(after, _logits(model, inputs), rtol=0, atol=0)
    assert not torch.allclose(after.double(), before.double())


def test_named_images_skip_hashing_and_share_entries():
    model = _model()
    cache = VisionCache(max_bytes=1 << 20)
    enable_vision_cache(model, cache)
    inputs = tiny.make_inputs("qwen2_vl", model, n_images=2)
    with cache.named_images(["cat.jpg", "dog.jpg"]):
        first = _logits(model, inputs)
    with cache.named_images(["cat.jpg", "dog.jpg"]):
        second = _logits(model, inputs)
    torch.testing.assert_close(first, second, rtol=0, atol=0)
    stats = cache.stats()
    assert (stats.hits, stats.misses, stats.hashed_images) == (2, 2, 0)
    assert any(key[0][:2] == ("named", "cat.jpg") for key in cache.cached_keys())
    too_few = r"^keys: named_images has 1 keys left for 2 images"
    with pytest.raises(ValueError, match=too_few), cache.named_images(["cat.jpg"]):
        _logits(model, inputs)
    wrong_type = r"^keys: expected str, bytes or int image keys, got 1.5"
    with pytest.raises(TypeError, match=wrong_type), cache.named_images([1.5]):
        pass


def _value(size: int) -> CachedFeatures:
    return CachedFeatures(object, False, (torch.zeros(size, dtype=torch.uint8),))


@settings(max_examples=60, deadline=None)
@given(
    st.integers(min_value=1, max_value=64),
    st.lists(
        st.tuples(st.sampled_from(["store", "lookup"]), st.integers(0, 7), st.integers(1, 40)),
        max_size=60,
    ),
)
def test_lru_order_and_byte_bound_follow_a_reference(max_bytes, operations):
    cache = VisionCache(max_bytes=max_bytes)
    reference: OrderedDict[int, int] = OrderedDict()
    cache.lookup(1, "weights", [])
    for operation, key, size in operations:
        if operation == "store":
            cache.store(1, "weights", key, _value(size))
            if size <= max_bytes:
                reference.pop(key, None)
                reference[key] = size
                while sum(reference.values()) > max_bytes:
                    reference.popitem(last=False)
        else:
            (found,) = cache.lookup(1, "weights", [key])
            assert (found is not None) == (key in reference)
            if found is not None:
                assert found.nbytes == reference[key]
                reference.move_to_end(key)
        assert cache.cached_keys() == list(reference)
        assert cache.stats().bytes == sum(reference.values()) <= max_bytes


def test_threads_share_one_cache_consistently():
    model = _model()
    cache = VisionCache(max_bytes=1 << 20)
    enable_vision_cache(model, cache)
    inputs = tiny.make_inputs("qwen2_vl", model, n_images=2)
    expected = _logits(model, inputs)
    results, errors = [], []

    def worker():
        try:
            for _ in range(5):
                results.append(_logits(model, inputs))
        except Exception as error:  # pragma: no cover - reported below
            errors.append(error)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert all(torch.equal(result, expected) for result in results)
    stats = cache.stats()
    assert stats.hits + stats.misses == 2 * 21 and stats.entries == 2


def test_the_mock_npu_path_gives_the_cpu_result(mock_npu):
    model = _model()
    ascend_vlm.patch(model)
    inputs = tiny.make_inputs("qwen2_vl", model, n_images=2)
    expected = _logits(model, inputs)
    cache = VisionCache(max_bytes=1 << 20)
    enable_vision_cache(model, cache)
    _logits(model, inputs)
    torch.testing.assert_close(_logits(model, inputs), expected, rtol=0, atol=0)
    assert cache.stats().hits == 2


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match=r"^max_bytes: expected > 0, got -1"):
        VisionCache(max_bytes=-1)
    with pytest.raises(TypeError, match=r"^max_bytes: expected an int, got float"):
        VisionCache(max_bytes=1.5)
    with pytest.raises(TypeError, match=r"^max_bytes: expected an int, got bool"):
        VisionCache(max_bytes=True)
    model = _model()
    with pytest.raises(TypeError, match=r"^cache: expected a VisionCache, got dict"):
        enable_vision_cache(model, {})
    with pytest.raises(
        ValueError, match=r"^model: the vision cache supports model_type .*'gemma3'"
    ):
        enable_vision_cache(tiny.build_model("gemma3"), VisionCache(max_bytes=1))
    with pytest.raises(TypeError, match=r"^model: expected a torch.nn.Module"):
        enable_vision_cache("qwen2_vl", VisionCache(max_bytes=1))


def test_enable_switches_caches_and_disable_restores():
    model = _model()
    first, second = VisionCache(max_bytes=1 << 20), VisionCache(max_bytes=1 << 20)
    enable_vision_cache(model, first)
    enable_vision_cache(model, second)
    assert vision_cache_of(model) is second
    _logits(model, tiny.make_inputs("qwen2_vl", model, n_images=1))
    assert (len(first), len(second)) == (0, 1)
    disable_vision_cache(model)
    assert vision_cache_of(model) is None
    assert "get_image_features" not in vars(model.model)


def test_a_cache_outlives_disabling_and_serves_a_fresh_enable():
    model = _model()
    inputs = tiny.make_inputs("qwen2_vl", model, n_images=2)
    cache = VisionCache(max_bytes=1 << 20)
    enable_vision_cache(model, cache)
    expected = _logits(model, inputs)
    disable_vision_cache(model)
    enable_vision_cache(model, cache)
    calls = _encoder_calls(model)
    torch.testing.assert_close(_logits(model, inputs), expected, rtol=0, atol=0)
    assert calls == [] and cache.stats().hits == 2


def test_pruning_runs_on_cached_features():
    from ascend_vlm import pruning

    model = _model()
    inputs = tiny.make_inputs("qwen2_vl", model, n_images=2)
    pruning.enable_token_pruning(model, pruning.PruneConfig(method="fastv", layer=1, keep=0.5))
    try:
        expected = _logits(model, inputs)
        cache = VisionCache(max_bytes=1 << 20)
        enable_vision_cache(model, cache)
        _logits(model, inputs)
        torch.testing.assert_close(_logits(model, inputs), expected, rtol=0, atol=0)
        assert pruning.pruning_stats(model).kept_visual_tokens == (4,)
        assert cache.stats().hits == 2
    finally:
        pruning.disable_token_pruning(model)


def _video(model, frames: int = 4):
    vision = model.config.vision_config
    side = vision.image_side_in_patches
    grid = torch.tensor([[frames // vision.temporal_patch_size, side, side]])
    patch = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    pixels = torch.randn(int(grid.prod()), patch, generator=torch.Generator().manual_seed(7))
    return pixels, grid


@pytest.mark.parametrize("name", ["qwen2_vl", "qwen3_vl", "qwen3_vl_moe"])
def test_videos_are_cached_once_and_apart_from_images(name):
    # Qwen3-VL's video features run its image features: the inner call must not count, key or
    # store anything of its own.
    model = _model(name)
    pixels, grid = _video(model)
    with torch.no_grad():
        expected = model.model.get_video_features(pixels, grid).pooler_output
        cache = VisionCache(max_bytes=1 << 20)
        enable_vision_cache(model, cache)
        with cache.named_images(["clip-A"]):
            first = model.model.get_video_features(pixels, grid).pooler_output
        with cache.named_images(["clip-A"]):
            second = model.model.get_video_features(pixels, grid).pooler_output
        with cache.named_images(["clip-A"]):  # the same name as an image: another entry
            image = model.model.get_image_features(pixels, grid).pooler_output
    for got in (first, second):
        torch.testing.assert_close(torch.cat(got), torch.cat(expected), rtol=0, atol=0)
    assert len(image) == 1
    stats = cache.stats()
    assert (stats.hits, stats.misses, stats.entries) == (1, 2, 2)


def test_named_keys_serve_one_thread_and_must_all_be_used():
    model = _model()
    cache = VisionCache(max_bytes=1 << 20)
    enable_vision_cache(model, cache)
    inputs = tiny.make_inputs("qwen2_vl", model, n_images=1)
    errors = []
    with cache.named_images(["a.jpg"]):
        # the worker runs in a copy of this context, as executors and asyncio.to_thread do
        worker = threading.Thread(
            target=contextvars.copy_context().run,
            args=(lambda: errors.append(_try(model, inputs)),),
        )
        worker.start()
        worker.join()
        _logits(model, inputs)
    assert isinstance(errors[0], RuntimeError) and "thread that opened the block" in str(errors[0])
    unused = r"^keys: named_images got 2 keys but 1 images were encoded"
    with pytest.raises(ValueError, match=unused), cache.named_images(["a.jpg", "b.jpg"]):
        _logits(model, inputs)


def _try(model, inputs):
    try:
        _logits(model, inputs)
    except Exception as error:
        return error
    return None


def test_training_through_the_vision_tower_is_never_cached():
    model = _model().train()
    cache = VisionCache(max_bytes=1 << 20)
    enable_vision_cache(model, cache)
    inputs = tiny.make_inputs("qwen2_vl", model, n_images=1)
    for _ in range(2):
        model(**inputs).logits.sum().backward()
        assert model.model.visual.merger.mlp[0].weight.grad is not None
        model.zero_grad()
    assert cache.stats().hits + cache.stats().misses == 0


def test_adapter_switches_and_disabling_miss():
    peft = pytest.importorskip("peft")
    model = _model()
    wrapped = peft.get_peft_model(
        model,
        peft.LoraConfig(r=2, target_modules=["visual.merger.mlp.0"], init_lora_weights=False),
    ).eval()
    inputs = tiny.make_inputs("qwen2_vl", model, n_images=1)
    cache = VisionCache(max_bytes=1 << 20)
    enable_vision_cache(wrapped, cache)
    adapted = _logits(wrapped, inputs)
    with wrapped.disable_adapter():
        plain = _logits(wrapped, inputs)
    disable_vision_cache(wrapped)
    with wrapped.disable_adapter():
        torch.testing.assert_close(plain, _logits(wrapped, inputs), rtol=0, atol=0)
    assert not torch.allclose(adapted, plain)
    assert cache.stats().misses == 2


def test_a_tuple_is_returned_when_asked_for():
    model = _model()
    inputs = tiny.make_inputs("qwen2_vl", model, n_images=1)
    enable_vision_cache(model, VisionCache(max_bytes=1 << 20))
    with torch.no_grad():
        for _ in range(2):
            result = model.model.get_image_features(
                inputs["pixel_values"], inputs["image_grid_thw"], return_dict=False
            )
            assert isinstance(result, tuple) and result[0][0].shape[0] == 4
