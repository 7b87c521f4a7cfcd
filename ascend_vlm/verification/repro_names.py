"""What a repro file may name: the classes and functions
:mod:`ascend_vlm.verification.repro_codec` rebuilds from their import paths. A repro comes
from someone else, so a path is trusted only as far as these limits go; anything else is
refused with a ValueError naming the path, before it is called or built.

* :func:`resolve`: the object at ``"package.module:qualname"``, imported only from a module
  under the given roots, never looked up through a module outside :data:`IMPORT_ROOTS`, and
  defined under those roots itself (its own ``__module__``, or for an instance its class's);
* classes (:func:`resolve_class`): ``nn.Module`` subclasses, transformers config (and
  generation config) subclasses and the dataclasses of ``ascend_vlm.models`` (a family spec's
  entries, which patched forwards are bound to), defined under :data:`CLASS_ROOTS`;
* the function a repro targets (:func:`resolve_target_function`): a public function of
  ``ascend_vlm.ops``, a RoPE drop-in of ``ascend_vlm.patching.adapters`` (what `patch` resolves
  an attention's rotary function to), or a rotary function of a transformers modeling module
  (``apply_rotary_pos_emb`` and its kin in ``transformers.models.*.modeling_*``);
* other functions (:func:`resolve_callable`): those, the forwards ``ascend_vlm.patching``
  installs (``*_forward``) and the tensor functions of ``torch.nn.functional`` and torch's
  builtins (an activation a module holds, such as ``torch._C._nn.gelu``).
"""

from __future__ import annotations

import dataclasses
import importlib
import re
import types
from typing import Any

from torch import nn

# Packages a repro may import from; anything else is refused on load.
IMPORT_ROOTS = ("ascend_vlm", "torch", "transformers")
# Where the classes a repro rebuilds are defined.
CLASS_ROOTS = ("ascend_vlm", "torch.nn", "transformers")
_DATACLASS_ROOTS = ("ascend_vlm.models",)
_PATCHED_FORWARDS = re.compile(r"ascend_vlm\.patching(\.\w+)*:[a-z]\w*_forward")
_TRANSFORMERS_ROTARY = re.compile(r"transformers\.models\.\w+\.modeling_\w+:\w*rotary\w*")
# Builtin tensor functions (their __module__) a module may hold as an attribute.
_TORCH_BUILTIN_MODULES = ("torch", "torch._C._nn", "torch._C._VariableFunctions")


def _under(module_name: str, roots: tuple[str, ...]) -> bool:
    return any(module_name == root or module_name.startswith(root + ".") for root in roots)


def _defined_in(value: object) -> str:
    """The module ``value`` is defined in: its own for a class or function, else its class's."""
    if isinstance(value, type | types.FunctionType | types.BuiltinFunctionType):
        return getattr(value, "__module__", None) or ""
    return type(value).__module__


def resolve(path: str, roots: tuple[str, ...] = IMPORT_ROOTS) -> Any:
    """The object at ``"package.module:qualname"``, imported from a module under ``roots`` and
    defined under them (see the module docstring); ValueError naming ``path`` otherwise."""
    module_name, _, qualname = path.partition(":")
    if not _under(module_name, roots) or not qualname:
        raise ValueError(f"import path: expected 'module:name' under {roots}, got {path!r}")
    value: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        value = getattr(value, part)
        if isinstance(value, types.ModuleType) and not _under(value.__name__, IMPORT_ROOTS):
            raise ValueError(
                f"import path {path!r}: {part} is the module {value.__name__}, outside "
                f"{IMPORT_ROOTS}"
            )
    if isinstance(value, types.ModuleType) or not _under(_defined_in(value), roots):
        raise ValueError(
            f"import path {path!r}: expected an object defined under {roots}, got one of "
            f"{_defined_in(value)!r}"
        )
    return value


