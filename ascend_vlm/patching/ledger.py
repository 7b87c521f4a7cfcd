"""The edit ledger: every change a feature makes to a model instance, recorded so it can be undone.

A *feature* is any object with a ``name`` (one of :data:`FEATURE_ORDER`) and an
``install(edits)`` method that makes every change to the model through the :class:`Edits` it
is handed: set an instance attribute (a rebound ``forward``, a private config copy, a method
override), swap a submodule, add a hook, or run a clean-up on removal. `apply_feature` and
`remove_feature` are the only ways features enter and leave a model; `applied_features` lists
them (for reports, refusals and a server's model listing).

Features stack in :data:`FEATURE_ORDER`, innermost first, whatever order the user applied them
in: applying or removing one undoes the features stacked above it (newest first), installs or
undoes it, and installs those above again. A model carrying a given set of features is
therefore edited exactly as if that set had been applied in the canonical order, so removing one
leaves the others as if it had never been there (a tap installed on a patched model taps the
stock attention once ``unpatch`` runs), and removing all of them leaves the instance as it was
before the first. ``install`` may therefore run several times on the same model: it must be
cheap and give the same edits each time (build expensive things once and keep them on the
feature object).

The ledger lives in the base model's ``__dict__`` (under a PEFT wrapper, the transformers model)
and pickles and deep-copies with it; it is gone once the last feature is removed.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from torch import nn
from torch.utils.hooks import RemovableHandle

from ascend_vlm._base_model import base_model
from ascend_vlm._compat.module_internals import forward_attribute
from ascend_vlm._errors import PatchError

# Innermost first: weights, then the kernels that run them (the vision cache keys its entries
# by these two), what answers encodings from a cache, what reshapes the prompt, and the
# observers, so an observer sees what the model really computes. Mixed-adapter rows come and
# go with every mixed-row call and hook only PEFT's LoRA layers, which nothing else hooks, so
# they go last, where applying them unwinds nothing.
FEATURE_ORDER = (
    "quantization",
    "patch",
    "vision_cache",
    "token_pruning",
    "attention_tap",
    "tracer",
    "verify_capture",
    "adapter_rows",
)
_LEDGER_KEY = "_ascend_vlm_ledger"


class _Missing(enum.Enum):
    """Marks an instance attribute that did not exist before an edit; an enum member stays the
    same object through pickling, so an unpickled ledger still recognises it."""

    MISSING = "missing"


MISSING = _Missing.MISSING


@runtime_checkable
class Feature(Protocol):
    """What the ledger needs of a feature: its name and how to install it."""

    name: str

    def install(self, edits: Edits) -> None: ...


class Edits:
    """The recorder a feature's ``install`` makes its changes through; `undo` reverts them all,
    newest first."""

    def __init__(self) -> None:
        self._undo: list[tuple[str, Any]] = []
        self.reversible = True

    def set_attribute(self, target: object, name: str, value: object) -> None:
        """Set instance attribute ``name`` of ``target`` (a module or a config) to ``value``.
        ``"forward"`` goes where the module's calls find it (`forward_attribute`): on a module
        carrying an accelerate hook, the forward the hook wraps, so the hook stays around it."""
        if name == "forward":
            name = forward_attribute(target)
        attributes = vars(target)
        self._undo.append(("attribute", (target, name, attributes.get(name, MISSING))))
        attributes[name] = value

    def swap_submodule(
        self, parent: nn.Module, name: str, module: nn.Module, *, keep_previous: bool = True
    ) -> None:
        """Put ``module`` at ``parent.<name>``. With ``keep_previous=False`` the module it
        replaces is not kept (its memory is freed), and the feature can no longer be removed."""
        previous = parent._modules[name]
        if not keep_previous:
            self.reversible = False
            previous = MISSING
        self._undo.append(("submodule", (parent, name, previous)))
        parent._modules[name] = module

    def add_hook(self, handle: RemovableHandle) -> None:
        """Record a hook handle (``module.register_forward_hook(...)`` and kin): removed on
        undo."""
        self._undo.append(("hook", handle))

    def on_undo(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` when the edits are undone (in order with the other edits): for
        state kept outside the model, such as an event listener."""
        self._undo.append(("callback", callback))

    def undo(self) -> None:
        """Revert every recorded edit, newest first. A submodule swapped without keeping the
        module it replaced stays; PatchError naming it once everything else is reverted."""
        lost = []
        while self._undo:
            kind, record = self._undo.pop()
            if kind == "submodule" and record[2] is MISSING:
                lost.append(record[1])
            elif kind == "attribute":
                target, name, previous = record
                if previous is MISSING:
                    vars(target).pop(name, None)
                else:
                    vars(target)[name] = previous
            elif kind == "submodule":
                parent, name, previous = record
                parent._modules[name] = previous
            elif kind == "hook":
                record.remove()
            else:
                record()
        if lost:
            raise PatchError(
                f"edits: {', '.join(lost)} replaced a submodule that was not kept, so it stays"
            )


