"""Servers for the serving tests: the app over an engine over a BatchGenerator, run by uvicorn
in a thread on 127.0.0.1 at a free port, and what a test needs to talk to it (the official
``openai`` client, a ``requests`` session for raw HTTP, messages with data-URL images).

A module of its own, not conftest.py: test modules import these names, and ``conftest`` is
ambiguous in a run that collects several test folders with a conftest each."""

from __future__ import annotations

import base64
import contextlib
import io
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from PIL import Image

from ascend_vlm.batching import BatchGenerator
from ascend_vlm.serving.app import build_app
from ascend_vlm.serving.conversion import ServedModels
from ascend_vlm.serving.engine import Engine
from ascend_vlm.serving.limits import ServingLimits
from ascend_vlm.serving.server import DrainingServer, bind_socket

MODEL_NAME = "tiny-vlm"
API_KEY = "not-a-real-key"


@dataclass
class RunningServer:
    """A server in a thread: its ``url`` (``http://127.0.0.1:PORT``), engine and uvicorn
    server."""

    url: str
    engine: Engine
    server: DrainingServer
    api_key: str | None

    def client(self, **options: Any):
        import openai

        settings = {"api_key": self.api_key or "unused", "max_retries": 0, "timeout": 120}
        return openai.OpenAI(base_url=f"{self.url}/v1", **{**settings, **options})

    def metric(self, text: str) -> float:
        """The value of the metric line starting with ``text`` (name and labels)."""
        import requests

        headers = {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        body = requests.get(f"{self.url}/metrics", headers=headers, timeout=30).text
        for line in body.splitlines():
            if line.startswith(text + " "):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(text)


@contextlib.contextmanager
def running_server(
    model: Any,
    processor: Any,
    limits: ServingLimits | None = None,
    api_key: str | None = None,
    adapters: Any = None,
    served: ServedModels | None = None,
    decoded_images: Any = None,
    **budgets: Any,
) -> Iterator[RunningServer]:
    """Serve ``model`` on 127.0.0.1 at a free port while inside (``decoded_images``: as
    ``build_app`` takes it)."""
    limits = limits or ServingLimits(max_completion_tokens=64)
    generator = BatchGenerator(model, processor, adapters=adapters, **budgets)
    engine = Engine(generator, limits.max_queue)
    engine.start()
    app = build_app(
        engine, served or ServedModels(MODEL_NAME), limits, api_key, decoded_images=decoded_images
    )
    listener = bind_socket("127.0.0.1", 0)
    server = DrainingServer(app, engine, limits.drain_seconds, log_level="warning")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield RunningServer(
            f"http://127.0.0.1:{listener.getsockname()[1]}", engine, server, api_key
        )
    finally:
        server.should_exit = True
        thread.join(30)
        engine.stop()
        listener.close()


def data_url(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def chat_messages(text: str, images: tuple[Image.Image, ...] = ()) -> list[dict]:
    """One user turn in OpenAI's format: ``images`` as data URLs, then ``text``."""
    parts = [{"type": "image_url", "image_url": {"url": data_url(image)}} for image in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]
