"""Instant events that features report to whoever traces them (pruning, vision cache, batching).

A feature calls :func:`emit` where something worth seeing on a timeline happens, naming the
model it happened in (a tracer keeps only its own model's events). With no listener (no
:class:`~ascend_vlm.observability.Tracer` enabled) that is one truth test and a return; a
feature whose fields cost something to build asks :func:`listening` first. Field values must
be JSON-serialisable: they become the ``args`` of Chrome-trace instant events.

The module belongs to the core so that every feature reports here without importing another
feature: the reporters (pruning, reuse, batching) and the listener (observability) meet below
them all.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

Listener = Callable[[str, nn.Module, dict[str, Any]], None]

_LISTENERS: list[Listener] = []


def listening() -> bool:
    """Whether any listener would receive an event now."""
    return bool(_LISTENERS)


def emit(name: str, source: nn.Module, **fields: Any) -> None:
    """Hand event ``name`` from model ``source`` (the model for generation or its
    multimodal ``.model``) with ``fields`` to every listener (nothing when none listens)."""
    if _LISTENERS:
        for listener in tuple(_LISTENERS):
            listener(name, source, fields)


def add_listener(listener: Listener) -> None:
    """Start handing events to ``listener``."""
    _LISTENERS.append(listener)


def remove_listener(listener: Listener) -> None:
    """Stop handing events to ``listener`` (no-op when it does not listen)."""
    if listener in _LISTENERS:
        _LISTENERS.remove(listener)
