"""The transformers versions `ascend_vlm.patch` supports, and a named probe per internal it uses.

`patch` relies on details of transformers (and of accelerate and kernels when installed) that no
public contract covers. Each detail has a probe here: a function that checks it against the
installed packages without building a model and returns why it does not hold, or None.

Version gate (`check_transformers_version`, called by `patch`):

* older than ``LOWEST_SUPPORTED``: refused with `PatchError` (the probes are not what fails
  there: e.g. Qwen-VL's text RoPE is a different function before 5.17).
* ``LOWEST_SUPPORTED`` .. ``NEWEST_TESTED``: accepted; CI runs the family tests on both ends.
* newer than ``NEWEST_TESTED``: every probe runs once per process; when all pass, `patch`
  proceeds with one `UserWarning` per process, otherwise it raises `PatchError` naming each
  failing probe and what it found.

The details probed, with who relies on them:

========================== ==========================================================================
probe                      detail
========================== ==========================================================================
transformers-names         ``AttentionInterface``, ``PreTrainedConfig``, ``PreTrainedModel`` import
                           from ``transformers`` (patching).
attention-interface        ``AttentionInterface.register`` adds a function that attention modules find
                           through ``ALL_ATTENTION_FUNCTIONS.get_interface`` (patching).
attention-call-convention  the interface calls ``f(module, query, key, value, attention_mask, ...,
                           dropout=, scaling=, is_causal=)`` as ``sdpa_attention_forward`` takes them
                           (``ascend_attention_forward``).
mask-interface             ``masking_utils.AttentionMaskInterface.register`` and ``sdpa_mask`` exist;
                           without a mask function the mask is None and causality is lost
                           (`register_attention_function`).
config-attn-implementation ``config._attn_implementation`` reads ``_attn_implementation_internal``,
                           the attribute patch switches per config (`set_attention_implementation`).
config-sub-configs         a config class lists its sub-configs in ``sub_configs`` and an instance
                           holds them in its ``__dict__`` under those names (config routing).
varlen-kwargs              ``FlashAttentionKwargs`` names the packed-segment kwargs ``VARLEN_KWARGS``
                           and their bounds ``VARLEN_BOUND_KWARGS`` (``ascend_attention_forward``).
output-collector           ``utils.output_capturing._active_collector`` is the context variable
                           holding the outputs a capture collects (`output_collector`): attention
                           weights are computed only when it asks for "*attentions".
silu-activation            ``ACT2FN["silu"]``'s class is one of ``SILU_ACTIVATIONS`` (MLP adapter).
accelerate-hooks           ``add_hook_to_module`` keeps ``_hf_hook`` and calls ``_old_forward`` at
                           each call, so rebinding ``_old_forward`` keeps the hook
                           (`forward_attribute`).
deprecate-kwarg-wrapper    ``deprecate_kwarg`` (on attention forwards since 5.24) keeps the function
                           in one closure cell, so `rewrap` rebuilds it around the RoPE-rebound one.
kernels-wrappers           with ``kernels`` installed (a dependency of transformers >= 5.25): the
                           class wrapper of ``use_kernelized_func`` is rebuilt by `rewrap`, and
                           `plain_function` finds the function ``use_kernel_forward_from_hub``
                           turned into a module.
classes:<model_type>       the module classes the family specs name exist in that modeling module.
attributes:<model_type>    the norm classes store ``weight`` and one of ``NORM_EPS_ATTRIBUTES``, the
                           MLP classes ``MLP_PROJECTIONS`` and ``MLP_ACTIVATION`` (the adapters
                           read them; a module without them is left alone).
attention-routing:<mt>     each attention class's forward looks its function up in
                           ``ALL_ATTENTION_FUNCTIONS`` by ``config._attn_implementation``.
rope:<model_type>          the RoPE function exists with the parameters of its style
                           (``ROPE_PARAMETERS``) and each listed class's forward calls it, under
                           decorators `rewrap` can rebuild.
varlen-vision:<mt>         a vision attention whose forward asks ``is_flash_attention_requested``
                           gets True for ``ATTENTION_NAME`` (the "flash" substring rule) and passes
                           its packed segments as ``VARLEN_KWARGS``.
vision-tower:<model_type>  the model classes store the tower under a path of the family spec.
torch-mode-stacks          ``torch._C._len_torch_function_stack`` / ``_len_torch_dispatch_stack``
                           count the active torch function / dispatch modes
                           (`torch_mode_stack_depths`: the ops' eager fast path).
torch-fake-tensors         ``torch._subclasses.fake_tensor.is_fake`` tells the fake tensors of
                           ``torch.compile`` / ``torch.export`` from real ones (`fake_tensor_test`:
                           the ops read no values of fake tensors).
tensor-versions            ``Tensor._version`` counts in-place writes (`tensor_version`: the vision
                           cache's weights fingerprint).
torch-int8pack-mm          ``torch._weight_int8pack_mm(x, weight, scales)`` computes
                           ``x @ (weight * scales[:, None])^T`` for int8 ``weight (N, K)``
                           (`int8_weight_matmul`: ``ops.weight_quant_matmul``'s bf16 CPU path).
cache-layers               a ``DynamicCache`` holds ``DynamicLayer``s whose ``keys`` / ``values``
                           token pruning may replace, and ``get_seq_length(layer)`` /
                           ``get_mask_sizes(query, layer)`` read them (`replace_cached_states`).
========================== ==========================================================================
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import sys
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass

from ascend_vlm._errors import PatchError

LOWEST_SUPPORTED = (5, 17)
NEWEST_TESTED = (5, 25)

# Contains "flash": transformers' `is_flash_attention_requested` tests for that substring, and the
# Qwen-VL vision towers then make one packed varlen call instead of a per-image loop.
ATTENTION_NAME = "ascend_flash"
# The packed-segment boundaries `ascend_attention_forward` reads; a tower that passed them under
# other names would reach its padded path with no mask and attend across images.
VARLEN_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k")
# Optional upper bounds of the segment lengths passed beside them.
VARLEN_BOUND_KWARGS = ("max_length_q", "max_length_k")
ROPE_PARAMETERS = {
    "text": ("q", "k", "cos", "sin", "unsqueeze_dim"),
    "vision": ("q", "k", "cos", "sin"),
}
SILU_ACTIVATIONS = ("SiLU", "SiLUActivation")
# Attributes the module adapters read: an RMSNorm's epsilon (Llama style, then Gemma style), a
# gated MLP's projections and activation.
NORM_EPS_ATTRIBUTES = ("variance_epsilon", "eps")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
MLP_ACTIVATION = "act_fn"


@dataclass(frozen=True)
class Probe:
    """One transformers internal `patch` relies on: ``check()`` returns why it does not hold in
    the installed packages, or None when it holds."""

    name: str
    check: Callable[[], str | None]


# --------------------------------------------------------------------------- version gate

_warned: set[str] = set()


def _major_minor(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def _dotted(version: tuple[int, int]) -> str:
    return f"{version[0]}.{version[1]}"


def check_transformers_version(version: str | None = None) -> str:
    """Return the installed transformers version after the gate described in the module doc.

    `version` stands in for the installed version string (tests); the probes always examine the
    installed packages. Raises PatchError for a version older than ``LOWEST_SUPPORTED`` and for
    a newer-than-tested one where a probe fails; warns once per process for a newer one where
    every probe passes.
    """
    if version is None:
        import transformers

        version = transformers.__version__
    release = _major_minor(version)
    supported = f">={_dotted(LOWEST_SUPPORTED)},<={_dotted(NEWEST_TESTED)}.*"
    if release < LOWEST_SUPPORTED:
        raise PatchError(
            f"transformers {version} is older than ascend_vlm.patch supports ({supported}); "
            f"upgrade transformers"
        )
    if release <= NEWEST_TESTED:
        return version
    failures = failed_probes()
    if failures:
        found = "; ".join(f"probe {name!r}: {why}" for name, why in failures.items())
        raise PatchError(
            f"transformers {version} is newer than the newest version ascend_vlm.patch is tested "
            f"with ({_dotted(NEWEST_TESTED)}) and changed internals patch relies on: {found}. "
            f"Install transformers{supported} or an ascend_vlm release made for {version}"
        )
    if version not in _warned:
        _warned.add(version)
        warnings.warn(
            f"transformers {version} is newer than the newest version ascend_vlm.patch is tested "
            f"with ({_dotted(NEWEST_TESTED)}); every internal it relies on passed its probe, so "
            f"patch proceeds",
            UserWarning,
            stacklevel=3,
        )
    return version


@functools.cache
def failed_probes() -> dict[str, str]:
    """Name -> what was found, for every probe that fails here (run once per process). A probe
    that raises fails with the exception."""
    failures = {}
    for probe in probes():
        try:
            why = probe.check()
        except Exception as error:  # any exception means an internal it reaches for changed
            why = f"{type(error).__name__}: {error}"
        if why is not None:
            failures[probe.name] = why
    return failures


# --------------------------------------------------------------------------- decorated functions


def _from_kernels(function: object) -> bool:
    """Whether `function` was defined inside the installed ``kernels`` package."""
    kernels = sys.modules.get("kernels")
    code = getattr(function, "__code__", None)
    if kernels is None or code is None or kernels.__file__ is None:
        return False
    return code.co_filename.startswith(os.path.dirname(kernels.__file__) + os.sep)


def plain_function(function: object) -> object:
    """The function kernels' ``use_kernel_forward_from_hub`` turned into a module instance (its
    forward dispatches to a hub kernel or calls the function), or `function` itself."""
    forward = getattr(type(function), "forward", None)
    if not _from_kernels(forward):
        return function
    cells = dict(zip(forward.__code__.co_freevars, forward.__closure__ or (), strict=True))
    return cells["func"].cell_contents if "func" in cells else function


def _cell_of_wrapped(wrapper: Callable) -> int | None:
    """Index of the one closure cell of `wrapper` holding ``wrapper.__wrapped__``, else None."""
    wrapped = getattr(wrapper, "__wrapped__", None)
    cells = getattr(wrapper, "__closure__", None) or ()
    held = [index for index, cell in enumerate(cells) if _contents(cell) is wrapped]
    return held[0] if len(held) == 1 else None


def _contents(cell: types.CellType) -> object:
    try:
        return cell.cell_contents
    except ValueError:  # a cell whose variable is not assigned yet
        return None


def rewrap(wrapper: types.FunctionType, inner: Callable) -> types.FunctionType:
    """A copy of the decorator's `wrapper` that calls `inner` where it called its ``__wrapped__``.

    transformers decorates attention forwards (``deprecate_kwarg``; kernels'
    ``use_kernelized_func`` when installed) with functions that keep the decorated function in
    one closure cell; the copy keeps what the decorator does (kwarg renames, kernel routing).
    Raises ValueError when no single cell holds ``__wrapped__``.
    """
    index = _cell_of_wrapped(wrapper)
    if index is None:
        raise ValueError(
            f"wrapper: expected one closure cell holding __wrapped__, got {wrapper.__code__.co_name}"
            f" from {wrapper.__code__.co_filename}"
        )
    closure = list(wrapper.__closure__)
    closure[index] = types.CellType(inner)
    clone = types.FunctionType(
        wrapper.__code__,
        wrapper.__globals__,
        wrapper.__name__,
        wrapper.__defaults__,
        tuple(closure),
    )
    clone.__kwdefaults__ = wrapper.__kwdefaults__
    clone.__qualname__ = wrapper.__qualname__
    clone.__dict__.update(wrapper.__dict__)
    clone.__wrapped__ = inner
    return clone


def rope_problem(cls: type, function_name: str, style: str) -> str | None:
    """Why `cls`'s forward cannot have its module-level `function_name` (a RoPE function of
    `style`, a key of ``ROPE_PARAMETERS``) resolved to an adapter, or None when it can.

    A decorated forward qualifies when each decorator can be rebuilt around the rebound function
    (`rewrap`)."""
    forward = cls.forward
    while hasattr(forward, "__wrapped__"):
        if _cell_of_wrapped(forward) is None:
            code = getattr(forward, "__code__", None)
            where = f"{code.co_name} ({code.co_filename})" if code else repr(forward)
            return f"{cls.__name__}.forward is decorated by {where}, which rebinding cannot rebuild"
        forward = forward.__wrapped__
    if not isinstance(forward, types.FunctionType):
        return f"{cls.__name__}.forward is not a Python function: {forward!r}"
    if function_name not in forward.__code__.co_names:
        return f"{cls.__name__}.forward does not call {function_name}"
    original = plain_function(forward.__globals__.get(function_name))
    expected = ROPE_PARAMETERS[style]
    parameters = tuple(inspect.signature(original).parameters) if callable(original) else ()
    if parameters != expected:
        return f"{function_name}{parameters} does not have the expected signature {expected}"
    return None


# --------------------------------------------------------------------------- internals, used

# The accelerate hook's attribute and the forward it wraps (`accelerate.hooks.add_hook_to_module`).
_HOOK_ATTRIBUTE, _HOOKED_FORWARD = "_hf_hook", "_old_forward"


def register_attention_function(name: str, function: Callable) -> None:
    """Register `function` as transformers attention implementation `name`, with ``sdpa_mask``
    as its mask function (idempotent). Without a mask function transformers hands the attention
    a mask of None and causal masking is silently lost."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, function)
    AttentionMaskInterface.register(name, sdpa_mask)