def resolve_class(path: str, bases: tuple[type, ...] | None) -> type:
    """The class at ``path`` under :data:`CLASS_ROOTS`, a subclass of one of ``bases`` (None: a
    dataclass of ``ascend_vlm.models``); ValueError naming ``path`` otherwise."""
    cls = resolve(path, CLASS_ROOTS if bases is not None else _DATACLASS_ROOTS)
    if not isinstance(cls, type):
        raise ValueError(f"class {path!r}: expected a class, got {type(cls).__name__}")
    expected = dataclasses.is_dataclass(cls) if bases is None else issubclass(cls, bases)
    if not expected:
        wanted = "a dataclass" if bases is None else " or ".join(b.__name__ for b in bases)
        raise ValueError(f"class {path!r}: expected {wanted}")
    return cls


def resolve_module_class_of(path: str) -> type:
    """The class of the ``nn.Module`` instance at ``path`` (a module-level object under
    :data:`CLASS_ROOTS`, such as a function the ``kernels`` package made a module of);
    ValueError naming ``path`` otherwise."""
    found = resolve(path, CLASS_ROOTS)
    if not isinstance(found, nn.Module) or "." in path.partition(":")[2]:
        raise ValueError(f"class_of {path!r}: expected a module-level nn.Module")
    return type(found)


def _is_target_function(path: str, function: object) -> bool:
    from ascend_vlm import ops
    from ascend_vlm.patching.adapters import rope_drop_ins

    name = getattr(function, "__name__", "")
    return (
        (name in ops.__all__ and getattr(ops, name) is function)
        or function in rope_drop_ins()
        or bool(_TRANSFORMERS_ROTARY.fullmatch(path))
    )


def resolve_target_function(path: str) -> Any:
    """The function a repro targets at ``path`` (module docstring: the ops, the RoPE drop-ins,
    transformers' rotary functions); ValueError naming ``path`` for any other."""
    module_name = path.partition(":")[0]
    if not _TRANSFORMERS_ROTARY.fullmatch(path) and not _under(module_name, ("ascend_vlm",)):
        raise ValueError(f"function {path!r}: not a function a repro may target")
    function = resolve(path)
    if not _is_target_function(path, function):
        raise ValueError(f"function {path!r}: not a function a repro may target")
    return function


def check_function_target(encoded: Any) -> None:
    """ValueError unless a repro's function target (a function, a partial of one, or a
    function the ``kernels`` package made a module of) names one a repro may target
    (:func:`resolve_target_function`), checked before anything is rebuilt or called."""
    inner = (
        encoded.get("func")
        if isinstance(encoded, dict) and encoded.get("t") == "partial"
        else encoded
    )
    path = None
    if isinstance(inner, dict):
        path = inner.get("path") if inner.get("t") == "callable" else inner.get("class_of")
    if not isinstance(path, str):
        raise ValueError("function target: expected a function, or a partial of one, by path")
    resolve_target_function(path)


def resolve_callable(path: str) -> Any:
    """A function or class a rebuilt object holds (module docstring); ValueError naming ``path``
    for any other."""
    found = resolve(path)
    if isinstance(found, type):
        return resolve_class(path, (nn.Module,))
    if isinstance(found, types.BuiltinFunctionType):
        allowed = found.__module__ in _TORCH_BUILTIN_MODULES and not found.__name__.startswith("_")
    else:
        allowed = (
            found.__module__ == "torch.nn.functional"
            or bool(_PATCHED_FORWARDS.fullmatch(path))
            or _is_target_function(path, found)
        )
    if not allowed:
        raise ValueError(f"callable {path!r}: not a function a repro may hold")
    return found


def resolve_patched_forward(path: str) -> Any:
    """A forward (or forward factory) of ``ascend_vlm.patching`` at ``path``; ValueError naming
    ``path`` for any other."""
    if not _PATCHED_FORWARDS.fullmatch(path):
        raise ValueError(f"forward {path!r}: expected a *_forward of ascend_vlm.patching")
    return resolve(path)


def bound_method(owner: object, name: str) -> types.MethodType:
    """``owner``'s method ``name`` (not a dunder), one its class defines under
    :data:`CLASS_ROOTS`; ValueError naming it otherwise."""
    method = None if name.startswith("__") else getattr(owner, name, None)
    if (
        not isinstance(method, types.MethodType)
        or method.__self__ is not owner
        or not _under(_defined_in(method.__func__), CLASS_ROOTS)
    ):
        raise ValueError(f"method {type(owner).__name__}.{name}: not a method a repro may bind")
    return method
