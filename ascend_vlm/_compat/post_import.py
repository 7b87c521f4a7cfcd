"""Running a function once another library's module is imported, without importing it.

``import ascend_vlm`` registers its attention implementation with transformers this way:
importing transformers' modeling code costs seconds, which a user who never builds a model
should not pay. Python's import system has no post-import hook of its own (PEP 369 was
withdrawn); a finder on ``sys.meta_path`` that wraps the module's loader is the standard way
(``wrapt.when_imported`` works the same).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Callable

ModuleCallback = Callable[[types.ModuleType], None]


class _CallbackLoader(importlib.abc.Loader):
    """The module's own loader, then `callback(module)` once the module has executed; every
    other attribute (``get_source``, ``get_filename``, ...) is the own loader's."""

    def __init__(self, loader: importlib.abc.Loader, callback: ModuleCallback) -> None:
        self._loader = loader
        self._callback = callback

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__loader__ = self._loader
        self._loader.exec_module(module)
        self._callback(module)

    def __getattr__(self, name: str) -> object:
        return getattr(self._loader, name)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for module ``name`` it asks the other finders and hands back their
    spec with the loader wrapped (`_CallbackLoader`), then leaves ``sys.meta_path``."""

    def __init__(self, name: str, callback: ModuleCallback) -> None:
        self._name = name
        self._callback = callback
        self._searching = False

    def find_spec(
        self, fullname: str, path: object = None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self._name or self._searching:
            return None
        self._searching = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._searching = False
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _CallbackLoader(spec.loader, self._callback)
        return spec


def call_when_imported(name: str, callback: ModuleCallback) -> None:
    """Call `callback(module)` once module `name` (a dotted name such as
    "transformers.modeling_utils") has been imported: now when it already is, else right after
    its first import executes it, in the importing thread. Importing `name` is never triggered
    here; an exception of `callback` propagates to whoever imports `name`."""
    module = sys.modules.get(name)
    if module is not None:
        callback(module)
        return
    sys.meta_path.insert(0, _PostImportFinder(name, callback))
