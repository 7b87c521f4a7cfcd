"""Benchmark: OpenAI-compatible VLM servers under N concurrent streaming clients, side by side:
``python -m ascend_vlm serve``, ``transformers serve`` and sequential ``model.generate``
in-process, on the same model folder and machine; then a conversation's later turn with the
server's reuse (whichever of its caches ``--reuse-args`` turns on) on and off.

The model is the benchmark Qwen2-VL of ``scripts/_bench_models.py`` (``--layers`` language
layers of width ``--width``, by default 8 of 256, a 4-layer vision tower, the default model's
tokenizer and chat template), saved with ``save_pretrained`` into a temporary folder together with its processor (images
224x224, 64 visual tokens each) and no end-of-sequence token, so every answer runs to the
``max_tokens`` its request asks. Its output head keeps only whole-word tokens, so its answers,
like a trained model's, re-tokenize to the tokens it generated when a conversation sends them
back. ``--model PATH`` serves a folder of your own instead.

Workload: ``--requests`` chat requests in a fixed random order, 40% text only, 40% with one
image, 20% with three (PNG data URLs), prompts of 2 to 40 words, greedy answers of ``--min-new``
to ``--max-new`` tokens (by default bench_batching.py's workload: 4 to 128), sent by ``--clients`` concurrent clients (the official ``openai`` async
client, ``stream=True`` with a usage chunk): each client sends its next request when its last
answer ends. Throughput is requests and generated tokens (the servers' usage counts) per second
of wall time; TTFT is from sending a request to the first chunk carrying text.

* ``ascend_vlm serve``: ``python -m ascend_vlm serve --model FOLDER`` plus ``--serve-args``.
* ``transformers serve``: ``transformers serve FOLDER --continuous-batching`` (transformers 5.25
  falls back to one ``generate`` at a time for a VLM: "Only LLMs support continuous batching").
* ``generate, sequential``: ``model.generate`` per request in this process in arrival order; a
  request's TTFT counts from when its client would have sent it in the same closed loop (the
  end of the request ``--clients`` places earlier) to its first generated token.
* ``ascend_vlm serve (A/A)``: the same server measured a second time as its own contender: its
  ratio to the first measurement is the noise floor of every other ratio.

Timing: both servers start on 127.0.0.1 (free ports) and get ``--clients`` warm-up requests;
then ``--rounds`` interleaved rounds run the whole workload on every contender in a rotating
order. Each contender's throughput is its total over the rounds; TTFT percentiles pool its
requests of every round (linear interpolation between order statistics).

Conversation: ``--conversations`` conversations of ``--turns`` turns (three images and a long
question first, then short questions, every turn repeating the conversation so far as clients
do), each with fresh images, alternately on a server started with ``--reuse-args`` added (the
flags that turn its reuse on, e.g. ``--vision-cache 256``) and on one without them; the rows
give the last turn's TTFT. Without ``--reuse-args`` they are left out; ``--only-conversations``
leaves out everything else.

KV memory: while the workload runs, a thread reads ``ascend_vlm serve``'s ``/metrics`` every
``KV_SAMPLE_SECONDS``: the running rows, the KV bytes they hold (``ascend_vlm_kv_bytes``) and
the tokens whose KV they hold (``ascend_vlm_kv_tokens``). A second table gives, over the
samples with a running row, the KV bytes per running row, what its tokens need (tokens x the
model's KV bytes per token) and their ratio: blocks cost at most a partly filled block per row
beyond the tokens, where a padded batch costs the longest row's length per row. (With a prefix
cache, rows sharing blocks count them once, so the ratio can fall below 1.)

A benchmark, not a test: numbers depend on the machine and its load.

Usage::

    python scripts/bench_serve.py [--clients 16] [--requests 32] [--rounds 3] [--layers 8] [--width 256]
        [--min-new 4] [--max-new 128] [--threads N] [--model PATH] [--serve-args ARGS]
        [--reuse-args ARGS] [--turns 3] [--conversations 6] [--only-conversations]
        [--json PATH]  (PATH: the table as JSON for docs/benchmarks/, see _bench_record.py)
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import functools
import io
import math
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a source checkout

import torch
from _bench_models import bench_processor, load_bench_model, random_images, width_problem
from _bench_record import show_table, table
from PIL import Image

IMAGE_SIDE = 224
WORDS = ["shape", "colour", "left", "right", "circle", "square", "red", "blue", "count", "where"]
LOOPBACK = "127.0.0.1"
OURS, THEIRS, SEQUENTIAL, OURS_AGAIN = (
    "ascend_vlm serve",
    "transformers serve",
    "generate, sequential",
    "ascend_vlm serve (A/A)",
)
# Seconds between two reads of the server's KV gauges.
KV_SAMPLE_SECONDS = 0.25
KV_HEADER = [
    "contender", "samples", "running rows (mean)", "KV bytes per running row",
    "what its tokens need", "KV / need",
]  # fmt: skip
HEADER = [
    "clients", "contender", "requests/s", "tokens/s", "TTFT p50 s", "TTFT p95 s", "vs",
    "throughput x", "TTFT p50 speed-up", "TTFT p95 speed-up", "A/A",
]  # fmt: skip


class ChatRequest(NamedTuple):
    """One user turn: its text, its images, and the answer length it asks for."""

    text: str
    images: tuple[Image.Image, ...]
    max_tokens: int


class Sample(NamedTuple):
    """One answered request: seconds to its first text, seconds to its end, tokens generated."""

    ttft: float
    latency: float
    tokens: int


class Run(NamedTuple):
    """One pass of a workload: its answered requests and its wall time in seconds."""

    samples: tuple[Sample, ...]
    wall: float


def workload(count: int, min_new: int, max_new: int, seed: int) -> list[ChatRequest]:
    """The mixed requests (see the module docstring)."""
    rng = random.Random(seed)
    requests = []
    for index in range(count):
        pictures = rng.choices([0, 1, 3], weights=[0.4, 0.4, 0.2])[0]
        requests.append(
            ChatRequest(
                text=" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 40))),
                images=tuple(random_images(pictures, IMAGE_SIDE, seed * 1000 + index)),
                max_tokens=rng.randint(min_new, max_new),
            )
        )
    return requests


def data_url(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def openai_content(request: ChatRequest) -> list[dict]:
    """The turn as OpenAI content parts: its images as data URLs, then its text."""
    parts = [{"type": "image_url", "image_url": {"url": data_url(i)}} for i in request.images]
    return [*parts, {"type": "text", "text": request.text}]


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values``, interpolating linearly between the order
    statistics around rank ``q / 100 * (n - 1)`` (numpy's default)."""
    if not values:
        raise ValueError("values: expected at least one value, got none")
    if not 0 <= q <= 100:
        raise ValueError(f"q: expected a percentile in [0, 100], got {q}")
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


