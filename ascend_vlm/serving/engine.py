"""`Engine`: one thread drives a :class:`~ascend_vlm.batching.BatchGenerator`; the asyncio
front end submits to it from any thread and reads each request's tokens from its own
:class:`RequestStream`.

Thread-safety contract: :meth:`Engine.submit`, :meth:`Engine.cancel`,
:meth:`Engine.stop_admitting`, :meth:`Engine.wait_idle` and :meth:`Engine.stop` may be called
from any thread; they only touch a lock-guarded counter and a thread-safe inbox. Only the
engine thread touches the generator: it takes the inbox's submissions and cancellations
between the generator's events (so requests join the running batch at the next step), and
hands every event to the request's stream with ``loop.call_soon_threadsafe``, so the asyncio
queue behind a stream is only ever touched on its event loop.

A stream yields, in order: :class:`Admitted` (the prompt was encoded and fits every budget) or
the exception :meth:`~ascend_vlm.batching.BatchGenerator.submit` raised (``BudgetError`` and
``ValueError`` are the request's fault, anything else the server's), then a ``str`` per new
token (the text it adds, "" while a character or a possible stop string is held back), then
the :class:`~ascend_vlm.batching.RequestResult`, or an :class:`EngineFailure` when a step
raised. A prefill that raises fails its own request only (the generator names it, and the
running batch goes on); a decode step that raises fails every pending request (the shared
batch state of that step is lost).

A cancelled request (its client left) frees its place in ``max_queue`` at once, whether it
runs or waits; the generator frees its row at the next step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any

from ascend_vlm.batching import BatchGenerator, GenerationRequest, RequestResult, TokenEvent

LOG = logging.getLogger(__name__)


class QueueFull(Exception):
    """The engine holds ``max_queue`` requests already."""


class Draining(Exception):
    """The engine stopped admitting requests (the server is shutting down)."""


class EngineFailure(Exception):
    """A step of the batch raised; the request it is delivered to ended unanswered."""


@dataclass(frozen=True)
class Admitted:
    """The request was accepted by the generator: its ``prompt_tokens``, of which
    ``visual_tokens`` are image tokens."""

    prompt_tokens: int
    visual_tokens: int


class RequestStream:
    """A submitted request as the front end sees it: :meth:`get` its items (see the module
    docstring) on the event loop ``loop``."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self._loop = loop
        self._items: asyncio.Queue = asyncio.Queue()

    def put(self, item: Any) -> None:
        """Deliver ``item`` (from any thread)."""
        self._loop.call_soon_threadsafe(self._items.put_nowait, item)

    async def get(self) -> Any:
        """The next item."""
        return await self._items.get()