def set_attention_implementation(config: object, name: str) -> None:
    """Make `config` (a ``PreTrainedConfig``) name attention implementation `name`, without the
    checks and sub-config propagation of transformers' public setter."""
    config._attn_implementation_internal = name


def forward_attribute(module: object) -> str:
    """The instance attribute holding the forward that `module`'s calls run: ``"forward"``, or
    for a module carrying an accelerate hook (``device_map=...``, offload), the wrapped forward
    the hook's wrapper looks up at every call, so rebinding it keeps the hook around it."""
    if hasattr(module, _HOOK_ATTRIBUTE) and _HOOKED_FORWARD in vars(module):
        return _HOOKED_FORWARD
    return "forward"


def attention_function(module: object, name: str) -> Callable:
    """The function transformers' attention `module` calls under implementation `name`: the
    registered one, or for "eager" its modeling module's ``eager_attention_forward``."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    return ALL_ATTENTION_FUNCTIONS.get_interface(name, eager)


def tensor_version(tensor: object) -> int:
    """torch's in-place modification counter of `tensor` (``Tensor._version``): it grows with
    every in-place write (``copy_`` in ``load_state_dict``, optimizer steps), so a vision-feature
    cache can tell the weights changed without hashing them."""
    return tensor._version


# The keyword a decoder layer receives its cache under: "cache" from transformers 5.25 (with
# "past_key_values" deprecated), "past_key_values" before.
CACHE_KWARGS = ("cache", "past_key_values")


def cache_argument(kwargs: dict) -> object | None:
    """The cache a model or decoder layer call received (None without one)."""
    for name in CACHE_KWARGS:
        if kwargs.get(name) is not None:
            return kwargs[name]
    return None


def cache_layer_kind(cache: object, layer: int) -> str:
    """ "dynamic" (grows by concatenation), "static" (preallocated, written at its own length),
    or the layer class's name for any other kind (sliding windows, offloading, quantised)."""
    layers = getattr(cache, "layers", None)
    if layers is None or layer >= len(layers):
        return type(cache).__name__
    name = type(layers[layer]).__name__
    return {"DynamicLayer": "dynamic", "StaticLayer": "static"}.get(name, name)


