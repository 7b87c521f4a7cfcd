"""Replay: one flagged module (or one fused op) saved with its inputs as a small
self-contained repro file, and re-run on the device against a float64 CPU reference.

A repro is a ``.pt`` file that ``torch.load(path, weights_only=True)`` reads: a dict of
tensors and plain data (``FORMAT``, ``VERSION``, ``about``: a sentence saying what it holds
and how to run it, the ``command`` that replays it, the module's name and kind, the dtype
and device it ran in, the target and the call's arguments), with the module written by
:mod:`ascend_vlm.verification.repro_codec` (class paths, attributes, weights; never pickled
code). It is what a user sends to a kernel team: ``python -m ascend_vlm verify --replay
FILE.pt``. A repro may come from anyone: the classes and functions it names are rebuilt only
within :mod:`ascend_vlm.verification.repro_names`'s limits, anything else is refused with a
ValueError naming the file and the path, before it is built or called.

Targets:

* a module (``save_repro(module, ...)``): rebuilt twice from the file, once as it ran
  (patched forwards included), moved to the device, and once stock (what ``ascend_vlm.patch``
  rebound left out, attention through transformers' ``"sdpa"``), in float64 on the CPU;
* a function (an importable one, or a ``functools.partial`` of one, such as the RoPE drop-in
  ``patch`` resolves an attention's rotary function to): the function on the device, and the
  same function in float64 on the CPU with the ops' reference kernels;
* a fused op (``save_repro("rms_norm", ...)``, any name of ``ascend_vlm.ops.OPS``): the op on
  the device, and the op's own reference in float64 on the CPU.

:func:`replay` compares the device output with the reference (relative L2, max abs, cosine
over every floating output both give) and, for a module, each ``ascend_vlm::`` op its forward
calls with that op's float64 reference on the same (upcast) inputs, so a kernel's error is
told apart from the rounding of what feeds it. A cache handed to the module with a prefill
call is dropped (the call computes the same without it); a call continuing a cached sequence
is refused, since replay runs one call on its own.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ascend_vlm._version import __version__
from ascend_vlm.kernel_backend import active_backend, using_backend
from ascend_vlm.verification.repro_codec import Decoder, Encoder, Unencodable
from ascend_vlm.verification.repro_names import check_function_target

FORMAT = "ascend_vlm.repro"
VERSION = 1
_REQUIRED = ("module_name", "kind", "dtype", "device", "target", "inputs", "command")


def replay_command(path: str | Path) -> str:
    """The command that replays the repro at ``path``."""
    return f"python -m ascend_vlm verify --replay {Path(path).name}"


@dataclass(frozen=True)
class Errors:
    """How far an output is from its reference: ``||got - ref|| / ||ref||`` (relative L2),
    ``max |got - ref|`` and the cosine of the two, over every floating output both have."""

    rel_l2: float
    max_abs: float
    cosine: float


@dataclass(frozen=True)
class OpError:
    """One ``ascend_vlm::`` op call (``call``: its index among the op calls; ``module``: the
    submodule that made it, "" for the replayed module itself) against that op's float64
    reference on the same inputs."""

    op: str
    call: int
    module: str
    errors: Errors


@dataclass(frozen=True)
class ReplayResult:
    """What :func:`replay` measured: the output of ``target`` ("module <class>", "function
    <name>" or "op ascend_vlm::<name>") on ``device`` in ``dtype`` (under the kernel ``backend``) against the
    float64 CPU reference, and the errors of each op call (for a module, every op its forward
    calls). ``notes`` say what the repro left out (attributes, a cache) and where it ran."""

    path: str
    module_name: str
    kind: str
    target: str
    dtype: str
    device: str
    backend: str
    errors: Errors
    op_errors: tuple[OpError, ...]
    notes: tuple[str, ...]
    command: str

    def to_json(self) -> dict[str, Any]:
        """The result as JSON-ready data."""
        return asdict(self)

    def table(self) -> str:
        """A readable table: the target's output errors, then one row per op call."""
        header = (
            f"replay of {self.module_name} ({self.kind}: {self.target}) in {self.dtype} on "
            f"{self.device} [backend {self.backend}] against the float64 CPU reference"
        )
        rows = [("output", self.errors)]
        rows += [
            (f"  #{e.call} {e.op}" + (f" in {e.module}" if e.module else ""), e.errors)
            for e in self.op_errors
        ]
        width = max(len(name) for name, _ in rows)
        lines = [header, f"{'':<{width}}  {'rel L2':>10}  {'max abs':>10}  {'cosine':>10}"]
        lines += [
            f"{name:<{width}}  {e.rel_l2:>10.3e}  {e.max_abs:>10.3e}  {e.cosine:>10.6f}"
            for name, e in rows
        ]
        lines += [f"note: {note}" for note in self.notes]
        lines.append(f"command: {self.command}")
        return "\n".join(lines)


def save_repro(
    module: nn.Module | Callable | str,
    args: tuple | list,
    kwargs: dict[str, Any],
    path: str | Path,
    *,
    kind: str,
    dtype: torch.dtype | str,
    device: torch.device | str,
    module_name: str,
) -> Path:
    """Write the repro of one call ``module(*args, **kwargs)`` to ``path`` and return it.

    ``module``: the module as it ran (patched or not), a function (importable, or a partial of
    one), or the name of a fused op of ``ascend_vlm.ops.OPS``, whose arguments ``args`` /
    ``kwargs`` are. ``kind``: the op kind the caller flagged (e.g. "norm", "attention");
    ``dtype`` / ``device``: what it ran in and on; ``module_name``: its dotted name in the
    model. Raises ValueError naming the argument
    for a bad one, an input with no plain-data form, or a call continuing a cached sequence
    (a cache passed with a prefill call is dropped: the call computes the same without it).
    """
    if not isinstance(kind, str) or not kind:
        raise ValueError(f"kind: expected a non-empty op kind, got {kind!r}")
    if not isinstance(args, tuple | list) or not isinstance(kwargs, dict):
        raise ValueError(
            f"args, kwargs: expected a tuple and a dict, got {type(args).__name__} and "
            f"{type(kwargs).__name__}"
        )
    _check_prefill(kwargs)
    path = Path(path)
    encoder = Encoder()
    notes: list[str] = []
    inputs = {"args": tuple(_without_cache(a, notes) for a in args)}
    inputs["kwargs"] = {k: _without_cache(v, notes) for k, v in kwargs.items()}
    try:
        encoded_inputs = encoder.encode(inputs, "inputs")
        target = _encode_target(module, encoder)
    except Unencodable as error:
        raise ValueError(f"module, args, kwargs: {error}") from error
    notes += [f"attribute {name} is not saved (no plain-data form)" for name in encoder.omitted]
    what = f"ascend_vlm::{target['op']}" if "op" in target else _label(module)
    repro = {
        "format": FORMAT,
        "version": VERSION,
        "about": (
            f"{what} at {module_name} ({kind}), one call in {_dtype_name(dtype)} on "
            f"{device}, saved by ascend_vlm {__version__}. Run it with "
            f"`{replay_command(path)}` (on a machine without an NPU, ASCEND_VLM_BACKEND=mock "
            f"runs the NPU code path on the CPU); it reports the error against a float64 CPU "
            f"reference and, per ascend_vlm op, against that op's own."
        ),
        "command": replay_command(path),
        "module_name": str(module_name),
        "kind": kind,
        "dtype": _dtype_name(dtype),
        "device": str(device),
        "backend": active_backend(),
        "target": target,
        "inputs": encoded_inputs,
        "notes": notes,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(repro, path)
    return path


def _dtype_name(dtype: torch.dtype | str) -> str:
    """``dtype``'s name ("bfloat16"), from a torch dtype or that name."""
    name = str(dtype).removeprefix("torch.")
    if not isinstance(getattr(torch, name, None), torch.dtype):
        raise ValueError(f"dtype: expected a torch dtype or its name, got {dtype!r}")
    return name


def _label(target: Callable) -> str:
    """A module's class name, or a function's (a partial's function's) qualified name."""
    if isinstance(target, nn.Module):
        return type(target).__name__
    function = target.func if isinstance(target, functools.partial) else target
    return getattr(function, "__qualname__", type(function).__name__)


def _encode_target(module: nn.Module | Callable | str, encoder: Encoder) -> dict[str, Any]:
    """The repro's ``target``: ``{"op": name}``, ``{"module": ...}`` or ``{"function": ...}``."""
    from ascend_vlm.ops import OPS

    if isinstance(module, str):
        name = module.removeprefix("ascend_vlm::")
        if name not in OPS:
            raise ValueError(
                f"module: expected an nn.Module, a function or one of {OPS}, got {module!r}"
            )
        return {"op": name}
    if isinstance(module, nn.Module):
        return {"module": encoder.encode(module, "")}
    if callable(module):
        return {"function": encoder.encode(module, "function")}
    raise ValueError(
        f"module: expected an nn.Module, a function or an op name, got {type(module).__name__}"
    )


def _without_cache(value: Any, notes: list[str]) -> Any:
    """``value``, or None for a transformers cache (noted in ``notes``)."""
    from transformers import Cache

    if not isinstance(value, Cache):
        return value
    notes.append(f"a {type(value).__name__} was dropped: the call is replayed as a prefill")
    return None


def _check_prefill(kwargs: dict[str, Any]) -> None:
    """ValueError when ``kwargs["cache_position"]`` says the call continues a cached sequence,
    which replay, running one call on its own without the cache, cannot reproduce."""
    positions = kwargs.get("cache_position")
    if isinstance(positions, torch.Tensor) and positions.numel() and int(positions.min()) > 0:
        raise ValueError(
            f"kwargs: expected a prefill call (cache_position starting at 0), got one continuing "
            f"a cached sequence at position {int(positions.min())}"
        )


def load_repro(path: str | Path) -> dict[str, Any]:
    """The repro dict saved at ``path``, read with ``weights_only=True``. ValueError naming the
    file when it is not a readable ``.pt`` or not a repro of this format and version."""
    path = Path(path)
    try:
        repro = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as error:  # torch raises many types for a corrupt or foreign file
        raise ValueError(
            f"{path}: expected a repro .pt file, got an unreadable one ({error})"
        ) from error
    if not isinstance(repro, dict) or repro.get("format") != FORMAT:
        found = repro.get("format") if isinstance(repro, dict) else type(repro).__name__
        raise ValueError(
            f"{path}: expected an ascend_vlm repro (format {FORMAT!r}, written by save_repro), "
            f"got {'a dict without that format' if found is None else repr(found)}"
        )
    if repro.get("version") != VERSION:
        raise ValueError(f"{path}: expected repro version {VERSION}, got {repro.get('version')!r}")
    missing = [key for key in _REQUIRED if key not in repro]
    if missing:
        raise ValueError(f"{path}: repro lacks {', '.join(missing)}")
    return repro


def replay(path: str | Path, *, device: torch.device | str | None = None) -> ReplayResult:
    """Re-run the repro at ``path`` on ``device`` in the saved dtype, against the float64 CPU
    reference (module docstring). ``device`` None: the device it was saved from, or the CPU
    for one saved on an NPU when the kernel backend here is not "npu" (the mock runs the NPU
    code path on CPU tensors; noted in the result). ValueError naming the file for a file that
    is not a repro or cannot be rebuilt here."""
    repro = load_repro(path)
    notes = list(repro.get("notes", ()))
    # Device names stay strings until used: torch parses "npu" only once torch_npu is imported.
    saved = repro["device"]
    where = saved if device is None else str(device)
    if device is None and saved.startswith("npu") and active_backend() != "npu":
        where = "cpu"
        notes.append(
            f"saved on {saved}, replayed on the CPU under the {active_backend()!r} backend"
        )
    if where.startswith("npu") and active_backend() != "npu":
        raise ValueError(
            f"{path}: device {where!r} is not usable here (kernel backend "
            f"{active_backend()!r}); pass device='cpu', with ASCEND_VLM_BACKEND=mock to run the "
            f"NPU code path on the CPU"
        )
    try:
        inputs = Decoder().decode(repro["inputs"])
        target, run, reference, watched = _rebuilt(repro["target"], where)
        errors, op_errors = _compare(run, reference, watched, inputs, where)
    except (ValueError, KeyError, AttributeError, ImportError) as error:
        raise ValueError(f"{path}: cannot replay this repro here ({error})") from error
    return ReplayResult(
        path=str(path),
        module_name=repro["module_name"],
        kind=repro["kind"],
        target=target,
        dtype=repro["dtype"],
        device=where,
        backend=active_backend(),
        errors=errors,
        op_errors=tuple(op_errors),
        notes=tuple(notes),
        command=repro["command"],
    )


def _rebuilt(target: dict, device: str) -> tuple[str, Callable, Callable, nn.Module | None]:
    """(what the target is, it as it ran on ``device``, its float64 CPU reference, the module
    whose submodules the op rows name or None) of a repro's ``target``."""
    if "op" in target:
        op = getattr(torch.ops.ascend_vlm, target["op"]).default
        return f"op ascend_vlm::{target['op']}", op, op, None
    if "function" in target:
        check_function_target(target["function"])
        function = Decoder().decode(target["function"])
        return f"function {_label(function)}", function, function, None
    from ascend_vlm.patching.attention import register_attention

    register_attention()  # a patched module's configs name our attention function
    encoded = target["module"]
    module = Decoder().decode(encoded).to(device)
    reference = Decoder(stock=True).decode(encoded).to("cpu", torch.float64)
    return f"module {_label(module)}", module, reference, module


def _compare(
    run: Callable, reference: Callable, watched: nn.Module | None, inputs: dict, device: str
) -> tuple[Errors, list[OpError]]:
    """``run`` on ``inputs`` on ``device`` against ``reference`` on them in float64 on the CPU
    (with the ops' reference kernels), and each op call ``run`` makes against its reference."""
    args, kwargs = _moved(inputs, device)
    args64, kwargs64 = _moved(inputs, "cpu", torch.float64)
    with torch.no_grad():
        with OpRecorder(watched) as recorder:
            got = run(*args, **kwargs)
        with using_backend("cpu"):
            expected = reference(*args64, **kwargs64)
        op_errors = [
            OpError(
                call.op.name(),
                index,
                call.module,
                output_errors(call.outputs, _op_reference(call.op, call.args, call.kwargs)),
            )
            for index, call in enumerate(recorder.calls)
        ]
    return output_errors(got, expected), op_errors


def _op_reference(op: Any, args: tuple, kwargs: dict) -> Any:
    """``op`` on ``args`` / ``kwargs`` upcast to float64 on the CPU, through its reference."""
    args64, kwargs64 = _moved({"args": args, "kwargs": kwargs}, "cpu", torch.float64)
    with using_backend("cpu"):
        return op(*args64, **kwargs64)


@dataclass(frozen=True)
class RecordedOp:
    """One ``ascend_vlm::`` op call: the op, the submodule that made it (dotted name inside the
    recorded module, "" for the module itself or when none is watched), copies of its
    arguments taken at call time and of its outputs."""

    op: Any
    module: str
    args: tuple
    kwargs: dict
    outputs: Any


class OpRecorder(TorchFunctionMode):
    """Records each ``ascend_vlm::`` op called inside it in ``calls`` (:class:`RecordedOp`),
    with the submodule of ``module`` (when given) running at the time. Arguments are copied
    at call time: a caller may write into them afterwards, as the short-convolution cache
    update does."""

    def __init__(self, module: nn.Module | None = None) -> None:
        super().__init__()
        self.calls: list[RecordedOp] = []
        self._module = module
        self._running: list[str] = [""]
        self._hooks: list[Any] = []

    def __enter__(self) -> OpRecorder:
        for name, submodule in self._module.named_modules() if self._module else ():
            self._hooks.append(
                submodule.register_forward_pre_hook(lambda *_, n=name: self._running.append(n))
            )
            self._hooks.append(submodule.register_forward_hook(self._returned))
        return super().__enter__()

    def _returned(self, *_: object) -> None:
        # a forward hook's result replaces the output unless None
        self._running.pop()

    def __exit__(self, *exc_info: object) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        super().__exit__(*exc_info)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "namespace", None) != "ascend_vlm":
            return func(*args, **kwargs)
        copied_args, copied_kwargs = _moved({"args": args, "kwargs": kwargs}, None)
        outputs = func(*args, **kwargs)
        copied_outputs = _moved({"args": (outputs,), "kwargs": {}}, None)[0][0]
        self.calls.append(
            RecordedOp(func, self._running[-1], copied_args, copied_kwargs, copied_outputs)
        )
        return outputs


def _moved(
    inputs: dict, device: torch.device | str | None, dtype: torch.dtype | None = None
) -> tuple[tuple, dict]:
    """Copies of ``inputs["args"]`` and ``inputs["kwargs"]`` with every tensor on ``device``
    (None: where it is) and, given ``dtype``, every floating tensor in it."""

    def move(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            cast = dtype if dtype is not None and value.is_floating_point() else value.dtype
            return value.detach().to(device or value.device, cast, copy=True)
        if isinstance(value, tuple | list):
            return type(value)(move(v) for v in value)
        if isinstance(value, dict):
            return {k: move(v) for k, v in value.items()}
        return value

    return move(tuple(inputs["args"])), move(dict(inputs["kwargs"]))


def _floating_leaves(value: Any) -> Iterator[torch.Tensor | None]:
    """Every leaf of a (nested) output in order, None where a leaf is not a floating tensor."""
    if isinstance(value, tuple | list):
        for item in value:
            yield from _floating_leaves(item)
    elif isinstance(value, dict) or hasattr(value, "to_tuple"):
        yield from _floating_leaves(
            list(value.values()) if isinstance(value, dict) else value.to_tuple()
        )
    else:
        yield value if isinstance(value, torch.Tensor) and value.is_floating_point() else None


def output_errors(got: Any, expected: Any) -> Errors:
    """:class:`Errors` of ``got`` against ``expected`` over the floating tensors at the same
    places of both outputs with the same shapes, in float64 on the CPU. ValueError when there
    are none."""
    pairs = [
        (
            g.detach().to("cpu", torch.float64).flatten(),
            e.detach().to("cpu", torch.float64).flatten(),
        )
        for g, e in zip(_floating_leaves(got), _floating_leaves(expected), strict=False)
        if g is not None and e is not None and g.shape == e.shape
    ]
    if not pairs:
        raise ValueError(
            "output: expected a floating tensor to compare with the reference, got none"
        )
    g = torch.cat([p[0] for p in pairs])
    e = torch.cat([p[1] for p in pairs])
    difference = g - e
    norm_e, norm_g = float(e.norm()), float(g.norm())
    rel_l2 = float(difference.norm()) / norm_e if norm_e else float(difference.norm())
    cosine = float(g @ e) / (norm_g * norm_e) if norm_g and norm_e else float(norm_g == norm_e)
    max_abs = float(difference.abs().max()) if difference.numel() else 0.0
    return Errors(rel_l2, max_abs, cosine)
