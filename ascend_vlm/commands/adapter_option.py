"""The "adapter" feature option of ``python -m ascend_vlm eval``: ``--adapter NAME=PATH``
(repeatable) loads LoRA adapters into an :class:`~ascend_vlm.adapters.AdapterSet` over the
loaded model and ``--use-adapter NAME`` chooses the one that answers (``__base__``: none).

An adapter folder holding ``visual_tokens.json`` (a run with ``--new-tokens``) first gets its
tokens added to the model and its processor, so the questions and answers that use them
tokenise as in training; such an adapter is loaded alone. With ``--use-adapter __base__`` the
base then answers with the tokens added at placeholder rows (the mean of the old rows), not
as the untouched base, whose tokenizer splits them into pieces. PEFT injects the LoRA layers
into the model's own modules, so the loaded model itself answers through the active adapter.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ascend_vlm.adapters.adapter_set import BASE_ADAPTER, AdapterSet, check_adapter_name


def named_path(text: str) -> tuple[str, str]:
    """``NAME=PATH`` as ``(NAME, PATH)``; ArgumentTypeError naming what is accepted."""
    name, separator, path = text.partition("=")
    if not separator or not path:
        raise argparse.ArgumentTypeError(
            f"expected NAME=PATH (an adapter name and its folder), got {text!r}"
        )
    try:
        check_adapter_name(name)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return name, path


def add_adapter_arguments(group: Any) -> None:
    """Add ``--adapter NAME=PATH`` (repeatable, default none) and ``--use-adapter NAME``."""
    group.add_argument(
        "--adapter",
        type=named_path,
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="load the LoRA adapter saved in folder PATH (safetensors) as NAME; repeat for "
        "several resident adapters",
    )
    group.add_argument(
        "--use-adapter",
        default=None,
        metavar="NAME",
        help=f"the adapter that answers: a loaded NAME or {BASE_ADAPTER} (the base); default "
        "the only --adapter given",
    )


def _chosen(args: argparse.Namespace) -> str:
    names = [name for name, _ in args.adapter]
    if args.use_adapter is None:
        if len(names) > 1:
            raise ValueError(
                f"--use-adapter: expected the adapter to answer with when several are loaded "
                f"({', '.join(names)}), got none"
            )
        return names[0]
    if args.use_adapter not in (BASE_ADAPTER, *names):
        raise ValueError(
            f"--use-adapter: expected one of {', '.join([BASE_ADAPTER, *names])}, got "
            f"{args.use_adapter!r}"
        )
    return args.use_adapter


def load_adapter_set(
    model: Any, processor: Any, named_paths: list[tuple[str, str]]
) -> tuple[AdapterSet, list[str]]:
    """An :class:`~ascend_vlm.adapters.AdapterSet` over ``model`` holding the adapters of
    ``named_paths`` (``(NAME, PATH)`` pairs, as ``--adapter`` parses them), and the new tokens
    an adapter folder with ``visual_tokens.json`` added to ``model`` and ``processor`` (such an
    adapter is loaded alone). ValueError naming ``--adapter`` for a name given twice or an
    adapter that does not load."""
    from ascend_vlm.adapters import AdapterSet, load_visual_tokens
    from ascend_vlm.adapters.visual_vocabulary import VISUAL_TOKENS_FILE

    names = [name for name, _ in named_paths]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"--adapter: expected each NAME once, got {', '.join(repeated)} twice")
    with_tokens = [(n, p) for n, p in named_paths if (Path(p) / VISUAL_TOKENS_FILE).is_file()]
    if with_tokens and len(named_paths) > 1:
        # PEFT's trainable tokens wrap the embedding and head, which the other adapters'
        # loading (or a table they save in full) does not expect.
        raise ValueError(
            f"--adapter: expected an adapter with new tokens ({with_tokens[0][0]}) alone, got "
            f"{len(named_paths)} adapters"
        )
    new_tokens: list[str] = []
    adapters = AdapterSet(model)
    for name, path in named_paths:
        try:
            if (name, path) in with_tokens:
                new_tokens = list(load_visual_tokens(model, processor, path).tokens)
            adapters.load(name, path)
        except (ValueError, FileNotFoundError) as error:
            raise ValueError(f"--adapter {name}={path}: {error}") from None
    return adapters, new_tokens


def apply_adapters(model: Any, args: argparse.Namespace, processor: Any) -> dict[str, Any]:
    """Load ``args.adapter`` over ``model`` and activate ``args.use_adapter``; the dict
    records the resident adapters, the active one and any new tokens."""
    if not args.adapter:
        if args.use_adapter not in (None, BASE_ADAPTER):
            raise ValueError(
                f"--use-adapter: expected an adapter loaded with --adapter NAME=PATH, got "
                f"{args.use_adapter!r} with none loaded"
            )
        return {"summary": "no adapter", "adapters": {}, "active": BASE_ADAPTER, "new_tokens": []}
    active = _chosen(args)
    adapters, new_tokens = load_adapter_set(model, processor, args.adapter)
    adapters.activate(active)
    resident = ", ".join(adapters.names)
    tokens = f", new tokens {' '.join(new_tokens)}" if new_tokens else ""
    return {
        "summary": f"adapter {active} active (resident: {resident}{tokens})",
        "adapters": {name: str(Path(path).resolve()) for name, path in args.adapter},
        "active": active,
        "new_tokens": new_tokens,
    }
