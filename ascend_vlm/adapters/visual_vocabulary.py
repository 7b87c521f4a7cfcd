"""Private visual vocabulary: new tokens such as ``<defect-17>`` that name visual concepts.

:func:`add_visual_tokens` appends K tokens to a processor's tokenizer and K rows to the model's
input embedding and output head, initialised from given vectors or from example images.
:func:`trainable_token_indices` is the ``peft.LoraConfig(trainable_token_indices=...)`` value
that trains exactly those rows next to a LoRA adapter, so the base weights stay frozen and the
adapter file holds only the K trained rows. :func:`save_visual_tokens` writes the tokens next to
the adapter and :func:`load_visual_tokens` re-adds them, at the same ids, to a fresh base model
before ``PeftModel.from_pretrained`` restores the trained rows.

How PEFT 0.21 trains the rows (``peft.utils.other.TrainableTokensWrapper`` around
``peft.tuners.trainable_tokens.layer.TrainableTokensLayer``): the wrapped layer keeps its base
weight untouched and holds a ``[K, hidden]`` parameter of the selected rows; its forward uses
the base weight with those rows replaced (``index_copy``), and ``merge`` writes them in. When
``model.config.tie_word_embeddings`` is true, ``set_additional_trainable_modules`` wraps the
output head with a layer tied to the embedding's (sharing its rows, saving nothing of its
own), so naming the embedding alone trains both. When the head is untied it needs its own
entry, and then trains its own K rows.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# The file save_visual_tokens writes next to an adapter.
VISUAL_TOKENS_FILE = "visual_tokens.json"


@dataclass(frozen=True)
class VisualTokens:
    """Tokens added to a tokenizer and its model.

    Attributes:
        tokens: the token strings, e.g. ``("<defect-17>", "<logo>")``.
        token_ids: their ids in the tokenizer (and rows in the model's embedding), same order.
        vocab_size: the rows of the model's input embedding once the tokens are added; a base
            model that ends up with another size after :func:`load_visual_tokens` is refused.
    """

    tokens: tuple[str, ...]
    token_ids: tuple[int, ...]
    vocab_size: int


def add_visual_tokens(
    model,
    processor,
    tokens: Sequence[str],
    *,
    vectors: torch.Tensor | None = None,
    examples: Mapping[str, Sequence[Any]] | None = None,
) -> VisualTokens:
    """Add ``tokens`` to ``processor.tokenizer`` and to ``model``, initialising their rows.

    Each token becomes one added token (matched verbatim, never split by BPE, not special so
    decoding keeps it) at the next free id. The model's embedding grows through
    ``model.resize_token_embeddings``, which also grows an untied output head, keeps a tied
    one tied and sets the text config's ``vocab_size``. When the embedding already has unused rows
    past the tokenizer (checkpoints that pad their vocabulary), the new ids take those rows
    instead. The rows of every token the tokenizer had stay bit-identical.

    Exactly one of ``vectors`` and ``examples`` gives the new input-embedding rows e_k:

    * ``vectors``: a ``[K, hidden]`` tensor of the embedding's dtype; e_k = vectors[k].
    * ``examples``: token -> PIL images. e_k = (1/N_k) * sum over the N_k visual tokens of the
      token's images of f, where f is a row of ``model.model.get_image_features`` on the
      pixels of ``processor.image_processor``: the vectors the language model receives in
      place of image tokens, so e_k lies in its embedding space. Computed in float32 with the
      model in eval mode (dropout off), then cast to the embedding's dtype.

    A tied output head shares e_k. An untied head's new rows are the mean of its rows of the
    existing tokens, w_k = (1/V) * sum_v w_v (and likewise its bias): the new tokens' logits
    start at the mean of the old logits, so the next-token distribution over the old
    vocabulary barely moves until training teaches the head when to emit them.

    Raises ``ValueError`` for empty, non-string, duplicate or already-known tokens, for both
    or neither of ``vectors`` / ``examples``, for vectors of another shape or dtype, and for
    examples that miss a token, name an unknown one or hold no images, and for a tokenizer
    with more tokens than the model has embedding rows; all before the tokenizer or model
    changes. Raises ``RuntimeError`` when a tied head comes out of the resize untied.
    """
    tokenizer = processor.tokenizer
    tokens = _check_tokens(tokens, tokenizer)
    if (vectors is None) == (examples is None):
        raise ValueError(
            "vectors, examples: expected exactly one of them, got "
            f"{'both' if vectors is not None else 'neither'}"
        )
    weight = model.get_input_embeddings().weight
    if vectors is not None:
        rows = _check_vectors(vectors, len(tokens), weight)
    else:
        rows = _mean_image_features(model, processor, tokens, examples).to(weight.dtype)
    return _grow(model, tokenizer, tokens, rows)


def trainable_token_indices(model, visual: VisualTokens) -> dict[str, list[int]]:
    """The ``trainable_token_indices`` argument of ``peft.LoraConfig`` that trains exactly the
    rows of ``visual``'s tokens: ``{embedding module name: ids}``, plus ``{output head module
    name: ids}`` when the head is untied (a tied head follows the embedding's rows in PEFT).

    Module names are the full names in ``model.named_modules()``; PEFT matches them by suffix.
    Raises ``ValueError`` when ``visual``'s ids lie beyond the model's embedding (tokens of
    another model) or when the weights' actual tying disagrees with
    ``model.config.tie_word_embeddings``, which is what PEFT reads to decide tying.
    """
    embedding = model.get_input_embeddings()
    head = model.get_output_embeddings()
    rows = embedding.weight.shape[0]
    if max(visual.token_ids) >= rows:
        raise ValueError(
            f"visual: expected token ids below the model's {rows} embedding rows, got "
            f"{list(visual.token_ids)}; add the tokens to this model first "
            "(add_visual_tokens or load_visual_tokens)"
        )
    tied = head is not None and head.weight is embedding.weight
    config_tied = bool(getattr(model.config, "tie_word_embeddings", False))
    if tied != config_tied:
        raise ValueError(
            f"model: expected config.tie_word_embeddings to say whether the output head shares "
            f"the embedding's weight ({tied}), got {config_tied}; PEFT ties the trainable rows "
            "by the config"
        )
    names = {module: name for name, module in model.named_modules()}
    ids = list(visual.token_ids)
    indices = {names[embedding]: ids}
    if head is not None and not tied:
        indices[names[head]] = list(ids)
    return indices


def save_visual_tokens(visual: VisualTokens, processor, folder: str | os.PathLike) -> None:
    """Write ``visual`` to ``folder/visual_tokens.json`` (creating ``folder``), typically the
    folder of the adapter trained on these tokens.

    Raises ``ValueError`` when ``processor.tokenizer`` does not map the tokens to ``visual``'s
    ids (``visual`` was made for another processor).
    """
    ids = tuple(processor.tokenizer.convert_tokens_to_ids(list(visual.tokens)))
    if ids != visual.token_ids:
        raise ValueError(
            f"processor: expected a tokenizer mapping {list(visual.tokens)} to "
            f"{list(visual.token_ids)}, got {list(ids)}"
        )
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    record = {
        "tokens": list(visual.tokens),
        "token_ids": list(visual.token_ids),
        "vocab_size": visual.vocab_size,
    }
    (folder / VISUAL_TOKENS_FILE).write_text(json.dumps(record, indent=2) + "\n")


def load_visual_tokens(model, processor, folder: str | os.PathLike) -> VisualTokens:
    """Re-add the tokens saved in ``folder`` to a fresh base ``model`` and ``processor``.

    The tokens get the saved ids and the embedding the saved number of rows, so a LoRA adapter
    trained with :func:`trainable_token_indices` loads onto the model
    (``PeftModel.from_pretrained``) and replaces the new rows with its trained ones. Until
    then the new rows hold the mean of the existing tokens' rows (embedding and head), a
    neutral placeholder.

    Raises ``FileNotFoundError`` when ``folder`` has no ``visual_tokens.json`` and
    ``ValueError`` when the tokens would land at other ids or the embedding at another size
    (the tokens were saved for another base model), or are already in the tokenizer.
    """
    path = Path(folder) / VISUAL_TOKENS_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"folder: expected a folder with {VISUAL_TOKENS_FILE} (save_visual_tokens), "
            f"got {folder} without it"
        )
    saved = json.loads(path.read_text())
    tokenizer = processor.tokenizer
    tokens = _check_tokens(saved["tokens"], tokenizer)
    start = len(tokenizer)
    ids = list(range(start, start + len(tokens)))
    weight = model.get_input_embeddings().weight
    vocab_size = max(weight.shape[0], start + len(tokens))
    if ids != saved["token_ids"] or vocab_size != saved["vocab_size"]:
        raise ValueError(
            f"model, processor: expected a base whose tokenizer puts {saved['tokens']} at ids "
            f"{saved['token_ids']} and whose embedding then has {saved['vocab_size']} rows, got "
            f"ids {ids} and {vocab_size} rows (a tokenizer of {start} tokens, an embedding of "
            f"{weight.shape[0]} rows); the tokens were saved for another base model"
        )
    rows = weight[:start].detach().float().mean(0).expand(len(tokens), -1).to(weight.dtype)
    return _grow(model, tokenizer, tokens, rows)


def _check_tokens(tokens: Sequence[str], tokenizer) -> tuple[str, ...]:
    """``tokens`` as a tuple, after refusing what cannot become K new distinct tokens."""
    if isinstance(tokens, str) or not isinstance(tokens, Sequence):
        raise ValueError(
            f"tokens: expected a sequence of token strings, got {type(tokens).__name__} {tokens!r}"
        )
    if not tokens:
        raise ValueError("tokens: expected at least one token, got an empty sequence")
    bad = [token for token in tokens if not isinstance(token, str) or not token]
    if bad:
        raise ValueError(f"tokens: expected non-empty strings, got {bad!r}")
    duplicates = sorted({token for token in tokens if tokens.count(token) > 1})
    if duplicates:
        raise ValueError(f"tokens: expected distinct tokens, got duplicates {duplicates}")
    vocabulary = tokenizer.get_vocab()
    known = [token for token in tokens if token in vocabulary]
    if known:
        raise ValueError(
            f"tokens: expected tokens not yet in the tokenizer's vocabulary, got {known} "
            f"(ids {[vocabulary[token] for token in known]})"
        )
    return tuple(tokens)


def _check_vectors(vectors: torch.Tensor, count: int, weight: torch.Tensor) -> torch.Tensor:
    """``vectors`` on the embedding's device, after checking shape [count, hidden] and dtype."""
    expected = (count, weight.shape[1])
    if not isinstance(vectors, torch.Tensor) or tuple(vectors.shape) != expected:
        got = tuple(vectors.shape) if isinstance(vectors, torch.Tensor) else type(vectors).__name__
        raise ValueError(
            f"vectors: expected a tensor of shape {expected} (tokens, hidden), got {got}"
        )
    if vectors.dtype != weight.dtype:
        raise ValueError(
            f"vectors: expected the embedding's dtype {weight.dtype}, got {vectors.dtype}"
        )
    return vectors.detach().to(weight.device)


def _mean_image_features(
    model, processor, tokens: tuple[str, ...], examples: Mapping[str, Sequence[Any]]
) -> torch.Tensor:
    """``[K, hidden]`` float32: per token, the mean projected visual feature of its images."""
    if not isinstance(examples, Mapping):
        raise ValueError(
            f"examples: expected a mapping token -> images, got {type(examples).__name__}"
        )
    missing = [token for token in tokens if token not in examples]
    unknown = [key for key in examples if key not in tokens]
    if missing or unknown:
        raise ValueError(
            f"examples: expected exactly the tokens {list(tokens)} as keys, got "
            f"{list(examples)} (missing {missing}, unknown {unknown})"
        )
    empty = [token for token in tokens if len(examples[token]) == 0]
    if empty:
        raise ValueError(f"examples: expected at least one image per token, got none for {empty}")

    device = model.get_input_embeddings().weight.device
    dtype = model.get_input_embeddings().weight.dtype
    means = []
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for token in tokens:
                pixels = processor.image_processor(
                    images=list(examples[token]), return_tensors="pt"
                )
                pixels = {
                    key: value.to(device, dtype) if value.is_floating_point() else value.to(device)
                    for key, value in pixels.items()
                }
                features = model.model.get_image_features(**pixels)
                # transformers 5 returns a model output whose pooler_output holds one tensor
                # per image.
                features = getattr(features, "pooler_output", features)
                flat = torch.cat([f.reshape(-1, f.shape[-1]) for f in features])
                means.append(flat.float().mean(0))
    finally:
        model.train(training)
    return torch.stack(means)


def _grow(model, tokenizer, tokens: tuple[str, ...], rows: torch.Tensor) -> VisualTokens:
    """Add ``tokens`` to ``tokenizer`` and ``model``; their embedding rows become ``rows``."""
    from transformers import AddedToken

    embedding = model.get_input_embeddings()
    head = model.get_output_embeddings()
    known = len(tokenizer)
    if known > embedding.weight.shape[0]:
        raise ValueError(
            f"processor: expected a tokenizer no larger than the model's "
            f"{embedding.weight.shape[0]} embedding rows, got {known} tokens"
        )
    tied = head is not None and head.weight is embedding.weight

    tokenizer.add_tokens([AddedToken(token, normalized=False, special=False) for token in tokens])
    ids = tokenizer.convert_tokens_to_ids(list(tokens))
    vocab_size = max(embedding.weight.shape[0], max(ids) + 1)
    if vocab_size > embedding.weight.shape[0]:
        # The new rows are overwritten below, so transformers' mean-covariance sampling of
        # them would be wasted work.
        model.resize_token_embeddings(vocab_size, mean_resizing=False)
    embedding = model.get_input_embeddings()
    head = model.get_output_embeddings()
    if tied and head.weight is not embedding.weight:
        raise RuntimeError(
            "model: its output head shared the input embedding's weight before the resize and "
            "no longer does; resize_token_embeddings did not re-tie them"
        )

    index = torch.tensor(ids, device=embedding.weight.device)
    with torch.no_grad():
        embedding.weight.index_copy_(0, index, rows.to(embedding.weight.device))
        if head is not None and not tied:
            head_rows = head.weight[:known].float().mean(0).to(head.weight.dtype)
            head.weight.index_copy_(0, index, head_rows.expand(len(ids), -1))
            if getattr(head, "bias", None) is not None:
                head.bias[index] = head.bias[:known].float().mean().to(head.bias.dtype)
    return VisualTokens(tuple(tokens), tuple(ids), vocab_size)
