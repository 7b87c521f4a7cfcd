"""`BatchGenerator`: continuous batching of Hugging Face VLM generation under budgets.

Requests wait in arrival order. Each step (see :mod:`~ascend_vlm.batching.budgets`):

1. cancelled requests leave, running or waiting;
2. waiting requests are admitted, first come first served, while every budget holds for the
   step (the first that does not fit waits, so none is overtaken for ever);
3. one decode step runs for every sequence already running, batched: each sequence keeps its
   KV in blocks of ``kv_block_size`` tokens (:class:`~ascend_vlm.batching.block_pool.BlockPool`,
   read through :class:`~ascend_vlm.batching.paged_cache.PagedCache`; on NPU with torch_npu's
   page attention), and each row gets its own positions (its length, plus its M-RoPE
   ``rope_deltas`` for Qwen-VL models);
4. each admitted request is prefilled alone, exactly as ``generate`` prefills it (its images
   encoded by the model's own forward, so a vision cache applies), its first token chosen, and
   its KV written into blocks of its own.

Sequences leave when they reach ``max_new_tokens``, the end-of-sequence token or a stop
string, handing back their blocks; joining and leaving move no stored KV. Greedy outputs equal a
one-request ``generate`` with the same settings (tested token for token); sampled ones depend
only on the request's seed.

Prefix cache (``prefix_cache=True``, the default): full blocks of prompts (and of finished
sequences) stay cached under the chained hash of their tokens and images
(:mod:`~ascend_vlm.batching.prefix_keys`); a later prompt starting with cached blocks takes
them and prefills only the rest (:mod:`~ascend_vlm.batching.prefill`). Cached blocks no
sequence holds are evicted least recently used first when the pool needs room.

One cache per sequence, each decoded in its own forward, replaces the blocks for families
whose decoder layers are not all full attention (sliding windows, chunked or linear attention
keep state a block table cannot page) and with token pruning (:mod:`ascend_vlm.pruning`: a
pruned prompt holds fewer positions past the pruning layer; the pruner re-indexes each mask as
in ``generate``, and KV bytes count the pruned cache once prefilled).

Not supported: beams, videos, and the families whose descriptor refuses
batching (``ascend_vlm.models``; ValueError with the reason when the generator is made).

What the generator reads of the model and asks of it (encoding, forwards, positions, the next
token) is :class:`~ascend_vlm.batching.batched_model.BatchedModel`; this module schedules.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import asdict
from typing import Any

import torch
from torch import nn

from ascend_vlm import trace_events
from ascend_vlm.batching.batched_model import BatchedModel
from ascend_vlm.batching.budgets import (
    BatchBudgets,
    BudgetError,
    StepUsage,
    budget_utilisation,
    cached_kv_bytes,
    projected_kv_bytes,
    refusal,
)
from ascend_vlm.batching.decode import decode_alone, decode_in_blocks
from ascend_vlm.batching.kv_blocks import KVBlocks, full_attention_only
from ascend_vlm.batching.request import (
    GenerationRequest,
    RequestHandle,
    RequestResult,
    SequenceState,
    TokenEvent,
)
from ascend_vlm.batching.sampling import request_generator
from ascend_vlm.batching.stats import RunStats
from ascend_vlm.data.content_keys import encoding_content_keys, processed_content_keys
from ascend_vlm.patching.ledger import applied_features


class BatchGenerator:
    """Continuous batching for ``model`` (a transformers VLM, optionally patched, PEFT-wrapped
    or with a vision cache) with its ``processor`` (chat template and image processor).

    Budgets are :class:`~ascend_vlm.batching.budgets.BatchBudgets` fields, given as keywords
    (``max_batch_tokens``, ``max_visual_tokens_per_step``, ``max_kv_bytes``,
    ``max_batch_size``). ``kv_block_size``: tokens per KV block (16 by default; a multiple of
    16 up to 512 lets the NPU's page attention read them); ``prefix_cache``: reuse cached
    prompt blocks across requests (module docstring). ``adapters``: an
    :class:`~ascend_vlm.adapters.AdapterSet` over ``model`` (anything with
    ``forward(adapter_names, **inputs)``), through which every forward runs with each row's
    :attr:`GenerationRequest.adapter` (None: the set's ``active`` one), so requests for
    different adapters share a batch. Not thread-safe: submit, run and cancel from one thread.
    """

    def __init__(
        self,
        model: nn.Module,
        processor: Any,
        adapters: Any = None,
        *,
        kv_block_size: int = 16,
        prefix_cache: bool = True,
        **budgets: Any,
    ) -> None:
        if not isinstance(model, nn.Module) or not callable(getattr(model, "generate", None)):
            raise TypeError(
                f"model: expected a transformers model with generate(), got {type(model).__name__}"
            )
        if not callable(processor) or not hasattr(processor, "apply_chat_template"):
            raise TypeError(
                f"processor: expected a callable processor with a chat template, got "
                f"{type(processor).__name__}"
            )
        if (
            isinstance(kv_block_size, bool)
            or not isinstance(kv_block_size, int)
            or (kv_block_size < 1)
        ):
            raise ValueError(f"kv_block_size: expected an int >= 1, got {kv_block_size!r}")
        if not isinstance(prefix_cache, bool):
            raise ValueError(f"prefix_cache: expected True or False, got {prefix_cache!r}")
        self.model = model
        self._pruning = bool(applied_features(model, "token_pruning"))
        self.processor = processor
        self.budgets = BatchBudgets(**budgets)
        self._batched = BatchedModel(model, processor, adapters)
        self._own_caches = self._pruning or not full_attention_only(self._batched.text_config)
        self._block_size = kv_block_size
        self._prefix_cache = prefix_cache and not self._own_caches
        self._waiting: deque[SequenceState] = deque()
        self._running: list[SequenceState] = []
        self._blocks: KVBlocks | None = None
        if not self._own_caches:
            block_bytes = self._batched.kv_bytes_per_token * kv_block_size
            limit = self.budgets.max_kv_bytes
            self._blocks = KVBlocks(
                kv_block_size,
                self._prefix_cache,
                None if limit is None else max(1, limit // block_bytes),
                self._batched.image_token,
                self._batched.base.config,
            )
        self._clock = time.perf_counter()
        # Events made by a step and not yet yielded (run() may be left between two).
        self._events: deque[TokenEvent | RequestResult] = deque()
        self.step_usage: list[StepUsage] = []
        # The request whose prefill raised out of the last failed step (run()'s docstring).
        self.failed_request: str | None = None
        self._finished = 0
        self._output_tokens = 0
        self._run_seconds = 0.0
        self._submit_seconds = 0.0
        self._prefilled = 0
        self._prefix_hits = 0
        self._reused = 0

    # ------------------------------------------------------------------ submission

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Queue ``request``; its prompt is encoded now. Raises BudgetError naming the budget
        when the request alone exceeds one, TypeError for a non-request."""
        if not isinstance(request, GenerationRequest):
            raise TypeError(f"request: expected a GenerationRequest, got {type(request).__name__}")
        adapters = self._batched.adapters
        if request.adapter is not None and adapters is None:
            raise ValueError(
                f"request: adapter {request.adapter!r} needs a BatchGenerator made with adapters"
            )
        if any(s.request.request_id == request.request_id for s in self._pending_sequences()):
            raise ValueError(
                f"request: request_id {request.request_id!r} is already waiting or running; "
                "give each pending request its own id"
            )
        start = time.perf_counter()
        inputs, size = self._batched.encode(request)
        per_token = self._batched.kv_bytes_per_token
        block = 1 if self._own_caches else self._block_size
        why = refusal(self.budgets, size, per_token, block)
        if why is not None:
            raise BudgetError(f"{why} (request {request.request_id!r})")
        sequence = SequenceState(
            request=request,
            inputs=inputs,
            size=size,
            submitted=self._now(),
            generator=request_generator(request),
            kv_bytes=size.longest * per_token,
            adapter=None if adapters is None else request.adapter or adapters.active,
            image_keys=processed_content_keys(
                request.images(), getattr(self.processor, "image_processor", None)
            ),
        )
        if self._blocks is not None:
            self._blocks.key_prompt(sequence)
        self._waiting.append(sequence)
        self._submit_seconds += time.perf_counter() - start
        return RequestHandle(sequence)

    def _pending_sequences(self) -> list[SequenceState]:
        return [*self._waiting, *self._running]

    # ------------------------------------------------------------------ running

    @property
    def pending(self) -> int:
        """Requests waiting or running."""
        return len(self._waiting) + len(self._running)

    def run(self) -> Iterator[TokenEvent | RequestResult]:
        """Step until no request waits or runs, yielding each new token (:class:`TokenEvent`)
        and each finished request (:class:`RequestResult`) as they happen. Requests submitted
        meanwhile join.

        A step that raises leaves run() with its exception; a later run() goes on. When a
        prefill raised, ``failed_request`` names its request (it waits again, first in line,
        with the others admitted in that step) and the running sequences are intact; when the
        decode raised, ``failed_request`` is None and the running sequences end with
        "error"."""
        while self.pending or self._events:
            if not self._events:
                self._check_cache_mode()
                start = time.perf_counter()
                try:
                    self._step()
                finally:
                    self._run_seconds += time.perf_counter() - start
            yield self._events.popleft()

    def generate_many(
        self, requests: Iterable[GenerationRequest], progress: bool = False
    ) -> list[RequestResult]:
        """Submit ``requests``, run them and return their results in input order
        (``progress``: a tqdm bar of finished requests). A request refused at submission
        raises before any of them runs, and none of them stays queued; RuntimeError while
        requests submitted earlier are pending (their results would be someone else's)."""
        if self.pending or self._events:
            raise RuntimeError(
                f"generate_many: {self.pending} requests submitted earlier are still pending; "
                "collect them with run() first"
            )
        handles: list[RequestHandle] = []
        try:
            for request in requests:
                handles.append(self.submit(request))
        except BaseException:
            # All or nothing: the requests already queued by this call leave the queue.
            queued = {id(handle._sequence) for handle in handles}
            self._waiting = deque(s for s in self._waiting if id(s) not in queued)
            raise
        results: dict[str, RequestResult] = {}
        from tqdm.auto import tqdm

        with tqdm(total=len(handles), desc="generate", unit="request", disable=not progress) as bar:
            for event in self.run():
                if isinstance(event, RequestResult):
                    results[event.request_id] = event
                    bar.update(1)
        return [results[handle.request_id] for handle in handles]

    def stats(self) -> RunStats:
        """The counters now."""
        utilisation = budget_utilisation(self.budgets, self.step_usage)
        return RunStats(
            requests=self._finished,
            output_tokens=self._output_tokens,
            steps=len(self.step_usage),
            seconds=self._run_seconds + self._submit_seconds,
            utilisation=utilisation,
            prefilled_tokens=self._prefilled,
            prefix_hits=self._prefix_hits,
            reused_tokens=self._reused,
            kv_bytes=self.kv_bytes(),
        )

    def running_kv_tokens(self) -> list[int]:
        """Tokens whose KV each running sequence holds now, in running order."""
        return [
            s.cached_tokens if self._blocks is not None else s.cache.get_seq_length()
            for s in self._running
        ]

    def kv_bytes(self) -> int:
        """Bytes of KV the running sequences hold now: their blocks (each counted once), or
        their own caches."""
        if self._blocks is None:
            return sum(cached_kv_bytes(s.cache) for s in self._running if s.cache is not None)
        return self._blocks.held_bytes()

    # ------------------------------------------------------------------ one step

    def _check_cache_mode(self) -> None:
        if bool(applied_features(self.model, "token_pruning")) != self._pruning:
            raise ValueError(
                "model: token pruning was enabled or disabled after this BatchGenerator was "
                "made; its running sequences' caches follow the old setting: make a new one"
            )

    def _step(self) -> None:
        events = self._events
        self.failed_request = None
        cancelled = [row for row, sequence in enumerate(self._running) if sequence.cancelled]
        for row in cancelled:
            events.append(self._finish(self._running[row], "cancelled"))
        self._leave(cancelled)
        # Every cancelled waiting request leaves now, not once it reaches the head of the line.
        if any(s.cancelled for s in self._waiting):
            events.extend(self._finish(s, "cancelled") for s in self._waiting if s.cancelled)
            self._waiting = deque(s for s in self._waiting if not s.cancelled)
        admitted = self._admit()
        decode_tokens = len(self._running)
        if self._running:
            try:
                self._decode(events)
            except BaseException:
                # The shared cache may hold part of the step: the running sequences end here.
                # Those admitted this step have not started: they wait again, first in line.
                for sequence in self._running:
                    events.append(self._finish(sequence, "error"))
                if self._blocks is not None:
                    self._blocks.release(self._running)
                self._running = []
                self._waiting.extendleft(reversed(admitted))
                raise
        prefilled = self._prefilled
        visual = sum(sequence.size.visual_tokens for sequence in admitted)
        for index, sequence in enumerate(admitted):
            try:
                self._prefill(sequence, events)
            except BaseException:
                # Not started (_prefill handed back the blocks of the one that failed): they
                # wait again, first in line, for the next run().
                self.failed_request = sequence.request.request_id
                for waiting in reversed(admitted[index:]):
                    waiting.tokens, waiting.text, waiting.emitted = [], "", 0
                    waiting.cached_tokens, waiting.first_token, waiting.admitted = 0, None, None
                    self._waiting.appendleft(waiting)
                raise
        usage = StepUsage(
            prefill_tokens=self._prefilled - prefilled,
            decode_tokens=decode_tokens,
            visual_tokens=visual,
            kv_bytes=self._projected_kv(self._running),
            batch_size=len(self._running),
        )
        self.step_usage.append(usage)
        if trace_events.listening():
            trace_events.emit("batching_step", self._batched.base, **asdict(usage))

    def _admit(self) -> list[SequenceState]:
        """Waiting requests that fit this step's budgets, first come first served."""
        budgets = self.budgets
        admitted: list[SequenceState] = []
        tokens = len(self._running)
        visual = 0
        while self._waiting:
            sequence = self._waiting[0]
            size = sequence.size
            fits = (
                (budgets.max_batch_size is None
                 or len(self._running) + len(admitted) < budgets.max_batch_size)
                and (budgets.max_batch_tokens is None
                     or tokens + size.prompt_tokens <= budgets.max_batch_tokens)
                and (budgets.max_visual_tokens_per_step is None
                     or visual + size.visual_tokens <= budgets.max_visual_tokens_per_step)
                and (budgets.max_kv_bytes is None
                     or self._projected_kv([*self._running, *admitted, sequence])
                     <= budgets.max_kv_bytes)
            )  # fmt: skip
            if not fits:
                break
            self._waiting.popleft()
            admitted.append(sequence)
            tokens += size.prompt_tokens
            visual += size.visual_tokens
        return admitted

    def _projected_kv(self, sequences: list[SequenceState]) -> int:
        """KV bytes ``sequences`` reach at their longest: of the shared right-aligned cache, or
        the sum of their own caches'."""
        if self._own_caches:
            return sum(sequence.kv_bytes for sequence in sequences)
        longest = [sequence.size.longest for sequence in sequences]
        return projected_kv_bytes(longest, self._batched.kv_bytes_per_token, self._block_size)

    def _prefill(self, sequence: SequenceState, events: Any) -> None:
        """Prefill ``sequence`` alone, as ``generate`` does (padding a batch of prompts to the
        longest would cost more than the batching saves, and change the arithmetic), after
        the prefix the prefix cache holds, and add it to the running batch unless it finished
        at its first token."""
        batched = self._batched
        inputs = {key: value.to(batched.device) for key, value in sequence.inputs.items()}
        extra = {"logits_to_keep": 1} if batched.keeps_last_logits else {}
        sequence.admitted = self._now()
        trace_events.emit("batching_admit", batched.base, request_id=sequence.request.request_id)
        positions = None
        if batched.rope_index is not None:
            positions, sequence.rope_delta = batched.prompt_rope_index(inputs)
        blocks = self._blocks
        start = 0 if blocks is None else blocks.reuse(sequence)
        try:
            if blocks is None:
                from transformers import DynamicCache

                cache, call = DynamicCache(config=batched.base.config), inputs
            else:
                cache, call = blocks.prefill_call(sequence, inputs, start, positions)
            # The images this forward encodes, if any, are all the prompt's (prefill.py).
            with torch.no_grad(), encoding_content_keys(sequence.image_keys):
                output = batched.forward(
                    [sequence], **call, **{batched.cache_keyword: cache}, use_cache=True, **extra
                )
            if blocks is not None:
                blocks.store(sequence, cache, start)
            sequence.first_token = self._now()
            finished = self._take(sequence, output.logits[0, -1], events)
        except BaseException:
            if blocks is not None:
                blocks.release([sequence])
            raise
        sequence.reused_tokens = start
        self._prefilled += sequence.size.prompt_tokens - start
        self._prefix_hits += bool(start)
        self._reused += start
        if finished:
            if blocks is not None:
                blocks.release([sequence])
            return
        if blocks is None:
            sequence.cache = cache
            held = cached_kv_bytes(cache)
            remaining = sequence.request.max_new_tokens - 1
            sequence.kv_bytes = held + remaining * batched.kv_bytes_per_token
        self._running.append(sequence)

    def _decode(self, events: Any) -> None:
        """One decode step of every running sequence: batched over KV blocks, or each in its
        own cache (module docstring)."""
        batched, running = self._batched, self._running
        keyword, device = batched.cache_keyword, batched.device
        mrope = batched.rope_index is not None
        if self._blocks is None:
            rows = [
                decode_alone(batched.forward_of([s]), s, keyword, mrope, device) for s in running
            ]
        else:
            cache = self._blocks.decode_cache(running, not batched.reads_blocks_in_place())
            rows = decode_in_blocks(
                batched.forward_of(running), running, cache, keyword, mrope, device
            )
            for sequence in running:
                sequence.cached_tokens += 1
        done = [row for row, s in enumerate(running) if self._take(s, rows[row], events)]
        self._leave(done)

    def _take(self, sequence: SequenceState, logits: torch.Tensor, events: Any) -> bool:
        """Choose and record the sequence's next token; True when the sequence finished (its
        result is in ``events``), as :meth:`BatchedModel.choose_token` chooses it."""
        event, reason = self._batched.choose_token(sequence, logits)
        events.append(event)
        if reason is None:
            return False
        events.append(self._finish(sequence, reason))
        return True

    def _leave(self, rows: list[int]) -> None:
        if not rows:
            return
        leaving = set(rows)
        if self._blocks is not None:
            self._blocks.release([s for row, s in enumerate(self._running) if row in leaving])
        self._running = [s for row, s in enumerate(self._running) if row not in leaving]

    def _finish(self, sequence: SequenceState, reason: str) -> RequestResult:
        self._finished += 1
        self._output_tokens += len(sequence.tokens)
        trace_events.emit(
            "batching_finish",
            self._batched.base,
            request_id=sequence.request.request_id,
            reason=reason,
        )
        return RequestResult(
            request_id=sequence.request.request_id,
            tokens=tuple(sequence.tokens),
            text=sequence.text,
            finish_reason=reason,
            prompt_tokens=sequence.size.prompt_tokens,
            submitted=sequence.submitted,
            admitted=sequence.admitted,
            first_token=sequence.first_token,
            finished=self._now(),
            cached_tokens=sequence.reused_tokens,
        )

    def _now(self) -> float:
        return time.perf_counter() - self._clock
