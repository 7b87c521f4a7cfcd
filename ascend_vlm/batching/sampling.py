"""The next token of one sequence from its logits: greedy (argmax, as ``generate`` with
``do_sample=False``), or sampled from ``softmax(logits / temperature)`` restricted to the
``top_k`` most likely tokens and the smallest set whose probability reaches ``top_p``, drawn
with the request's own generator (so the draw does not depend on other sequences; in fp16 or
bf16 a batched forward may change the logits' low bits, and with them a draw, and the draws
are not those of ``generate(do_sample=True)`` with the same seed).

Before choosing, the model's generation config applies as ``generate`` applies it: the
repetition penalty (transformers' own processor, over the prompt and the tokens so far) and
the minimum lengths (end-of-sequence tokens masked before them). Settings that would need
more (n-gram bans, forced or suppressed tokens, beams ...) are refused by
:func:`generation_rules`, naming the setting.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ascend_vlm.batching.request import GenerationRequest

# generation-config settings whose processors the generator does not apply, with the value
# that means "off".
_UNSUPPORTED = {
    "num_beams": 1,
    "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0,
    "bad_words_ids": None,
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
    "sequence_bias": None,
    "exponential_decay_length_penalty": None,
    "renormalize_logits": False,
    "diversity_penalty": 0.0,
    "encoder_repetition_penalty": 1.0,
}


@dataclass(frozen=True)
class GenerationRules:
    """What a model's generation config adds to every request: a repetition penalty (a
    transformers processor, or None) and minimum lengths (new tokens, and prompt + new)."""

    repetition: Any
    min_new_tokens: int
    min_length: int
    eos: tuple[int, ...]

    def apply(self, prompt: torch.Tensor, tokens: list[int], logits: torch.Tensor) -> torch.Tensor:
        """``logits`` [vocab] of the next token after ``prompt`` [L] and ``tokens``."""
        if self.repetition is not None:
            ids = torch.cat([prompt, torch.tensor(tokens, dtype=prompt.dtype)])[None]
            logits = self.repetition(ids.to(logits.device), logits[None])[0]
        too_short = len(tokens) < self.min_new_tokens or (
            prompt.numel() + len(tokens) < self.min_length
        )
        if too_short and self.eos:
            logits = logits.clone()
            logits[list(self.eos)] = float("-inf")
        return logits


def generation_rules(config: Any, eos: list[int]) -> GenerationRules:
    """The rules of ``config`` (a ``GenerationConfig``). ValueError naming a setting it sets
    that the batch generator does not apply."""
    for name, off in _UNSUPPORTED.items():
        value = getattr(config, name, off)
        if value not in (off, None) and not (name == "num_beams" and value == 1):
            raise ValueError(
                f"model: generation_config.{name}={value!r} is not supported by BatchGenerator "
                f"(expected {off!r}); set it off on model.generation_config"
            )
    repetition = None
    penalty = getattr(config, "repetition_penalty", None)
    if penalty is not None and penalty != 1.0:
        from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor

        repetition = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(penalty=penalty)])
    return GenerationRules(
        repetition=repetition,
        min_new_tokens=getattr(config, "min_new_tokens", None) or 0,
        min_length=getattr(config, "min_length", None) or 0,
        eos=tuple(eos),
    )


def request_generator(request: GenerationRequest) -> torch.Generator | None:
    """The request's random generator (None for greedy requests)."""
    return torch.Generator().manual_seed(request.seed) if request.do_sample else None


# Below this temperature sampling is greedy: dividing logits by it overflows float32 (a logit of
# 30 over 1e-38 is inf) long before the distribution stops being one-hot in practice.
GREEDY_BELOW_TEMPERATURE = 1e-5


def next_token(
    logits: torch.Tensor, request: GenerationRequest, generator: torch.Generator | None
) -> int:
    """The token chosen from ``logits`` ``[vocab]`` for ``request``: the argmax when it does
    not sample or its temperature is below :data:`GREEDY_BELOW_TEMPERATURE`."""
    if not request.do_sample or request.temperature < GREEDY_BELOW_TEMPERATURE:
        return int(logits.argmax())
    scores = logits.float().cpu() / request.temperature
    if request.top_k is not None and request.top_k < scores.numel():
        threshold = torch.topk(scores, request.top_k).values[-1]
        scores = scores.masked_fill(scores < threshold, float("-inf"))
    if request.top_p is not None and request.top_p < 1:
        ordered, order = torch.sort(scores, descending=True)
        cumulative = ordered.softmax(-1).cumsum(-1)
        # keep the tokens before the cumulative mass passes top_p, and the one that passes it
        drop = cumulative - ordered.softmax(-1) >= request.top_p
        scores = scores.scatter(0, order[drop], float("-inf"))
    return int(torch.multinomial(scores.softmax(-1), 1, generator=generator))