def replace_cached_states(cache: object, layer: int, keys: object, values: object) -> None:
    """Make the dynamic cache layer `layer` hold exactly `keys` / `values` [B, Nkv, L, D]."""
    cached = cache.layers[layer]
    cached.keys, cached.values = keys, values


@functools.cache
def output_collector() -> Callable[[], dict | None]:
    """The getter of transformers' active output collector: None, or the dict of the outputs the
    running capture collects (output name -> list).

    transformers 5 asks for attention weights through its output capture: the ``capture_outputs``
    decorator of a model's forward (reading ``output_attentions`` from the call or the config)
    sets this per-context dict, and forward hooks on the attention modules append element 1 of
    their result, the weights, to its "attentions" list.
    """
    from transformers.utils.output_capturing import _active_collector

    return _active_collector.get


# --------------------------------------------------------------------------- global probes


def _missing(owner: object, names: tuple[str, ...]) -> str | None:
    absent = [name for name in names if getattr(owner, name, None) is None]
    label = getattr(owner, "__name__", type(owner).__name__)
    return f"{label} has no {', '.join(absent)}" if absent else None


def _transformers_names() -> str | None:
    import transformers

    return _missing(transformers, ("AttentionInterface", "PreTrainedConfig", "PreTrainedModel"))


def _attention_interface() -> str | None:
    from transformers import modeling_utils

    problem = _missing(modeling_utils, ("AttentionInterface", "ALL_ATTENTION_FUNCTIONS"))
    if problem:
        return problem
    interface = modeling_utils.ALL_ATTENTION_FUNCTIONS
    if not isinstance(interface, modeling_utils.AttentionInterface):
        return f"ALL_ATTENTION_FUNCTIONS is a {type(interface).__name__}, not an AttentionInterface"
    return _missing(modeling_utils.AttentionInterface, ("register", "get_interface"))