class _Ledger:
    """The features applied to one model, in :data:`FEATURE_ORDER`, each with its edits.

    One lock serialises applying and removing features on the model. It does not guard the
    model's forward: a model's features must not change while another thread runs it."""

    def __init__(self) -> None:
        self.entries: list[tuple[Feature, Edits]] = []
        self.lock = threading.RLock()

    def __getstate__(self) -> dict:
        return {"entries": self.entries}

    def __setstate__(self, state: dict) -> None:
        self.entries = state["entries"]
        self.lock = threading.RLock()

    def _unwind(self, start: int) -> list[Feature]:
        """Undo the entries from ``start`` on, newest first; returns their features in order."""
        features = [feature for feature, _ in self.entries[start:]]
        while len(self.entries) > start:
            _, edits = self.entries.pop()
            edits.undo()
        return features

    def _install(self, features: list[Feature]) -> None:
        for feature in features:
            edits = Edits()
            try:
                feature.install(edits)
            except BaseException as error:
                try:
                    edits.undo()
                except PatchError as lost:
                    raise lost from error
                raise
            self.entries.append((feature, edits))

    def _restack(self, start: int, features: list[Feature], previous: list[Feature]) -> None:
        """Install ``features`` from ``start`` on; if one fails, give the model back the
        ``previous`` features (those it carried from ``start`` on before) and re-raise."""
        try:
            self._install(features)
        except BaseException as error:
            try:
                self._unwind(start)
                self._install(previous)
            except BaseException as stuck:
                raise PatchError(
                    f"{features[0].name}: installing {', '.join(f.name for f in features)} "
                    f"failed ({error!r}), and so did restoring "
                    f"{', '.join(f.name for f in previous) or 'nothing'} ({stuck!r}); the model "
                    f"carries {', '.join(f.name for f, _ in self.entries) or 'no feature'}"
                ) from error
            raise

    def _refuse_irreversible(self, start: int, action: str) -> None:
        for feature, edits in self.entries[start:]:
            if not edits.reversible:
                raise PatchError(
                    f"{action}: {feature.name} cannot be undone (it did not keep what it "
                    f"replaced); reload the model to change what is applied beneath it"
                )

    def add(self, feature: Feature) -> None:
        rank = _rank(feature.name)
        start = next(
            (i for i, (f, _) in enumerate(self.entries) if _rank(f.name) > rank), len(self.entries)
        )
        self._refuse_irreversible(start, f"applying {feature.name}")
        above = self._unwind(start)
        self._restack(start, [feature, *above], above)

    def remove(self, feature: Feature) -> None:
        start = next(i for i, (f, _) in enumerate(self.entries) if f is feature)
        self._refuse_irreversible(start, f"removing {feature.name}")
        stack = self._unwind(start)
        self._restack(start, stack[1:], stack)


def _rank(name: str) -> int:
    if name not in FEATURE_ORDER:
        raise ValueError(f"feature name: expected one of {FEATURE_ORDER}, got {name!r}")
    return FEATURE_ORDER.index(name)


def _ledger(model: nn.Module, create: bool) -> _Ledger | None:
    base = base_model(model)
    ledger = vars(base).get(_LEDGER_KEY)
    if ledger is None and create:
        ledger = vars(base)[_LEDGER_KEY] = _Ledger()
    return ledger


def apply_feature(model: nn.Module, feature: Feature) -> None:
    """Install ``feature`` on ``model`` (a transformers model, optionally PEFT-wrapped or
    compiled) in its place in :data:`FEATURE_ORDER`. ValueError for an unknown feature name or
    a feature object already applied; PatchError when a feature above it cannot be undone and
    re-installed. If ``install`` raises, or installing a feature above it again does, the
    model is given back the features it had and the error is raised."""
    if not isinstance(feature, Feature):
        raise TypeError(f"feature: expected an object with name and install(), got {feature!r}")
    _rank(feature.name)
    ledger = _ledger(model, create=True)
    with ledger.lock:
        if any(f is feature for f, _ in ledger.entries):
            raise ValueError(f"feature: this {feature.name} is already applied to the model")
        try:
            ledger.add(feature)
        finally:
            _drop_if_empty(model, ledger)


def remove_feature(model: nn.Module, feature: Feature | str) -> list[Feature]:
    """Undo ``feature`` (the object, or every applied feature of that name) on ``model``;
    returns what was removed (empty when nothing matched). PatchError when it, or a feature
    above it, did not keep what it replaced."""
    ledger = _ledger(model, create=False)
    if ledger is None:
        return []
    matches = [
        f
        for f, _ in ledger.entries
        if f is feature or (isinstance(feature, str) and f.name == feature)
    ]
    for match in reversed(matches):
        ledger.remove(match)
    _drop_if_empty(model, ledger)
    return matches


def applied_features(model: nn.Module, name: str | None = None) -> list[Feature]:
    """The features applied to ``model`` in the order they are stacked (innermost first);
    with ``name`` (one of :data:`FEATURE_ORDER`, else ValueError), only those of that name."""
    if name is not None:
        _rank(name)  # a misspelt name would otherwise find nothing, silently
    ledger = _ledger(model, create=False)
    features = [] if ledger is None else [f for f, _ in ledger.entries]
    return [f for f in features if name is None or f.name == name]


def _drop_if_empty(model: nn.Module, ledger: _Ledger) -> None:
    if not ledger.entries:
        vars(base_model(model)).pop(_LEDGER_KEY, None)
