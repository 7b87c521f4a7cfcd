"""BatchGenerator when a step fails: the KV blocks of the sequence whose prefill failed go back
to the pool, the requests a failed decode step admitted wait again instead of vanishing, and a
temperature too small to divide by samples greedily instead of failing the step."""

from __future__ import annotations

import pytest
from chat_vlms import generate_alone

import ascend_vlm.batching.batched_model as batched_model_module
import ascend_vlm.batching.generator as generator_module
from ascend_vlm.batching import BatchGenerator, GenerationRequest, RequestResult

LONG = "tell me everything about the picture and the shapes in it " * 3


def _raising_once(function):
    calls = {"left": 1}

    def wrapped(*args, **kwargs):
        if calls["left"]:
            calls["left"] -= 1
            raise RuntimeError("injected failure")
        return function(*args, **kwargs)

    return wrapped


def test_a_failed_first_token_hands_its_blocks_back_and_the_request_waits(
    model_and_processor, monkeypatch
):
    model, processor = model_and_processor
    generator = BatchGenerator(model, processor)
    request = GenerationRequest.from_prompt(LONG, max_new_tokens=4)
    generator.submit(request)
    monkeypatch.setattr(
        batched_model_module, "next_token", _raising_once(batched_model_module.next_token)
    )
    with pytest.raises(RuntimeError, match="injected failure"):
        list(generator.run())
    assert generator._blocks.pool.held_blocks == 0 and generator.pending == 1
    [result] = [event for event in generator.run() if isinstance(event, RequestResult)]
    assert list(result.tokens) == generate_alone(model, processor, request)
    assert generator._blocks.pool.held_blocks == 0


def test_requests_admitted_in_a_failed_decode_step_wait_again(model_and_processor, monkeypatch):
    model, processor = model_and_processor
    generator = BatchGenerator(model, processor)
    first = GenerationRequest.from_prompt("hello there", max_new_tokens=6)
    second = GenerationRequest.from_prompt("and another question", max_new_tokens=5)
    generator.submit(first)
    events = generator.run()
    next(events)  # the first request's prefill step: its first token
    generator.submit(second)
    monkeypatch.setattr(
        generator_module, "decode_in_blocks", _raising_once(generator_module.decode_in_blocks)
    )
    with pytest.raises(RuntimeError, match="injected failure"):
        list(events)
    assert generator.pending == 1  # the second request, admitted in the failed step
    results = [event for event in generator.run() if isinstance(event, RequestResult)]
    by_id = {result.request_id: result for result in results}
    assert by_id[first.request_id].finish_reason == "error"
    assert list(by_id[second.request_id].tokens) == generate_alone(model, processor, second)
    assert generator._blocks.pool.held_blocks == 0


def test_a_vanishing_temperature_samples_the_argmax(model_and_processor):
    model, processor = model_and_processor
    greedy = GenerationRequest.from_prompt(LONG, max_new_tokens=5)
    tiny = GenerationRequest.from_prompt(LONG, max_new_tokens=5, do_sample=True, temperature=1e-30)
    results = BatchGenerator(model, processor).generate_many([greedy, tiny])
    assert list(results[1].tokens) == list(results[0].tokens)
    assert list(results[0].tokens) == generate_alone(model, processor, greedy)
