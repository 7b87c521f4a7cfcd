"""Modules, configs and call arguments as plain data that ``torch.load(weights_only=True)``
reads back: tensors, str, int, float, bool, None, and lists and dicts of them. No code is
pickled; a class or function is stored by its import path and rebuilt only within the limits
of :mod:`ascend_vlm.verification.repro_names`.

Encoding (:meth:`Encoder.encode`): every container becomes a dict tagged by ``"t"``:

* ``list`` / ``tuple`` / ``set`` / ``dict`` (its items as ``[key, value]`` pairs);
* ``dtype`` / ``device``: their names;
* ``config``: a transformers config (or generation config) by class path, its ``to_dict()``
  and the attention and experts implementations it names, which ``to_dict`` leaves out;
* ``module``: an ``nn.Module`` by class path, its instance attributes, parameters, buffers
  (persistent or not), children and its training flag. Instance attributes that shadow a
  method of the class (``forward`` and ``extra_repr`` rebound by ``ascend_vlm.patch``) are
  kept apart under ``"rebound"``: :meth:`Decoder.decode` restores them unless asked for the stock
  module. A module is rebuilt with ``cls.__new__`` and ``nn.Module.__init__``; its own
  ``__init__`` never runs, so no constructor arguments are needed;
* ``partial``, ``rebound`` (a patched forward rebuilt from its recipe, see
  ``patching.rebound_globals.ReboundForward``), ``method`` (bound), ``callable`` (by path),
  ``dataclass`` (by class path and fields);
* ``ref``: an object already encoded (shared configs, a forward's own module).

An attribute :meth:`Encoder.encode` cannot express (e.g. an instance of a class defined inside a
function) is left out of its module and named in the ``omitted`` list the caller gets back.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import types
from typing import Any

import torch
from torch import nn

from ascend_vlm._compat.module_state import (
    CONFIG_IMPLEMENTATIONS,
    MODULE_MACHINERY,
    OwnState,
    config_implementations,
    own_state,
    restore_own_state,
    set_config_implementations,
)
from ascend_vlm.verification.repro_names import (
    IMPORT_ROOTS,
    bound_method,
    resolve,
    resolve_callable,
    resolve_class,
    resolve_module_class_of,
    resolve_patched_forward,
)

# What the stock (reference) rebuild's configs name instead of the implementations saved: sdpa
# attention takes both the boolean and the additive masks a model makes, eager experts float64.
STOCK_IMPLEMENTATIONS = dict(zip(CONFIG_IMPLEMENTATIONS, ("sdpa", "eager"), strict=True))
# Instance attributes a patched module gets that only describe it (its repr).
_DESCRIPTIVE = frozenset({"extra_repr"})


class Unencodable(TypeError):
    """A value :func:`encode` has no plain-data form for."""


def import_path(value: object) -> str:
    """``"package.module:qualname"`` of a class or function, which :func:`resolve` turns back
    into ``value``; raises :class:`Unencodable` when that round trip does not hold."""
    module, qualname = getattr(value, "__module__", None), getattr(value, "__qualname__", "")
    if not module or "<locals>" in qualname or module.split(".")[0] not in IMPORT_ROOTS:
        raise Unencodable(f"{value!r} has no import path under {IMPORT_ROOTS}")
    path = f"{module}:{qualname}"
    try:
        found = resolve(path)
    except (ImportError, AttributeError, ValueError) as error:
        raise Unencodable(f"{path} does not import: {error}") from error
    if found is not value:
        raise Unencodable(f"{path} imports another object than {value!r}")
    return path


def _is_config(value: object) -> bool:
    from transformers import GenerationConfig, PreTrainedConfig

    return isinstance(value, PreTrainedConfig | GenerationConfig)


class Encoder:
    """One encoding pass: objects seen twice (a shared config, a forward's module) are stored
    once and referred to; ``omitted`` collects the attributes left out, by dotted name."""

    def __init__(self) -> None:
        self._seen: dict[int, int] = {}
        self._keep_alive: list[object] = []
        self.omitted: list[str] = []

    def encode(self, value: Any, where: str) -> Any:
        """The plain-data form of ``value`` (``where`` names it in errors); raises
        :class:`Unencodable`."""
        if value is None or type(value) in (bool, int, float, str):
            return value
        if isinstance(value, torch.Tensor):
            return _copy(value)
        if isinstance(value, torch.dtype):
            return {"t": "dtype", "name": str(value).removeprefix("torch.")}
        if isinstance(value, torch.device):
            return {"t": "device", "name": str(value)}
        if type(value) in (list, tuple, set, frozenset, torch.Size):
            kind = {list: "list", set: "set", frozenset: "set"}.get(type(value), "tuple")
            items = sorted(value, key=repr) if kind == "set" else value
            return {
                "t": kind,
                "items": [self.encode(v, f"{where}[{i}]") for i, v in enumerate(items)],
            }
        if isinstance(value, dict):
            return {
                "t": "dict",
                "items": [
                    [self.encode(k, where), self.encode(v, f"{where}.{k}")]
                    for k, v in value.items()
                ],
            }
        if id(value) in self._seen:
            return {"t": "ref", "id": self._seen[id(value)]}
        if isinstance(value, nn.Module | functools.partial) or _is_config(value):
            self._seen[id(value)] = len(self._seen)
            self._keep_alive.append(value)  # ids stay unique while the pass runs
            try:
                return {"id": self._seen[id(value)], **self._encode_object(value, where)}
            except Unencodable:
                del self._seen[id(value)]  # nothing may refer to what is left out
                raise
        return self._encode_named(value, where)

    def _encode_object(self, value: Any, where: str) -> dict[str, Any]:
        if isinstance(value, nn.Module):
            return self._encode_module(value, where)
        if hasattr(value, "recipe") and isinstance(value, functools.partial):
            factory, *arguments = value.recipe
            return {
                "t": "rebound",
                "factory": import_path(factory),
                "self": self.encode(value.args[0], where),
                "arguments": self.encode(tuple(arguments), where),
            }
        if isinstance(value, functools.partial):
            return {
                "t": "partial",
                "func": self.encode(value.func, where),
                "args": self.encode(value.args, where),
                "keywords": self.encode(dict(value.keywords), where),
            }
        return {
            "t": "config",
            "class": import_path(type(value)),
            "values": self.encode(value.to_dict(), where),
            "implementations": config_implementations(value),
        }

    def _encode_named(self, value: Any, where: str) -> dict[str, Any]:
        if isinstance(value, types.MethodType):
            return {
                "t": "method",
                "self": self.encode(value.__self__, where),
                "name": value.__name__,
            }
        if isinstance(value, type | types.FunctionType | types.BuiltinFunctionType):
            path = import_path(value)
            try:
                resolve_callable(path)
            except ValueError as error:  # what a repro may not hold is left out, not refused later
                raise Unencodable(str(error)) from error
            return {"t": "callable", "path": path}
        if dataclasses.is_dataclass(value):
            fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value) if f.init}
            return {
                "t": "dataclass",
                "class": import_path(type(value)),
                "fields": self.encode(fields, where),
            }
        raise Unencodable(f"{where}: no plain-data form for {type(value).__qualname__}")

    def _encode_module(self, module: nn.Module, where: str) -> dict[str, Any]:
        cls = type(module)
        attributes: dict[str, Any] = {}
        rebound: dict[str, Any] = {}
        for name, value in vars(module).items():
            if name in MODULE_MACHINERY or name in _DESCRIPTIVE:
                continue
            shadows_method = callable(getattr(cls, name, None)) and callable(value)
            try:
                (rebound if shadows_method else attributes)[name] = self.encode(
                    value, f"{where}.{name}".lstrip(".")
                )
            except Unencodable:
                self.omitted.append(f"{where}.{name}".lstrip("."))
        state = own_state(module)
        return {
            "t": "module",
            **_class_reference(cls),
            "training": module.training,
            "attributes": attributes,
            "rebound": rebound,
            "parameters": {name: _copy(p) for name, p in state.parameters.items()},
            "buffers": {name: _copy(b) for name, b in state.buffers.items()},
            "non_persistent": sorted(state.non_persistent),
            "children": {
                name: None if child is None else self.encode(child, f"{where}.{name}".lstrip("."))
                for name, child in state.children.items()
            },
        }


def _copy(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """A CPU copy of ``tensor``, detached (None stays None)."""
    return None if tensor is None else tensor.detach().to("cpu", copy=True)


def _class_reference(cls: type) -> dict[str, str]:
    """``{"class": path}`` of an importable module class, else ``{"class_of": path}`` of an
    object of its module whose type it is (the per-function ``nn.Module`` classes the
    ``kernels`` package makes, one instance of which each decorated function is)."""
    try:
        return {"class": import_path(cls)}
    except Unencodable:
        module = sys.modules.get(cls.__module__)
        if module is not None and cls.__module__.split(".")[0] in IMPORT_ROOTS:
            for name, value in vars(module).items():
                if type(value) is cls:
                    return {"class_of": f"{cls.__module__}:{name}"}
        raise


class Decoder:
    """One decoding pass of :class:`Encoder`'s output. ``stock``: rebuild modules without what
    ``ascend_vlm.patch`` rebound and with every config naming the implementations of
    :data:`STOCK_IMPLEMENTATIONS`."""

    def __init__(self, *, stock: bool = False) -> None:
        self._objects: dict[int, Any] = {}
        self._stock = stock

    def decode(self, data: Any) -> Any:
        """The object :meth:`Encoder.encode` encoded as ``data``; ValueError for a form it does
        not make."""
        if data is None or isinstance(data, bool | int | float | str | torch.Tensor):
            return data
        if not isinstance(data, dict) or "t" not in data:
            raise ValueError(f"expected an encoded value, got {type(data).__name__}")
        tag = data["t"]
        if tag == "ref":
            return self._objects[data["id"]]
        if tag in ("list", "tuple", "set"):
            items = [self.decode(v) for v in data["items"]]
            return {"list": list, "tuple": tuple, "set": set}[tag](items)
        if tag == "dict":
            return {self.decode(k): self.decode(v) for k, v in data["items"]}
        if tag == "dtype":
            dtype = getattr(torch, data["name"], None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"dtype: expected a torch dtype name, got {data['name']!r}")
            return dtype
        if tag == "device":
            return torch.device(data["name"])
        if tag == "callable":
            return resolve_callable(data["path"])
        if tag == "method":
            return bound_method(self.decode(data["self"]), data["name"])
        if tag == "dataclass":
            return resolve_class(data["class"], None)(**self.decode(data["fields"]))
        if tag in _OBJECT_DECODERS:
            return _OBJECT_DECODERS[tag](self, data)
        raise ValueError(f"unknown encoded form {tag!r}")

    def _config(self, data: dict[str, Any]) -> Any:
        from transformers import GenerationConfig, PreTrainedConfig

        cls = resolve_class(data["class"], (PreTrainedConfig, GenerationConfig))
        config = cls.from_dict(self.decode(data["values"]))
        if isinstance(config, PreTrainedConfig):
            saved = data["implementations"]
            stock = {name: STOCK_IMPLEMENTATIONS[name] for name in saved}
            set_config_implementations(config, stock if self._stock else saved)
        self._objects[data["id"]] = config
        return config

    def _module(self, data: dict[str, Any]) -> nn.Module:
        if "class_of" in data:
            cls = resolve_module_class_of(data["class_of"])
        else:
            cls = resolve_class(data["class"], (nn.Module,))
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        self._objects[data["id"]] = module
        module.training = data["training"]
        for name, value in data["attributes"].items():
            object.__setattr__(module, name, self.decode(value))
        parameters = {
            name: None if tensor is None else nn.Parameter(tensor, requires_grad=False)
            for name, tensor in data["parameters"].items()
        }
        children = {
            name: None if child is None else self.decode(child)
            for name, child in data["children"].items()
        }
        restore_own_state(
            module, OwnState(parameters, data["buffers"], set(data["non_persistent"]), children)
        )
        if not self._stock:
            for name, value in data["rebound"].items():
                object.__setattr__(module, name, self.decode(value))
        return module

    def _partial(self, data: dict[str, Any]) -> functools.partial:
        function = functools.partial(
            self.decode(data["func"]), *self.decode(data["args"]), **self.decode(data["keywords"])
        )
        self._objects[data["id"]] = function
        return function

    def _rebound(self, data: dict[str, Any]) -> Any:
        factory = resolve_patched_forward(data["factory"])
        forward = factory(self.decode(data["self"]), *self.decode(data["arguments"]))
        self._objects[data["id"]] = forward
        return forward


_OBJECT_DECODERS = {
    "config": Decoder._config,
    "module": Decoder._module,
    "partial": Decoder._partial,
    "rebound": Decoder._rebound,
}
