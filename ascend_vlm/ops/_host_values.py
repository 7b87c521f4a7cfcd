"""Host-side values read from small device tensors, kept per tensor object and in-place version.

transformers hands one attention mask and one ``cu_seqlens`` tensor to every layer of a forward.
Reading such a tensor on the host is a device synchronisation on NPU; keeping the answer per
tensor object (and its in-place version counter) makes it one read per forward instead of one per
layer, however many places ask. Inference tensors have no version counter and are read on every
call.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Generic, TypeVar

import torch

from ascend_vlm._compat.torch_internals import fake_tensor_test

Value = TypeVar("Value")
_is_fake = fake_tensor_test()


class HostValueCache(Generic[Value]):
    """``cache(tensor)`` is ``read(tensor)``, computed once per tensor object and version.

    ``read`` must return an immutable value (callers share it). An entry leaves with its tensor.
    """

    def __init__(self, read: Callable[[torch.Tensor], Value]) -> None:
        self._read = read
        # id(tensor) -> (weak reference, version counter, value)
        self._entries: dict[int, tuple[weakref.ref, int, Value]] = {}

    def __call__(self, tensor: torch.Tensor) -> Value:
        key = id(tensor)
        cached = self._entries.get(key)
        trackable = not tensor.is_inference()
        if (
            trackable
            and cached is not None
            and cached[0]() is tensor
            and cached[1] == tensor._version
        ):
            return cached[2]
        value = self._read(tensor)
        if trackable:
            entries = self._entries
            reference = weakref.ref(tensor, lambda _: entries.pop(key, None))
            entries[key] = (reference, tensor._version, value)
        return value


def readable_on_host(tensor: torch.Tensor) -> bool:
    """False for the fake tensors ``torch.compile``, AOT autograd and ``torch.export`` trace
    with: their values do not exist, so a caller takes its value-independent path instead."""
    return not _is_fake(tensor)
