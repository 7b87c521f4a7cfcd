"""`BatchedModel`: a VLM and its processor as the batch generator drives them.

What the generator needs from the model, read once when it is made: its base model and the
family's batching descriptor (a family that refuses batching raises here), the image token,
the M-RoPE index (None for plain RoPE), the keyword its forward takes the cache under, its
end-of-sequence tokens and generation-config rules, and the KV bytes one token costs. And what
it asks of the model: encode a request's prompt and images, run a forward over some sequences
(through each one's adapter), the positions of a prompt, and the next token of a sequence.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ascend_vlm._base_model import base_model
from ascend_vlm._compat.attention import ATTENTION_NAME
from ascend_vlm._compat.cache import cache_keyword_of
from ascend_vlm.batching.budgets import RequestSize, kv_bytes_per_token
from ascend_vlm.batching.request import GenerationRequest, SequenceState, TokenEvent
from ascend_vlm.batching.sampling import generation_rules, next_token
from ascend_vlm.batching.streaming import record_token
from ascend_vlm.models import require_feature
from ascend_vlm.patching.attention_tap import tapped_implementation


class BatchedModel:
    """``model`` (a transformers VLM with ``generate``, optionally patched, PEFT-wrapped or
    with a vision cache) and ``processor`` (a callable with a chat template), both checked by
    the caller; ``adapters``: an :class:`~ascend_vlm.adapters.AdapterSet` over ``model`` or
    None. ValueError when the model's family refuses batching."""

    def __init__(self, model: nn.Module, processor: Any, adapters: Any) -> None:
        self.model = model
        self.processor = processor
        self.adapters = adapters
        self.base = base_model(model)
        self.text_config = getattr(self.base.config, "text_config", None) or self.base.config
        # The decoder's attention modules (a patch gives each its own config): when all run
        # ascend_vlm's attention, a decode step reads the KV blocks in place.
        self._attention_modules = [
            module
            for module in self.base.modules()
            if isinstance(getattr(module, "layer_idx", None), int)
            and type(module).__name__.endswith("Attention")
            and hasattr(module, "config")
        ]
        descriptor = require_feature(self.base, "batching")
        self.image_token: int | None = getattr(self.base.config, descriptor.visual_token_ids[0])
        self.rope_index: Callable[..., Any] | None = descriptor.rope_index(self.base)
        self.cache_keyword = cache_keyword_of(self.base)
        self.keeps_last_logits = "logits_to_keep" in inspect.signature(self.base.forward).parameters
        generation_config = self.base.generation_config
        eos = generation_config.eos_token_id
        self._eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self._rules = generation_rules(generation_config, sorted(self._eos))
        self.kv_bytes_per_token = kv_bytes_per_token(self.base)
        self.device = next(self.base.parameters()).device

    def encode(self, request: GenerationRequest) -> tuple[dict[str, torch.Tensor], RequestSize]:
        """``request``'s prompt (chat template with the generation prompt) and images as model
        inputs (one row, on the CPU), and what admitting it costs."""
        prompt = self.processor.apply_chat_template(
            list(request.messages), tokenize=False, add_generation_prompt=True
        )
        images = request.images()
        encoded = self.processor(text=[prompt], images=images or None, return_tensors="pt")
        inputs = {k: v for k, v in encoded.items() if isinstance(v, torch.Tensor)}
        prompt_tokens = int(inputs["input_ids"].shape[1])
        visual = 0
        if self.image_token is not None:
            visual = int((inputs["input_ids"] == self.image_token).sum())
        return inputs, RequestSize(prompt_tokens, visual, prompt_tokens + request.max_new_tokens)

    def reads_blocks_in_place(self) -> bool:
        """Whether every decoder attention module runs ascend_vlm's attention now (a patch may
        be applied or reverted between steps), so a decode step reads the KV blocks in place
        instead of gathering them."""
        return all(
            tapped_implementation(module.config) == ATTENTION_NAME
            for module in self._attention_modules
        )

    def prompt_rope_index(self, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        """A prompt's M-RoPE position ids ``[3, 1, L]`` and ``rope_deltas``: its decode
        positions run ``length + delta``. Only for models whose ``rope_index`` is not None."""
        keywords = {
            name: inputs[name]
            for name in ("mm_token_type_ids", "image_grid_thw", "attention_mask")
            if name in inputs
        }
        positions, deltas = self.rope_index(inputs["input_ids"], **keywords)
        return positions, int(deltas.reshape(-1)[0])

    def forward_of(self, sequences: list[SequenceState]) -> Callable[..., Any]:
        """The model's forward over ``sequences`` as a function of the inputs (`forward`)."""
        return functools.partial(self.forward, sequences)

    def forward(self, sequences: list[SequenceState], **inputs: Any) -> Any:
        """The model's forward over ``sequences`` (one batch row each), through each one's
        adapter when there are ``adapters``."""
        if self.adapters is None:
            return self.model(**inputs)
        return self.adapters.forward([sequence.adapter for sequence in sequences], **inputs)

    def choose_token(
        self, sequence: SequenceState, logits: torch.Tensor
    ) -> tuple[TokenEvent, str | None]:
        """Choose and record the sequence's next token from its ``logits`` ``[vocab]``: its
        :class:`TokenEvent` and why the sequence finished (None while it runs). The model's
        generation-config processors (repetition penalty, minimum length) see the prompt and
        the tokens so far, as in ``generate``."""
        logits = self._rules.apply(sequence.inputs["input_ids"][0], sequence.tokens, logits)
        token = next_token(logits, sequence.request, sequence.generator)
        return record_token(sequence, token, self.processor.tokenizer, self._eos)
