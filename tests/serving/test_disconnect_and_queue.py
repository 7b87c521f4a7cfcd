"""A client that disconnects cancels its request and frees its row for the next, and its place
in the queue at once even while it waits behind another; a full queue answers 429 with
OpenAI's error object."""

from __future__ import annotations

import http.client
import json
import time

import requests
from served_vlm import MODEL_NAME, chat_messages, running_server

from ascend_vlm.serving.limits import ServingLimits

# New tokens of the request that holds the only row: enough to outlast each test's steps.
LONG = 512


class _RawClient:
    """One request on its own connection, which :meth:`leave` closes (the socket itself, so
    the server sees the client go)."""

    def __init__(self, server, text: str, max_tokens: int, stream: bool) -> None:
        body = {"model": MODEL_NAME, "messages": chat_messages(text), "max_tokens": max_tokens,
                "temperature": 0, "stream": stream}  # fmt: skip
        self.connection = http.client.HTTPConnection(
            server.url.removeprefix("http://"), timeout=120
        )
        self.connection.request("POST", "/v1/chat/completions", json.dumps(body),
                                {"content-type": "application/json"})  # fmt: skip
        self.response: http.client.HTTPResponse | None = None

    def events(self):
        """The response's server-sent event lines, as they come."""
        self.response = self.response or self.connection.getresponse()
        assert self.response.status == 200, self.response.read()
        for line in self.response:
            if line.strip():
                yield line.decode().strip()

    def leave(self) -> None:
        if self.response is not None:
            self.response.close()
        self.connection.close()


def _wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _cancelled(server) -> float:
    return server.metric('ascend_vlm_requests_total{status="cancelled"}')


def test_a_disconnect_frees_the_row_and_a_full_queue_answers_429(model_and_processor):
    model, processor = model_and_processor
    limits = ServingLimits(max_queue=2, max_completion_tokens=LONG)
    with running_server(model, processor, limits, max_batch_size=1) as server:
        first = _RawClient(server, "a long answer please", LONG, stream=True)
        role = next(first.events())
        assert json.loads(role[6:])["choices"][0]["delta"]["role"] == "assistant"
        _wait_for(lambda: server.engine.running_rows == 1, "the first request never ran")
        second = _RawClient(server, "the next one", 3, stream=True)
        _wait_for(lambda: server.engine.queue_depth == 1, "the second request was not queued")
        refused = requests.post(
            f"{server.url}/v1/chat/completions", timeout=60,
            json={"model": MODEL_NAME, "messages": chat_messages("too many")},
        )  # fmt: skip
        assert refused.status_code == 429
        assert refused.json()["error"]["code"] == "queue_full"
        assert "--max-queue" in refused.json()["error"]["message"]
        first.leave()  # its request is cancelled, its row freed for the second
        events = list(second.events())
        assert events[-1] == "data: [DONE]"
        finish = json.loads(events[-2][6:])
        assert finish["choices"][0]["finish_reason"] in ("length", "stop")
        _wait_for(lambda: _cancelled(server) == 1, "the disconnect was not counted")
        assert server.metric('ascend_vlm_requests_total{status="queue_full"}') == 1
        assert server.metric('ascend_vlm_requests_total{status="ok"}') == 1
        _wait_for(lambda: server.engine.queue_depth == 0, "the cancelled request stayed queued")
        # Only the second request's tokens were generated to the end.
        completion = finish["usage"]["completion_tokens"]
        assert server.metric("ascend_vlm_generated_tokens_total") == completion


def test_a_waiting_client_that_gives_up_cancels_its_request(model_and_processor):
    model, processor = model_and_processor
    limits = ServingLimits(max_completion_tokens=LONG)
    with running_server(model, processor, limits, max_batch_size=1) as server:
        first = _RawClient(server, "a long answer please", LONG, stream=True)
        next(first.events())
        # A non-streaming request waits for the only row; its client leaves meanwhile.
        waiting = _RawClient(server, "wait", 4, stream=False)
        _wait_for(lambda: server.engine.queue_depth == 1, "the second request was not queued")
        waiting.leave()
        _wait_for(lambda: _cancelled(server) == 1, "the waiting client's departure was missed")
        first.leave()
        _wait_for(lambda: _cancelled(server) == 2, "the streaming client's departure was missed")
        _wait_for(lambda: server.engine.queue_depth == 0 and server.engine.running_rows == 0,
                  "a cancelled request kept its place")  # fmt: skip
        assert server.metric("ascend_vlm_generated_tokens_total") == 0


def test_a_waiting_client_that_leaves_frees_its_queue_place_at_once(model_and_processor):
    model, processor = model_and_processor
    limits = ServingLimits(max_queue=3, max_completion_tokens=LONG)
    with running_server(model, processor, limits, max_batch_size=1) as server:
        running = _RawClient(server, "a long answer please", LONG, stream=True)
        next(running.events())
        _wait_for(lambda: server.engine.running_rows == 1, "the first request never ran")
        # The next in line waits for the only row; behind it a client gives up.
        next_in_line = _RawClient(server, "the next one", LONG, stream=True)
        _wait_for(lambda: server.engine.queue_depth == 1, "the second request was not queued")
        leaving = _RawClient(server, "wait", 4, stream=False)
        _wait_for(lambda: server.engine.queue_depth == 2, "the third request was not queued")
        leaving.leave()
        _wait_for(lambda: _cancelled(server) == 1, "the waiting client's departure was missed")
        # Its place is free while the one ahead of it still waits: a new request gets it.
        _wait_for(lambda: server.engine.queue_depth == 1, "the cancelled request kept its place")
        admitted = _RawClient(server, "one more", LONG, stream=True)
        assert json.loads(next(admitted.events())[6:])["choices"][0]["delta"]["role"]
        refused = requests.post(
            f"{server.url}/v1/chat/completions", timeout=60,
            json={"model": MODEL_NAME, "messages": chat_messages("too many")},
        )  # fmt: skip
        assert refused.status_code == 429, refused.text
        assert server.engine.queue_depth == 2  # the next in line and the new one
        for client in (running, next_in_line, admitted):
            client.leave()
        _wait_for(lambda: server.engine.queue_depth == 0 and server.engine.running_rows == 0,
                  "a cancelled request kept its place")  # fmt: skip
