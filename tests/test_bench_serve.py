"""scripts/bench_serve.py's pieces: its clients against a fake OpenAI-compatible server on
127.0.0.1, its server launcher, its closed-loop arithmetic and its statistics."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, StreamingResponse

FIRST_TEXT_DELAY = 0.05
# What the fake server's /metrics says: two running rows holding 40 tokens in 3 KiB.
FAKE_METRICS = (
    "# HELP ascend_vlm_running_rows Sequences in the running batch\n"
    "ascend_vlm_running_rows 2.0\nascend_vlm_kv_bytes 3072.0\nascend_vlm_kv_tokens 40.0\n"
    "ascend_vlm_kv_bytes_other 1.0\n"
)


@pytest.fixture(scope="module")
def bench(script_module):
    return script_module("bench_serve")


class FakeServer:
    """An OpenAI-compatible chat endpoint that answers ``max_tokens`` one-word chunks after
    FIRST_TEXT_DELAY, noting the most requests it held at once and every request's messages."""

    def __init__(self) -> None:
        self.in_flight = self.most_in_flight = 0
        self.conversations: list[list[dict]] = []
        self.app = FastAPI()
        self.app.get("/health")(lambda: {"status": "ok"})
        self.app.get("/v1/models")(lambda: {"object": "list", "data": [{"id": "fake", "object": "model", "created": 0, "owned_by": "me"}]})  # fmt: skip
        self.app.post("/v1/chat/completions")(self.chat)
        self.app.get("/metrics")(lambda: PlainTextResponse(FAKE_METRICS))

    def chunk(self, delta: dict, usage: dict | None = None) -> str:
        choices = [] if usage else [{"index": 0, "delta": delta, "finish_reason": None}]
        body = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "fake",
                "choices": choices, "usage": usage}  # fmt: skip
        return f"data: {json.dumps(body)}\n\n"

    async def chat(self, request: Request):
        body = await request.json()
        self.conversations.append(body["messages"])
        tokens = body["max_tokens"]
        if not body.get("stream"):
            return {"id": "c", "object": "chat.completion", "created": 0, "model": "fake",
                    "choices": [{"index": 0, "finish_reason": "length",
                                 "message": {"role": "assistant", "content": "word " * tokens}}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": tokens,
                              "total_tokens": tokens + 1}}  # fmt: skip

        async def events():
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            yield self.chunk({"role": "assistant", "content": ""})
            await asyncio.sleep(FIRST_TEXT_DELAY)
            for _ in range(tokens):
                yield self.chunk({"content": "word "})
            self.in_flight -= 1
            usage = {"prompt_tokens": 1, "completion_tokens": tokens, "total_tokens": tokens + 1}
            yield self.chunk({}, usage)
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")


