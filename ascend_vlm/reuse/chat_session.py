"""`ChatSession`: a multi-turn chat with a VLM that keeps its KV cache between turns.

Each turn renders the processor's chat template over the FULL conversation (earlier user turns
with their images, earlier answers as text, the new user turn, ``add_generation_prompt=True``)
and tokenizes it with all images. The cache holds the ids of the earlier turns as they were fed
(the generated ids, not their re-tokenized text); the session keeps the longest prefix of the
new ids that equals them, crops the cache to it (``DynamicCache.crop``) and prefills only the
rest. A greedy answer is therefore the one ``model.generate`` gives for the full conversation
from scratch, up to floating-point differences between a chunked and a one-shot prefill.

Images across turns: the model's forward encodes the ``pixel_values`` it is given and scatters
them into the image tokens of the uncached input, so only the images whose tokens lie past the
reused prefix are passed (with their ``image_grid_thw`` rows). An earlier image counts as
cached only if its tokens lie wholly inside the prefix at the same span as when they were
cached (a processor may give an image a different token count once more images come); else
the prefix is shortened to that image's start. The session keeps its own copies of the images,
so changing an image after passing it does not reach the conversation. Positions: for models
whose family descriptor declares M-RoPE (Qwen2-VL, Qwen2.5-VL and Qwen3-VL) the 3-D position
ids of the whole conversation are computed here with the inner model's ``get_rope_index`` from
all images' grids, in the ``[text; t; h; w]`` layout ``generate`` builds
itself, and passed as ``position_ids``; ``generate`` slices them to the uncached tokens and
extends them while decoding, so the model never reads positions from the grids of the new
images alone. Other models (LLaVA) get ``generate``'s own positions from the full attention
mask. A PEFT-wrapped model is unwrapped (``get_base_model()``) to read its config and
``get_rope_index``; generation still goes through the wrapper.

Processors supported: outputs limited to ``input_ids``, ``attention_mask``,
``mm_token_type_ids``, ``pixel_values`` and ``image_grid_thw``, with pixels either as rows per
image grid (Qwen-VL) or one ``(C, H, W)`` entry per image with the same token count per image
(LLaVA). Anything else (e.g. LLaVA-NeXT's ``image_sizes``, videos) raises ``ValueError``. The
cache is a ``DynamicCache`` of full-attention layers: a sliding-window layer that has filled its
window cannot be cropped back, and transformers raises then. A model whose family descriptor
refuses chat sessions (``ascend_vlm.models``) raises ``ValueError`` with the reason when the
session is made.
"""

from __future__ import annotations

import contextvars
import copy
import inspect
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ascend_vlm._base_model import base_model
from ascend_vlm._compat.cache import cache_keyword_of
from ascend_vlm.models import require_feature

# Arguments the session sets itself; a caller's value for them would break the cache bookkeeping.
_MANAGED_GENERATE_KWARGS = frozenset(
    {
        "input_ids",
        "attention_mask",
        "position_ids",
        "mm_token_type_ids",
        "pixel_values",
        "image_grid_thw",
        "cache",
        "past_key_values",
        "streamer",
        "return_dict_in_generate",
        "inputs_embeds",
        "use_cache",
    }
)
# Decoding settings that would make ``generate`` keep more than one sequence in the cache.
_SINGLE_SEQUENCE_SETTINGS = ("num_beams", "num_return_sequences")
_PROCESSOR_OUTPUTS = frozenset(
    {"input_ids", "attention_mask", "mm_token_type_ids", "pixel_values", "image_grid_thw"}
)


@dataclass
class _Turn:
    """A prepared turn: the user's text and images, the full prompt's ids, the ``generate``
    arguments (the images past the reused prefix only) and the reused prefix length."""

    text: str
    images: list[Any]
    input_ids: torch.Tensor  # (1, L): the whole conversation
    generate_inputs: dict[str, Any]
    reused: int  # prompt tokens answered from the cache
    spans: list[tuple[int, int]]  # [start, end) of every image's tokens in input_ids
    first_new: int  # images[:first_new] of the conversation are in the reused prefix


