"""BatchGenerator with KV in blocks: batched outputs equal ``generate`` (CPU gather path and the
mock NPU's page attention), joins and leaves move no stored KV, KV bytes follow each row's
tokens, the prefix cache is exact and skips prefill (M-RoPE offsets included), eviction, the
per-sequence fallback of families with other than full-attention layers, and bad options."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from chat_vlms import generate_alone
from PIL import Image

from ascend_vlm.batching import BatchGenerator, GenerationRequest, RequestResult, TokenEvent
from ascend_vlm.batching.kv_blocks import KVBlocks
from ascend_vlm.batching.prefill import suffix_inputs

FAMILIES = {
    "qwen2_vl": "model_and_processor",
    "qwen2_5_vl": "qwen2_5_vl_and_processor",
    "llava": "llava_and_processor",
}


def _image(colour: str, size: tuple[int, int]) -> Image.Image:
    return Image.new("RGB", size, colour)


def _requests() -> list[GenerationRequest]:
    red, blue = _image("red", (64, 64)), _image("blue", (100, 80))
    return [
        GenerationRequest.from_prompt("hello there", max_new_tokens=10),
        GenerationRequest.from_prompt("describe this", [red], max_new_tokens=3),
        GenerationRequest.from_prompt("compare them", [red, blue], max_new_tokens=14),
        GenerationRequest.from_prompt("a longer question about shapes", max_new_tokens=6),
        GenerationRequest.from_prompt("and this one", [blue], max_new_tokens=8),
    ]


def _conversation(image: Image.Image, reply: str) -> tuple[GenerationRequest, GenerationRequest]:
    """A first turn with an image, and the second turn that repeats it."""
    first = [
        {"role": "user", "content": [
            {"type": "image", "image": image},
            {"type": "text", "text": "describe the picture in detail, every part of it"},
        ]},
    ]  # fmt: skip
    second = [
        *first,
        {"role": "assistant", "content": [{"type": "text", "text": reply}]},
        {"role": "user", "content": [{"type": "text", "text": "and what else is there?"}]},
    ]
    return GenerationRequest(first, max_new_tokens=6), GenerationRequest(second, max_new_tokens=6)


def test_blocks_on_the_mock_npu_read_by_page_attention_equal_generate(
    model_and_processor, mock_npu, monkeypatch
):
    import ascend_vlm

    base, processor = model_and_processor
    model = copy.deepcopy(base).to(torch.bfloat16)  # the page-attention kernel's dtypes
    ascend_vlm.patch(model)
    calls = []
    kernel = mock_npu.torch_npu.npu_fused_infer_attention_score

    def spy(*args, **kwargs):
        calls.append(len(kwargs["actual_seq_lengths_kv"]))
        return kernel(*args, **kwargs)

    monkeypatch.setattr(mock_npu.torch_npu, "npu_fused_infer_attention_score", spy)
    requests = _requests()
    results = BatchGenerator(model, processor, max_batch_size=3).generate_many(requests)
    assert max(calls) == 3  # three rows read their blocks in one kernel call
    for result, query in zip(results, requests, strict=True):
        assert list(result.tokens) == generate_alone(model, processor, query), query.request_id


def test_joins_and_leaves_move_no_stored_kv(model_and_processor, monkeypatch):
    model, processor = model_and_processor
    generator = BatchGenerator(model, processor, max_batch_size=3, prefix_cache=False)
    for query in _requests():
        generator.submit(query)
    pooled: list[int] = []
    concatenated = []
    original_cat = torch.cat

    def watched_cat(tensors, *args, **kwargs):
        pointers = {t.untyped_storage().data_ptr() for t in tensors}
        concatenated.append(bool(pointers & set(pooled)))
        return original_cat(tensors, *args, **kwargs)

    monkeypatch.setattr(torch, "cat", watched_cat)
    snapshot, watched, rows_seen = None, None, []
    for event in generator.run():
        pool = generator._blocks.pool
        pooled[:] = [t.untyped_storage().data_ptr() for t in (*pool.keys, *pool.values)]
        running = generator._running
        rows_seen.append(len(running))
        if watched is None and running:
            watched = running[0]
            first_pointers = list(pooled)
            snapshot = pool.keys[1][watched.blocks].clone(), watched.cached_tokens
        if watched is not None and isinstance(event, RequestResult):
            if event.request_id == watched.request.request_id:
                break
            stored, length = snapshot
            now = pool.keys[1][watched.blocks[: len(stored)]]
            flat = now.transpose(0, 1).reshape(now.shape[1], -1, now.shape[-1])[:, :length]
            expected = stored.transpose(0, 1).reshape(now.shape[1], -1, now.shape[-1])[:, :length]
            assert torch.equal(flat, expected)  # its tokens stay where they were written
    assert pooled == first_pointers  # no pool was reallocated
    assert not any(concatenated)  # and none was concatenated
    assert max(rows_seen) == 3 and min(rows_seen[rows_seen.index(3) :]) < 3


def test_kv_bytes_follow_each_rows_tokens_not_the_longest_row(model_and_processor):
    model, processor = model_and_processor
    generator = BatchGenerator(model, processor, kv_block_size=2, prefix_cache=False)
    for query in _requests():
        generator.submit(query)
    per_token = None
    for event in generator.run():
        running = generator._running
        if not running or not isinstance(event, TokenEvent):
            continue
        pool = generator._blocks.pool
        per_token = pool.block_bytes // pool.block_size
        held = generator.stats().kv_bytes
        needed = sum(s.cached_tokens for s in running) * per_token
        blocks = sum(-(-s.cached_tokens // 2) for s in running) * pool.block_bytes
        assert needed <= held <= blocks and held <= 1.1 * needed
        padded = len(running) * max(s.cached_tokens for s in running) * per_token
        if len({s.cached_tokens for s in running}) > 1:
            assert held < padded
    assert per_token is not None


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_later_turn_reuses_the_earlier_turns_blocks_exactly(request, family):
    model, processor = request.getfixturevalue(FAMILIES[family])
    first, _ = _conversation(_image("green", (112, 112)), "")
    reused = BatchGenerator(model, processor)
    reply = reused.generate_many([first])[0].text
    _, second = _conversation(_image("green", (112, 112)), reply)
    before = reused.stats()
    result = reused.generate_many([second])[0]
    after = reused.stats()
    fresh = BatchGenerator(model, processor, prefix_cache=False)
    expected = fresh.generate_many([second])[0]
    assert result.tokens == expected.tokens
    assert list(result.tokens) == generate_alone(model, processor, second)
    reused_tokens = after.reused_tokens - before.reused_tokens
    assert after.prefix_hits == before.prefix_hits + 1 and reused_tokens >= 16
    prefilled = after.prefilled_tokens - before.prefilled_tokens
    assert prefilled == result.prompt_tokens - reused_tokens
    assert fresh.stats().prefix_hits == 0 and fresh.stats().prefilled_tokens == result.prompt_tokens


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_suffix_prefilled_after_a_cached_prefix_gives_the_full_prefills_logits(request, family):
    from transformers import DynamicCache

    model, processor = request.getfixturevalue(FAMILIES[family])
    generator = BatchGenerator(model, processor)
    _, second = _conversation(_image("purple", (112, 80)), "a purple square on white")
    sequence = generator.submit(second)._sequence
    inputs, keyword = sequence.inputs, generator._batched.cache_keyword
    full = DynamicCache(config=model.config)
    with torch.no_grad():
        expected = model(**inputs, **{keyword: full}, use_cache=True).logits[0, -1]
    ids = inputs["input_ids"]
    image_token = generator._batched.image_token
    start = (int((ids[0] == image_token).nonzero()[-1]) // 16 + 1) * 16  # past the image
    if generator._batched.rope_index is not None:
        positions, _ = generator._batched.prompt_rope_index(inputs)
    else:
        positions = torch.arange(ids.shape[1])[None]
    prefix = DynamicCache(config=model.config)
    for layer, cached in enumerate(full.layers):
        prefix.update(cached.keys[:, :, :start], cached.values[:, :, :start], layer)
    call = suffix_inputs(inputs, start, image_token, positions)
    assert "pixel_values" not in call and call["input_ids"].shape[1] == ids.shape[1] - start
    with torch.no_grad():
        logits = model(**call, **{keyword: prefix}, use_cache=True).logits[0, -1]
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-4)


def test_other_images_share_only_the_text_before_them(model_and_processor):
    model, processor = model_and_processor
    generator = BatchGenerator(model, processor)
    question = "what is in this picture, tell me in detail"
    generator.generate_many([GenerationRequest.from_prompt(question, [_image("red", (112, 112))])])
    other = GenerationRequest.from_prompt(question, [_image("blue", (112, 112))], max_new_tokens=8)
    result = generator.generate_many([other])[0]
    ids = generator.submit(other)._sequence.inputs["input_ids"][0]
    first_image = int((ids == generator._batched.image_token).nonzero()[0])
    assert generator.stats().reused_tokens <= first_image  # only blocks before the image
    assert list(result.tokens) == generate_alone(model, processor, other)


def test_cached_blocks_are_evicted_under_the_kv_budget(model_and_processor):
    model, processor = model_and_processor
    per_block = BatchGenerator(model, processor)._batched.kv_bytes_per_token * 16
    generator = BatchGenerator(model, processor, max_kv_bytes=12 * per_block)
    prompts = [f"question number {n}: " + "tell me more about it " * 6 for n in range(4)]

    def reused(prompt: str) -> int:
        before = generator.stats().reused_tokens
        generator.generate_many([GenerationRequest.from_prompt(prompt, max_new_tokens=2)])
        return generator.stats().reused_tokens - before

    for prompt in prompts:
        reused(prompt)
    pool = generator._blocks.pool
    assert pool.num_blocks == 12 and pool.held_blocks == 0 and pool.cached_blocks >= 10
    newest, oldest = reused(prompts[-1]), reused(prompts[0])
    # the newest prompt's blocks are still cached, the oldest one's were evicted for the others
    assert newest >= 64 and oldest == 0


def test_families_with_sliding_window_layers_keep_a_cache_per_sequence(model_and_processor):
    from transformers import AutoConfig, Qwen2VLForConditionalGeneration

    from ascend_vlm.default_model import default_model_path

    _, processor = model_and_processor
    config = AutoConfig.from_pretrained(default_model_path())
    text = config.text_config
    text.use_sliding_window, text.sliding_window = True, 4096
    text.layer_types = ["sliding_attention"] * text.num_hidden_layers
    model = Qwen2VLForConditionalGeneration.from_pretrained(default_model_path(), config=config)
    generator = BatchGenerator(model.eval(), processor, max_batch_size=3)
    requests = _requests()[:3]
    results = generator.generate_many(requests)
    assert generator._blocks is None and generator.stats().prefix_hits == 0
    for result, query in zip(results, requests, strict=True):
        assert list(result.tokens) == generate_alone(model, processor, query)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"kv_block_size": 0}, "^kv_block_size: expected an int >= 1, got 0"),
        ({"kv_block_size": "16"}, "^kv_block_size: expected an int >= 1, got '16'"),
        ({"kv_block_size": True}, "^kv_block_size: expected an int >= 1, got True"),
        ({"prefix_cache": "yes"}, "^prefix_cache: expected True or False, got 'yes'"),
    ],
)
def test_bad_block_options_are_refused(model_and_processor, options, message):
    model, processor = model_and_processor
    with pytest.raises(ValueError, match=message):
        BatchGenerator(model, processor, **options)


def test_rows_sharing_a_prefix_read_by_page_attention_equal_generate(model_and_processor, mock_npu):
    """Shared blocks count once in the pool but once per row in the kernel's rule that the pool
    holds at least the sum of the rows' block counts: the pool grows to meet it."""
    import ascend_vlm

    base, processor = model_and_processor
    model = copy.deepcopy(base).to(torch.bfloat16)
    ascend_vlm.patch(model)
    shared = " ".join(f"word{index % 37}" for index in range(300))
    requests = [
        GenerationRequest.from_prompt(f"{shared} question {index}", max_new_tokens=4)
        for index in range(6)
    ]
    generator = BatchGenerator(model, processor, max_batch_size=6)
    results = generator.generate_many(requests)
    for result, query in zip(results, requests, strict=True):
        assert list(result.tokens) == generate_alone(model, processor, query), query.request_id


