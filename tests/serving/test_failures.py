"""Failures inside the server: a prefill that raises fails its own request alone (500, or an
error event ending the stream) while the requests in flight finish with their answers; an
exception at submission that is not the request's fault is a logged 500, a request the model
cannot encode a 400; and the engine reads the KV bytes once per step, not per token."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from unittest import mock

import openai
import pytest
import requests
from chat_vlms import generate_alone
from served_vlm import MODEL_NAME, chat_messages

from ascend_vlm.batching import BatchGenerator, GenerationRequest, RequestResult
from ascend_vlm.serving.engine import Engine
from ascend_vlm.testing import faults

GOOD = ("hello there", "describe a red square")
GOOD_TOKENS = 64
FAILING = "kaboom kaboom kaboom"


def _wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_a_failing_prefill_fails_its_request_alone(tiny_server, model_and_processor):
    model, processor = model_and_processor
    tokenizer = processor.tokenizer
    marker = tokenizer(FAILING)["input_ids"][0]
    assert all(marker not in tokenizer(text)["input_ids"] for text in GOOD)
    expected = [
        tokenizer.decode(
            generate_alone(
                model, processor, GenerationRequest.from_prompt(text, max_new_tokens=GOOD_TOKENS)
            ),
            skip_special_tokens=True,
        )
        for text in GOOD
    ]
    pending_at_failure: list[int] = []

    def failing_prefill(**inputs) -> bool:
        ids = inputs["input_ids"]
        if ids.shape[1] > 1 and bool((ids == marker).any()):
            pending_at_failure.append(tiny_server.engine.generator.pending)
            return True
        return False

    client = tiny_server.client()

    def ask(text: str) -> str:
        stream = client.chat.completions.create(
            model=MODEL_NAME, messages=chat_messages(text), max_tokens=GOOD_TOKENS, temperature=0,
            stream=True,
        )  # fmt: skip
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    errors = tiny_server.metric('ascend_vlm_requests_total{status="error"}')
    injected = RuntimeError("injected prefill fault")
    with (
        faults.method_raises(model, "forward", injected, when=failing_prefill) as fault,
        ThreadPoolExecutor(len(GOOD)) as pool,
    ):
        answers = [pool.submit(ask, text) for text in GOOD]
        _wait_for(lambda: tiny_server.engine.running_rows == len(GOOD), "the answers ran")
        with pytest.raises(openai.InternalServerError, match="injected prefill fault"):
            client.chat.completions.create(model=MODEL_NAME, messages=chat_messages(FAILING))
        with pytest.raises(openai.APIError, match="injected prefill fault"):
            list(client.chat.completions.create(
                model=MODEL_NAME, messages=chat_messages(FAILING), stream=True
            ))  # fmt: skip
        body = {"model": MODEL_NAME, "messages": chat_messages(FAILING), "stream": True}
        raw = requests.post(f"{tiny_server.url}/v1/chat/completions", json=body, timeout=120)
        answers = [answer.result() for answer in answers]
    assert fault.calls == 3
    # The good requests were in flight at every failure, and each got its whole answer.
    assert min(pending_at_failure) >= len(GOOD), pending_at_failure
    assert answers == expected
    events = [line for line in raw.text.splitlines() if line]
    assert json.loads(events[0][6:])["choices"][0]["delta"]["role"] == "assistant"
    error = json.loads(events[-2][6:])["error"]
    assert error["type"] == "server_error" and "injected prefill fault" in error["message"]
    assert events[-1] == "data: [DONE]"
    assert tiny_server.metric('ascend_vlm_requests_total{status="error"}') == errors + 3
    assert tiny_server.engine.queue_depth == 0


@pytest.mark.parametrize(
    ("raised", "status", "kind", "param", "words"),
    [
        (RuntimeError("injected submit fault"), 500, "server_error", None,
         "the server failed to take the request: RuntimeError: injected submit fault"),
        (ValueError("injected bad prompt"), 400, "invalid_request_error", "messages",
         "messages: cannot be encoded (injected bad prompt)"),
    ],
)  # fmt: skip
def test_a_submission_failure_is_500_unless_it_is_the_requests_fault(
    tiny_server, caplog, raised, status, kind, param, words
):
    body = {"model": MODEL_NAME, "messages": chat_messages("hi"), "max_tokens": 2}
    generator = tiny_server.engine.generator
    with (
        caplog.at_level(logging.ERROR, logger="ascend_vlm.serving"),
        faults.method_raises(generator, "submit", raised) as fault,
    ):
        response = requests.post(f"{tiny_server.url}/v1/chat/completions", json=body, timeout=120)
    assert fault.calls == 1
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert (error["type"], error["param"], error["message"]) == (kind, param, words)
    logged = [record for record in caplog.records if record.exc_info is not None]
    assert [record.exc_info[1] for record in logged] == ([raised] if status == 500 else [])


def test_the_engine_reads_kv_bytes_once_per_step(model_and_processor):
    model, processor = model_and_processor
    generator = BatchGenerator(model, processor)
    engine = Engine(generator, max_queue=8)
    new_tokens = 6
    prompts = [
        GenerationRequest.from_prompt(f"question {n}", max_new_tokens=new_tokens) for n in range(4)
    ]

    async def tokens_of_all() -> int:
        loop = asyncio.get_running_loop()
        # Queued before the engine starts, so they join the batch in its first step.
        streams = [engine.submit(prompt, loop) for prompt in prompts]
        engine.start()
        tokens = 0
        for stream in streams:
            while not isinstance(item := await stream.get(), RequestResult):
                tokens += isinstance(item, str)
        return tokens

    with mock.patch.object(generator, "kv_bytes", wraps=generator.kv_bytes) as kv_bytes:
        try:
            tokens = asyncio.run(tokens_of_all())
        finally:
            engine.stop()
    assert tokens > new_tokens
    # One prefill step for all four, then at most new_tokens - 1 decode steps.
    assert 1 <= kv_bytes.call_count <= new_tokens