class Summary(NamedTuple):
    """A contender's figures over its runs."""

    requests_per_s: float
    tokens_per_s: float
    ttft_p50: float
    ttft_p95: float


def summarize(runs: list[Run]) -> Summary:
    """Throughput over the runs' total wall time; TTFT percentiles over every request."""
    samples = [sample for run in runs for sample in run.samples]
    wall = sum(run.wall for run in runs)
    ttfts = [sample.ttft for sample in samples]
    return Summary(
        requests_per_s=len(samples) / wall,
        tokens_per_s=sum(sample.tokens for sample in samples) / wall,
        ttft_p50=percentile(ttfts, 50),
        ttft_p95=percentile(ttfts, 95),
    )


async def stream_one(client, model: str, messages: list[dict], max_tokens: int) -> Sample:
    """Send one streaming chat request; time its first text chunk and its end."""
    start = time.perf_counter()
    first = None
    tokens = 0
    stream = await client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
    )
    async for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter()
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    end = time.perf_counter()
    if tokens == 0:
        raise RuntimeError(f"{model}: expected a usage chunk with completion tokens, got none")
    return Sample(ttft=(first or end) - start, latency=end - start, tokens=tokens)


async def run_clients(base_url: str, requests: list[ChatRequest], clients: int) -> Run:
    """``clients`` concurrent clients working through ``requests`` in order, each sending its
    next request when its previous answer ends."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key="bench", max_retries=0, timeout=3600)
    model = (await client.models.list()).data[0].id
    pending = iter([(r, [{"role": "user", "content": openai_content(r)}]) for r in requests])
    samples: list[Sample] = []

    async def one_client() -> None:
        for request, messages in pending:  # a shared iterator: each request goes to one client
            samples.append(await stream_one(client, model, messages, request.max_tokens))

    start = time.perf_counter()
    await asyncio.gather(*(one_client() for _ in range(clients)))
    wall = time.perf_counter() - start
    await client.close()
    return Run(samples=tuple(samples), wall=wall)


class KVSample(NamedTuple):
    """The server's KV gauges at one read: running rows, KV bytes and tokens they hold."""

    rows: int
    kv_bytes: float
    kv_tokens: float