def _attention_call_convention() -> str | None:
    from transformers.integrations import sdpa_attention

    if not callable(getattr(sdpa_attention, "sdpa_attention_forward", None)):
        return "transformers.integrations.sdpa_attention has no sdpa_attention_forward"
    parameters = tuple(inspect.signature(sdpa_attention.sdpa_attention_forward).parameters)
    positional = ("module", "query", "key", "value", "attention_mask")
    absent = {"dropout", "scaling", "is_causal"} - set(parameters)
    if parameters[:5] != positional or absent:
        return (
            f"sdpa_attention_forward{parameters} is not ({', '.join(positional)}, ...) with "
            f"dropout, scaling and is_causal"
        )
    return None


def _mask_interface() -> str | None:
    from transformers import masking_utils

    problem = _missing(masking_utils, ("AttentionMaskInterface", "sdpa_mask"))
    return problem or _missing(masking_utils.AttentionMaskInterface, ("register",))


def _config_attn_implementation() -> str | None:
    from transformers import PreTrainedConfig

    config = PreTrainedConfig()
    set_attention_implementation(config, ATTENTION_NAME)
    found = getattr(config, "_attn_implementation", None)
    if found != ATTENTION_NAME:
        return (
            f"config._attn_implementation reads {found!r} after _attn_implementation_internal "
            f"was set to {ATTENTION_NAME!r}"
        )
    return None