def _check_text(text: object) -> str:
    if not isinstance(text, str):
        raise TypeError(f"text: expected a str, got {type(text).__name__}")
    return text


def _check_images(images: object) -> list[Any]:
    from PIL import Image

    if images is None:
        return []
    if isinstance(images, Image.Image):
        return [images.copy()]
    if not isinstance(images, Sequence) or isinstance(images, (str, bytes)):
        raise TypeError(
            f"images: expected None, a PIL.Image.Image or a list of them, got "
            f"{type(images).__name__}"
        )
    for index, image in enumerate(images):
        if not isinstance(image, Image.Image):
            raise TypeError(
                f"images[{index}]: expected a PIL.Image.Image, got {type(image).__name__}"
            )
    # Copies: the cache holds these images' encodings, which must not go stale if the caller
    # changes an image in place (e.g. Image.thumbnail) after passing it.
    return [image.copy() for image in images]


def _check_max_new_tokens(max_new_tokens: object) -> int:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
        raise TypeError(f"max_new_tokens: expected an int >= 1, got {max_new_tokens!r}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected an int >= 1, got {max_new_tokens}")
    return max_new_tokens


def _check_generate_kwargs(model: Any, generate_kwargs: dict[str, Any]) -> dict[str, Any]:
    managed = sorted(_MANAGED_GENERATE_KWARGS & generate_kwargs.keys())
    if managed:
        raise TypeError(
            f"generate_kwargs: {', '.join(managed)} are set by ChatSession itself; pass only "
            f"decoding options (e.g. do_sample, temperature, eos_token_id)"
        )
    # The value generate uses: its keyword argument, else a passed generation_config's, else
    # model.generation_config's (unset fields are None), else the default 1.
    passed = generate_kwargs.get("generation_config")
    model_config = getattr(model, "generation_config", None)
    sources = (
        ("generate_kwargs", generate_kwargs),
        ("generation_config", vars(passed) if passed is not None else {}),
        ("model.generation_config", vars(model_config) if model_config is not None else {}),
    )
    for name in _SINGLE_SEQUENCE_SETTINGS:
        where, value = next(
            ((where, source[name]) for where, source in sources if source.get(name) is not None),
            (None, 1),
        )
        if value != 1:
            raise ValueError(
                f"{name}: ChatSession keeps one sequence's cache, expected 1, got {value} "
                f"(from {where})"
            )
    # Greedy unless the caller chose (here or in a passed generation_config); use_cache and
    # return_dict_in_generate override any generation_config's.
    chosen = "do_sample" in generate_kwargs or getattr(passed, "do_sample", None) is not None
    return {
        **({} if chosen else {"do_sample": False}),
        **generate_kwargs,
        "use_cache": True,
        "return_dict_in_generate": False,
    }


def _common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    n = min(a.numel(), b.numel())
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0, 0]) if differ.numel() else n


