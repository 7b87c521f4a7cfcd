"""The "prune" feature option of ``python -m ascend_vlm eval``: ``--prune`` drops visual tokens at
prefill and ``--kv`` compresses the prompt's KV cache (:mod:`ascend_vlm.pruning`).

Each flag takes one spec, ``METHOD[:key=value,...]``: ``METHOD`` is a token-pruning method of
:class:`~ascend_vlm.pruning.PruneConfig` for ``--prune`` and ``snapkv`` for ``--kv``; the keys are
the config's other fields, converted to the field's type (int, float, text, or ``true`` /
``false``), and the fields not given keep the config's defaults. Items may be separated by
``,``, ``;`` or ``+`` (a ``--compare`` configuration splits at commas, so there a spec uses
``;`` or ``+``). Values are checked by the config classes themselves; a bad spec is an
``argparse.ArgumentTypeError`` carrying their message.
"""

from __future__ import annotations

import argparse
import re
import typing
from dataclasses import asdict, fields
from typing import Any

from ascend_vlm import pruning
from ascend_vlm.pruning import PruneConfig, SnapKVConfig
from ascend_vlm.pruning.config import TOKEN_METHODS

KV_METHOD = "snapkv"
ITEM_SEPARATORS = re.compile(r"[,;+]")
_SPEC_FORM = "METHOD[:key=value,...] (items separated by ',', ';' or '+')"
_BOOLEANS = {"true": True, "false": False}


def _split_spec(spec: str) -> tuple[str, dict[str, str]]:
    """``(METHOD, {key: value text})`` of ``spec``; raises ArgumentTypeError when malformed."""
    method, colon, rest = spec.partition(":")
    values: dict[str, str] = {}
    items = ITEM_SEPARATORS.split(rest) if colon else []
    for item in items:
        key, equals, value = item.partition("=")
        if not (key and equals and value):
            raise argparse.ArgumentTypeError(
                f"expected {_SPEC_FORM}, got item {item!r} in {spec!r}"
            )
        if key in values:
            raise argparse.ArgumentTypeError(f"{key}: given twice in {spec!r}")
        values[key] = value
    return method, values


def _convert(key: str, text: str, kind: type) -> object:
    if kind is bool:
        if text.lower() not in _BOOLEANS:
            raise argparse.ArgumentTypeError(f"{key}: expected true or false, got {text!r}")
        return _BOOLEANS[text.lower()]
    try:
        return kind(text)
    except ValueError:
        expected = {int: "an int", float: "a number"}.get(kind, kind.__name__)
        raise argparse.ArgumentTypeError(f"{key}: expected {expected}, got {text!r}") from None


def _build(config_class: type, values: dict[str, str], **fixed: object) -> Any:
    """``config_class(**fixed, **values)`` with ``values`` converted to the fields' types; its
    ValueError (the config's own validation) becomes an ArgumentTypeError."""
    types = typing.get_type_hints(config_class)
    keys = [field.name for field in fields(config_class) if field.name not in fixed]
    arguments = dict(fixed)
    for key, text in values.items():
        if key not in keys:
            raise argparse.ArgumentTypeError(
                f"unknown key {key!r}: expected one of {', '.join(keys)}"
            )
        arguments[key] = _convert(key, text, types[key])
    try:
        return config_class(**arguments)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def prune_spec(spec: str) -> PruneConfig:
    """The :class:`PruneConfig` of a ``--prune`` spec, e.g. ``fastv:layer=2,keep=0.5``."""
    method, values = _split_spec(spec)
    return _build(PruneConfig, values, method=method)


def kv_spec(spec: str) -> SnapKVConfig:
    """The :class:`SnapKVConfig` of a ``--kv`` spec, e.g. ``snapkv:compression_ratio=0.5``."""
    method, values = _split_spec(spec)
    if method != KV_METHOD:
        raise argparse.ArgumentTypeError(f"method: expected {KV_METHOD}, got {method!r}")
    return _build(SnapKVConfig, values)


def _spec_text(value: object) -> str:
    """``value`` as a spec writes it (booleans as ``true`` / ``false``)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def _keys_help(config: object, skip: str = "") -> str:
    defaults = asdict(config).items()
    return ", ".join(f"{key} ({_spec_text(value)})" for key, value in defaults if key != skip)


def add_pruning_arguments(group: Any) -> None:
    """Add ``--prune`` and ``--kv`` (both default None: no pruning, no compression)."""
    group.add_argument(
        "--prune",
        type=prune_spec,
        metavar="SPEC",
        help=f"drop visual tokens at prefill: METHOD[:key=value,...], METHOD one of "
        f"{', '.join(TOKEN_METHODS)}; keys (default) "
        f"{_keys_help(PruneConfig(), skip='method')}; e.g. fastv:layer=2,keep=0.5. Items may "
        "also be separated by ';' or '+', as a --compare configuration needs: "
        "prune=fastv:layer=2+keep=0.5. Default: no pruning",
    )
    group.add_argument(
        "--kv",
        type=kv_spec,
        metavar="SPEC",
        help=f"compress the prompt's KV cache after prefill: {KV_METHOD}[:key=value,...]; keys "
        f"(default) {_keys_help(SnapKVConfig())}; booleans true/false; items separated as "
        "for --prune. Default: no compression",
    )


def _prune_summary(config: PruneConfig) -> str:
    seed = f" seed={config.seed}" if config.method == "random" else ""
    return f"pruned: {config.method} layer={config.layer} keep={config.keep:g}{seed}"


def _kv_summary(config: SnapKVConfig) -> str:
    return f"kv: {KV_METHOD} ratio={config.compression_ratio:g} window={config.window}"


def apply_pruning(model: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Enable token pruning on ``model`` per ``args.prune`` / ``args.kv`` (nothing when both are
    None); returns ``{"summary", "prune", "kv"}`` with the configs as dicts (or None).

    Raises ValueError prefixed with the flags given when the model refuses them (its family is
    not supported, or ``layer`` is not below its depth).
    """
    prune, kv = args.prune, args.kv
    if prune is None and kv is None:
        return {"summary": "not pruned", "prune": None, "kv": None}
    try:
        pruning.enable_token_pruning(model, prune, kv=kv)
    except ValueError as error:
        flags = [flag for flag, config in (("--prune", prune), ("--kv", kv)) if config is not None]
        raise ValueError(f"{', '.join(flags)}: {error}") from error
    parts = [] if prune is None else [_prune_summary(prune)]
    parts += [] if kv is None else [_kv_summary(kv)]
    return {
        "summary": "; ".join(parts),
        "prune": None if prune is None else asdict(prune),
        "kv": None if kv is None else asdict(kv),
    }


def finish_pruning(model: Any, args: argparse.Namespace) -> dict[str, Any]:
    """The last pruned prefill's statistics (:class:`~ascend_vlm.pruning.PruningStats`, its
    kept positions left out), when pruning ran."""
    stats = pruning.pruning_stats(model) if (args.prune or args.kv) else None
    if stats is None:
        return {}
    fields = stats.as_dict()
    del fields["kept_positions"]
    return {"last_prefill": fields}
