"""How far one capture is from the reference's: relative L2, max abs and cosine, summed over
inputs.

For a capture ``t`` and its reference ``r`` (flattened, every tensor of the capture joined):

* relative L2 = ||t - r|| / ||r||
* max abs     = max |t - r|
* cosine      = <t, r> / (||t|| ||r||)

Over several inputs the sums behind them add up (:class:`ErrorSums`), so the relative L2 of a
module is that of all its captures joined, and only five numbers per module outlive an input.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def error_sums(test: tuple[torch.Tensor, ...], reference: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The five sums of ``test`` against ``reference`` (tuples of tensors of the same sizes),
    computed where ``test`` lives in ``reference``'s dtype: a 1-D tensor
    ``[sum (t - r)^2, sum r^2, sum t^2, sum t r, max |t - r|]``; when the sizes differ (the
    module's output is not comparable) ``[inf, 1, inf, 0, inf]``: relative L2 and max abs
    infinite, cosine 0."""
    device, dtype = test[0].device, reference[0].dtype
    t = torch.cat([tensor.detach().reshape(-1).to(dtype) for tensor in test])
    r = torch.cat([tensor.reshape(-1).to(device) for tensor in reference])
    if t.numel() != r.numel():
        return torch.tensor([math.inf, 1.0, math.inf, 0.0, math.inf], dtype=dtype, device=device)
    difference = t - r
    return torch.stack(
        [
            difference.square().sum(),
            r.square().sum(),
            t.square().sum(),
            (t * r).sum(),
            difference.abs().max() if difference.numel() else difference.new_zeros(()),
        ]
    )


@dataclass
class ErrorSums:
    """The sums of one capture point over the inputs seen so far (see the module docstring)."""

    difference_squared: float = 0.0
    reference_squared: float = 0.0
    test_squared: float = 0.0
    dot: float = 0.0
    max_abs: float = 0.0

    def add(self, sums: list[float]) -> None:
        """Add one input's sums (`error_sums`, as floats)."""
        difference_squared, reference_squared, test_squared, dot, max_abs = sums
        self.difference_squared += difference_squared
        self.reference_squared += reference_squared
        self.test_squared += test_squared
        self.dot += dot
        self.max_abs = max(self.max_abs, max_abs)

    @property
    def relative_l2(self) -> float:
        """||t - r|| / ||r|| (0 when both are zero, inf when only r is)."""
        if self.reference_squared == 0.0:
            return 0.0 if self.difference_squared == 0.0 else math.inf
        return math.sqrt(self.difference_squared / self.reference_squared)

    @property
    def cosine(self) -> float:
        """<t, r> / (||t|| ||r||) (1 when both are zero)."""
        norms = math.sqrt(self.test_squared * self.reference_squared)
        if norms == 0.0:
            return 1.0 if self.difference_squared == 0.0 else 0.0
        return self.dot / norms