def read_kv_gauges(base_url: str) -> KVSample:
    """The KV gauges of the ``ascend_vlm serve`` at ``base_url`` (its ``/v1`` URL)."""
    metrics_url = base_url.removesuffix("/v1") + "/metrics"
    with urllib.request.urlopen(metrics_url, timeout=10) as answer:
        lines = answer.read().decode().splitlines()
    values = {}
    for line in lines:
        name, _, value = line.partition(" ")
        if name in ("ascend_vlm_running_rows", "ascend_vlm_kv_bytes", "ascend_vlm_kv_tokens"):
            values[name] = float(value)
    return KVSample(
        int(values["ascend_vlm_running_rows"]),
        values["ascend_vlm_kv_bytes"],
        values["ascend_vlm_kv_tokens"],
    )


@contextlib.contextmanager
def kv_samples(base_url: str) -> Iterator[list[KVSample]]:
    """While the block runs, read the server's KV gauges every ``KV_SAMPLE_SECONDS`` into the
    list yielded, keeping the reads with a running row."""
    samples: list[KVSample] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(KV_SAMPLE_SECONDS):
            with contextlib.suppress(OSError):
                read = read_kv_gauges(base_url)
                if read.rows and read.kv_tokens:
                    samples.append(read)

    sampler = threading.Thread(target=sample, name="bench-kv-sampler", daemon=True)
    sampler.start()
    try:
        yield samples
    finally:
        stop.set()
        sampler.join()


def kv_rows(samples: list[KVSample], bytes_per_token: int) -> list[list[str]]:
    """The KV memory row: KV bytes per running row against what its tokens need."""
    if not samples:
        return [[OURS, "0", "", "", "", ""]]
    held = sum(s.kv_bytes for s in samples)
    needed = sum(s.kv_tokens for s in samples) * bytes_per_token
    rows = sum(s.rows for s in samples)
    return [
        [
            OURS,
            str(len(samples)),
            f"{rows / len(samples):.1f}",
            f"{held / rows:,.0f}",
            f"{needed / rows:,.0f}",
            f"{held / needed:.3f}",
        ]
    ]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind((LOOPBACK, 0))
        return probe.getsockname()[1]


