"""`BatchGenerator`: continuous batching of Hugging Face VLM generation under budgets.

Requests wait in arrival order. Each step (see :mod:`~ascend_vlm.batching.budgets`):

1. running sequences that were cancelled leave;
2. waiting requests are admitted, first come first served, while every budget holds for the
   step (the first that does not fit waits, so none is overtaken for ever);
3. one decode step runs for every sequence already running, batched: the shared cache
   (:class:`~ascend_vlm.batching.row_cache.RowCache`) holds one right-aligned row per sequence,
   the attention mask hides each row's left padding, and each row gets its own positions
   (its length, plus its M-RoPE ``rope_deltas`` for Qwen-VL models);
4. each admitted request is prefilled alone, exactly as ``generate`` prefills it (its images
   encoded by the model's own forward, so a vision cache applies), its first token chosen, and
   its cache joins the shared one.

Sequences leave when they reach ``max_new_tokens``, the end-of-sequence token or a stop
string; columns no sequence needs any more are trimmed. Greedy outputs equal a one-request
``generate`` with the same settings (tested token for token); sampled ones depend only on the
request's seed.

Token pruning (:mod:`ascend_vlm.pruning`): a pruned prompt's cache holds fewer positions in the
layers past the pruning layer than before it, so it cannot be a row of the shared cache; with
pruning enabled every sequence keeps its own cache and decodes in its own forward (the pruner
re-indexes each one's mask as in ``generate``), and its KV bytes are counted from its pruned
cache once prefilled (before that, at the unpruned size).

Not supported: beams, sliding-window caches, videos, and the families whose descriptor refuses
batching (``ascend_vlm.models``; ValueError with the reason when the generator is made).
"""

from __future__ import annotations

import inspect
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from ascend_vlm import trace_events
from ascend_vlm._base_model import base_model
from ascend_vlm.batching.budgets import (
    BatchBudgets,
    BudgetError,
    RequestSize,
    StepUsage,
    cached_kv_bytes,
    kv_bytes_per_token,
    projected_kv_bytes,
    refusal,
)
from ascend_vlm.batching.request import (
    GenerationRequest,
    RequestHandle,
    RequestResult,
    SequenceState,
    TokenEvent,
)
from ascend_vlm.batching.row_cache import RowCache
from ascend_vlm.batching.sampling import generation_rules, next_token, request_generator
from ascend_vlm.models import require_feature
from ascend_vlm.patching.ledger import applied_features


@dataclass(frozen=True)
class RunStats:
    """Counters since the generator was made: finished ``requests``, ``output_tokens``,
    ``steps``, ``seconds`` spent in :meth:`BatchGenerator.submit` (encoding prompts and images)
    and :meth:`BatchGenerator.run`, and the mean share of each
    bounded budget used per step (``utilisation``, name -> fraction)."""

    requests: int
    output_tokens: int
    steps: int
    seconds: float
    utilisation: dict[str, float]

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0


