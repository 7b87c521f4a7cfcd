"""BatchGenerator: every greedy output equals a one-request ``generate`` in mixed batches
(Qwen2-VL, Qwen2.5-VL, LLaVA; patched on the mock NPU; with a vision cache), seeded sampling
independent of the batch, budgets never exceeded under random workloads, refusals, stop
strings, streaming, cancellation, and no deadlock under tight budgets."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from chat_vlms import generate_alone
from PIL import Image

from ascend_vlm.batching import (
    BatchGenerator,
    BudgetError,
    GenerationRequest,
    RequestResult,
    TokenEvent,
)

MODELS = {
    "qwen2_vl": "model_and_processor",
    "qwen2_5_vl": "qwen2_5_vl_and_processor",
    "qwen3_vl_moe": "qwen3_vl_moe_and_processor",
    "llava": "llava_and_processor",
    "glm4v": "glm4v_and_processor",
    "glm46v": "glm46v_and_processor",
    "glm4v_moe": "glm4v_moe_and_processor",
    "paddleocr_vl": "paddleocr_vl_and_processor",
}


def _image(colour: str, size: tuple[int, int]) -> Image.Image:
    return Image.new("RGB", size, colour)


def _mixed_requests() -> list[GenerationRequest]:
    red, blue = _image("red", (64, 64)), _image("blue", (100, 80))
    green, yellow = _image("green", (80, 112)), _image("yellow", (112, 112))
    return [
        GenerationRequest.from_prompt("hello there", max_new_tokens=12),
        GenerationRequest.from_prompt("describe this", [red], max_new_tokens=4),
        GenerationRequest.from_prompt("compare them", [red, blue, green], max_new_tokens=20),
        GenerationRequest.from_prompt("what is it", [yellow], max_new_tokens=16),
        GenerationRequest.from_prompt("a longer question about shapes", max_new_tokens=2),
        GenerationRequest.from_prompt("and this one", [blue], max_new_tokens=9),
    ]


@pytest.mark.parametrize("family", list(MODELS))
def test_greedy_outputs_equal_one_request_generate_in_mixed_batches(request, family):
    model, processor = request.getfixturevalue(MODELS[family])
    requests = _mixed_requests()
    generator = BatchGenerator(model, processor, max_batch_size=3)
    results = generator.generate_many(requests)
    assert [r.request_id for r in results] == [q.request_id for q in requests]
    for result, query in zip(results, requests, strict=True):
        assert list(result.tokens) == generate_alone(model, processor, query), query.request_id
    # sequences joined and left a running batch
    assert max(usage.batch_size for usage in generator.step_usage) == 3
    assert any(u.prefill_tokens and u.decode_tokens for u in generator.step_usage)


def test_a_patched_model_on_the_mock_npu_matches_generate(model_and_processor, mock_npu):
    import ascend_vlm

    base, processor = model_and_processor
    model = copy.deepcopy(base)
    ascend_vlm.patch(model)
    requests = _mixed_requests()[:4]
    results = BatchGenerator(model, processor, max_batch_size=4).generate_many(requests)
    for result, query in zip(results, requests, strict=True):
        assert list(result.tokens) == generate_alone(model, processor, query)


def test_a_vision_cache_serves_repeated_images_exactly(model_and_processor):
    from ascend_vlm.reuse import VisionCache, disable_vision_cache, enable_vision_cache

    model, processor = model_and_processor
    cache = VisionCache(max_bytes=1 << 24)
    enable_vision_cache(model, cache)
    try:
        image = _image("red", (64, 64))
        requests = [
            GenerationRequest.from_prompt(text, [image], max_new_tokens=6)
            for text in ("what colour", "which shape", "how many")
        ]
        generator = BatchGenerator(model, processor)
        # the first request's image is encoded once; the next two find it cached
        results = generator.generate_many(requests[:1]) + generator.generate_many(requests[1:])
        assert cache.stats().hits == 2
    finally:
        disable_vision_cache(model)
    for result, query in zip(results, requests, strict=True):
        assert list(result.tokens) == generate_alone(model, processor, query)


def test_a_pruned_model_matches_its_generate_and_counts_its_smaller_caches(
    model_and_processor,
):
    from ascend_vlm import pruning

    base, processor = model_and_processor
    model = copy.deepcopy(base)
    pruning.enable_token_pruning(model, pruning.PruneConfig(method="fastv", layer=1, keep=0.5))
    requests = _mixed_requests()
    generator = BatchGenerator(model, processor, max_batch_size=3)
    results = generator.generate_many(requests)
    for result, query in zip(results, requests, strict=True):
        assert list(result.tokens) == generate_alone(model, processor, query), query.request_id
    assert max(usage.batch_size for usage in generator.step_usage) == 3
    # the three-image request alone: its pruned cache is smaller than the unpruned projection
    alone = BatchGenerator(model, processor)
    alone.generate_many([requests[2]])
    unpruned = BatchGenerator(base, processor)
    unpruned.generate_many([requests[2]])
    assert alone.step_usage[0].kv_bytes < unpruned.step_usage[0].kv_bytes


def test_seeded_sampling_does_not_depend_on_the_batch(model_and_processor):
    model, processor = model_and_processor
    sampled = GenerationRequest.from_prompt(
        "tell me", [_image("red", (64, 64))], max_new_tokens=12, do_sample=True, seed=7,
        temperature=0.8, top_k=50, top_p=0.9,
    )  # fmt: skip
    alone = BatchGenerator(model, processor).generate_many([sampled])[0]
    others = _mixed_requests()
    together = BatchGenerator(model, processor).generate_many([*others[:3], sampled, *others[3:]])
    assert together[3].tokens == alone.tokens and len(alone.tokens) == 12
    reseeded = GenerationRequest(**{**sampled.__dict__, "seed": 8, "request_id": "other"})
    assert BatchGenerator(model, processor).generate_many([reseeded])[0].tokens != alone.tokens


def test_stop_strings_end_the_text_and_tokens_stream_it(model_and_processor):
    model, processor = model_and_processor
    plain = GenerationRequest.from_prompt("hello there", max_new_tokens=12)
    full = BatchGenerator(model, processor).generate_many([plain])[0]
    stop = full.text[3:5]
    stopped = GenerationRequest.from_prompt("hello there", max_new_tokens=12, stop=[stop])
    generator = BatchGenerator(model, processor)
    generator.submit(stopped)
    events = list(generator.run())
    (result,) = [e for e in events if isinstance(e, RequestResult)]
    assert result.finish_reason == "stop" and result.text == full.text[: full.text.find(stop)]
    streamed = "".join(e.text for e in events if isinstance(e, TokenEvent))
    assert streamed == result.text  # the stop string itself is never streamed
    assert list(result.tokens) == list(full.tokens[: len(result.tokens)])


def test_streamed_text_never_splits_a_character(model_and_processor):
    model, processor = model_and_processor
    tokenizer = processor.tokenizer
    word = "héllo 你好世界 🙂"
    tokens = tokenizer(word, add_special_tokens=False)["input_ids"]
    generator = BatchGenerator(model, processor)
    sequence = generator.submit(GenerationRequest.from_prompt("x", max_new_tokens=len(tokens)))
    sequence = sequence._sequence
    events = []
    for token in tokens:
        logits = torch.full((len(tokenizer),), -1e9)
        logits[token] = 0.0
        generator._take(sequence, logits, events)
    pieces = [e.text for e in events if isinstance(e, TokenEvent)]
    assert "".join(pieces) == word and not any("\ufffd" in piece for piece in pieces)


def test_generation_config_rules_apply_as_in_generate(model_and_processor):
    base, processor = model_and_processor
    model = copy.deepcopy(base)
    model.generation_config.repetition_penalty = 1.3
    model.generation_config.min_new_tokens = 5
    first = generate_alone(base, processor, _mixed_requests()[0])
    model.generation_config.eos_token_id = [first[0], first[1]]  # would end at token 1 or 2
    requests = _mixed_requests()
    results = BatchGenerator(model, processor, max_batch_size=3).generate_many(requests)
    for result, query in zip(results, requests, strict=True):
        assert list(result.tokens) == generate_alone(model, processor, query), query.request_id
    assert any(r.finish_reason == "eos" for r in results)
    assert all(
        len(r.tokens) >= min(5, q.max_new_tokens) for r, q in zip(results, requests, strict=True)
    )
    model.generation_config.no_repeat_ngram_size = 3
    with pytest.raises(ValueError, match=r"^model: generation_config.no_repeat_ngram_size=3 is"):
        BatchGenerator(model, processor)


def _random_workload(rng: random.Random, count: int) -> list[GenerationRequest]:
    colours = ["red", "green", "blue", "white"]
    requests = []
    for index in range(count):
        images = [
            _image(rng.choice(colours), (rng.choice([56, 84, 112]), rng.choice([56, 84, 112])))
            for _ in range(rng.choice([0, 0, 1, 1, 2, 3]))
        ]
        requests.append(
            GenerationRequest.from_prompt(
                "question " * rng.randint(1, 12),
                images,
                max_new_tokens=rng.randint(1, 10),
                request_id=f"r{index}",
            )
        )
    return requests


@pytest.mark.parametrize("seed", range(4))
def test_random_workloads_never_exceed_a_budget(model_and_processor, seed):
    model, processor = model_and_processor
    rng = random.Random(seed)
    requests = _random_workload(rng, 10)
    probe = BatchGenerator(model, processor)
    sizes = [probe.submit(q)._sequence.size for q in requests]
    budgets = {
        "max_batch_tokens": max(s.prompt_tokens for s in sizes) + rng.randint(0, 150),
        "max_visual_tokens_per_step": max(s.visual_tokens for s in sizes) + rng.randint(0, 60),
        "max_kv_bytes": probe._batched.kv_bytes_per_token * max(s.longest for s in sizes) * rng.randint(1, 4),
        "max_batch_size": rng.randint(1, 5),
    }  # fmt: skip
    generator = BatchGenerator(model, processor, **budgets)
    results = generator.generate_many(requests)
    for result, query in zip(results, requests, strict=True):
        assert result.finish_reason in ("length", "eos")
        assert len(result.tokens) == query.max_new_tokens or result.finish_reason == "eos"
    for usage in generator.step_usage:
        assert usage.batch_tokens <= budgets["max_batch_tokens"]
        assert usage.visual_tokens <= budgets["max_visual_tokens_per_step"]
        assert usage.kv_bytes <= budgets["max_kv_bytes"]
        assert usage.batch_size <= budgets["max_batch_size"]
    for result, query in zip(results[:3], requests[:3], strict=True):
        assert list(result.tokens) == generate_alone(model, processor, query)


def test_requests_larger_than_a_budget_are_refused_at_submission(model_and_processor):
    model, processor = model_and_processor
    images = [_image("red", (112, 112))] * 2
    request = GenerationRequest.from_prompt("look", images, max_new_tokens=4, request_id="big")
    size = BatchGenerator(model, processor).submit(request)._sequence.size
    cases = {
        "max_batch_tokens": (size.prompt_tokens - 1, f"needs {size.prompt_tokens} prompt tokens"),
        "max_visual_tokens_per_step": (size.visual_tokens - 1, f"needs {size.visual_tokens} image"),
        "max_kv_bytes": (1000, r"needs \d+ KV bytes at its longest"),
    }
    for budget, (limit, needs) in cases.items():
        generator = BatchGenerator(model, processor, **{budget: limit})
        with pytest.raises(BudgetError, match=rf"^{budget}: the request {needs}") as info:
            generator.submit(request)
        assert f"budget of {limit} (request 'big')" in str(info.value)
        assert generator.pending == 0


def test_generate_many_queues_all_or_nothing(model_and_processor):
    model, processor = model_and_processor
    generator = BatchGenerator(model, processor, max_visual_tokens_per_step=20)
    fine = GenerationRequest.from_prompt("hello", max_new_tokens=2)
    too_big = GenerationRequest.from_prompt("look", [_image("red", (112, 112))] * 3)
    with pytest.raises(BudgetError, match=r"^max_visual_tokens_per_step: the request needs"):
        generator.generate_many([fine, too_big])
    assert generator.pending == 0


def test_tight_budgets_run_everything_one_at_a_time(model_and_processor):
    model, processor = model_and_processor
    requests = _mixed_requests()
    prompts = [BatchGenerator(model, processor).submit(q)._sequence.size for q in requests]
    generator = BatchGenerator(
        model, processor, max_batch_size=1, max_batch_tokens=max(p.prompt_tokens for p in prompts)
    )
    results = generator.generate_many(requests)
    assert all(usage.batch_size <= 1 for usage in generator.step_usage)
    assert [len(r.tokens) for r in results] == [q.max_new_tokens for q in requests]


def test_cancelling_frees_the_row_and_leaves_the_others_exact(model_and_processor):
    model, processor = model_and_processor
    requests = _mixed_requests()[:3]
    generator = BatchGenerator(model, processor)
    handles = [generator.submit(q) for q in requests]
    queued = generator.submit(GenerationRequest.from_prompt("never", max_new_tokens=4))
    queued.cancel()
    results, streamed = {}, 0
    for event in generator.run():
        if isinstance(event, TokenEvent) and event.request_id == handles[2].request_id:
            streamed += 1
            if streamed == 3:
                handles[2].cancel()
        if isinstance(event, RequestResult):
            results[event.request_id] = event
    assert results[queued.request_id].finish_reason == "cancelled"
    assert results[queued.request_id].tokens == ()
    cancelled = results[handles[2].request_id]
    assert cancelled.finish_reason == "cancelled" and len(cancelled.tokens) == 3
    sizes = [usage.batch_size for usage in generator.step_usage]
    assert sizes[0] == 3 and len(sizes) < 19  # the 20-token request left early
    for handle, query in zip(handles[:2], requests[:2], strict=True):
        assert list(results[handle.request_id].tokens) == generate_alone(model, processor, query)


def test_events_survive_leaving_run_and_ids_stay_unique(model_and_processor):
    model, processor = model_and_processor
    generator = BatchGenerator(model, processor)
    requests = _mixed_requests()[:3]
    for query in requests:
        generator.submit(query)
    with pytest.raises(ValueError, match=r"^request: request_id 'request-\d+' is already"):
        generator.submit(requests[0])
    with pytest.raises(RuntimeError, match=r"^generate_many: 3 requests submitted earlier"):
        generator.generate_many([GenerationRequest.from_prompt("later")])
    first = next(iter(generator.run()))  # leave run() after one event
    rest = list(generator.run())
    results = [e for e in [first, *rest] if isinstance(e, RequestResult)]
    assert sorted(r.request_id for r in results) == sorted(q.request_id for q in requests)
    assert generator.pending == 0


def test_toggling_pruning_under_a_generator_is_refused(model_and_processor):
    from ascend_vlm import pruning

    base, processor = model_and_processor
    model = copy.deepcopy(base)
    generator = BatchGenerator(model, processor)
    generator.submit(GenerationRequest.from_prompt("hello", max_new_tokens=3))
    pruning.enable_token_pruning(model, pruning.PruneConfig(method="fastv", layer=1, keep=0.5))
    with pytest.raises(ValueError, match=r"^model: token pruning was enabled or disabled after"):
        list(generator.run())


def test_results_carry_timings_and_the_run_its_counters(model_and_processor):
    model, processor = model_and_processor
    generator = BatchGenerator(model, processor, max_batch_size=2)
    results = generator.generate_many(_mixed_requests()[:3])
    for result in results:
        assert 0 <= result.queue_time <= result.time_to_first_token <= result.latency
        assert result.tokens_per_second is None or result.tokens_per_second > 0
    stats = generator.stats()
    assert stats.requests == 3 and stats.output_tokens == sum(len(r.tokens) for r in results)
    assert 0 < stats.utilisation["max_batch_size"] <= 1 and stats.tokens_per_second > 0


def test_bad_input_is_refused(model_and_processor):
    model, processor = model_and_processor
    with pytest.raises(ValueError, match=r"^max_batch_size: expected None or an int >= 1, got 0"):
        BatchGenerator(model, processor, max_batch_size=0)
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_tokens'"):
        BatchGenerator(model, processor, max_tokens=5)
    with pytest.raises(TypeError, match=r"^request: expected a GenerationRequest, got str"):
        BatchGenerator(model, processor).submit("hello")
    with pytest.raises(ValueError, match=r"^max_new_tokens: expected an int >= 1, got 0"):
        GenerationRequest.from_prompt("hi", max_new_tokens=0)
    with pytest.raises(ValueError, match=r"^stop: expected a sequence of non-empty strings"):
        GenerationRequest.from_prompt("hi", stop="x")
