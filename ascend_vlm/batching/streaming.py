"""Recording a sequence's next token: its text so far, whether it finished (a stop string, the
end-of-sequence token or ``max_new_tokens``) and the text it is safe to stream now."""

from __future__ import annotations

from typing import Any

from ascend_vlm.batching.request import SequenceState, TokenEvent


def record_token(
    sequence: SequenceState, token: int, tokenizer: Any, eos: set[int]
) -> tuple[TokenEvent, str | None]:
    """Append ``token`` to ``sequence`` and return its :class:`TokenEvent` and why the sequence
    finished ("stop", "eos", "length"; None while it runs). The text is cut before the first
    stop string; while the sequence runs, an unfinished character (a multi-token one decodes
    to U+FFFD until its last token) and what could still become a stop string are held back."""
    sequence.tokens.append(token)
    text = tokenizer.decode(sequence.tokens, skip_special_tokens=True)
    stops = [text.find(stop) for stop in sequence.request.stop if stop in text]
    reason = None
    if stops:
        text, reason = text[: min(stops)], "stop"
    elif token in eos:
        reason = "eos"
    elif len(sequence.tokens) >= sequence.request.max_new_tokens:
        reason = "length"
    sequence.text = text
    if reason is None:
        ready = len(text.rstrip("\ufffd"))
        ready -= max((len(stop) - 1 for stop in sequence.request.stop), default=0)
        ready = max(ready, sequence.emitted)
    else:
        ready = len(text)
    event = TokenEvent(sequence.request.request_id, token, text[sequence.emitted : ready])
    sequence.emitted = ready
    return event, reason