def _silu_activation() -> str | None:
    from transformers.activations import ACT2FN

    name = type(ACT2FN["silu"]).__name__
    return None if name in SILU_ACTIVATIONS else f'ACT2FN["silu"] is a {name}'


def _accelerate_hooks() -> str | None:
    try:
        from accelerate.hooks import ModelHook, add_hook_to_module
    except ImportError:
        return None  # nothing can attach accelerate hooks to a model
    import torch

    module = add_hook_to_module(torch.nn.Identity(), ModelHook())
    if forward_attribute(module) != _HOOKED_FORWARD:
        return f"add_hook_to_module sets no {_HOOK_ATTRIBUTE} / instance {_HOOKED_FORWARD}"
    vars(module)[_HOOKED_FORWARD] = lambda x: x + 1
    if module(torch.zeros(1)).item() != 1.0:
        return "the hooked forward does not call _old_forward at call time"
    return None


def _config_sub_configs() -> str | None:
    from transformers import CONFIG_MAPPING, PreTrainedConfig

    from ascend_vlm.models import REGISTRY

    for model_type in REGISTRY:
        # The class is read before an instance is made: some versions' __init__ indexes
        # sub_configs itself and would fail there, not here.
        config_class = CONFIG_MAPPING[model_type]
        names = getattr(config_class, "sub_configs", None)
        if not isinstance(names, dict) or not any("vision" in name for name in names):
            return f"{config_class.__name__}.sub_configs names no vision sub-config: {names!r}"
        config = config_class()
        held = [n for n in names if isinstance(config.__dict__.get(n), PreTrainedConfig)]
        if not held:
            return f"{config_class.__name__} holds none of {list(names)} in its __dict__"
    return None


def _varlen_kwargs() -> str | None:
    from transformers.modeling_flash_attention_utils import FlashAttentionKwargs

    absent = set(VARLEN_KWARGS + VARLEN_BOUND_KWARGS) - set(FlashAttentionKwargs.__annotations__)
    return f"FlashAttentionKwargs has no {', '.join(sorted(absent))}" if absent else None


def _output_collector() -> str | None:
    from transformers.utils import output_capturing

    problem = _missing(output_capturing, ("_active_collector",))
    return problem or _missing(output_capturing._active_collector, ("get", "set", "reset"))


def _rewrapped_call(wrapper: types.FunctionType, *args, **kwargs) -> object:
    """What `wrapper` rebuilt around a recorder hands to the function it decorates."""
    calls = []
    rewrap(wrapper, lambda *a, **k: calls.append((a, k)))(*args, **kwargs)
    return calls[0] if calls else None


def _deprecate_kwarg_wrapper() -> str | None:
    from transformers.utils.deprecation import deprecate_kwarg

    def forward(self, cache=None):
        return cache

    wrapper = deprecate_kwarg("past_key_values", "99.0.0", new_name="cache")(forward)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        call = _rewrapped_call(wrapper, "self", past_key_values=1)
    if call != (("self",), {"cache": 1}):
        return f"deprecate_kwarg's wrapper, rebuilt by rewrap, passed on {call} instead of cache=1"
    return None