class Engine:
    """The engine thread over ``generator`` with at most ``max_queue`` requests accepted and
    not finished. :meth:`start` starts the thread; :meth:`stop` ends it."""

    def __init__(self, generator: BatchGenerator, max_queue: int) -> None:
        if not isinstance(max_queue, int) or max_queue < 1:
            raise ValueError(f"max_queue: expected an int >= 1, got {max_queue!r}")
        self.generator = generator
        self.max_queue = max_queue
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._state = threading.Condition()
        self._outstanding = 0  # accepted and not finished; guarded by _state
        self._admitting = True
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._handles: dict[str, Any] = {}
        self._thread = threading.Thread(target=self._run, name="ascend_vlm-engine", daemon=True)
        # Written by the engine thread after each step, read by the metrics at scrape.
        self.running_rows = 0
        self.kv_bytes = 0
        self.kv_tokens = 0  # tokens whose KV the running rows hold

    # ------------------------------------------------------------------ any thread

    def start(self) -> None:
        self._thread.start()

    @property
    def queue_depth(self) -> int:
        """Requests accepted and not running yet."""
        with self._state:
            return max(self._outstanding - self.running_rows, 0)

    @property
    def admitting(self) -> bool:
        return self._admitting

    @property
    def alive(self) -> bool:
        """Whether the engine thread runs."""
        return self._thread.is_alive()

    def submit(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop) -> RequestStream:
        """Queue ``request``; its stream delivers on ``loop``. Raises :class:`Draining` after
        :meth:`stop_admitting`, :class:`QueueFull` with ``max_queue`` requests outstanding."""
        with self._state:
            if not self._admitting:
                raise Draining("the server is shutting down and admits no new request")
            if self._outstanding >= self.max_queue:
                raise QueueFull(
                    f"the server holds {self._outstanding} requests, its --max-queue; retry later"
                )
            self._outstanding += 1
        stream = RequestStream(request.request_id, loop)
        self._inbox.put(("submit", request, stream))
        return stream

    def cancel(self, request_id: str) -> None:
        """Its client left: free ``request_id``'s place in the queue at once and its row at the
        next step; its stream gets nothing more (nothing if it ended)."""
        self._inbox.put(("cancel", request_id))

    def stop_admitting(self) -> None:
        """From now on :meth:`submit` raises :class:`Draining`."""
        with self._state:
            self._admitting = False

    def wait_idle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for every accepted request to finish; True if they
        did."""
        with self._state:
            return self._state.wait_for(lambda: self._outstanding == 0, timeout=timeout)

    def cancel_all(self) -> None:
        """Cancel every accepted request."""
        self._inbox.put(("cancel_all",))

    def stop(self, timeout: float = 10.0) -> None:
        """End the engine thread (pending requests are left unanswered)."""
        if self._thread.is_alive():
            self._inbox.put(("stop",))
            self._thread.join(timeout)

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        events = None
        while True:
            idle = events is None and not self.generator.pending
            if not self._take_inbox(block=idle):
                return
            if events is None:
                if not self.generator.pending:
                    continue
                events = self.generator.run()
            try:
                event = next(events)
            except StopIteration:
                events = None
                self.running_rows = self.kv_bytes = self.kv_tokens = 0
                continue
            except Exception as error:
                events = None
                self._step_failed(error)
                continue
            self._deliver(event)

    def _take_inbox(self, block: bool) -> bool:
        """Apply the inbox's submissions and cancellations (waiting for one when ``block``);
        False once told to stop."""
        while True:
            try:
                message = self._inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            kind = message[0]
            if kind == "stop":
                return False
            if kind == "submit":
                self._submit(*message[1:])
            elif kind == "cancel":
                self._drop(message[1])
            elif kind == "cancel_all":
                for handle in self._handles.values():
                    handle.cancel()

    def _submit(self, request: GenerationRequest, stream: RequestStream) -> None:
        try:
            handle = self.generator.submit(request)
        except Exception as error:  # refused (budget, bad request): the stream says why
            stream.put(error)
            self._finished()
            return
        self._streams[request.request_id] = stream
        self._handles[request.request_id] = handle
        stream.put(Admitted(handle.size.prompt_tokens, handle.size.visual_tokens))

    def _deliver(self, event: TokenEvent | RequestResult) -> None:
        stream = self._streams.get(event.request_id)
        if isinstance(event, TokenEvent):
            if stream is not None:
                stream.put(event.text)  # "" too: a token came, its text is held back
            usage = self.generator.step_usage
            if usage:  # the first event since a step ended: read that step's usage once
                self.running_rows, self.kv_bytes = usage[-1].batch_size, self.generator.kv_bytes()
                self.kv_tokens = sum(self.generator.running_kv_tokens())
                # A server runs for ever: keep no step's usage once read.
                usage.clear()
            return
        self._handles.pop(event.request_id, None)
        if self._streams.pop(event.request_id, None) is not None:
            stream.put(event)
            self._finished()

    def _step_failed(self, error: Exception) -> None:
        """Fail the request whose prefill raised, or every pending one when the decode did."""
        failure = EngineFailure(f"the model failed: {type(error).__name__}: {error}")
        failed = self.generator.failed_request
        if failed is not None:
            LOG.exception("the prefill of %s raised; failing that request alone", failed)
            self._drop(failed, failure)
            return
        LOG.exception("a batch step raised; failing every pending request")
        for request_id in list(self._streams):
            self._drop(request_id, failure)

    def _drop(self, request_id: str, last_item: Any = None) -> None:
        """Cancel ``request_id`` in the generator and free its place in the queue now; its
        stream gets ``last_item`` (None: nothing, its client left). Nothing if it ended."""
        handle = self._handles.pop(request_id, None)
        if handle is None:
            return
        handle.cancel()
        stream = self._streams.pop(request_id)
        if last_item is not None:
            stream.put(last_item)
        self._finished()

    def _finished(self) -> None:
        with self._state:
            self._outstanding -= 1
            self._state.notify_all()
