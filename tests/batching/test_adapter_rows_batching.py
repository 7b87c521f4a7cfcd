"""BatchGenerator with an AdapterSet: requests for different adapters share a batch, and each
one's greedy tokens equal its adapter's ``generate`` alone."""

from __future__ import annotations

import copy

import pytest
import torch
from adapters.random_adapters import save_random_adapter
from PIL import Image

from ascend_vlm.adapters import BASE_ADAPTER, AdapterSet
from ascend_vlm.batching import BatchGenerator, GenerationRequest


@pytest.fixture(scope="module")
def served(model_and_processor, tmp_path_factory):
    base, _ = model_and_processor
    root = tmp_path_factory.mktemp("batched_adapters")
    adapters = AdapterSet(copy.deepcopy(base))
    adapters.load("first", save_random_adapter(base, root / "first", 1))
    adapters.load("second", save_random_adapter(base, root / "second", 2, rank=8))
    return adapters


def _alone(adapters, processor, request: GenerationRequest, name: str) -> list[int]:
    prompt = processor.apply_chat_template(
        list(request.messages), tokenize=False, add_generation_prompt=True
    )
    images = request.images()
    inputs = processor(text=[prompt], images=images or None, return_tensors="pt")
    adapters.activate(name)
    try:
        with torch.no_grad():
            output = adapters.model.generate(
                **inputs, max_new_tokens=request.max_new_tokens, do_sample=False
            )
    finally:
        adapters.activate(BASE_ADAPTER)
    return output[0, inputs["input_ids"].shape[1] :].tolist()


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
        expected = _alone(served, processor, request, name or served.active)
        assert list(result.tokens) == expected, name
        answers.setdefault(name or BASE_ADAPTER, list(result.tokens))
    assert len({tuple(tokens) for tokens in answers.values()}) == 3  # the adapters differ


def test_a_request_naming_an_adapter_needs_a_generator_with_adapters(model_and_processor):
    model, processor = model_and_processor
    generator = BatchGenerator(model, processor)
    with pytest.raises(ValueError, match="^request: adapter 'first' needs a BatchGenerator"):
        generator.submit(GenerationRequest.from_prompt("hi", adapter="first"))
    with pytest.raises(ValueError, match="^adapter: expected None or an adapter name"):
        GenerationRequest.from_prompt("hi", adapter="")