def _kernels_wrappers() -> str | None:
    try:
        from kernels import use_kernel_forward_from_hub, use_kernelized_func
    except ImportError:
        return None  # transformers then defines plain functions and forwards
    import torch

    def rotate(q, k, cos, sin):
        return q, k

    hub_function = use_kernel_forward_from_hub("ascend_vlm_probe")(rotate)

    class Module(torch.nn.Module):
        def forward(self, x):
            return hub_function(x, x, x, x)

    module = use_kernelized_func(hub_function)(Module)()
    if plain_function(hub_function) is not rotate:
        return "plain_function does not find the function use_kernel_forward_from_hub wraps"
    call = _rewrapped_call(Module.forward, module, 2)
    if call != ((module, 2), {}):
        return f"use_kernelized_func's wrapper, rebuilt by rewrap, passed on {call}"
    return None


# --------------------------------------------------------------------------- torch internals


def torch_mode_stack_depths() -> tuple[Callable[[], int], Callable[[], int]]:
    """The functions counting the active ``__torch_function__`` and ``__torch_dispatch__``
    modes. The public way to ask (``torch.overrides._get_current_function_mode_stack``) builds
    a list per call; the ops ask on every call."""
    import torch

    return torch._C._len_torch_function_stack, torch._C._len_torch_dispatch_stack


def fake_tensor_test() -> Callable[[object], bool]:
    """The function telling whether a tensor is (or wraps) a fake tensor of ``torch.compile``,
    AOT autograd or ``torch.export``, whose values do not exist."""
    from torch._subclasses.fake_tensor import is_fake

    return is_fake


def int8_weight_matmul(x: object, weight: object, scales: object) -> object:
    """``x (M, K) @ (weight (N, K) * scales (N,)[:, None])^T`` by torch's int8 weight-only CPU
    kernel (``torch._weight_int8pack_mm``)."""
    import torch

    return torch._weight_int8pack_mm(x, weight, scales)


def _torch_int8pack_mm() -> str | None:
    import torch

    if not hasattr(torch, "_weight_int8pack_mm"):
        return "torch._weight_int8pack_mm is missing"
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 64, generator=generator).to(torch.bfloat16)
    weight = torch.randint(-127, 128, (3, 64), dtype=torch.int8, generator=generator)
    scales = torch.tensor([0.5, 1.0, 2.0], dtype=torch.bfloat16)
    got = int8_weight_matmul(x, weight, scales).float()
    expected = x.float() @ (weight.float() * scales.float()[:, None]).t()
    error = float((got - expected).abs().max() / expected.abs().max())
    return None if error < 2e-2 else f"relative error {error:.3g} against x @ (w * s)^T"


def set_lora_active_adapter(layer: object, name: str) -> None:
    """Make ``name`` the one active adapter of PEFT tuner layer ``layer``, as
    ``BaseTunerLayer.set_adapter`` records it, without that method's pass over every resident
    adapter's ``requires_grad`` (whose cost grows with the adapters resident). The adapters
    must already be frozen. Valid while :func:`peft_active_adapter_problem` is None."""
    layer._active_adapter = [name]


@functools.cache
def peft_active_adapter_problem() -> str | None:
    """Why :func:`set_lora_active_adapter` does not hold with the installed PEFT (probe
    "peft-active-adapter"), None when it does: a two-adapter LoRA linear switched by it must
    report and compute exactly what PEFT's own ``set_adapter`` gives."""
    import copy

    import torch
    from peft import LoraConfig, get_peft_model
    from peft.tuners.tuners_utils import BaseTunerLayer

    torch.manual_seed(0)
    config = LoraConfig(r=2, target_modules=["0"], init_lora_weights=False)
    reference = get_peft_model(torch.nn.Sequential(torch.nn.Linear(4, 4)), config, "first")
    reference.add_adapter("second", config)
    switched = copy.deepcopy(reference)
    reference.set_adapter("second")
    layers = [m for m in switched.modules() if isinstance(m, BaseTunerLayer)]
    for layer in layers:
        set_lora_active_adapter(layer, "second")
    if not layers or layers[0].active_adapters != ["second"]:
        return f"{len(layers)} tuner layers; active_adapters not ['second'] after setting it"
    x = torch.randn(3, 4)
    with torch.no_grad():
        if not torch.equal(reference(x), switched(x)):
            return "a layer switched by _active_adapter computes otherwise than set_adapter"
    return None


def _tensor_versions() -> str | None:
    import torch

    tensor = torch.zeros(2)
    before = tensor_version(tensor)
    tensor.add_(1)
    after = tensor_version(tensor)
    return None if after == before + 1 else f"_version gives {before} then {after} around add_"


