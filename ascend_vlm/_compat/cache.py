"""transformers' KV cache as token pruning and batching use it: the keyword a decoder layer
receives it under, the kind of a cache layer, and replacing a dynamic layer's states.

========================== ==========================================================================
probe                      detail
========================== ==========================================================================
cache-layers               a ``DynamicCache`` holds ``DynamicLayer``s whose ``keys`` / ``values``
                           token pruning may replace, and ``get_seq_length(layer)`` /
                           ``get_mask_sizes(query, layer)`` read them (`replace_cached_states`).
========================== ==========================================================================

The probe is needed on every supported version. ``CACHE_KWARGS``' "past_key_values" is
removable once 5.25 is the lowest supported.
"""

from __future__ import annotations

import inspect

from ascend_vlm._compat.probe import NEEDED_ON_EVERY_SUPPORTED_VERSION, Probe

# The keyword a decoder layer receives its cache under: "cache" from transformers 5.25 (with
# "past_key_values" deprecated), "past_key_values" before: removable once 5.25 is the lowest
# supported.
CACHE_KWARGS = ("cache", "past_key_values")


def cache_keyword_of(model: object) -> str:
    """The keyword ``model``'s forward takes its cache under (the first of ``CACHE_KWARGS`` it
    names; a forward naming neither takes it by ``**kwargs`` as "past_key_values")."""
    parameters = inspect.signature(model.forward).parameters
    return next((name for name in CACHE_KWARGS if name in parameters), CACHE_KWARGS[-1])


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


CACHE_PROBES = (Probe("cache-layers", _cache_layers, NEEDED_ON_EVERY_SUPPORTED_VERSION),)