class ChatSession:
    """A conversation with ``model`` (a Hugging Face VLM with ``generate``) through
    ``processor`` (its processor, with a chat template), keeping the KV cache between turns.

    ``max_cached_tokens`` (None: unbounded) caps the cache: a turn whose prompt (the whole
    conversation so far plus the new user turn) plus ``max_new_tokens`` exceeds it raises
    ``ValueError`` before anything changes. Turns are never dropped silently; call
    :meth:`reset`, or :meth:`fork` earlier and continue from the fork.

    Not thread-safe: one turn at a time per session. Sessions share the model, so run one turn
    at a time across sessions of one model too.
    """

    def __init__(self, model: Any, processor: Any, *, max_cached_tokens: int | None = None):
        if not callable(getattr(model, "generate", None)):
            raise TypeError(
                f"model: expected a Hugging Face model with generate(), got {type(model).__name__}"
            )
        tokenizer = getattr(processor, "tokenizer", None)
        template = getattr(processor, "chat_template", None) or getattr(
            tokenizer, "chat_template", None
        )
        if tokenizer is None or not template or not callable(processor):
            raise ValueError(
                f"processor: expected a callable processor with a tokenizer and a chat "
                f"template (processor.chat_template), got {type(processor).__name__} "
                f"without one; set processor.chat_template to the model's template"
            )
        if max_cached_tokens is not None and (
            isinstance(max_cached_tokens, bool)
            or not isinstance(max_cached_tokens, int)
            or max_cached_tokens < 1
        ):
            raise ValueError(
                f"max_cached_tokens: expected None or an int >= 1, got {max_cached_tokens!r}"
            )
        self.model = model
        self.processor = processor
        self.max_cached_tokens = max_cached_tokens
        self._tokenizer = tokenizer
        # A PEFT model's forward takes **kwargs and its .model is the wrapped model itself.
        self._base = base_model(model) if isinstance(model, nn.Module) else model
        self._cache_keyword = cache_keyword_of(self._base)
        descriptor = require_feature(self._base, "chat_sessions")
        self._image_token_attribute = descriptor.visual_token_ids[0]
        self._rope_index = descriptor.rope_index(self._base)
        if self._rope_index is not None and (
            "mm_token_type_ids" not in inspect.signature(self._rope_index).parameters
        ):
            import transformers

            raise RuntimeError(
                f"model: ChatSession computes M-RoPE positions with get_rope_index(input_ids, "
                f"mm_token_type_ids, ...), which transformers {transformers.__version__} does "
                f"not have; use transformers >= 5.17"
            )
        self._messages: list[dict[str, Any]] = []
        self._images: list[Any] = []
        self._cache: Any = None
        self._cached_ids = torch.empty(0, dtype=torch.long)
        # [start, end) of the images whose tokens the cache holds, in image order.
        self._cached_spans: list[tuple[int, int]] = []

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The conversation so far as chat-template messages (a copy; the images in it are the
        session's own copies, taken when each turn was asked): user turns hold
        ``{"type": "image", "image": <PIL image>}`` parts then a text part, assistant turns one
        text part with the decoded answer."""
        return [
            {"role": message["role"], "content": [dict(part) for part in message["content"]]}
            for message in self._messages
        ]

    @property
    def cached_tokens(self) -> int:
        """The number of tokens whose keys and values the cache holds now."""
        return 0 if self._cache is None else int(self._cache.get_seq_length())

    def ask(
        self,
        text: str,
        images: Sequence[Any] | Any | None = None,
        *,
        max_new_tokens: int = 64,
        **generate_kwargs: Any,
    ) -> str:
        """Add a user turn (``text`` after ``images``, PIL images) and return the answer.

        Decoding is greedy unless ``generate_kwargs`` say otherwise (they go to
        ``model.generate``; the inputs, cache and streamer are the session's). The answer is
        the generated tokens decoded without special tokens; it is recorded as the assistant
        turn. On an error nothing is recorded and the cache keeps a prefix of the earlier turns.
        """
        turn = self._prepare(text, images, max_new_tokens, generate_kwargs)
        sequences = self._generate(turn, None)
        return self._record(turn, sequences)

    def ask_stream(
        self,
        text: str,
        images: Sequence[Any] | Any | None = None,
        *,
        max_new_tokens: int = 64,
        **generate_kwargs: Any,
    ) -> Iterator[str]:
        """Like :meth:`ask`, yielding the answer's text in pieces as it is generated.

        The arguments are checked and the prompt is built at the first ``next()``. The turn is
        recorded when the iterator is exhausted (the recorded answer is the decoded tokens, as
        :meth:`ask` returns). Closing the iterator early waits for the generation to end and
        records nothing.
        """
        from transformers import TextIteratorStreamer

        turn = self._prepare(text, images, max_new_tokens, generate_kwargs)
        streamer = TextIteratorStreamer(self._tokenizer, skip_prompt=True, skip_special_tokens=True)
        result: dict[str, Any] = {}

        def run() -> None:
            try:
                result["sequences"] = self._generate(turn, streamer)
            except BaseException as error:  # re-raised in the consumer's thread
                result["error"] = error
                streamer.end()

        # The worker runs in a copy of the caller's context, so context variables set by the
        # caller (e.g. for logging or tracing inside the model) are seen by generate too.
        context = contextvars.copy_context()
        worker = threading.Thread(
            target=context.run, args=(run,), name="ChatSession.ask_stream", daemon=True
        )
        worker.start()
        finished = False
        try:
            yield from streamer
            finished = True
        finally:
            worker.join()
            if not finished:
                # Closed early: drop the unrecorded turn from the cache.
                self._crop_cache(turn.reused)
        if "error" in result:
            raise result["error"]
        self._record(turn, result["sequences"])

    def fork(self) -> ChatSession:
        """An independent session with a copy of this conversation and of its cache: turns
        asked on either do not affect the other."""
        other = ChatSession(self.model, self.processor, max_cached_tokens=self.max_cached_tokens)
        other._messages = self.messages
        other._images = list(self._images)
        other._cache = copy.deepcopy(self._cache)
        other._cached_ids = self._cached_ids.clone()
        other._cached_spans = list(self._cached_spans)
        return other

    def reset(self) -> None:
        """Forget the conversation and free the cache."""
        self._messages = []
        self._images = []
        self._cache = None
        self._cached_ids = torch.empty(0, dtype=torch.long)
        self._cached_spans = []

    def _prepare(
        self, text: object, images: object, max_new_tokens: object, generate_kwargs: dict
    ) -> _Turn:
        text = _check_text(text)
        images = _check_images(images)
        max_new_tokens = _check_max_new_tokens(max_new_tokens)
        generate_kwargs = _check_generate_kwargs(self.model, generate_kwargs)

        user = {
            "role": "user",
            "content": [{"type": "image", "image": image} for image in images]
            + [{"type": "text", "text": text}],
        }
        prompt = self.processor.apply_chat_template(
            [*self._messages, user], tokenize=False, add_generation_prompt=True
        )
        all_images = self._images + images
        encoded = self.processor(text=[prompt], images=all_images or None, return_tensors="pt")
        extra = sorted(set(encoded.keys()) - _PROCESSOR_OUTPUTS)
        if extra:
            raise ValueError(
                f"processor: returns {', '.join(extra)}, which ChatSession does not know how to "
                f"split per image; supported outputs are {', '.join(sorted(_PROCESSOR_OUTPUTS))}"
            )
        input_ids = encoded["input_ids"]
        needed = input_ids.shape[1] + max_new_tokens
        if self.max_cached_tokens is not None and needed > self.max_cached_tokens:
            raise ValueError(
                f"max_cached_tokens: this turn needs {needed} cached tokens (prompt "
                f"{input_ids.shape[1]} + max_new_tokens {max_new_tokens}), over the limit of "
                f"{self.max_cached_tokens}; call reset() to start over, or continue from a "
                f"fork() taken earlier, or ask for fewer max_new_tokens"
            )

        spans = self._image_spans(encoded, len(all_images))
        reused = _common_prefix(self._cached_ids, input_ids[0])
        # generate needs at least one uncached token to compute the next-token logits from.
        reused = min(reused, input_ids.shape[1] - 1)
        for index, (start, end) in enumerate(spans):
            if start >= reused:
                break
            # Cached only if wholly in the prefix and cached with the same tokens; equal ids
            # alone do not prove that when the image's token count changed between turns.
            cached = index < len(self._cached_spans) and self._cached_spans[index] == (start, end)
            if end > reused or not cached:
                reused = start
                break
        first_new = sum(1 for _, end in spans if end <= reused)

        inputs: dict[str, Any] = {
            "input_ids": input_ids,
            "attention_mask": encoded["attention_mask"],
            "max_new_tokens": max_new_tokens,
            **generate_kwargs,
        }
        if "mm_token_type_ids" in encoded:
            inputs["mm_token_type_ids"] = encoded["mm_token_type_ids"]
        if first_new < len(all_images):
            inputs.update(self._image_inputs(encoded, first_new))
        if self._rope_index is not None:
            inputs["position_ids"] = self._mrope_positions(encoded)
        return _Turn(text, images, input_ids, inputs, reused, spans, first_new)

    def _image_spans(self, encoded: Any, count: int) -> list[tuple[int, int]]:
        """[start, end) of each image's tokens in the prompt, in image order."""
        if count == 0:
            return []
        config = self._base.config
        image_token_id = getattr(config, self._image_token_attribute)
        positions = (encoded["input_ids"][0] == image_token_id).nonzero()[:, 0].tolist()
        if "image_grid_thw" in encoded:
            merge = config.vision_config.spatial_merge_size
            sizes = (encoded["image_grid_thw"].prod(-1) // merge**2).tolist()
        elif len(positions) % count == 0:
            sizes = [len(positions) // count] * count
        else:
            raise ValueError(
                f"processor: {len(positions)} image tokens for {count} images; ChatSession "
                f"needs the same number of tokens per image when there is no image_grid_thw"
            )
        spans, offset = [], 0
        for size in sizes:
            spans.append((positions[offset], positions[offset + size - 1] + 1))
            offset += size
        return spans

    @staticmethod
    def _image_inputs(encoded: Any, first: int) -> dict[str, torch.Tensor]:
        """``pixel_values`` (and ``image_grid_thw``) of the images from index ``first`` on."""
        pixels = encoded["pixel_values"]
        if "image_grid_thw" not in encoded:
            return {"pixel_values": pixels[first:]}
        grid = encoded["image_grid_thw"]
        row = int(grid[:first].prod(-1).sum())
        return {"pixel_values": pixels[row:], "image_grid_thw": grid[first:]}

    def _mrope_positions(self, encoded: Any) -> torch.Tensor:
        """``[text; t; h; w]`` position ids (4, 1, L) of the whole prompt over all images, as
        ``generate`` computes them for a prompt it prefills from scratch."""
        if "mm_token_type_ids" not in encoded:
            raise ValueError(
                "processor: returns no mm_token_type_ids, which M-RoPE positions need; use the "
                "model's own processor (transformers >= 5.17)"
            )
        attention_mask = encoded["attention_mask"]
        text = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)
        vision, _ = self._rope_index(
            encoded["input_ids"],
            mm_token_type_ids=encoded["mm_token_type_ids"],
            image_grid_thw=encoded.get("image_grid_thw"),
            attention_mask=attention_mask,
        )
        return torch.cat([text[None], vision.to(text.dtype)], dim=0)

    def _generate(self, turn: _Turn, streamer: Any) -> torch.Tensor:
        from transformers import DynamicCache

        if self._cache is None or turn.reused == 0:
            self._cache = DynamicCache(config=self._base.config)
        else:
            self._crop_cache(turn.reused)
        self._cached_ids = self._cached_ids[: turn.reused]
        self._cached_spans = turn.spans[: turn.first_new]
        try:
            return self.model.generate(
                **turn.generate_inputs, **{self._cache_keyword: self._cache}, streamer=streamer
            )
        except BaseException:
            # The cache may hold part of this turn; keep it consistent with the recorded ids.
            self._crop_cache(turn.reused)
            raise

    def _crop_cache(self, length: int) -> None:
        """Keep the first ``length`` tokens of every layer of the cache.

        Layer by layer: after an error inside a forward the layers it reached hold more tokens
        than the rest, so ``Cache.crop``, which removes the same count from every layer, would
        cut the others below ``length``. ``crop`` takes a negative count (the positive,
        absolute form is gone in transformers 5.18).
        """
        if self._cache is None:
            return
        for layer in self._cache.layers:
            extra = layer.get_seq_length() - length
            if extra > 0:
                layer.crop(-extra)

    def _record(self, turn: _Turn, sequences: torch.Tensor) -> str:
        answer = self._tokenizer.decode(
            sequences[0, turn.input_ids.shape[1] :], skip_special_tokens=True
        )
        self._messages.append(
            {
                "role": "user",
                "content": [{"type": "image", "image": image} for image in turn.images]
                + [{"type": "text", "text": turn.text}],
            }
        )
        self._messages.append({"role": "assistant", "content": [{"type": "text", "text": answer}]})
        self._images.extend(turn.images)
        self._cached_ids = sequences[0, : self.cached_tokens].clone()
        self._cached_spans = list(turn.spans)
        return answer