def _cache_layers() -> str | None:
    """Token pruning reads and rewrites caches: a DynamicCache of DynamicLayers holding ``keys``
    / ``values`` [B, N, S, D], ``get_seq_length(layer)`` and ``get_mask_sizes(query, layer)``."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache()
    states = torch.zeros(1, 1, 3, 2)
    cache.update(states, states, 0)
    if cache_layer_kind(cache, 0) != "dynamic":
        return f"DynamicCache holds a {type(cache.layers[0]).__name__}, not a DynamicLayer"
    replace_cached_states(cache, 0, states[:, :, :1], states[:, :, :1])
    found = (cache.get_seq_length(0), cache.get_mask_sizes(2, 0)[0])
    if found != (1, 3):
        return f"after keeping 1 of 3 slots, (get_seq_length, get_mask_sizes(2)) gives {found}"
    return None


def _torch_mode_stacks() -> str | None:
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    function_modes, dispatch_modes = torch_mode_stack_depths()
    outside = (function_modes(), dispatch_modes())
    with TorchFunctionMode():
        in_function_mode = (function_modes(), dispatch_modes())
    with TorchDispatchMode():
        in_dispatch_mode = (function_modes(), dispatch_modes())
    found = (outside, in_function_mode, in_dispatch_mode)
    if found != ((0, 0), (1, 0), (0, 1)):
        return (
            f"(function, dispatch) mode depths outside, in a function mode, in a dispatch mode: "
            f"{found}, expected ((0, 0), (1, 0), (0, 1))"
        )
    return None


def _torch_fake_tensors() -> str | None:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = torch.empty(2)
    is_fake = fake_tensor_test()
    found = (is_fake(fake), is_fake(torch.empty(2)))
    return None if found == (True, False) else f"is_fake (fake, real) gives {found}"


_GLOBAL_PROBES = (
    Probe("transformers-names", _transformers_names),
    Probe("attention-interface", _attention_interface),
    Probe("attention-call-convention", _attention_call_convention),
    Probe("mask-interface", _mask_interface),
    Probe("config-attn-implementation", _config_attn_implementation),
    Probe("config-sub-configs", _config_sub_configs),
    Probe("varlen-kwargs", _varlen_kwargs),
    Probe("output-collector", _output_collector),
    Probe("silu-activation", _silu_activation),
    Probe("accelerate-hooks", _accelerate_hooks),
    Probe("deprecate-kwarg-wrapper", _deprecate_kwarg_wrapper),
    Probe("kernels-wrappers", _kernels_wrappers),
    Probe("cache-layers", _cache_layers),
    Probe("tensor-versions", _tensor_versions),
    Probe("torch-mode-stacks", _torch_mode_stacks),
    Probe("torch-fake-tensors", _torch_fake_tensors),
    Probe("torch-int8pack-mm", _torch_int8pack_mm),
)


# --------------------------------------------------------------------------- family probes


@dataclass(frozen=True)
class _Part:
    """A part spec ("text" or "vision" `side`) of a model family or backbone, with the
    model_type of its (sub-)config and the module defining that config class."""

    model_type: str
    side: str
    spec: object  # ascend_vlm.models.family_spec.PartSpec
    config_module: str

    @property
    def modeling(self) -> types.ModuleType:
        """The modeling module beside the config module, which defines the spec's classes."""
        return importlib.import_module(self.config_module.replace(".configuration_", ".modeling_"))


def _parts() -> list[_Part]:
    """Every part spec `patch` can apply: each family's (from its default config) and each
    known backbone's, one entry per (model_type, spec)."""
    from transformers import CONFIG_MAPPING, AutoConfig

    from ascend_vlm.models import REGISTRY, TEXT_BACKBONES, VISION_BACKBONES, spec_for

    parts: dict[str, _Part] = {}
    for model_type in REGISTRY:
        config = AutoConfig.for_model(model_type)
        spec = spec_for(config)
        for side in ("text", "vision"):
            sub_config = getattr(config, f"{side}_config")
            parts.setdefault(
                sub_config.model_type,
                _Part(
                    sub_config.model_type, side, getattr(spec, side), type(sub_config).__module__
                ),
            )
    for side, table in (("text", TEXT_BACKBONES), ("vision", VISION_BACKBONES)):
        for model_type, spec in table.items():
            parts.setdefault(
                model_type, _Part(model_type, side, spec, CONFIG_MAPPING[model_type].__module__)
            )
    return list(parts.values())


def _swapped_classes(spec) -> list[str]:
    names = [*spec.attention]
    for entries in (spec.norms, spec.mlps, spec.ropes):
        names += [name for entry in entries for name in entry.classes]
    return list(dict.fromkeys(names))


