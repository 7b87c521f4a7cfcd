"""`enable_vision_cache` / `disable_vision_cache`: route a model's vision encoding through a
:class:`~ascend_vlm.reuse.vision_cache.VisionCache`.

The multimodal model's ``get_image_features`` (and ``get_video_features``) is rebound on the
instance to a wrapper that splits the call into images, answers the cached ones from the cache,
encodes the rest in one call to the original method and reassembles the per-image outputs in
order. Everything downstream (token merging, M-RoPE, pruning) sees what the original returns.
The entries carry a fingerprint of the vision weights (every parameter's identity and in-place
write counter, and PEFT's active adapters), so ``load_state_dict``, an optimizer step, a LoRA
switch or ``model.to(...)`` turns every old entry into a miss.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ascend_vlm._compat import tensor_version
from ascend_vlm.reuse.vision_cache import VisionCache

_STATE_KEY = "_ascend_vlm_vision_cache"
# Arguments that shape the output object, not the features.
_OUTPUT_FLAGS = frozenset({"return_dict", "output_attentions", "output_hidden_states"})


@dataclass(frozen=True)
class _Method:
    """A feature method of a family: its name, the argument carrying per-item grids (items are
    rows of ``pixel_values`` counted by the grid's product) or None (items are the first axis),
    and the submodules whose weights produce the features."""

    name: str
    grid: str | None
    towers: tuple[str, ...]


_QWEN = (
    _Method("get_image_features", "image_grid_thw", ("visual",)),
    _Method("get_video_features", "video_grid_thw", ("visual",)),
)
FAMILIES: dict[str, tuple[_Method, ...]] = {
    "qwen2_vl": _QWEN,
    "qwen2_5_vl": _QWEN,
    "qwen3_vl": _QWEN,
    "llava": (_Method("get_image_features", None, ("vision_tower", "multi_modal_projector")),),
}


def _weights_fingerprint(towers: list[nn.Module]) -> tuple:
    parameters = tuple(
        (id(parameter), tensor_version(parameter), parameter.dtype, parameter.device)
        for tower in towers
        for parameter in tower.parameters()
    )
    # PEFT's tuner layers name their active adapters (a list); switching adapters changes no
    # parameter, so the names enter the fingerprint.
    adapters = tuple(
        tuple(active)
        for tower in towers
        for module in tower.modules()
        if isinstance(active := getattr(module, "active_adapters", None), (list, tuple))
    )
    return parameters, adapters


def _items(pixels: torch.Tensor, grid: torch.Tensor | None) -> list[tuple[torch.Tensor, tuple]]:
    """``(pixels, grid)`` per image: grid rows split the patch rows, else the first axis."""
    if grid is None:
        return [(pixels[index : index + 1], ()) for index in range(pixels.shape[0])]
    sizes = grid.prod(dim=-1).tolist()
    rows = torch.split(pixels, sizes)
    return [(part, tuple(row)) for part, row in zip(rows, grid.tolist(), strict=True)]


def _per_image(output: Any) -> list[tuple]:
    """Each image's outputs: ``(output class, deepstack joined?, pooled embeddings, deepstack
    features per layer...)``. Deepstack layers come split per image (transformers >= 5.25) or
    as one tensor over all images (earlier), and are given back the same way."""
    pooled = list(output.pooler_output)
    deepstack = list(getattr(output, "deepstack_features", None) or [])
    joined = bool(deepstack) and isinstance(deepstack[0], torch.Tensor)
    if joined:
        sizes = [embedding.shape[0] for embedding in pooled]
        deepstack = [torch.split(layer, sizes) for layer in deepstack]
    return [
        (type(output), joined, embedding, *(layer[index] for layer in deepstack))
        for index, embedding in enumerate(pooled)
    ]


def _assembled(values: list[tuple]) -> Any:
    """The output object of the images ``values`` (as `_per_image` gives them), in order."""
    output_class, joined = values[0][0], values[0][1]
    fields: dict[str, Any] = {"pooler_output": tuple(value[2] for value in values)}
    depth = len(values[0]) - 3
    if depth:
        layers = [tuple(value[3 + layer] for value in values) for layer in range(depth)]
        fields["deepstack_features"] = [torch.cat(parts) for parts in layers] if joined else layers
    return output_class(**fields)


def _cached_method(
    cache: VisionCache, owner: nn.Module, method: _Method, original: Callable
) -> Callable:
    towers = [getattr(owner, name) for name in method.towers]

    # generate() picks the encoder's keyword arguments from its signature: keep the original's.
    @functools.wraps(original)
    def cached(pixel_values: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        grid = None
        if method.grid is not None:
            grid, args = (args[0], args[1:]) if args else (kwargs.pop(method.grid, None), ())
            if grid is None:
                return original(pixel_values, **kwargs)
        if kwargs.get("image_sizes") is not None:
            return original(pixel_values, *args, **kwargs)  # a layout it does not split
        items = _items(pixel_values, grid)
        # the feature-selecting arguments (e.g. LLaVA's vision_feature_layer) are part of the key
        chosen = sorted(
            (name, value) for name, value in kwargs.items() if name not in _OUTPUT_FLAGS
        )
        selection = repr((args, chosen))
        keys = [(key, selection) for key in cache.image_keys(items)]
        fingerprint = _weights_fingerprint(towers)
        values = cache.lookup(id(owner), fingerprint, keys)
        missing = [index for index, value in enumerate(values) if value is None]
        if missing:
            pixels = torch.cat([items[index][0] for index in missing])
            grids = () if grid is None else (grid[missing],)
            output = original(pixels, *grids, *args, **kwargs)
            for index, value in zip(missing, _per_image(output), strict=True):
                values[index] = value
                cache.store(id(owner), fingerprint, keys[index], value)
        return _assembled(values)

    return cached


def _multimodal(model: nn.Module) -> tuple[nn.Module, tuple[_Method, ...]]:
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"model: expected a torch.nn.Module (a transformers VLM, optionally PEFT-wrapped), "
            f"got {type(model).__name__}"
        )
    get_base_model = getattr(model, "get_base_model", None)
    base = get_base_model() if callable(get_base_model) else model
    model_type = getattr(getattr(base, "config", None), "model_type", None)
    methods = FAMILIES.get(model_type)
    multimodal = getattr(base, "model", None)
    if methods is None or not isinstance(multimodal, nn.Module):
        raise ValueError(
            f"model: the vision cache supports model_type {', '.join(FAMILIES)}; got "
            f"{type(base).__name__} with model_type {model_type!r}"
        )
    return multimodal, methods


def enable_vision_cache(model: nn.Module, cache: VisionCache) -> None:
    """Answer ``model``'s image (and video) encodings from ``cache`` from now on; a model
    already using a cache switches to this one. TypeError for a ``cache`` that is not a
    VisionCache or a ``model`` that is not a module; ValueError for an unsupported family."""
    if not isinstance(cache, VisionCache):
        raise TypeError(f"cache: expected a VisionCache, got {type(cache).__name__}")
    multimodal, methods = _multimodal(model)
    disable_vision_cache(model)
    previous = {}
    for method in methods:
        original = getattr(multimodal, method.name, None)
        if original is None or not all(hasattr(multimodal, t) for t in method.towers):
            continue
        previous[method.name] = multimodal.__dict__.get(method.name)
        multimodal.__dict__[method.name] = _cached_method(cache, multimodal, method, original)
    multimodal.__dict__[_STATE_KEY] = (cache, previous)


def disable_vision_cache(model: nn.Module) -> None:
    """Encode every image again (a no-op when no cache is enabled)."""
    multimodal, _ = _multimodal(model)
    state = multimodal.__dict__.pop(_STATE_KEY, None)
    if state is None:
        return
    for name, previous in state[1].items():
        if previous is None:
            multimodal.__dict__.pop(name, None)
        else:
            multimodal.__dict__[name] = previous


def vision_cache_of(model: nn.Module) -> VisionCache | None:
    """The cache ``model`` encodes through (None when none is enabled)."""
    multimodal, _ = _multimodal(model)
    state = multimodal.__dict__.get(_STATE_KEY)
    return None if state is None else state[0]
