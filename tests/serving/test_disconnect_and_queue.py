"""A client that disconnects cancels its request and frees its row for the next; a full queue
answers 429 with OpenAI's error object."""

from __future__ import annotations

import http.client
import json
import time

import requests
from conftest import MODEL_NAME, chat_messages, running_server

from ascend_vlm.serving.limits import ServingLimits

# New tokens of the request that holds the only row: enough to outlast each test's steps.
LONG = 512


def _stream(server, text: str, max_tokens: int) -> requests.Response:
    body = {"model": MODEL_NAME, "messages": chat_messages(text), "max_tokens": max_tokens,
            "temperature": 0, "stream": True}  # fmt: skip
    return requests.post(f"{server.url}/v1/chat/completions", json=body, stream=True, timeout=120)


def _wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_a_disconnect_frees_the_row_and_a_full_queue_answers_429(model_and_processor):
    model, processor = model_and_processor
    limits = ServingLimits(max_queue=2, max_completion_tokens=LONG)
    with running_server(model, processor, limits, max_batch_size=1) as server:
        first = _stream(server, "a long answer please", LONG)
        lines = first.iter_lines(decode_unicode=True)
        role = next(line for line in lines if line.startswith("data: "))
        assert json.loads(role[6:])["choices"][0]["delta"]["role"] == "assistant"
        _wait_for(lambda: server.engine.running_rows == 1, "the first request never ran")
        second = _stream(server, "the next one", 3)  # admitted, waits for the only row
        assert second.status_code == 200
        refused = requests.post(
            f"{server.url}/v1/chat/completions", timeout=60,
            json={"model": MODEL_NAME, "messages": chat_messages("too many")},
        )  # fmt: skip
        assert refused.status_code == 429
        assert refused.json()["error"]["code"] == "queue_full"
        assert "--max-queue" in refused.json()["error"]["message"]
        first.close()  # the client leaves: its request is cancelled, its row freed
        events = [line for line in second.iter_lines(decode_unicode=True) if line]
        assert events[-1] == "data: [DONE]"
        finish = json.loads(events[-2][6:])
        assert finish["choices"][0]["finish_reason"] in ("length", "stop")
        _wait_for(lambda: server.metric('ascend_vlm_requests_total{status="cancelled"}') == 1,
                  "the disconnect was not counted as a cancellation")  # fmt: skip
        assert server.metric('ascend_vlm_requests_total{status="queue_full"}') == 1
        assert server.metric('ascend_vlm_requests_total{status="ok"}') == 1
        _wait_for(lambda: server.engine.queue_depth == 0, "the cancelled request stayed queued")
        # Only the second request's tokens were generated to the end.
        assert (
            server.metric("ascend_vlm_generated_tokens_total")
            == finish["usage"]["completion_tokens"]
        )


def test_a_waiting_client_that_gives_up_cancels_its_request(model_and_processor):
    model, processor = model_and_processor
    limits = ServingLimits(max_completion_tokens=LONG)
    with running_server(model, processor, limits, max_batch_size=1) as server:
        first = _stream(server, "a long answer please", LONG)
        next(line for line in first.iter_lines(decode_unicode=True) if line)
        # A non-streaming request waits for the only row; its client leaves meanwhile.
        body = json.dumps({"model": MODEL_NAME, "messages": chat_messages("wait"),
                           "max_tokens": 4})  # fmt: skip
        waiting = http.client.HTTPConnection(server.url.removeprefix("http://"), timeout=60)
        waiting.request("POST", "/v1/chat/completions", body,
                        {"content-type": "application/json"})  # fmt: skip
        _wait_for(lambda: server.engine.queue_depth == 1, "the second request was not queued")
        waiting.close()
        _wait_for(lambda: server.metric('ascend_vlm_requests_total{status="cancelled"}') == 1,
                  "the waiting client's departure was not noticed")  # fmt: skip
        first.close()
        _wait_for(lambda: server.metric('ascend_vlm_requests_total{status="cancelled"}') == 2,
                  "the streaming client's departure was not noticed")  # fmt: skip
        _wait_for(lambda: server.engine.queue_depth == 0 and server.engine.running_rows == 0,
                  "a cancelled request kept its place")  # fmt: skip
        assert server.metric("ascend_vlm_generated_tokens_total") == 0