def _classes_probe(part: _Part) -> str | None:
    module = part.modeling
    absent = [name for name in _swapped_classes(part.spec) if not hasattr(module, name)]
    return f"{module.__name__} has no {', '.join(absent)}" if absent else None


def _attributes_probe(part: _Part) -> str | None:
    """Attribute names a class stores, read from its ``__init__``'s code (no model is built)."""
    module = part.modeling
    expected = [
        (name, ("weight",), NORM_EPS_ATTRIBUTES) for n in part.spec.norms for name in n.classes
    ]
    expected += [
        (name, (*MLP_PROJECTIONS, MLP_ACTIVATION), ()) for m in part.spec.mlps for name in m.classes
    ]
    for name, required, one_of in expected:
        stored = set(getattr(module, name).__init__.__code__.co_names)
        absent = [attribute for attribute in required if attribute not in stored]
        if one_of and not stored & set(one_of):
            absent.append(" or ".join(one_of))
        if absent:
            return f"{name}.__init__ stores no {', '.join(absent)}"
    return None


def _attention_routing_probe(part: _Part) -> str | None:
    module = part.modeling
    for name in part.spec.attention:
        forward = inspect.unwrap(getattr(module, name).forward)
        if "ALL_ATTENTION_FUNCTIONS" not in forward.__code__.co_names:
            return f"{name}.forward does not look its function up in ALL_ATTENTION_FUNCTIONS"
    return None


def _rope_probe(part: _Part) -> str | None:
    module = part.modeling
    for rope in part.spec.ropes:
        if not callable(getattr(module, rope.function, None)):
            return f"{module.__name__} has no {rope.function}"
        for name in rope.classes:
            problem = rope_problem(getattr(module, name), rope.function, rope.style)
            if problem:
                return problem
    return None


def _keyword_names(code: types.CodeType) -> set[str]:
    """Keyword-argument names the function's calls pass (they sit in tuple constants)."""
    return {n for c in code.co_consts if isinstance(c, tuple) for n in c if isinstance(n, str)}


def _varlen_vision_probe(part: _Part) -> str | None:
    module = part.modeling
    for name in part.spec.attention:
        forward = inspect.unwrap(getattr(module, name).forward)
        if "is_flash_attention_requested" not in forward.__code__.co_names:
            continue  # a tower without a packed path: one call per image or a padded batch
        requested = forward.__globals__["is_flash_attention_requested"]
        stand_in = types.SimpleNamespace(_attn_implementation=ATTENTION_NAME)
        if not requested(stand_in):
            return f"is_flash_attention_requested is False for {ATTENTION_NAME!r}"
        absent = set(VARLEN_KWARGS) - _keyword_names(forward.__code__)
        if absent:
            return f"{name}.forward does not pass {', '.join(sorted(absent))}"
    return None


def _vision_tower_probe(model_type: str) -> str | None:
    from transformers import AutoConfig
    from transformers.models.auto import modeling_auto

    from ascend_vlm.models import spec_for

    config = AutoConfig.for_model(model_type)
    paths = [p.split(".") for p in spec_for(config).vision_towers]
    module = importlib.import_module(
        type(config).__module__.replace(".configuration_", ".modeling_")
    )
    base = getattr(module, modeling_auto.MODEL_MAPPING_NAMES[model_type])
    head = getattr(module, modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES[model_type])
    stored = {cls: set(cls.__init__.__code__.co_names) for cls in (base, head)}
    for path in paths:
        if len(path) == 2 and path[0] in stored[head] and path[1] in stored[base]:
            return None
    return (
        f"neither {head.__name__} nor {base.__name__} stores the vision tower under "
        f"{' or '.join('.'.join(p) for p in paths)}"
    )


@functools.cache
def probes() -> tuple[Probe, ...]:
    """Every probe: the global ones, then per part and per family (built on first use; the
    family probes import the modeling modules they examine)."""
    from ascend_vlm.models import REGISTRY

    found = list(_GLOBAL_PROBES)
    for part in _parts():
        checks = {
            "classes": _classes_probe,
            "attributes": _attributes_probe,
            "attention-routing": _attention_routing_probe,
        }
        if part.spec.ropes:
            checks["rope"] = _rope_probe
        if part.side == "vision":
            checks["varlen-vision"] = _varlen_vision_probe
        for kind, check in checks.items():
            found.append(Probe(f"{kind}:{part.model_type}", functools.partial(check, part)))
    for model_type in REGISTRY:
        found.append(
            Probe(f"vision-tower:{model_type}", functools.partial(_vision_tower_probe, model_type))
        )
    return tuple(found)
