"""Feature options of ``python -m ascend_vlm eval``: the one registration point.

A feature that changes the model under evaluation (patching, token pruning, quantization,
caching ...) registers itself once with ``REGISTRY.register`` (:meth:`OptionRegistry.register`);
from then on

* its flags are flags of ``eval`` (an argument group titled with the option's name),
* ``apply(model, args)`` transforms each freshly loaded model according to those flags,
  before any sample is answered, in registration order,
* the dict ``apply`` returns is recorded in the JSON report under ``options[name]``, and its
  ``"summary"`` string is printed in the text report,
* its presets are configuration names ``--compare`` accepts (e.g. ``unpatched``).

The registrations live in :mod:`ascend_vlm.commands.features`; adding a feature means adding
one ``REGISTRY.register`` call there.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

_NAME = re.compile(r"[a-z][a-z0-9-]*")


@dataclass(frozen=True)
class EvalOption:
    """One registered feature option (see :meth:`REGISTRY.register <OptionRegistry.register>` for the fields' contract)."""

    name: str
    add_arguments: Callable[[Any], None]
    apply: Callable[[Any, argparse.Namespace], dict[str, Any]]
    presets: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    finish: Callable[[Any, argparse.Namespace], dict[str, Any]] | None = None
    needs_processor: bool = False


class OptionRegistry:
    """An ordered set of :class:`EvalOption`; ``REGISTRY`` is the one ``eval`` uses."""

    def __init__(self) -> None:
        self._options: dict[str, EvalOption] = {}

    def register(
        self,
        name: str,
        add_arguments: Callable[[Any], None],
        apply: Callable[[Any, argparse.Namespace], dict[str, Any]],
        *,
        presets: Mapping[str, Any] | None = None,
        finish: Callable[[Any, argparse.Namespace], dict[str, Any]] | None = None,
        needs_processor: bool = False,
    ) -> EvalOption:
        """Register the feature option ``name`` (lowercase words joined by ``-``).

        ``add_arguments(group)`` adds the feature's flags to an argparse argument group (give
        every flag a default, so a configuration that does not mention it is well defined).
        ``apply(model, args)`` transforms ``model`` in place according to ``args`` (the parsed
        namespace) and returns a JSON-serialisable dict with at least a one-line ``"summary"``
        string; when the loaded model cannot take the flags' values it raises ``ValueError``
        starting with the flag's name, which ``eval`` reports as an ``error:`` line (exit
        status 2). ``presets`` maps a ``--compare`` configuration name to the flags it stands for
        (e.g. ``{"unpatched": ["--no-patch"]}``). ``finish(model, args)``, when given, runs once
        the model has answered every sample and returns entries (e.g. the feature's counters,
        a fuller ``"summary"``) that update the dict ``apply`` returned. With
        ``needs_processor`` ``apply`` is called as ``apply(model, args, processor)`` with the
        model's processor (e.g. to encode calibration data). Raises ``ValueError`` for a
        malformed name or a name or preset already registered.
        """
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError(f"name: expected lowercase words joined by '-', got {name!r}")
        if name in self._options:
            raise ValueError(f"name: option {name!r} is already registered")
        presets = {key: tuple(flags) for key, flags in (presets or {}).items()}
        taken = set(presets) & set(self.presets())
        if taken:
            raise ValueError(f"presets: {sorted(taken)} already registered by another option")
        option = EvalOption(name, add_arguments, apply, presets, finish, needs_processor)
        self._options[name] = option
        return option

    def options(self) -> tuple[EvalOption, ...]:
        """The registered options in registration order."""
        return tuple(self._options.values())

    def presets(self) -> dict[str, tuple[str, ...]]:
        """Every option's presets: configuration name -> flags."""
        return {
            key: flags for option in self._options.values() for key, flags in option.presets.items()
        }

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Add each option's flags to ``parser``, one argument group per option."""
        for option in self._options.values():
            option.add_arguments(parser.add_argument_group(f"{option.name} option"))

    def apply(
        self, model: Any, args: argparse.Namespace, processor: Any = None
    ) -> dict[str, dict[str, Any]]:
        """Apply every option to ``model`` in registration order (``processor`` reaches the
        options that need it); returns name -> its dict.

        Raises ``TypeError`` naming the option when its ``apply`` returns no dict with a string
        ``"summary"``.
        """
        applied = {}
        for option in self._options.values():
            extra = (processor,) if option.needs_processor else ()
            result = option.apply(model, args, *extra)
            if not isinstance(result, dict) or not isinstance(result.get("summary"), str):
                raise TypeError(
                    f"option {option.name!r}: apply must return a dict with a 'summary' string, "
                    f"got {result!r}"
                )
            applied[option.name] = result
        return applied

    def finish(
        self, model: Any, args: argparse.Namespace, applied: dict[str, dict[str, Any]]
    ) -> dict[str, dict[str, Any]]:
        """``applied`` (from :meth:`apply`) updated by every option's ``finish``, after the run."""
        finished = {}
        for name, result in applied.items():
            finish = self._options[name].finish
            extra = finish(model, args) if finish else {}
            if not isinstance(extra, dict):
                raise TypeError(f"option {name!r}: finish must return a dict, got {extra!r}")
            finished[name] = {**result, **extra}
        return finished


REGISTRY = OptionRegistry()