def wait_until_healthy(url: str, process: subprocess.Popen, timeout: float) -> None:
    """Poll ``url`` until it answers 200; raise if ``process`` exits or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url}: the server exited with code {process.returncode}")
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as answer:
            if answer.status == 200:
                return
        time.sleep(0.5)
    raise TimeoutError(f"{url}: expected 200 within {timeout:.0f} s, got no answer")


@contextlib.contextmanager
def server(command: Callable[[int], list[str]], log: Path, threads: int) -> Iterator[str]:
    """Run ``command(port)`` (a server listening on 127.0.0.1:``port``, a free port) until the
    block ends; yield its OpenAI base URL. Its output goes to ``log``; it stops with SIGTERM as
    a deployment stops it (then SIGKILL after 60 s)."""
    port = free_port()
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_DISABLE_UPDATE_CHECK": "1",
        "PYTHONPATH": str(Path(__file__).resolve().parent.parent),
    }
    with log.open("w") as output:
        process = subprocess.Popen(command(port), stdout=output, stderr=subprocess.STDOUT, env=env)
        try:
            try:
                wait_until_healthy(f"http://{LOOPBACK}:{port}/health", process, timeout=600)
            except (RuntimeError, TimeoutError) as error:
                tail = log.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{error}; its output ends:\n{tail}") from None
            yield f"http://{LOOPBACK}:{port}/v1"
        finally:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def ours_command(folder: Path, extra: list[str], port: int) -> list[str]:
    return [sys.executable, "-m", "ascend_vlm", "serve", "--model", str(folder),
            "--host", LOOPBACK, "--port", str(port), *extra]  # fmt: skip


def transformers_command(folder: Path, port: int) -> list[str]:
    return [sys.executable, "-m", "transformers.cli.transformers", "serve", str(folder),
            "--host", LOOPBACK, "--port", str(port), "--continuous-batching"]  # fmt: skip


class _FirstToken:
    """A ``generate`` streamer that notes when the first generated token arrives (its first
    ``put`` is the prompt)."""

    def __init__(self) -> None:
        self.puts = 0
        self.first: float | None = None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def generate_sequentially(model, processor, requests: list[ChatRequest], clients: int) -> Run:
    """Each request through ``model.generate`` in arrival order; TTFTs as ``clients`` closed-loop
    clients would see them (see the module docstring)."""
    start = time.perf_counter()
    finished: list[float] = []
    samples = []
    for index, request in enumerate(requests):
        content = [{"type": "image", "image": image} for image in request.images]
        messages = [{"role": "user", "content": [*content, {"type": "text", "text": request.text}]}]
        inputs = processor.apply_chat_template(
            messages,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
            return_tensors="pt",
        )
        streamer = _FirstToken()
        with torch.no_grad():
            output = model.generate(
                **inputs, max_new_tokens=request.max_tokens, do_sample=False, streamer=streamer
            )
        end = time.perf_counter() - start
        sent = finished[index - clients] if index >= clients else 0.0
        samples.append(
            Sample(
                ttft=streamer.first - start - sent,
                latency=end - sent,
                tokens=output.shape[1] - inputs["input_ids"].shape[1],
            )
        )
        finished.append(end)
    return Run(samples=tuple(samples), wall=time.perf_counter() - start)


def conversation(turns: int, seed: int) -> list[ChatRequest]:
    """A conversation's user turns: three images and a long question, then short questions."""
    rng = random.Random(seed)
    first = ChatRequest(
        text=" ".join(rng.choice(WORDS) for _ in range(60)),
        images=tuple(random_images(3, IMAGE_SIDE, 10_000 + seed)),
        max_tokens=16,
    )
    later = [
        ChatRequest(" ".join(rng.choice(WORDS) for _ in range(6)), (), max_tokens=8)
        for _ in range(turns - 1)
    ]
    return [first, *later]


