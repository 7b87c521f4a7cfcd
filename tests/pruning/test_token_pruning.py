"""Token pruning and SnapKV on tiny 4-layer models: identity at keep=1, real removal, positions,
caches, batching, generation paths, the mock NPU, and bad input."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _pruning_models import LAYERS, greedy, tiny_model
from torch.utils._python_dispatch import TorchDispatchMode

import ascend_vlm
from ascend_vlm import pruning
from ascend_vlm.models import tiny
from ascend_vlm.pruning import PruneConfig, SnapKVConfig
from ascend_vlm.pruning.config import kept_count

FAMILIES = [
    "qwen2_vl",
    "qwen2_5_vl",
    "qwen3_vl",
    "qwen3_vl_moe",
    "llava_clip",
    "llava_onevision",
    "internvl",
    "idefics3",
    "glm4v",
    "glm46v",
    "glm4v_moe",
    "mistral3",
    "paddleocr_vl",
    "deepseek_ocr2",
]
METHODS = ["fastv", "divprune", "random", "uniform"]


def _enable(model, track, prune=None, kv=None):
    pruning.enable_token_pruning(model, prune, kv=kv)
    track(model)


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("method", METHODS)
def test_keep_one_is_the_unprunedtiny_model(name, method, pruned):
    model = tiny_model(name)
    inputs = tiny.make_inputs(name, model, n_images=2)
    with torch.no_grad():
        logits = model(**inputs).logits
    tokens = greedy(model, inputs)
    _enable(model, pruned, PruneConfig(method=method, layer=2, keep=1.0))
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs).logits, logits, rtol=0, atol=0)
    assert torch.equal(greedy(model, inputs), tokens)
    assert pruning.pruning_stats(model).kv_ratio == 1.0


@pytest.mark.parametrize("name", FAMILIES)
def test_snapkv_without_compression_is_the_unprunedtiny_model(name, pruned):
    model = tiny_model(name)
    inputs = tiny.make_inputs(name, model, n_images=1)
    tokens = greedy(model, inputs)
    _enable(model, pruned, kv=SnapKVConfig(compression_ratio=0.0, window=2))
    assert torch.equal(greedy(model, inputs), tokens)


def _kept_visual(inputs, keep: float) -> tuple[int, int]:
    visual = int((inputs["input_ids"] == tiny.IMAGE_TOKEN).sum())
    return visual, kept_count(keep, visual)


@pytest.mark.parametrize("method", METHODS)
def test_pruned_layers_compute_and_cache_only_the_kept_tokens(method, pruned):
    model = tiny_model()
    inputs = tiny.make_inputs("qwen2_vl", model, n_images=2)
    prompt = inputs["input_ids"].shape[1]
    visual, kept = _kept_visual(inputs, 0.5)
    _enable(model, pruned, PruneConfig(method=method, layer=2, keep=0.5))
    seen = []
    handle = model.model.language_model.layers[3].register_forward_pre_hook(
        lambda module, args: seen.append(args[0].shape[1])
    )
    with torch.no_grad():
        output = model.generate(
            **inputs, max_new_tokens=3, do_sample=False, return_dict_in_generate=True
        )
    handle.remove()
    pruned_prompt = prompt - (visual - kept)
    assert seen == [pruned_prompt, 1, 1]
    cache = output.past_key_values
    lengths = [layer.keys.shape[2] for layer in cache.layers]
    assert lengths == [prompt + 2, prompt + 2, pruned_prompt + 2, pruned_prompt + 2]
    stats = pruning.pruning_stats(model)
    assert stats.visual_tokens == (visual,) and stats.kept_visual_tokens == (kept,)
    assert stats.layer_tokens == (prompt, prompt, pruned_prompt, pruned_prompt)
    assert stats.kv_ratio == pytest.approx((2 * prompt + 2 * pruned_prompt) / (4 * prompt))
    assert stats.flops < stats.flops_unpruned


@pytest.mark.parametrize("name", ["qwen2_vl", "glm4v", "glm4v_moe"])
def test_kept_tokens_keep_their_mrope_positions(name, pruned):
    model = tiny_model(name)
    inputs = tiny.make_inputs(name, model, n_images=2)
    layer = model.model.language_model.layers[2]
    tables = []

    def record(module, args, kwargs):
        tables.append(kwargs["position_embeddings"][0])

    with torch.no_grad():
        handle = layer.register_forward_pre_hook(record, with_kwargs=True)
        model(**inputs)
        handle.remove()
        _enable(model, pruned, PruneConfig(method="fastv", layer=2, keep=0.5))
        handle = layer.register_forward_pre_hook(record, with_kwargs=True)  # after pruning's
        model(**inputs)
        handle.remove()
    full, kept = tables
    positions = pruning.pruning_stats(model).kept_positions
    assert positions.shape[1] == kept.shape[-2] < full.shape[-2]
    assert torch.equal(kept, full[..., positions[0], :])
    # the visual tokens' (t, h, w) positions are not 1-D: a recomputed table would differ
    assert not torch.equal(kept, full[..., : kept.shape[-2], :])


@pytest.mark.parametrize("name", ["qwen2_vl", "glm4v", "glm4v_moe"])
@pytest.mark.parametrize("method", ["random", "uniform"])
def test_decode_steps_match_a_pruned_forward_over_the_whole_sequence(method, name, pruned):
    # random/uniform choose the same tokens whatever the prompt ends with, so the logits of
    # every cached decode step equal those of one pruned forward over prompt + tokens so far
    model = tiny_model(name)
    inputs = tiny.make_inputs(name, model, n_images=2)
    _enable(model, pruned, PruneConfig(method=method, layer=2, keep=0.5))
    with torch.no_grad():
        output = model.generate(
            **inputs,
            max_new_tokens=4,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
        prompt = inputs["input_ids"].shape[1]
        for step, logits in enumerate(output.logits):
            sequence = output.sequences[:, : prompt + step]
            full = dict(inputs, input_ids=sequence, attention_mask=torch.ones_like(sequence))
            full["mm_token_type_ids"] = (sequence == tiny.IMAGE_TOKEN).int()
            expected = model(**full).logits[:, -1]
            torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("method", METHODS)
def test_a_batch_prunes_each_row_as_alone(method, pruned):
    model = tiny_model("qwen2_vl")
    rows = [
        tiny.qwen_prompt(model, 2, 5, 1),
        tiny.qwen_prompt(model, 1, 3, 2),
        tiny.qwen_prompt(model, 3, 2, 3),
    ]
    _enable(model, pruned, PruneConfig(method=method, layer=2, keep=0.4))
    batched = greedy(model, tiny.left_padded_qwen_batch(rows), steps=3)
    kept_batched = pruning.pruning_stats(model).kept_visual_tokens
    for index, row in enumerate(rows):
        alone = greedy(model, tiny.left_padded_qwen_batch([row]), steps=3)
        assert torch.equal(batched[index, -3:], alone[0, -3:]), index
        assert pruning.pruning_stats(model).kept_visual_tokens == (kept_batched[index],)


def test_static_cache_generates_what_the_dynamic_cache_does(pruned):
    model = tiny_model("qwen2_vl")
    inputs = tiny.left_padded_qwen_batch(
        [tiny.qwen_prompt(model, 2, 4, 1), tiny.qwen_prompt(model, 1, 2, 2)]
    )
    _enable(model, pruned, PruneConfig(method="fastv", layer=2, keep=0.3))
    dynamic = greedy(model, inputs, steps=5)
    static = greedy(model, inputs, steps=5, cache_implementation="static")
    assert torch.equal(dynamic, static)


@pytest.mark.parametrize("method", ["fastv", "divprune"])
def test_attention_implementations_and_patch_prune_alike(method, pruned):
    config = PruneConfig(method=method, layer=2, keep=0.5)
    results = []
    for attn, patched in (("eager", False), ("sdpa", False), ("sdpa", True)):
        model = tiny_model("qwen2_vl", attn=attn)
        inputs = tiny.make_inputs("qwen2_vl", model, n_images=2)
        if patched:
            ascend_vlm.patch(model)
        _enable(model, pruned, config)
        with torch.no_grad():
            logits = model(**inputs).logits
        results.append((logits, pruning.pruning_stats(model).kept_positions))
    for logits, positions in results[1:]:
        assert torch.equal(positions, results[0][1])
        torch.testing.assert_close(logits, results[0][0], atol=1e-5, rtol=1e-5)


def test_mock_npu_path_equals_the_cpu_path(pruned, request):
    config = PruneConfig(method="fastv", layer=2, keep=0.5)
    kv = SnapKVConfig(compression_ratio=0.5, window=2)
    results = []
    for backend in ("cpu", "mock"):
        model = tiny_model("qwen2_vl")
        ascend_vlm.patch(model)
        _enable(model, pruned, config, kv)
        inputs = tiny.make_inputs("qwen2_vl", model, n_images=2)
        if backend == "mock":
            request.getfixturevalue("mock_npu")
        with torch.no_grad():
            output = model.generate(
                **inputs,
                max_new_tokens=3,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
        results.append(output)
    cpu, mock = results
    assert torch.equal(cpu.sequences, mock.sequences)
    for a, b in zip(cpu.logits, mock.logits, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


class _HostReads(TorchDispatchMode):
    """Counts reads of tensor values back to the host: the dispatcher's scalar reads and
    data-dependent shapes, and the Python conversions that bypass it (``tolist``, ``bool`` ...)."""

    OPS = frozenset({"_local_scalar_dense", "nonzero", "item", "equal", "unique"})
    METHODS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__")

    def __init__(self, monkeypatch):
        super().__init__()
        self.count = 0
        for name in self.METHODS:
            method = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._counting(method))

    def _counting(self, method):
        def counted(tensor, *args, **kwargs):
            self.count += 1
            return method(tensor, *args, **kwargs)

        return counted

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] in self.OPS:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _host_reads(model, inputs) -> int:
    with pytest.MonkeyPatch.context() as monkeypatch:
        with torch.no_grad(), _HostReads(monkeypatch) as counter:
            model(**inputs, use_cache=True)
        return counter.count


@pytest.mark.parametrize(
    "configs",
    [(PruneConfig(method=method, layer=2, keep=0.5), None) for method in METHODS]
    + [(None, SnapKVConfig(window=2)), (PruneConfig(layer=2), SnapKVConfig(window=2))],
    ids=[*METHODS, "snapkv", "fastv+snapkv"],
)
def test_pruning_adds_one_host_read_per_prefill_not_per_layer(configs, pruned):
    added = []
    for layers in (4, 8):
        model = tiny_model("qwen2_vl", layers=layers)
        inputs = tiny.make_inputs("qwen2_vl", model, n_images=2)
        unpruned = _host_reads(model, inputs)
        _enable(model, pruned, *configs)
        added.append(_host_reads(model, inputs) - unpruned)
    assert added == [1, 1]  # the visual-token counts


def test_fastv_and_snapkv_combine(pruned):
    model = tiny_model("qwen2_vl")
    inputs = tiny.make_inputs("qwen2_vl", model, n_images=2)
    prompt = inputs["input_ids"].shape[1]
    _enable(
        model,
        pruned,
        PruneConfig(method="fastv", layer=2, keep=0.5),
        SnapKVConfig(compression_ratio=0.5, window=2, per_head=False),
    )
    with torch.no_grad():
        output = model.generate(
            **inputs, max_new_tokens=2, do_sample=False, return_dict_in_generate=True
        )
    stats = pruning.pruning_stats(model)
    cut = stats.layer_tokens[2]
    assert stats.layer_tokens[0] == prompt and stats.layer_tokens[1] == prompt - prompt // 2
    assert cut < prompt - prompt // 2
    lengths = [layer.keys.shape[2] for layer in output.past_key_values.layers]
    assert lengths == [length + 1 for length in stats.layer_tokens]


# ---------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"keep": 0.0}, r"^keep: expected a number with 0 < x <= 1, got 0.0"),
        ({"keep": 1.5}, r"^keep: "),
        ({"keep": float("nan")}, r"^keep: "),
        ({"method": "fastest"}, r"^method: expected one of fastv, divprune, random, uniform"),
        ({"layer": 0}, r"^layer: expected an int >= 1, got 0"),
        ({"layer": True}, r"^layer: "),
    ],
)
def test_bad_prune_configs_are_refused(arguments, message):
    with pytest.raises(ValueError, match=message):
        PruneConfig(**arguments)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"compression_ratio": 1.0}, r"^compression_ratio: expected a number with 0 <= x < 1"),
        ({"window": 0}, r"^window: "),
        ({"kernel_size": 4}, r"^kernel_size: expected an odd int"),
        ({"pooling": "median"}, r"^pooling: expected one of avg, max"),
    ],
)
def test_bad_snapkv_configs_are_refused(arguments, message):
    with pytest.raises(ValueError, match=message):
        SnapKVConfig(**arguments)


def test_layer_beyond_depth_is_refused():
    model = tiny_model()
    with pytest.raises(ValueError, match=r"^layer: expected 1 <= layer < 4 .* got 4"):
        pruning.enable_token_pruning(model, PruneConfig(layer=4))
    assert pruning.pruning_stats(model) is None


def test_models_without_visual_tokens_or_bidirectional_images_are_refused():
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    with pytest.raises(ValueError, match=r"^model: token pruning supports model_type .* 'llama'"):
        pruning.enable_token_pruning(transformers.LlamaForCausalLM(config), PruneConfig(layer=1))
    with pytest.raises(
        ValueError,
        match=r"^model: token pruning supports model_type .*, got 'gemma3': its image tokens attend",
    ):
        pruning.enable_token_pruning(tiny.build_model("gemma3"), PruneConfig(layer=1))
    with pytest.raises(TypeError, match=r"^model: expected a torch.nn.Module"):
        pruning.enable_token_pruning("qwen2_vl", PruneConfig())
    with pytest.raises(ValueError, match=r"^prune, kv: expected a PruneConfig, a SnapKVConfig"):
        pruning.enable_token_pruning(tiny_model())


def test_enabling_twice_needs_the_same_configs(pruned):
    model = tiny_model()
    _enable(model, pruned, PruneConfig(layer=2))
    pruning.enable_token_pruning(model, PruneConfig(layer=2))
    with pytest.raises(ValueError, match=r"^model: token pruning is already enabled"):
        pruning.enable_token_pruning(model, PruneConfig(layer=3))


def test_labels_and_new_images_on_a_pruned_cache_are_refused(pruned):
    model = tiny_model()
    inputs = tiny.make_inputs("qwen2_vl", model, n_images=1)
    _enable(model, pruned, PruneConfig(layer=2, keep=0.5))
    with pytest.raises(ValueError, match=r"^labels: token pruning drops prompt positions"):
        model(**inputs, labels=inputs["input_ids"])
    with torch.no_grad():
        output = model(**inputs, use_cache=True)
        follow_up = dict(inputs, past_key_values=output.past_key_values)
        with pytest.raises(ValueError, match=r"^input_ids: token pruning prunes a prompt's first"):
            model(**follow_up)


def test_prompts_without_visual_tokens_pass_through(pruned):
    model = tiny_model()
    inputs = tiny.make_inputs("qwen2_vl", model, n_images=0)
    tokens = greedy(model, inputs)
    _enable(model, pruned, PruneConfig(layer=2, keep=0.25))
    assert torch.equal(greedy(model, inputs), tokens)
    assert pruning.pruning_stats(model) is None


def test_snapkv_refuses_a_static_cache(pruned):
    model = tiny_model()
    inputs = tiny.make_inputs("qwen2_vl", model, n_images=1)
    _enable(model, pruned, kv=SnapKVConfig())
    with pytest.raises(ValueError, match=r"^cache: token pruning needs full-attention dynamic"):
        greedy(model, inputs, cache_implementation="static")


def _video_inputs(model, frames: int = 4):
    """One Qwen2-VL video of ``frames`` frames (2 per temporal patch) and an image after it."""
    vision = model.config.vision_config
    side = vision.image_side_in_patches
    grid = torch.tensor([[frames // vision.temporal_patch_size, side, side]])
    patch = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    generator = torch.Generator().manual_seed(5)
    video = torch.randn(int(grid.prod()), patch, generator=generator)
    image, per_image = tiny.qwen_images(model, 1)
    video_tokens = int(grid.prod()) // vision.spatial_merge_size**2
    ids = [tiny.BOS, tiny.VISION_START] + [tiny.VIDEO_TOKEN] * video_tokens
    ids += [tiny.VISION_START] + [tiny.IMAGE_TOKEN] * per_image[0] + [5, 6, 7]
    input_ids = torch.tensor([ids])
    token_types = (input_ids == tiny.IMAGE_TOKEN).int() + 2 * (input_ids == tiny.VIDEO_TOKEN).int()
    return {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "mm_token_type_ids": token_types,
        "pixel_values_videos": video,
        "video_grid_thw": grid,
        **image,
    }, video_tokens + per_image[0]


@pytest.mark.parametrize("name", ["qwen2_vl", "qwen2_5_vl"])
def test_video_frames_and_images_are_pruned_together(name, pruned):
    model = tiny_model(name)
    inputs, visual = _video_inputs(model)
    if name == "qwen2_5_vl":
        inputs["second_per_grid_ts"] = torch.tensor([1.0])
    tokens = greedy(model, inputs)
    _enable(model, pruned, PruneConfig(method="fastv", layer=2, keep=1.0))
    assert torch.equal(greedy(model, inputs), tokens)
    pruning.disable_token_pruning(model)
    _enable(model, pruned, PruneConfig(method="divprune", layer=2, keep=0.25))
    greedy(model, inputs)
    stats = pruning.pruning_stats(model)
    assert stats.visual_tokens == (visual,) and stats.kept_visual_tokens == (-(-visual // 4),)


def test_llava_next_without_a_sliding_window_is_pruned(pruned):
    import transformers

    config = tiny.FAMILIES["llava_next"].config(dataclasses.replace(tiny.TINY, layers=LAYERS))
    config.text_config.sliding_window = None
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.LlavaNextForConditionalGeneration(config).eval()
    inputs = tiny.make_inputs("llava_next", model, n_images=1)
    tokens = greedy(model, inputs)
    _enable(model, pruned, PruneConfig(method="fastv", layer=2, keep=1.0))
    assert torch.equal(greedy(model, inputs), tokens)


def test_a_sliding_window_cache_is_refused(pruned):
    model = tiny_model("llava_next")  # its tiny mistral backbone keeps a sliding-window cache
    inputs = tiny.make_inputs("llava_next", model, n_images=1)
    _enable(model, pruned, PruneConfig(layer=2))
    with pytest.raises(ValueError, match=r"^cache: .* got \['DynamicSlidingWindowLayer'\]"):
        greedy(model, inputs)


def test_assisted_decoding_verifies_drafts_on_the_pruned_cache(pruned):
    # Drafts are checked several tokens at a time and rejected ones cropped off every layer;
    # "uniform" picks the same tokens whatever the prompt ends with (the main model's first
    # forward also holds the first draft token), so greedy assisted output equals plain greedy.
    model = tiny_model("qwen2_vl")
    assistant = tiny.build_model("qwen2_vl", layers=2, attn_implementation="sdpa", seed=1)
    inputs = tiny.make_inputs("qwen2_vl", model, n_images=2)
    _enable(model, pruned, PruneConfig(method="uniform", layer=2, keep=0.5))
    plain = greedy(model, inputs, steps=8)
    assert torch.equal(greedy(model, inputs, steps=8, assistant_model=assistant), plain)


def test_a_cache_cropped_past_the_pruned_layout_is_refused(pruned):
    model = tiny_model("qwen2_vl")
    inputs = tiny.make_inputs("qwen2_vl", model, n_images=2)
    _enable(model, pruned, PruneConfig(method="fastv", layer=2, keep=0.5))
    with torch.no_grad():
        cache = model(**inputs, use_cache=True).past_key_values
        cache.layers[0].keys = cache.layers[0].keys[:, :, :-2]  # as a crop of layer 0 alone
        cache.layers[0].values = cache.layers[0].values[:, :, :-2]
        step = {"input_ids": torch.tensor([[5]]), "past_key_values": cache}
        with pytest.raises(RuntimeError, match=r"^cache: layer 2 holds 13 slots where the pruned"):
            model(**step)
