"""`enable_vision_cache` / `disable_vision_cache`: route a model's vision encoding through a
:class:`~ascend_vlm.reuse.vision_cache.VisionCache`.

The multimodal model's ``get_image_features`` (and ``get_video_features``) is rebound on the
instance to a wrapper that splits the call into images, answers the cached ones from the cache,
encodes the rest in one call to the original method and reassembles the per-image outputs in
order: the pooled embeddings (and Qwen3-VL's deepstack features) that token merging, M-RoPE and
pruning read; a cached result carries no hidden states or attentions. The wrapper steps aside
(calls the original) when the call asks for hidden states or attentions, passes tensors it
cannot split (``image_sizes`` ...), or would build an autograd graph through trainable vision
weights (training must see its gradients), and inside another wrapped call (Qwen3-VL's video
features run its image features).

The key of an image is its method, its pixels (or named key) and grid, and the arguments that
choose features (LLaVA's ``vision_feature_layer`` / strategy, resolved from the config when
None); the entry also carries a fingerprint of everything else that changes the features:
every vision parameter's and buffer's (quantized weights) identity, storage and in-place write
counter, PEFT's active adapters, whether adapters are disabled and their scaling, the
autocast state, and the ledger features stacked beneath the cache (``patch`` with its options,
quantization), which choose the kernels. ``load_state_dict``, an optimizer step,
``p.data = ...``, a LoRA switch, ``model.to(...)``, autocast or patching therefore miss.
Writes through ``p.data.copy_(...)`` bypass torch's write counter: call ``cache.clear()`` after
them.
"""

from __future__ import annotations

import contextvars
import functools
import itertools
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ascend_vlm import trace_events as events
from ascend_vlm._base_model import base_model
from ascend_vlm._compat.torch_internals import tensor_version
from ascend_vlm.models import require_feature
from ascend_vlm.patching.ledger import Edits, applied_features, apply_feature, remove_feature
from ascend_vlm.reuse.cache_entry import CachedFeatures
from ascend_vlm.reuse.vision_cache import VisionCache

# Arguments that shape the output object, not the features.
_OUTPUT_FLAGS = frozenset({"return_dict", "output_attentions", "output_hidden_states"})
# LLaVA's feature-choosing arguments, taken from the config when a call passes None.
_CONFIG_DEFAULTS = ("vision_feature_layer", "vision_feature_select_strategy")
# Set while a wrapper runs: a wrapped method it reaches (Qwen3-VL's video features call its
# image features) goes straight to the original, so images are neither counted nor keyed twice.
_ENCODING: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "ascend_vlm_vision_encoding", default=False
)
# One number per multimodal model instance: its entries' owner (unlike id(), never reused by a
# later model; kept across disable / enable, so a re-enabled model finds its entries). Held
# beside the model, not on it, so a model the cache is removed from is as it was.
_OWNERS = itertools.count()
_OWNER_NUMBERS: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class _Method:
    """A feature method of a family: its name, the argument carrying per-item grids (items are
    rows of ``pixel_values`` counted by the grid's product) or None (items are the first axis),
    and the submodules whose weights produce the features."""

    name: str
    grid: str | None
    towers: tuple[str, ...]


def _weights_fingerprint(towers: list[nn.Module], device_type: str) -> tuple:
    # Buffers too: a quantized linear layer holds its weights in buffers.
    parameters = tuple(
        (id(p), p.data_ptr(), tensor_version(p), p.dtype, p.device)
        for tower in towers
        for p in (*tower.parameters(), *tower.buffers())
    )
    # PEFT's tuner layers: switching or disabling adapters, or rescaling them, changes no
    # parameter.
    adapters = tuple(
        (
            tuple(active),
            getattr(module, "disable_adapters", None),
            repr(getattr(module, "scaling", None)),
        )
        for tower in towers
        for module in tower.modules()
        if isinstance(active := getattr(module, "active_adapters", None), (list, tuple))
    )
    autocast = torch.is_autocast_enabled(device_type) and torch.get_autocast_dtype(device_type)
    return parameters, adapters, autocast


def _items(pixels: torch.Tensor, grid: torch.Tensor | None) -> list[tuple[torch.Tensor, tuple]]:
    """``(pixels, grid)`` per image: grid rows split the patch rows, else the first axis."""
    if grid is None:
        return [(pixels[index : index + 1], ()) for index in range(pixels.shape[0])]
    sizes = grid.prod(dim=-1).tolist()
    rows = torch.split(pixels, sizes)
    return [(part, tuple(row)) for part, row in zip(rows, grid.tolist(), strict=True)]


def _per_image(output: Any) -> list[CachedFeatures]:
    """Each image's outputs. Deepstack layers come split per image (transformers >= 5.25) or as
    one tensor over all images (earlier), and are given back the same way."""
    pooled = list(output.pooler_output)
    deepstack = list(getattr(output, "deepstack_features", None) or [])
    joined = bool(deepstack) and isinstance(deepstack[0], torch.Tensor)
    if joined:
        sizes = [embedding.shape[0] for embedding in pooled]
        deepstack = [torch.split(layer, sizes) for layer in deepstack]
    return [
        CachedFeatures(
            type(output),
            joined,
            tuple(t.detach() for t in (embedding, *(layer[index] for layer in deepstack))),
        )
        for index, embedding in enumerate(pooled)
    ]


def _assembled(values: list[CachedFeatures]) -> Any:
    """The output object of the images ``values``, in order."""
    first = values[0]
    fields: dict[str, Any] = {"pooler_output": tuple(value.tensors[0] for value in values)}
    depth = len(first.tensors) - 1
    if depth:
        layers = [tuple(value.tensors[1 + layer] for value in values) for layer in range(depth)]
        joined = first.deepstack_joined
        fields["deepstack_features"] = [torch.cat(parts) for parts in layers] if joined else layers
    return first.output_class(**fields)