async def last_turn_ttft(base_url: str, turns: list[ChatRequest]) -> float:
    """Hold the conversation as a client does (each request repeats the turns so far and the
    answers); the TTFT of its last turn."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key="bench", max_retries=0, timeout=3600)
    model = (await client.models.list()).data[0].id
    messages: list[dict] = []
    for turn in turns[:-1]:
        messages.append({"role": "user", "content": openai_content(turn)})
        answer = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=turn.max_tokens, temperature=0.0
        )
        messages.append({"role": "assistant", "content": answer.choices[0].message.content})
    messages.append({"role": "user", "content": openai_content(turns[-1])})
    sample = await stream_one(client, model, messages, turns[-1].max_tokens)
    await client.close()
    return sample.ttft


def rotated(names: list[str], round_index: int) -> list[str]:
    shift = round_index % len(names)
    return names[shift:] + names[:shift]


def conversation_ttfts(urls: dict[str, str], turns: int, count: int) -> dict[str, list[float]]:
    """The last turn's TTFT of ``count`` conversations on every server of ``urls``, interleaved
    (each conversation on every server, in a rotating order), after one warm-up each."""
    for url in urls.values():
        asyncio.run(last_turn_ttft(url, conversation(turns, seed=-1)))
    ttfts: dict[str, list[float]] = {name: [] for name in urls}
    for index in range(count):
        for name in rotated(list(urls), index):
            ttfts[name].append(asyncio.run(last_turn_ttft(urls[name], conversation(turns, index))))
    return ttfts


def answer_in_whole_words(model, tokenizer) -> int:
    """Zero the output-head rows of every token but whole words (a space, then ASCII letters);
    returns how many tokens keep their rows.

    A random model's greedy answer is otherwise a run of arbitrary byte pieces whose text does
    not re-tokenize to the tokens it generated, so when a client sends the answer back a prefix
    cache stops at its first piece. A trained model answers in text that round-trips; so does
    this one: every kept row's logit beats the zeroed rows' 0 for some kept token (the maximum
    of dozens of random logits is positive), and words separated by spaces tokenize alone."""
    words = [
        index
        for piece, index in tokenizer.get_vocab().items()
        if piece.startswith("Ġ") and piece[1:].isascii() and piece[1:].isalpha()
    ]
    keep = torch.zeros(model.lm_head.weight.shape[0], dtype=torch.bool)
    keep[words] = True
    with torch.no_grad():
        model.lm_head.weight[~keep] = 0.0
    return len(words)


def build_model_folder(folder: Path, layers: int, width: int) -> Path:
    """The benchmark model and its processor saved in ``folder``: answers in whole words
    (``answer_in_whole_words``) and with no end-of-sequence token (every answer runs to its
    ``max_tokens``)."""
    model = load_bench_model(folder, layers, width)
    processor = bench_processor(IMAGE_SIDE)
    kept = answer_in_whole_words(model, processor.tokenizer)
    print(f"[bench_serve] answers drawn from {kept} whole-word tokens", flush=True)
    model.generation_config.eos_token_id = None
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def throughput_rows(clients: int, summaries: dict[str, Summary]) -> list[list[str]]:
    """A row per contender: its figures and its ratios to ``transformers serve``."""
    theirs = summaries[THEIRS]
    noise = summaries[OURS_AGAIN].tokens_per_s / summaries[OURS].tokens_per_s
    return [
        [
            str(clients),
            name,
            f"{s.requests_per_s:.2f}",
            f"{s.tokens_per_s:.1f}",
            f"{s.ttft_p50:.2f}",
            f"{s.ttft_p95:.2f}",
            THEIRS,
            f"{s.tokens_per_s / theirs.tokens_per_s:.2f}",
            f"{theirs.ttft_p50 / s.ttft_p50:.2f}",
            f"{theirs.ttft_p95 / s.ttft_p95:.2f}",
            f"{noise:.2f}",
        ]
        for name, s in summaries.items()
    ]


def conversation_rows(turns: int, ttfts: dict[str, list[float]]) -> list[list[str]]:
    """A row per server of the conversation: its last turn's TTFT and its speed-up over the
    server without reuse."""
    off = ttfts["reuse off"]
    noise = percentile(ttfts["reuse on (A/A)"], 50) / percentile(ttfts["reuse on"], 50)
    rows = []
    for name, values in ttfts.items():
        p50, p95 = percentile(values, 50), percentile(values, 95)
        rows.append(
            [
                "1",
                f"{OURS}, turn {turns}, {name}",
                "",
                "",
                f"{p50:.3f}",
                f"{p95:.3f}",
                "reuse off",
                "",
                f"{percentile(off, 50) / p50:.2f}",
                f"{percentile(off, 95) / p95:.2f}",
                f"{noise:.2f}",
            ]
        )
    return rows


def measure_throughput(args, folder: Path, logs: Path) -> tuple[list[list[str]], list[list[str]]]:
    """Warm-up, then ``--rounds`` interleaved rounds of the workload on every contender; the
    throughput rows and the KV memory rows of ``ascend_vlm serve``."""
    from transformers import AutoModelForImageTextToText

    from ascend_vlm.batching.budgets import kv_bytes_per_token
    from ascend_vlm.default_model import load_processor

    requests = workload(args.requests, args.min_new, args.max_new, args.seed)
    warm_up = workload(args.clients, args.min_new, args.min_new, args.seed + 1)
    model = AutoModelForImageTextToText.from_pretrained(folder).eval()
    processor = load_processor(folder)
    ours_at = functools.partial(ours_command, folder, args.serve_args)
    theirs_at = functools.partial(transformers_command, folder)
    with (
        server(ours_at, logs / "ours.log", args.threads) as ours,
        server(theirs_at, logs / "theirs.log", args.threads) as theirs,
    ):
        calls = {
            OURS: lambda: asyncio.run(run_clients(ours, requests, args.clients)),
            THEIRS: lambda: asyncio.run(run_clients(theirs, requests, args.clients)),
            SEQUENTIAL: lambda: generate_sequentially(model, processor, requests, args.clients),
            OURS_AGAIN: lambda: asyncio.run(run_clients(ours, requests, args.clients)),
        }
        print("[bench_serve] warm-up", flush=True)
        for url in (ours, theirs):
            asyncio.run(run_clients(url, warm_up, args.clients))
        generate_sequentially(model, processor, warm_up[:2], args.clients)
        runs: dict[str, list[Run]] = {name: [] for name in calls}
        with kv_samples(ours) as samples:
            for round_index in range(args.rounds):
                for name in rotated(list(calls), round_index):
                    print(f"[bench_serve] round {round_index + 1}: {name}", flush=True)
                    runs[name].append(calls[name]())
    summaries = {name: summarize(r) for name, r in runs.items()}
    return throughput_rows(args.clients, summaries), kv_rows(samples, kv_bytes_per_token(model))


def measure_conversations(args, folder: Path, logs: Path) -> list[list[str]]:
    """The conversation rows: the same server with reuse (twice, for A/A) and without."""
    reuse_on_at = functools.partial(ours_command, folder, [*args.serve_args, *args.reuse_args])
    reuse_off_at = functools.partial(ours_command, folder, args.serve_args)
    with (
        server(reuse_on_at, logs / "reuse_on.log", args.threads) as on,
        server(reuse_off_at, logs / "reuse_off.log", args.threads) as off,
    ):
        print("[bench_serve] conversations", flush=True)
        urls = {"reuse on": on, "reuse off": off, "reuse on (A/A)": on}
        ttfts = conversation_ttfts(urls, args.turns, args.conversations)
    return conversation_rows(args.turns, ttfts)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", type=int, default=8, help="language-model depth")
    parser.add_argument(
        "--width", type=int, default=256, help="language-model hidden size, a multiple of 64"
    )
    parser.add_argument("--min-new", type=int, default=4)
    parser.add_argument("--max-new", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads per process")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", type=Path, help="serve this model folder instead")
    parser.add_argument(
        "--serve-args", type=shlex.split, default=[], help="more ascend_vlm serve flags, quoted"
    )
    parser.add_argument(
        "--reuse-args", type=shlex.split, default=[],
        help="the ascend_vlm serve flags that turn reuse on, quoted",
    )  # fmt: skip
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument(
        "--only-conversations", action="store_true",
        help="measure the conversation rows alone (needs --reuse-args)",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, help="also write the table to this file")
    args = parser.parse_args(argv)
    for flag in ("clients", "requests", "rounds", "layers", "min_new", "threads", "conversations"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')}: expected an int >= 1")
    if args.max_new < args.min_new:
        parser.error(f"--max-new: expected >= --min-new ({args.min_new}), got {args.max_new}")
    if args.only_conversations and not args.reuse_args:
        parser.error("--only-conversations: expected --reuse-args too (the rows compare reuse)")
    if (problem := width_problem(args.width)) is not None:
        parser.error(f"--width: {problem}")
    if args.turns < 2:
        parser.error(f"--turns: expected >= 2 (a later turn to measure), got {args.turns}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    print("$ python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv or sys.argv[1:])]))
    with tempfile.TemporaryDirectory() as scratch:
        folder = args.model or build_model_folder(Path(scratch) / "model", args.layers, args.width)
        rows, memory = [], []
        if not args.only_conversations:
            rows, memory = measure_throughput(args, folder, Path(scratch))
        if args.reuse_args:
            rows += measure_conversations(args, folder, Path(scratch))
        else:
            print("[bench_serve] no --reuse-args: the conversation rows are left out")
    show_table(HEADER, rows, args.json, sys.argv[0], list(argv or sys.argv[1:]))
    if memory:
        print("\nKV memory of ascend_vlm serve while the workload ran:")
        print(table(KV_HEADER, memory))
    return 0


if __name__ == "__main__":
    sys.exit(main())
