"""One image's vision outputs as the :class:`~ascend_vlm.reuse.vision_cache.VisionCache` keeps
them, on its device tier or its host tier (:mod:`ascend_vlm.reuse.host_tier`) alike."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class CachedFeatures:
    """One image's outputs as cached: the output class to rebuild, whether its deepstack layers
    came as one tensor over all images (else split per image), and the tensors (the pooled
    embeddings, then one per deepstack layer). ``produced`` is an event recorded after the work
    that writes accelerator tensors, ``ready`` one recorded after the copies that bring them
    back from the host tier (None when there is nothing to wait for)."""

    output_class: type
    deepstack_joined: bool
    tensors: tuple[torch.Tensor, ...]
    produced: Any = field(default=None, compare=False)
    ready: Any = field(default=None, compare=False)

    @property
    def nbytes(self) -> int:
        return sum(tensor.numel() * tensor.element_size() for tensor in self.tensors)

    def wait_ready(self) -> None:
        """Block until the tensors may be read (their copies from the host tier are done)."""
        if self.ready is not None:
            self.ready.synchronize()