def _steps_aside(kwargs: dict, method: _Method, towers: list[nn.Module]) -> bool:
    """Whether a call must run uncached (see the module docstring)."""
    if kwargs.get("output_attentions") or kwargs.get("output_hidden_states"):
        return True
    if any(
        isinstance(value, torch.Tensor) and name != method.grid for name, value in kwargs.items()
    ):
        return True
    return torch.is_grad_enabled() and any(
        p.requires_grad for tower in towers for p in tower.parameters()
    )


def _cached_method(
    cache: VisionCache,
    owner: nn.Module,
    owner_number: int,
    kernels: str,
    method: _Method,
    original: Callable,
) -> Callable:
    # generate() picks the encoder's keyword arguments from its signature: keep the original's.
    @functools.wraps(original)
    def cached(pixel_values: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        towers = [getattr(owner, name) for name in method.towers]
        if _ENCODING.get() or _steps_aside(kwargs, method, towers):
            return original(pixel_values, *args, **kwargs)
        grid = None
        if method.grid is not None:
            grid, args = (args[0], args[1:]) if args else (kwargs.pop(method.grid, None), ())
            if grid is None:
                return original(pixel_values, **kwargs)
        wants_tuple = kwargs.pop("return_dict", True) is False
        items = _items(pixel_values, grid)
        config = getattr(owner, "config", None)
        chosen = {
            name: value
            if value is not None or name not in _CONFIG_DEFAULTS
            else getattr(config, name, None)
            for name, value in kwargs.items()
            if name not in _OUTPUT_FLAGS
        }
        selection = repr((method.name, args, sorted(chosen.items())))
        keys = [(key, selection) for key in cache.image_keys(items)]
        fingerprint = (kernels, _weights_fingerprint(towers, pixel_values.device.type))
        # Host-tier hits copy back while the misses are encoded; they are waited for below.
        values = cache.lookup(owner_number, fingerprint, keys, wait=False)
        missing = [index for index, value in enumerate(values) if value is None]
        events.emit("vision_cache", owner, hits=len(values) - len(missing), misses=len(missing))
        if missing:
            pixels = torch.cat([items[index][0] for index in missing])
            grids = () if grid is None else (grid[missing],)
            token = _ENCODING.set(True)
            try:
                output = original(pixels, *grids, *args, return_dict=True, **kwargs)
            finally:
                _ENCODING.reset(token)
            for index, value in zip(missing, _per_image(output), strict=True):
                values[index] = value
                cache.store(owner_number, fingerprint, keys[index], value)
        for value in values:
            value.wait_ready()
        output = _assembled(values)
        return output.to_tuple() if wants_tuple else output

    return cached


def _multimodal(model: nn.Module) -> tuple[nn.Module, tuple[_Method, ...]]:
    base = base_model(model)
    descriptor = require_feature(base, "vision_cache")
    multimodal = descriptor.layout.multimodal_model(base)
    if not isinstance(multimodal, nn.Module):
        raise ValueError(
            f"model: expected {type(base).__name__}.{descriptor.layout.multimodal} (the "
            f"multimodal model), not found"
        )
    towers = descriptor.layout.encoder_modules
    return multimodal, tuple(_Method(e.method, e.grid, towers) for e in descriptor.encoders)


class _CachedEncoding:
    """Ledger feature ``"vision_cache"``: ``multimodal``'s feature methods rebound to wrappers
    answering from ``cache``."""

    name = "vision_cache"

    def __init__(
        self,
        cache: VisionCache,
        model: nn.Module,
        multimodal: nn.Module,
        methods: tuple[_Method, ...],
    ):
        self.cache = cache
        self.model = model
        self.multimodal = multimodal
        self.methods = methods

    def install(self, edits: Edits) -> None:
        multimodal = self.multimodal
        owner_number = _OWNER_NUMBERS.setdefault(multimodal, next(_OWNERS))
        # The features stacked beneath this one (the ledger installs them first and installs
        # this one again whenever they change) choose the kernels the towers run: entries
        # encoded under other kernels (patched or not) differ in rounding, so they miss.
        kernels = repr(
            [(f.name, getattr(f, "options", None)) for f in applied_features(self.model)]
        )
        for method in self.methods:
            original = getattr(multimodal, method.name, None)
            if original is None or not all(hasattr(multimodal, t) for t in method.towers):
                continue
            wrapper = _cached_method(
                self.cache, multimodal, owner_number, kernels, method, original
            )
            edits.set_attribute(multimodal, method.name, wrapper)


def enable_vision_cache(model: nn.Module, cache: VisionCache) -> None:
    """Answer ``model``'s image (and video) encodings from ``cache`` from now on; a model
    already using a cache switches to this one. TypeError for a ``cache`` that is not a
    VisionCache or a ``model`` that is not a module; ValueError for an unsupported family."""
    if not isinstance(cache, VisionCache):
        raise TypeError(f"cache: expected a VisionCache, got {type(cache).__name__}")
    multimodal, methods = _multimodal(model)
    disable_vision_cache(model)
    apply_feature(model, _CachedEncoding(cache, model, multimodal, methods))


def disable_vision_cache(model: nn.Module) -> None:
    """Encode every image again (a no-op when no cache is enabled). The model's entries stay in
    the cache until evicted: enabling it again finds them."""
    _multimodal(model)
    remove_feature(model, _CachedEncoding.name)


def vision_cache_of(model: nn.Module) -> VisionCache | None:
    """The cache ``model`` encodes through (None when none is enabled)."""
    _multimodal(model)
    applied = applied_features(model, _CachedEncoding.name)
    return applied[0].cache if applied else None