class BatchGenerator:
    """Continuous batching for ``model`` (a transformers VLM, optionally patched, PEFT-wrapped
    or with a vision cache) with its ``processor`` (chat template and image processor).

    Budgets are :class:`~ascend_vlm.batching.budgets.BatchBudgets` fields, given as keywords
    (``max_batch_tokens``, ``max_visual_tokens_per_step``, ``max_kv_bytes``,
    ``max_batch_size``). ``adapters``: an :class:`~ascend_vlm.adapters.AdapterSet` over
    ``model`` (anything with ``forward(adapter_names, **inputs)``), through which every forward
    runs with each row's :attr:`GenerationRequest.adapter` (None: the set's ``active`` one), so
    requests for different adapters share a batch. Not thread-safe: submit, run and cancel from
    one thread.
    """

    def __init__(
        self, model: nn.Module, processor: Any, adapters: Any = None, **budgets: Any
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
        self.model = model
        self._adapters = adapters
        self._own_caches = bool(applied_features(model, "token_pruning"))
        self.processor = processor
        self.budgets = BatchBudgets(**budgets)
        self._base = base_model(model)
        descriptor = require_feature(self._base, "batching")
        self._image_token = getattr(self._base.config, descriptor.visual_token_ids[0])
        self._rope_index = (
            None if descriptor.position_scheme == "rope" else self._base.model.get_rope_index
        )
        forward = inspect.signature(self._base.forward).parameters
        self._cache_keyword = "cache" if "cache" in forward else "past_key_values"
        self._keeps_last_logits = "logits_to_keep" in forward
        generation_config = self._base.generation_config
        eos = generation_config.eos_token_id
        self._eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self._rules = generation_rules(generation_config, sorted(self._eos))
        self._kv_bytes_per_token = kv_bytes_per_token(self._base)
        self._device = next(self._base.parameters()).device
        self._waiting: deque[SequenceState] = deque()
        self._running: list[SequenceState] = []
        self._rows = RowCache()
        self._clock = time.perf_counter()
        # Events made by a step and not yet yielded (run() may be left between two).
        self._events: deque[TokenEvent | RequestResult] = deque()
        self.step_usage: list[StepUsage] = []
        self._finished = 0
        self._output_tokens = 0
        self._run_seconds = 0.0
        self._submit_seconds = 0.0

    # ------------------------------------------------------------------ submission

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Queue ``request``; its prompt is encoded now. Raises BudgetError naming the budget
        when the request alone exceeds one, TypeError for a non-request."""
        if not isinstance(request, GenerationRequest):
            raise TypeError(f"request: expected a GenerationRequest, got {type(request).__name__}")
        if request.adapter is not None and self._adapters is None:
            raise ValueError(
                f"request: adapter {request.adapter!r} needs a BatchGenerator made with adapters"
            )
        if any(s.request.request_id == request.request_id for s in self._pending_sequences()):
            raise ValueError(
                f"request: request_id {request.request_id!r} is already waiting or running; "
                "give each pending request its own id"
            )
        start = time.perf_counter()
        prompt = self.processor.apply_chat_template(
            list(request.messages), tokenize=False, add_generation_prompt=True
        )
        images = request.images()
        encoded = self.processor(text=[prompt], images=images or None, return_tensors="pt")
        inputs = {k: v for k, v in encoded.items() if isinstance(v, torch.Tensor)}
        prompt_tokens = int(inputs["input_ids"].shape[1])
        visual = 0
        if self._image_token is not None:
            visual = int((inputs["input_ids"] == self._image_token).sum())
        size = RequestSize(prompt_tokens, visual, prompt_tokens + request.max_new_tokens)
        why = refusal(self.budgets, size, self._kv_bytes_per_token)
        if why is not None:
            raise BudgetError(f"{why} (request {request.request_id!r})")
        sequence = SequenceState(
            request=request,
            inputs=inputs,
            size=size,
            submitted=self._now(),
            generator=request_generator(request),
            kv_bytes=size.longest * self._kv_bytes_per_token,
        )
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
        meanwhile join."""
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
        limits = {
            "max_batch_tokens": lambda usage: usage.batch_tokens,
            "max_visual_tokens_per_step": lambda usage: usage.visual_tokens,
            "max_kv_bytes": lambda usage: usage.kv_bytes,
            "max_batch_size": lambda usage: usage.batch_size,
        }
        utilisation = {}
        for name, used in limits.items():
            limit = getattr(self.budgets, name)
            if limit is not None and self.step_usage:
                shares = [used(usage) / limit for usage in self.step_usage]
                utilisation[name] = sum(shares) / len(shares)
        return RunStats(
            requests=self._finished,
            output_tokens=self._output_tokens,
            steps=len(self.step_usage),
            seconds=self._run_seconds + self._submit_seconds,
            utilisation=utilisation,
        )

    # ------------------------------------------------------------------ one step

    def _check_cache_mode(self) -> None:
        if bool(applied_features(self.model, "token_pruning")) != self._own_caches:
            raise ValueError(
                "model: token pruning was enabled or disabled after this BatchGenerator was "
                "made; its running sequences' caches follow the old setting: make a new one"
            )

    def _step(self) -> None:
        events = self._events
        cancelled = [row for row, sequence in enumerate(self._running) if sequence.cancelled]
        for row in cancelled:
            events.append(self._finish(self._running[row], "cancelled"))
        self._leave(cancelled)
        admitted = self._admit(events)
        decode_tokens = len(self._running)
        if self._running:
            try:
                self._decode(events)
            except BaseException:
                # The shared cache may hold part of the step: the running sequences end here.
                for sequence in self._running:
                    events.append(self._finish(sequence, "error"))
                self._running, self._rows = [], RowCache()
                raise
        prefill_tokens = sum(sequence.size.prompt_tokens for sequence in admitted)
        visual = sum(sequence.size.visual_tokens for sequence in admitted)
        for index, sequence in enumerate(admitted):
            try:
                self._prefill(sequence, events)
            except BaseException:
                # Not started: they wait again, first in line, for the next run().
                for waiting in reversed(admitted[index:]):
                    waiting.tokens, waiting.text, waiting.emitted = [], "", 0
                    self._waiting.appendleft(waiting)
                raise
        usage = StepUsage(
            prefill_tokens=prefill_tokens,
            decode_tokens=decode_tokens,
            visual_tokens=visual,
            kv_bytes=self._projected_kv(self._running),
            batch_size=len(self._running),
        )
        self.step_usage.append(usage)
        if trace_events.listening():
            trace_events.emit("batching_step", self._base, **asdict(usage))

    def _admit(self, events: Any) -> list[SequenceState]:
        """Waiting requests that fit this step's budgets, first come first served."""
        budgets = self.budgets
        admitted: list[SequenceState] = []
        tokens = len(self._running)
        visual = 0
        while self._waiting:
            sequence = self._waiting[0]
            if sequence.cancelled:
                self._waiting.popleft()
                events.append(self._finish(sequence, "cancelled"))
                continue
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
        return projected_kv_bytes(longest, self._kv_bytes_per_token)

    def _prefill(self, sequence: SequenceState, events: Any) -> None:
        """Prefill ``sequence`` alone, as ``generate`` does (padding a batch of prompts to the
        longest would cost more than the batching saves, and change the arithmetic), and add
        it to the running batch unless it finished at its first token."""
        from transformers import DynamicCache

        cache = DynamicCache(config=self._base.config)
        inputs = {key: value.to(self._device) for key, value in sequence.inputs.items()}
        extra = {"logits_to_keep": 1} if self._keeps_last_logits else {}
        sequence.admitted = self._now()
        trace_events.emit("batching_admit", self._base, request_id=sequence.request.request_id)
        with torch.no_grad():
            output = self._forward(
                [sequence], **inputs, **{self._cache_keyword: cache}, use_cache=True, **extra
            )
        if self._rope_index is not None:
            sequence.rope_delta = self._prompt_rope_delta(inputs)
        sequence.first_token = self._now()
        if self._take(sequence, output.logits[0, -1], events):
            return
        if self._own_caches:
            sequence.cache = cache
            held = cached_kv_bytes(cache)
            remaining = sequence.request.max_new_tokens - 1
            sequence.kv_bytes = held + remaining * self._kv_bytes_per_token
        else:
            self._rows.add(cache, [sequence.size.prompt_tokens])
        self._running.append(sequence)

    def _prompt_rope_delta(self, inputs: dict[str, torch.Tensor]) -> int:
        """``rope_deltas`` of a prompt: its decode positions run ``length + delta``."""
        keywords = {
            name: inputs[name]
            for name in ("mm_token_type_ids", "image_grid_thw", "attention_mask")
            if name in inputs
        }
        _, deltas = self._rope_index(inputs["input_ids"], **keywords)
        return int(deltas.reshape(-1)[0])

    def _decode(self, events: Any) -> None:
        if self._own_caches:
            self._decode_each(events)
            return
        rows = self._rows
        last = torch.tensor([[sequence.tokens[-1]] for sequence in self._running])
        lengths = torch.tensor(rows.lengths)
        if self._rope_index is not None:
            deltas = torch.tensor([sequence.rope_delta for sequence in self._running])
            positions = (lengths + deltas)[None, :, None].expand(3, -1, -1)
        else:
            positions = lengths[:, None]
        width = rows.width
        with torch.no_grad():
            output = self._forward(
                self._running,
                input_ids=last.to(self._device),
                attention_mask=rows.attention_mask(extra=1).to(self._device),
                position_ids=positions.to(self._device),
                cache_position=torch.tensor([width], device=self._device),
                use_cache=True,
                **{self._cache_keyword: rows.cache},
            )
        rows.grow()
        done = [
            row
            for row, sequence in enumerate(self._running)
            if self._take(sequence, output.logits[row, -1], events)
        ]
        self._leave(done)

    def _decode_each(self, events: Any) -> None:
        """One decode step of every running sequence in its own cache (see the module
        docstring)."""
        done = []
        for row, sequence in enumerate(self._running):
            length = sequence.size.prompt_tokens + len(sequence.tokens) - 1
            position = torch.tensor([[length + sequence.rope_delta]])
            if self._rope_index is not None:
                position = position[None].expand(3, -1, -1)
            with torch.no_grad():
                output = self._forward(
                    [sequence],
                    input_ids=torch.tensor([[sequence.tokens[-1]]], device=self._device),
                    attention_mask=torch.ones(1, length + 1, dtype=torch.long, device=self._device),
                    position_ids=position.to(self._device),
                    cache_position=torch.tensor([length], device=self._device),
                    use_cache=True,
                    **{self._cache_keyword: sequence.cache},
                )
            if self._take(sequence, output.logits[0, -1], events):
                done.append(row)
        self._leave(done)

    def _forward(self, sequences: list[SequenceState], **inputs: Any) -> Any:
        """The model's forward over ``sequences`` (one batch row each), through each one's
        adapter when the generator has ``adapters``."""
        if self._adapters is None:
            return self.model(**inputs)
        active = self._adapters.active
        names = [sequence.request.adapter or active for sequence in sequences]
        return self._adapters.forward(names, **inputs)

    def _take(self, sequence: SequenceState, logits: torch.Tensor, events: Any) -> bool:
        """Choose and record the sequence's next token; True when the sequence finished (its
        result is in ``events``). The model's generation-config processors (repetition
        penalty, minimum length) see the prompt and the tokens so far, as in ``generate``."""
        logits = self._rules.apply(sequence.inputs["input_ids"][0], sequence.tokens, logits)
        token = next_token(logits, sequence.request, sequence.generator)
        sequence.tokens.append(token)
        text = self.processor.tokenizer.decode(sequence.tokens, skip_special_tokens=True)
        stops = [text.find(stop) for stop in sequence.request.stop if stop in text]
        reason = None
        if stops:
            text, reason = text[: min(stops)], "stop"
        elif token in self._eos:
            reason = "eos"
        elif len(sequence.tokens) >= sequence.request.max_new_tokens:
            reason = "length"
        sequence.text = text
        if reason is None:
            # Hold back an unfinished character (a multi-token one decodes to U+FFFD until its
            # last token) and what could still become a stop string.
            ready = len(text.rstrip("\ufffd"))
            ready -= max((len(stop) - 1 for stop in sequence.request.stop), default=0)
            ready = max(ready, sequence.emitted)
        else:
            ready = len(text)
        events.append(
            TokenEvent(sequence.request.request_id, token, text[sequence.emitted : ready])
        )
        sequence.emitted = ready
        if reason is None:
            return False
        events.append(self._finish(sequence, reason))
        return True

    def _leave(self, rows: list[int]) -> None:
        if not rows:
            return
        if not self._own_caches:
            self._rows.remove(rows)
        leaving = set(rows)
        self._running = [s for row, s in enumerate(self._running) if row not in leaving]

    def _finish(self, sequence: SequenceState, reason: str) -> RequestResult:
        self._finished += 1
        self._output_tokens += len(sequence.tokens)
        trace_events.emit(
            "batching_finish", self._base, request_id=sequence.request.request_id, reason=reason
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
        )

    def _now(self) -> float:
        return time.perf_counter() - self._clock
