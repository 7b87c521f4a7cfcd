"""The next token of one sequence from its logits: greedy (argmax, as ``generate`` with
``do_sample=False``), or sampled from ``softmax(logits / temperature)`` restricted to the
``top_k`` most likely tokens and the smallest set whose probability reaches ``top_p``, drawn
with the request's own generator (so the draw does not depend on other sequences)."""

from __future__ import annotations

import torch

from ascend_vlm.batching.request import GenerationRequest


def request_generator(request: GenerationRequest) -> torch.Generator | None:
    """The request's random generator (None for greedy requests)."""
    return torch.Generator().manual_seed(request.seed) if request.do_sample else None


def next_token(
    logits: torch.Tensor, request: GenerationRequest, generator: torch.Generator | None
) -> int:
    """The token chosen from ``logits`` ``[vocab]`` for ``request``."""
    if not request.do_sample:
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
