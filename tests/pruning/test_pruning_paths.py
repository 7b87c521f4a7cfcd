"""Token pruning off the main road: interrupted prefills, PEFT, patch order, SnapKV values and
batches, caches outliving their pruner, and implementations it cannot serve."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _pruning_models import greedy, tiny_model

import ascend_vlm
from ascend_vlm import pruning
from ascend_vlm.models import tiny
from ascend_vlm.patching.attention_tap import TAPPED_ATTENTION
from ascend_vlm.pruning import PruneConfig, SnapKVConfig
from ascend_vlm.pruning.pruner import recorded_views


def _layers(model):
    return model.model.language_model.layers


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, RuntimeError])
def test_an_interrupted_prefill_leaves_nothing_behind(interrupt, pruned):
    model = tiny_model()
    inputs = tiny.make_inputs("qwen2_vl", model, n_images=2)
    config = PruneConfig(method="fastv", layer=2, keep=0.5)
    pruning.enable_token_pruning(model, config)
    pruned(model)
    expected = greedy(model, inputs)

    def stop(module, args, kwargs):
        raise interrupt("stop")

    handle = _layers(model)[1].self_attn.register_forward_pre_hook(stop, with_kwargs=True)
    with pytest.raises(interrupt):
        greedy(model, inputs)
    handle.remove()
    # the interrupted forward's scored config is undone by the next forward ...
    assert torch.equal(greedy(model, inputs), expected)
    assert _layers(model)[1].self_attn.config._attn_implementation == "sdpa"
    with pytest.raises(interrupt):
        handle = _layers(model)[1].self_attn.register_forward_pre_hook(stop, with_kwargs=True)
        try:
            greedy(model, inputs)
        finally:
            handle.remove()
    # ... or by disabling
    pruning.disable_token_pruning(model)
    assert _layers(model)[1].self_attn.config._attn_implementation == "sdpa"
    pruning.enable_token_pruning(model, config)
    assert torch.equal(greedy(model, inputs), expected)


def test_a_prompt_ending_in_visual_tokens_keeps_its_last_position(pruned):
    model = tiny_model()
    inputs = tiny.make_inputs("qwen2_vl", model, n_images=3, text_len=0)
    assert inputs["input_ids"][0, -1] == tiny.IMAGE_TOKEN
    pruning.enable_token_pruning(model, PruneConfig(method="fastv", layer=2, keep=0.25))
    pruned(model)
    with torch.no_grad():
        model(**inputs)
    prompt = inputs["input_ids"].shape[1]
    assert pruning.pruning_stats(model).kept_positions[0, -1] == prompt - 1


def test_peft_wrapped_models_are_pruned(pruned):
    peft = pytest.importorskip("peft")
    model = tiny_model()
    inputs = tiny.make_inputs("qwen2_vl", model, n_images=2)
    wrapped = peft.get_peft_model(
        model, peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    ).eval()
    expected = greedy(wrapped, inputs)
    pruning.enable_token_pruning(wrapped, PruneConfig(method="fastv", layer=2, keep=1.0))
    pruned(wrapped)
    assert torch.equal(greedy(wrapped, inputs), expected)
    pruning.disable_token_pruning(wrapped)
    pruning.enable_token_pruning(wrapped, PruneConfig(method="fastv", layer=2, keep=0.5))
    greedy(wrapped, inputs)
    assert pruning.pruning_stats(wrapped).kept_visual_tokens == (4,)


def test_patch_after_pruning_prunes_alike(pruned):
    config = PruneConfig(method="fastv", layer=2, keep=0.5)
    results = []
    for patch_first in (True, False):
        model = tiny_model()
        inputs = tiny.make_inputs("qwen2_vl", model, n_images=2)
        if patch_first:
            ascend_vlm.patch(model)
        pruning.enable_token_pruning(model, config)
        pruned(model)
        if not patch_first:
            ascend_vlm.patch(model)
        with torch.no_grad():
            results.append(model(**inputs).logits)
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)


def test_llava_pruned_layers_get_the_kept_position_ids(pruned):
    model = tiny_model("llava_clip")
    inputs = tiny.make_inputs("llava_clip", model, n_images=1)
    pruning.enable_token_pruning(model, PruneConfig(method="fastv", layer=2, keep=0.5))
    pruned(model)
    seen = []
    _layers(model)[2].register_forward_pre_hook(
        lambda module, args, kwargs: seen.append((args[0].shape[1], kwargs["position_ids"])),
        with_kwargs=True,
    )
    with torch.no_grad():
        model(**inputs)
    (length, positions) = seen[0]
    kept = pruning.pruning_stats(model).kept_positions
    assert positions.shape[-1] == length and torch.equal(positions[0], kept[0])


def test_snapkv_caches_hold_the_unpruned_keys_it_chose(pruned):
    model = tiny_model()
    inputs = tiny.make_inputs("qwen2_vl", model, n_images=2)
    with torch.no_grad():
        full = model(**inputs, use_cache=True).past_key_values
        pruning.enable_token_pruning(model, kv=SnapKVConfig(compression_ratio=0.5, window=2))
        pruned(model)
        compressed = model(**inputs, use_cache=True).past_key_values
    views = recorded_views(compressed)
    assert sorted(views) == [1, 2, 3]
    for index, view in views.items():
        keys = full.layers[index].keys
        index_shape = (-1, keys.shape[1], -1, keys.shape[-1])
        expected = keys.gather(2, view.columns[..., None].expand(index_shape))
        torch.testing.assert_close(compressed.layers[index].keys, expected, rtol=0, atol=0)
        assert view.columns.shape[1] == model.config.text_config.num_key_value_heads


@pytest.mark.parametrize("prune", [None, PruneConfig(method="uniform", layer=2, keep=0.5)])
def test_snapkv_warns_when_its_window_covers_the_prompt(prune, pruned, recwarn):
    model = tiny_model()
    inputs = tiny.make_inputs("qwen2_vl", model, n_images=1)
    slots = inputs["input_ids"].shape[1]
    pruning.enable_token_pruning(model, prune=prune, kv=SnapKVConfig(window=2))
    pruned(model)
    with torch.no_grad():
        model(**inputs, use_cache=True)
    assert not [w for w in recwarn if "SnapKVConfig.window" in str(w.message)]
    pruning.disable_token_pruning(model)
    pruning.enable_token_pruning(model, prune=prune, kv=SnapKVConfig(window=slots))
    warned = pytest.warns(UserWarning, match=r"SnapKVConfig.window: .* left uncompressed")
    with warned, torch.no_grad():
        model(**inputs, use_cache=True)


@pytest.mark.parametrize("per_head", [True, False])
@pytest.mark.parametrize("prune", [None, PruneConfig(method="uniform", layer=2, keep=0.5)])
def test_snapkv_prunes_each_row_of_a_batch_as_alone(per_head, prune, pruned):
    model = tiny_model()
    rows = [tiny.qwen_prompt(model, 3, 5, 3), tiny.qwen_prompt(model, 1, 3, 1)]
    kv = SnapKVConfig(compression_ratio=0.5, window=2, per_head=per_head)
    pruning.enable_token_pruning(model, prune, kv=kv)
    pruned(model)
    with torch.no_grad():
        batched = model.generate(
            **tiny.left_padded_qwen_batch(rows),
            max_new_tokens=3,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
        for index, row in enumerate(rows):
            alone = model.generate(
                **tiny.left_padded_qwen_batch([row]),
                max_new_tokens=3,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
            assert torch.equal(batched.sequences[index, -3:], alone.sequences[0, -3:])
            for step, logits in enumerate(alone.logits):
                torch.testing.assert_close(
                    batched.logits[step][index], logits[0], atol=1e-5, rtol=1e-5
                )


def test_a_cache_outlives_disabling_and_enabling_again(pruned):
    model = tiny_model()
    rows = [tiny.qwen_prompt(model, 2, 3, 2), tiny.qwen_prompt(model, 1, 4, 1)]
    inputs = tiny.left_padded_qwen_batch(rows)
    config = PruneConfig(method="fastv", layer=2, keep=0.5)
    pruning.enable_token_pruning(model, config)
    pruned(model)
    with torch.no_grad():
        cache = model(**inputs, use_cache=True).past_key_values
        mask = torch.cat([inputs["attention_mask"], torch.ones(2, 1, dtype=torch.long)], dim=1)
        # the next token's M-RoPE position, as generate computes it
        position = (mask.cumsum(-1) - 1)[:, -1:] + model.model.rope_deltas
        step = {
            "input_ids": torch.tensor([[7], [7]]),
            "attention_mask": mask,
            "position_ids": position,
            "past_key_values": cache,
        }
        snapshot = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
        expected = model(**step).logits
        for layer, (keys, values) in zip(cache.layers, snapshot, strict=True):
            layer.keys, layer.values = keys, values  # back to the prompt alone
        pruning.disable_token_pruning(model)
        pruning.enable_token_pruning(model, config)
        torch.testing.assert_close(model(**step).logits, expected, rtol=0, atol=0)


def test_an_uneven_cache_without_a_record_is_refused(pruned):
    model = tiny_model()
    inputs = tiny.make_inputs("qwen2_vl", model, n_images=1)
    pruning.enable_token_pruning(model, PruneConfig(layer=2, keep=0.5))
    pruned(model)
    with torch.no_grad():
        cache = model(**inputs, use_cache=True).past_key_values
    from transformers import DynamicCache

    copy = DynamicCache()
    for index, layer in enumerate(cache.layers):
        copy.update(layer.keys, layer.values, index)
    with (
        torch.no_grad(),
        pytest.raises(RuntimeError, match=r"^cache: its layers hold \[\d+, \d+\]"),
    ):
        model(input_ids=torch.tensor([[7]]), past_key_values=copy)


def test_a_sliding_window_cache_made_inside_the_model_is_refused(pruned):
    model = tiny_model("llava_next")
    inputs = tiny.make_inputs("llava_next", model, n_images=1)
    pruning.enable_token_pruning(model, PruneConfig(layer=2))
    pruned(model)
    with torch.no_grad(), pytest.raises(ValueError, match=r"^cache: .*DynamicSlidingWindowLayer"):
        model(**inputs, use_cache=True)


def test_attention_implementations_without_4d_masks_are_refused(pruned):
    model = tiny_model("llava_clip", attn="flex_attention")
    inputs = tiny.make_inputs("llava_clip", model, n_images=1)
    pruning.enable_token_pruning(model, PruneConfig(layer=2))
    pruned(model)
    refused = r"^attn_implementation: .* got 'flex_attention'"
    with torch.no_grad(), pytest.raises(ValueError, match=refused):
        model(**inputs)
    assert TAPPED_ATTENTION not in str(_layers(model)[1].self_attn.config._attn_implementation)


def test_stats_count_flops_and_bytes_layer_by_layer(pruned):
    model = tiny_model()
    inputs = tiny.make_inputs("qwen2_vl", model, n_images=2)
    pruning.enable_token_pruning(model, PruneConfig(method="uniform", layer=2, keep=0.5))
    pruned(model)
    with torch.no_grad():
        model(**inputs)
    stats = pruning.pruning_stats(model)
    text = model.config.text_config
    head_dim = text.hidden_size // text.num_attention_heads
    weights = sum(
        module.weight.numel()
        for module in _layers(model)[0].modules()
        if isinstance(module, torch.nn.Linear)
    )

    def flops(n):
        return 2 * n * weights + 2 * n * n * text.num_attention_heads * head_dim

    full, cut = stats.layer_tokens[0], stats.layer_tokens[2]
    assert stats.flops == 2 * flops(full) + 2 * flops(cut)
    assert stats.flops_unpruned == 4 * flops(full)
    per_slot = 2 * text.num_key_value_heads * head_dim * 4  # keys + values, fp32
    assert stats.kv_bytes == per_slot * (2 * full + 2 * cut)
    record = stats.as_dict()
    assert record["flops_ratio"] == stats.flops / stats.flops_unpruned
    assert record["kept_positions"] == stats.kept_positions.tolist()


def test_more_families_prune_at_keep_one(pruned):
    for name in ("smolvlm", "llava_siglip"):
        model = tiny_model(name)
        inputs = tiny.make_inputs(name, model, n_images=1)
        expected = greedy(model, inputs)
        pruning.enable_token_pruning(model, PruneConfig(method="divprune", layer=2, keep=1.0))
        pruned(model)
        assert torch.equal(greedy(model, inputs), expected), name


def test_prune_config_replace_keeps_validation():
    with pytest.raises(ValueError, match=r"^keep: "):
        dataclasses.replace(PruneConfig(), keep=2.0)
