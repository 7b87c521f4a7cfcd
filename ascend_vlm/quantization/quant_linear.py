"""`QuantLinear`: a linear layer whose weight is held weight-only quantized.

``y = x @ W^T + bias`` with ``W`` the :class:`QuantizedWeight` math, computed by the op
:func:`ascend_vlm.ops.weight_quant_matmul` (torch_npu's ``npu_weight_quant_batchmatmul`` on the
NPU). The module subclasses ``nn.Linear`` so that code selecting linear layers by type (PEFT's
LoRA, the fine-tune script's target lists) takes it as one, but it holds no float weight: its
state is the buffers ``qweight``, ``scale``, ``offset`` (absent when symmetric) and a frozen
``bias``. ``weight`` is a read-only property giving an empty placeholder (shape ``(0,)``) in
the module's float dtype, on its device, for code that reads them (PEFT places adapters by
it); any arithmetic with it fails on the shape (merging an adapter into the base weights:
PEFT's ``merge_and_unload`` raises). :meth:`dequantize` gives the float weight.

On the NPU kernel path 4-bit weights are converted once to torch_npu's int4 packing
(``ops.prepack_int4_for_npu``) and kept beside the module's own layout (which saving and the
other paths read), converted again only when ``qweight`` is replaced or written: a 4-bit layer
on the NPU therefore holds its integers twice. The packing is forward only (a call whose input
needs a gradient, as under LoRA training, dequantizes instead), and deciding to use it is
Python that ``torch.compile(fullgraph=True)`` does not trace on the NPU path.
"""

from __future__ import annotations

import torch
from torch import nn

from ascend_vlm._compat.torch_internals import tensor_version
from ascend_vlm.kernel_backend import use_npu_kernels
from ascend_vlm.ops import npu_int4_kernel_takes, prepack_int4_for_npu, weight_quant_matmul
from ascend_vlm.quantization.quantized_weight import QuantizedWeight, group_count, storage_of
from ascend_vlm.quantization.rtn import check_scheme


class QuantLinear(nn.Linear):
    """A frozen linear layer of ``in_features`` -> ``out_features`` with ``bits`` (4 or 8)
    weights quantized per channel (``group_size`` 0) or per group of input columns, with an
    offset unless ``symmetric``; ``dtype`` is the scales' (and bias') dtype."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bits: int,
        group_size: int,
        symmetric: bool,
        bias: bool,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        nn.Module.__init__(self)
        check_scheme(bits, group_size)
        self.in_features = in_features
        self.out_features = out_features
        self.bits = bits
        self.group_size = group_size
        groups = group_count(in_features, group_size)
        storage, width = storage_of(bits, in_features)
        self.register_buffer(
            "qweight", torch.zeros(out_features, width, dtype=storage, device=device)
        )
        self.register_buffer("scale", torch.ones(groups, out_features, dtype=dtype, device=device))
        offset = (
            None if symmetric else torch.zeros(groups, out_features, dtype=dtype, device=device)
        )
        self.register_buffer("offset", offset)
        self.bias = (
            nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False)
            if bias
            else None
        )
        self._npu_weight: tuple[torch.Tensor, int, torch.Tensor] | None = None

    @classmethod
    def from_quantized(cls, weight: QuantizedWeight, bias: torch.Tensor | None) -> QuantLinear:
        """The layer holding ``weight`` (its tensors, not copies) and ``bias``."""
        layer = cls(
            weight.in_features,
            weight.out_features,
            weight.bits,
            weight.group_size,
            symmetric=weight.offset is None,
            bias=bias is not None,
            dtype=weight.scale.dtype,
            device="meta",
        )
        layer.qweight = weight.qweight
        layer.scale = weight.scale
        layer.offset = weight.offset
        if bias is not None:
            layer.bias = nn.Parameter(bias.detach().to(weight.scale.dtype), requires_grad=False)
        return layer

    @property
    def weight(self) -> torch.Tensor:
        """An empty placeholder in the scales' dtype, on their device (see the module
        docstring)."""
        return self.scale.new_empty(0)

    def quantized_weight(self) -> QuantizedWeight:
        """The layer's weight as a :class:`QuantizedWeight` (sharing the buffers)."""
        return QuantizedWeight(
            qweight=self.qweight,
            scale=self.scale,
            offset=self.offset,
            bits=self.bits,
            group_size=self.group_size,
            in_features=self.in_features,
        )

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The float weight ``(out_features, in_features)`` (in the scales' dtype by default)."""
        return self.quantized_weight().dequantize(dtype or self.scale.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return weight_quant_matmul(
            x, self._kernel_weight(x), self.scale, self.offset, self.bias, self.group_size
        )

    def _kernel_weight(self, x: torch.Tensor) -> torch.Tensor:
        """``qweight``, or for 4 bits where the NPU kernel takes the call its torch_npu packing
        (made once, cached)."""
        if self.bits == 8 or not use_npu_kernels(x):
            return self.qweight
        if not npu_int4_kernel_takes(x, self.out_features):
            return self.qweight

        # Keyed on the tensor itself (held, so its memory is never another tensor's) and its
        # in-place write counter.
        cached = self._npu_weight
        version = tensor_version(self.qweight)
        if cached is None or cached[0] is not self.qweight or cached[1] != version:
            packed = prepack_int4_for_npu(self.qweight, self.in_features)
            self._npu_weight = cached = (self.qweight, version, packed)
        return cached[2]

    def _apply(self, fn, recurse: bool = True):
        # Moving or casting the module makes new buffers; the packing follows on the next call.
        self._npu_weight = None
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        kind = "symmetric" if self.offset is None else "asymmetric"
        group = f"group_size={self.group_size}" if self.group_size else "per channel"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bits={self.bits}, {group}, {kind}, bias={self.bias is not None}"
        )
