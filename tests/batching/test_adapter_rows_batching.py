"""BatchGenerator with an AdapterSet: requests for different adapters share a batch, and each
one's greedy tokens equal its adapter's ``generate`` alone."""

from __future__ import annotations

import pytest
from adapters.random_adapters import generate_with_adapter, random_adapter_set
from PIL import Image

from ascend_vlm.adapters import BASE_ADAPTER
from ascend_vlm.batching import BatchGenerator, GenerationRequest


@pytest.fixture(scope="module")
def served(model_and_processor, tmp_path_factory):
    base, _ = model_and_processor
    root = tmp_path_factory.mktemp("batched_adapters")
    return random_adapter_set(base, root, {"first": 1, "second": 2})


def test_rows_of_different_adapters_each_equal_their_adapter_alone(served, model_and_processor):
    _, processor = model_and_processor
    image = Image.new("RGB", (64, 64), "green")
    rows = ["first", BASE_ADAPTER, "second", None, "first"]
    # The same question for every row: the answers differ by adapter only.
    requests = [
        GenerationRequest.from_prompt("what is it?", [image], max_new_tokens=6, adapter=name)
        for name in rows
    ]
    generator = BatchGenerator(served.model, processor, adapters=served, max_batch_size=5)
    results = generator.generate_many(requests)
    assert max(usage.batch_size for usage in generator.step_usage) == 5
    answers = {}
    for result, request, name in zip(results, requests, rows, strict=True):
        expected = generate_with_adapter(
            served, processor, request.messages, name or served.active, request.max_new_tokens
        )
        assert list(result.tokens) == expected, name
        answers.setdefault(name or BASE_ADAPTER, list(result.tokens))
    assert len({tuple(tokens) for tokens in answers.values()}) == 3  # the adapters differ


def test_a_request_naming_an_adapter_needs_a_generator_with_adapters(model_and_processor):
    model, processor = model_and_processor
    generator = BatchGenerator(model, processor)
    with pytest.raises(ValueError, match=r"^request: adapter 'first' needs a BatchGenerator"):
        generator.submit(GenerationRequest.from_prompt("hi", adapter="first"))
    with pytest.raises(ValueError, match=r"^adapter: expected None or an adapter name"):
        GenerationRequest.from_prompt("hi", adapter="")