@pytest.mark.parametrize(("max_blocks", "num_blocks", "gather"), [(None, 128, False), (8, 8, True)])
def test_a_step_whose_rows_blocks_sum_past_the_budget_gathers(max_blocks, num_blocks, gather):
    """Two rows sharing ``shared`` full blocks: the page-attention kernel wants the pool at
    least as long as both rows' block counts summed; past ``max_blocks`` the step gathers."""
    blocks = KVBlocks(4, prefix_cache=True, max_blocks=max_blocks, image_token=None, config=None)
    prefill = SimpleNamespace(layers=[SimpleNamespace(keys=torch.zeros(1, 2, 1, 8))])
    blocks._make_pool(prefill)
    shared = blocks.pool.allocate(40 if max_blocks is None else 6)
    blocks.pool.share(shared)
    rows = [SimpleNamespace(blocks=list(shared), cached_tokens=4 * len(shared)) for _ in "ab"]
    cache = blocks.decode_cache(rows, gather=False)
    assert cache.gather is gather and blocks.pool.num_blocks == num_blocks
    assert blocks.pool.held_blocks == len(shared) + 2


@pytest.mark.parametrize("failing", ["allocate", "store_prompt"])
def test_a_failed_store_holds_no_block_once_the_sequence_is_released(failing, monkeypatch):
    blocks = KVBlocks(4, prefix_cache=False, max_blocks=4, image_token=None, config=None)
    prefill = SimpleNamespace(layers=[SimpleNamespace(keys=torch.zeros(1, 2, 12, 8))])
    blocks._make_pool(prefill)
    other = blocks.pool.allocate(2 if failing == "allocate" else 1)  # 12 tokens want 3 blocks
    if failing == "store_prompt":

        def refuse(*args):
            raise RuntimeError("store_prompt: refused")

        monkeypatch.setattr("ascend_vlm.batching.kv_blocks.store_prompt", refuse)
    sequence = SimpleNamespace(blocks=[])
    with pytest.raises(RuntimeError, match=r"^(max_kv_bytes|store_prompt): "):
        blocks.store(sequence, prefill, start=0)
    blocks.release([sequence])
    assert blocks.pool.held_blocks == len(other)