@pytest.fixture(scope="module")
def fake(bench):
    fake_server = FakeServer()
    port = bench.free_port()
    config = uvicorn.Config(fake_server.app, host="127.0.0.1", port=port, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    fake_server.url = f"http://127.0.0.1:{port}/v1"
    yield fake_server
    server.should_exit = True
    thread.join(10)


def test_the_clients_stream_every_request_with_at_most_n_in_flight(bench, fake):
    requests = bench.workload(12, 2, 5, seed=0)
    fake.most_in_flight = 0
    run = asyncio.run(bench.run_clients(fake.url, requests, clients=4))
    assert fake.most_in_flight == 4
    assert sorted(s.tokens for s in run.samples) == sorted(r.max_tokens for r in requests)
    assert all(FIRST_TEXT_DELAY <= s.ttft <= s.latency <= run.wall for s in run.samples)
    # 12 requests, 4 at a time, each waiting FIRST_TEXT_DELAY: at least three waves.
    assert run.wall >= 3 * FIRST_TEXT_DELAY


def test_requests_carry_their_images_as_data_urls(bench, fake):
    (request,) = [r for r in bench.workload(20, 1, 1, seed=0) if len(r.images) == 3][:1]
    asyncio.run(bench.run_clients(fake.url, [request], clients=1))
    (message,) = fake.conversations[-1]
    urls = [part["image_url"]["url"] for part in message["content"] if part["type"] == "image_url"]
    assert len(urls) == 3 and all(url.startswith("data:image/png;base64,") for url in urls)
    assert message["content"][-1] == {"type": "text", "text": request.text}


def test_a_conversation_repeats_its_turns_and_answers(bench, fake):
    turns = bench.conversation(3, seed=0)
    ttft = asyncio.run(bench.last_turn_ttft(fake.url, turns))
    last = fake.conversations[-1]
    assert [m["role"] for m in last] == ["user", "assistant", "user", "assistant", "user"]
    assert last[1]["content"] == "word " * turns[0].max_tokens
    assert ttft >= FIRST_TEXT_DELAY


def test_the_workload_mixes_images_and_answer_lengths(bench):
    requests = bench.workload(40, 4, 64, seed=0)
    assert {len(r.images) for r in requests} == {0, 1, 3}
    lengths = [r.max_tokens for r in requests]
    assert min(lengths) >= 4 and max(lengths) <= 64 and len(set(lengths)) > 10
    assert bench.workload(40, 4, 64, seed=0)[7].text == requests[7].text


@pytest.mark.parametrize("q", [0, 5, 50, 90, 95, 99, 100])
def test_percentiles_interpolate_as_numpy_does(bench, q):
    values = list(np.random.default_rng(q).exponential(size=37))
    assert bench.percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert bench.percentile([3.0], q) == 3.0


def test_percentiles_refuse_nothing_and_out_of_range(bench):
    with pytest.raises(ValueError, match="values: expected at least one value"):
        bench.percentile([], 50)
    with pytest.raises(ValueError, match=r"q: expected a percentile in \[0, 100\], got 101"):
        bench.percentile([1.0], 101)


def test_a_summary_pools_the_rounds(bench):
    first = bench.Run((bench.Sample(1.0, 2.0, 10), bench.Sample(3.0, 4.0, 20)), wall=4.0)
    second = bench.Run((bench.Sample(2.0, 3.0, 30),), wall=2.0)
    summary = bench.summarize([first, second])
    assert summary.requests_per_s == pytest.approx(3 / 6)
    assert summary.tokens_per_s == pytest.approx(60 / 6)
    assert (summary.ttft_p50, summary.ttft_p95) == (2.0, pytest.approx(2.9))


def test_the_rows_compare_with_transformers_serve_and_carry_the_a_a_ratio(bench):
    def summary(tokens_per_s, p95):
        return bench.Summary(tokens_per_s / 10, tokens_per_s, p95 / 2, p95)

    summaries = {
        bench.OURS: summary(40.0, 1.0),
        bench.THEIRS: summary(10.0, 4.0),
        bench.SEQUENTIAL: summary(20.0, 2.0),
        bench.OURS_AGAIN: summary(44.0, 1.0),
    }
    rows = {
        row[1]: dict(zip(bench.HEADER, row, strict=True))
        for row in bench.throughput_rows(16, summaries)
    }
    assert rows[bench.OURS]["throughput x"] == "4.00"
    assert rows[bench.OURS]["TTFT p95 speed-up"] == "4.00"
    assert rows[bench.SEQUENTIAL]["TTFT p50 speed-up"] == "2.00"
    assert {row["A/A"] for row in rows.values()} == {"1.10"}


def test_the_conversation_rows_give_the_speed_up_of_reuse(bench):
    ttfts = {"reuse on": [0.1, 0.2, 0.3], "reuse off": [1.0, 1.5, 2.0], "reuse on (A/A)": [0.2]}
    rows = {
        row[1]: dict(zip(bench.HEADER, row, strict=True))
        for row in bench.conversation_rows(3, ttfts)
    }
    on = rows["ascend_vlm serve, turn 3, reuse on"]
    assert (on["TTFT p50 s"], on["TTFT p50 speed-up"], on["A/A"]) == ("0.200", "7.50", "1.00")


def test_the_kv_gauges_are_sampled_while_the_block_runs(bench, fake, monkeypatch):
    monkeypatch.setattr(bench, "KV_SAMPLE_SECONDS", 0.01)
    assert bench.read_kv_gauges(fake.url) == bench.KVSample(2, 3072.0, 40.0)
    with bench.kv_samples(fake.url) as samples:
        deadline = time.monotonic() + 30
        while len(samples) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert len(samples) >= 3 and set(samples) == {bench.KVSample(2, 3072.0, 40.0)}


def test_the_kv_row_compares_bytes_per_row_with_what_its_tokens_need(bench):
    samples = [bench.KVSample(2, 3072.0, 40.0), bench.KVSample(1, 1024.0, 10.0)]
    row = dict(zip(bench.KV_HEADER, bench.kv_rows(samples, 64)[0], strict=True))
    # 4096 bytes over 3 rows; 50 tokens x 64 bytes = 3200 bytes needed over 3 rows.
    assert row["KV bytes per running row"] == "1,365"
    assert row["what its tokens need"] == "1,067"
    assert row["KV / need"] == "1.280"
    assert bench.kv_rows([], 64)[0][1] == "0"


class _Clock:
    """A ``time`` module stand-in whose clock only the fake model moves."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class _FakeModel:
    """``generate`` that takes 10 ms of ``clock`` to its first token and 10 ms more to the end."""

    def __init__(self, clock: _Clock) -> None:
        self.clock = clock

    def generate(self, input_ids, max_new_tokens, do_sample, streamer):
        streamer.put(input_ids)
        self.clock.now += 0.01
        streamer.put(torch.tensor([1]))
        self.clock.now += 0.01
        streamer.end()
        return torch.cat([input_ids, torch.ones(1, max_new_tokens, dtype=torch.long)], dim=1)


class _FakeProcessor:
    def apply_chat_template(self, messages, **kwargs):
        return {"input_ids": torch.zeros(1, 5, dtype=torch.long)}


def test_sequential_generate_times_requests_as_closed_loop_clients_see_them(bench, monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(bench, "time", clock)
    requests = bench.workload(6, 3, 3, seed=0)
    run = bench.generate_sequentially(_FakeModel(clock), _FakeProcessor(), requests, clients=2)
    assert [s.tokens for s in run.samples] == [3] * 6
    # Both clients send at 0; from then on request i is sent when request i-2 ends, waits for
    # request i-1 (20 ms) and reaches its first token 10 ms later.
    assert [s.ttft for s in run.samples] == pytest.approx([0.01, 0.03, 0.03, 0.03, 0.03, 0.03])
    assert [s.latency for s in run.samples] == pytest.approx([0.02, 0.04, 0.04, 0.04, 0.04, 0.04])
    assert run.wall == pytest.approx(0.12)


def test_the_server_launcher_waits_for_health_and_stops_the_server(bench, tmp_path):
    script = (
        "import http.server, sys\n"
        "class H(http.server.BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        "        self.send_response(200 if self.path == '/health' else 404); self.end_headers()\n"
        "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()\n"
    )
    ports = []

    def command(port):
        ports.append(port)
        return [sys.executable, "-c", script, str(port)]

    with bench.server(command, tmp_path / "log", 1) as url:
        assert url == f"http://127.0.0.1:{ports[0]}/v1"
        urllib.request.urlopen(f"http://127.0.0.1:{ports[0]}/health", timeout=5).close()
    with pytest.raises(urllib.error.URLError):  # stopped: nothing listens any more
        urllib.request.urlopen(f"http://127.0.0.1:{ports[0]}/health", timeout=5)
    with (
        pytest.raises(
            RuntimeError, match="the server exited with code 3; its output ends:\nbad flag"
        ),
        bench.server(
            lambda port: [sys.executable, "-c", "print('bad flag'); exit(3)"], tmp_path / "log", 1
        ),
    ):
        pass


def test_the_commands_listen_on_loopback_only(bench, tmp_path):
    for command in (
        bench.ours_command(tmp_path, ["--vision-cache", "64"], 8000),
        bench.transformers_command(tmp_path, 8000),
    ):
        assert command[command.index("--host") + 1] == "127.0.0.1"


def test_bad_arguments_are_refused(bench, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--turns", "1"])
    assert exit_info.value.code == 2
    assert "--turns: expected >= 2 (a later turn to measure), got 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--only-conversations"])
    assert "--only-conversations: expected --reuse-args too" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--width", "100"])
    assert "--width: expected a multiple of 64 (64-wide heads), got 100" in capsys.readouterr().err


def test_the_model_answers_in_words_that_re_tokenize_to_its_tokens(bench, tmp_path):
    """Greedy answers of the served model, sent back in a conversation's next request, are
    the tokens it generated: the prefix cache can reach past them."""
    model = bench.load_bench_model(tmp_path, layers=1)
    processor = bench.bench_processor(bench.IMAGE_SIDE)
    tokenizer = processor.tokenizer
    kept = bench.answer_in_whole_words(model, tokenizer)
    assert 10 < kept < len(tokenizer) // 2
    for question in ("how many shapes", "where is the red circle", "count the squares"):
        messages = [{"role": "user", "content": [{"type": "text", "text": question}]}]
        prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None)
        answer = out[0, ids.shape[1] :].tolist()
        assert all(tokenizer.convert_ids_to_tokens(token).startswith("Ġ") for token in answer)
        sent_back = tokenizer(prompt + tokenizer.decode(answer), return_tensors="pt").input_ids
        assert sent_back[0, ids.shape[1] :].tolist() == answer
