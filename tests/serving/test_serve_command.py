"""``python -m ascend_vlm serve``: bad flags exit 2 naming the flag before anything loads, and
a served process drains at SIGTERM (new requests 503, the request in flight finishes) and
exits 0."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import requests
from served_vlm import chat_messages

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--model", "/no/such/folder"], "--model: expected a local checkpoint"),
        (["--model", "x", "--max-queue", "0"], "--max-queue: expected a number > 0, got '0'"),
        (["--model", "x", "--max-batch-size", "0"], "--max-batch-size: expected an int >= 1"),
        (["--model", "x", "--kv-block-size", "0"], "--kv-block-size: expected an int >= 1"),
        (["--model", "x", "--allow-local-images", "/no/dir"], "--allow-local-images: expected"),
        (["--model", "x", "--adapter", "noequals"], "--adapter: expected NAME=PATH"),
        (["--model", "x", "--image-cache", "-1"], "--image-cache: expected MiB >= 0, got -1"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(command_error, argv, words):
    assert words in command_error(["serve", *argv])


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ([], {"kv_block_size": 16, "prefix_cache": True}),
        (
            ["--kv-block-size", "32", "--no-prefix-cache"],
            {"kv_block_size": 32, "prefix_cache": False},
        ),
    ],
)
def test_kv_cache_flags_become_the_batch_generators_keywords(flags, expected):
    from ascend_vlm.__main__ import build_parser
    from ascend_vlm.batching.command_line import kv_cache_settings

    args = build_parser().parse_args(["serve", "--model", "x", *flags])
    assert kv_cache_settings(args, args.parser) == expected


@pytest.mark.parametrize("mib", [0, 8])
def test_image_cache_flag_sizes_the_served_processors_pixel_cache(tiny_model_path, mib):
    from ascend_vlm.__main__ import build_parser
    from ascend_vlm._byte_units import MIB
    from ascend_vlm.serving.cli import _prepared_model

    flags = ["serve", "--model", str(tiny_model_path), "--no-patch", "--image-cache", str(mib)]
    args = build_parser().parse_args(flags)
    _, processor, _ = _prepared_model(args, tiny_model_path)
    cache = getattr(processor.image_processor, "pixel_cache", None)
    assert (None if cache is None else cache.max_bytes) == (mib * MIB or None)


@pytest.mark.slow
def test_sigterm_drains_the_request_in_flight_and_exits_0(tiny_model_path):
    command = [sys.executable, "-m", "ascend_vlm", "serve", "--model", str(tiny_model_path),
               "--port", "0", "--no-patch", "--served-model-name", "tiny", "--drain-seconds",
               "120", "--log-level", "warning", "--image-cache", "8"]  # fmt: skip
    process = subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        for line in process.stdout:
            found = re.search(r"on (http://127\.0\.0\.1:\d+)/v1", line)
            if found:
                url = found.group(1)
                break
        else:
            pytest.fail("the server never said where it listens")
        body = {"model": "tiny", "messages": chat_messages("a long answer"), "max_tokens": 160,
                "temperature": 0, "stream": True}  # fmt: skip
        response = requests.post(f"{url}/v1/chat/completions", json=body, stream=True, timeout=300)
        lines = response.iter_lines(decode_unicode=True)
        next(line for line in lines if line.startswith("data: "))  # the request is in flight
        process.send_signal(signal.SIGTERM)
        events: list[str] = []
        reader = threading.Thread(target=lambda: events.extend(line for line in lines if line))
        reader.start()
        refused = requests.post(f"{url}/v1/chat/completions", timeout=60,
                                json={"model": "tiny", "messages": chat_messages("late")})  # fmt: skip
        health = requests.get(f"{url}/health", timeout=60)
        reader.join(300)
        assert process.wait(timeout=300) == 0
    finally:
        if process.poll() is None:
            process.kill()
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
    assert health.status_code == 503
    assert events[-1] == "data: [DONE]"
    finish = json.loads(events[-2][6:])
    assert finish["choices"][0]["finish_reason"] in ("length", "stop")
    assert finish["usage"]["completion_tokens"] >= 1
