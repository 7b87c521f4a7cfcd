"""Mixed-adapter batches in one pass per layer: the resident LoRA adapters stacked, so each
batch row gathers its own adapter's weights.

PEFT's mixed-batch forward (``adapter_names=``) loops over the distinct adapters of a batch in
every LoRA layer: per adapter a row selection, two small matmuls and a scatter, so 8 rows for
8 adapters cost 8 such rounds per layer per decode step, which eats most of what batching
saves. Here each LoRA layer's resident adapters are stacked, zero-padded to the largest rank
r: ``A`` as [N, r, in], ``B`` as [N, out, r], the scalings as [N]. Row i, served by adapter
a_i, adds to the base layer's output

    delta_i = s[a_i] * (x_i @ A[a_i]^T) @ B[a_i]^T

for all adapter rows at once: two batched matmuls over the weights gathered for the rows
(gathered once per call, reused at every decode step). The zero padding adds exact zeros; an
adapter a layer does not hold has zero weights and scaling there, so it adds nothing, as in
PEFT. Rows of the base are left out of the gather and get nothing added. ``generate`` with
beams or several sequences per prompt repeats each row (``repeat_interleave``); the rows'
adapters are repeated the same way.

Memory: the stacks copy every resident adapter once (at the largest rank among them), and a
call holds each row's gathered A and B for its whole duration, about rows x (in + out) x r
values per layer.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from ascend_vlm.patching.ledger import Edits, apply_feature, remove_feature


class StackedAdapters:
    """The LoRA weights of adapters ``names`` stacked per layer of ``layers`` (PEFT
    ``lora.Linear`` layers): ``weights[layer] = (A [N, r, in], B [N, out, r], scale [N])``
    with adapter ``names[k]`` at index k."""

    def __init__(self, layers: Sequence[nn.Module], names: Sequence[str]) -> None:
        self._layers = tuple(layers)
        self.names = tuple(names)
        self._copied = self._fingerprint()
        self.index = {name: position for position, name in enumerate(self.names)}
        self.weights: dict[nn.Module, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        count = len(self.names)
        for layer in layers:
            held = [name for name in self.names if name in layer.lora_A]
            if not held:
                continue
            first = layer.lora_A[held[0]].weight
            rank = max(layer.lora_A[name].weight.shape[0] for name in held)
            out_features = layer.lora_B[held[0]].weight.shape[0]
            stacked_a = first.new_zeros(count, rank, first.shape[1])
            stacked_b = first.new_zeros(count, out_features, rank)
            scale = first.new_zeros(count)
            for name in held:
                a, b = layer.lora_A[name].weight, layer.lora_B[name].weight
                stacked_a[self.index[name], : a.shape[0]] = a.detach()
                stacked_b[self.index[name], :, : b.shape[1]] = b.detach()
                scale[self.index[name]] = layer.scaling[name]
            self.weights[layer] = (stacked_a, stacked_b, scale)

    def _fingerprint(self) -> tuple:
        """What the stacks copied: every LoRA weight's device, dtype and in-place version
        counter, and every scaling."""
        state = []
        for layer in self._layers:
            for name in self.names:
                if name in layer.lora_A:
                    for weight in (layer.lora_A[name].weight, layer.lora_B[name].weight):
                        state.append((weight.device, weight.dtype, weight._version))
                    state.append(float(layer.scaling[name]))
        return tuple(state)

    def stale(self) -> bool:
        """True when a copied weight moved, changed dtype or was written since stacking."""
        return self._fingerprint() != self._copied


def plain_lora_layers(layers: Sequence[nn.Module], names: Sequence[str]) -> bool:
    """True when every layer is a PEFT ``lora.Linear`` and every adapter of ``names`` it holds
    is plain LoRA (no DoRA or other variant, no LoRA bias): the math above is all it does."""
    from peft.tuners.lora import Linear as LoraLinear

    for layer in layers:
        if not isinstance(layer, LoraLinear):
            return False
        for name in names:
            if name in layer.lora_variant or layer.lora_bias.get(name, False):
                return False
    return True


class _AdapterRows:
    """Ledger feature ``"adapter_rows"``: every layer of ``stacks`` adds row i's adapter
    ``row_adapters[i]`` (None: the base, nothing added) to its output."""

    name = "adapter_rows"

    def __init__(self, stacks: StackedAdapters, row_adapters: Sequence[str | None]) -> None:
        self.stacks = stacks
        self.batch = len(row_adapters)
        self.adapter_rows = [row for row, name in enumerate(row_adapters) if name is not None]
        self.adapter_index = [stacks.index[row_adapters[row]] for row in self.adapter_rows]
        # Per (layer, rows repeat): the rows and weights gathered for them, once per call.
        self.gathered: dict[tuple[nn.Module, int], tuple] = {}

    def install(self, edits: Edits) -> None:
        for layer in self.stacks.weights:
            edits.add_hook(layer.register_forward_hook(self._add_rows))

    def _gather(self, layer: nn.Module, repeat: int, device: torch.device) -> tuple:
        stacked_a, stacked_b, scale = self.stacks.weights[layer]
        index = torch.tensor(self.adapter_index, dtype=torch.long, device=device)
        index = index.repeat_interleave(repeat)
        rows = torch.tensor(self.adapter_rows, dtype=torch.long, device=device)
        rows = (rows[:, None] * repeat + torch.arange(repeat, device=device)).flatten()
        every_row = len(self.adapter_rows) == self.batch
        return (
            None if every_row else rows,
            stacked_a[index].transpose(1, 2),
            stacked_b[index].transpose(1, 2),
            scale[index][:, None, None],
        )

    def _add_rows(self, layer: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        x = args[0]
        if x.dim() != 3 or x.shape[0] % self.batch:
            raise RuntimeError(
                f"adapter_names: expected the layer input as [rows x {self.batch}, tokens, "
                f"features], got shape {tuple(x.shape)}"
            )
        repeat = x.shape[0] // self.batch
        key = (layer, repeat)
        if key not in self.gathered:
            self.gathered[key] = self._gather(layer, repeat, x.device)
        rows, a_t, b_t, scale_rows = self.gathered[key]
        selected = x if rows is None else x.index_select(0, rows)
        delta = torch.bmm(torch.bmm(selected.to(a_t.dtype), a_t), b_t) * scale_rows
        delta = delta.to(output.dtype)
        if rows is None:
            return output + delta
        return output.index_add(0, rows, delta)


@contextmanager
def rows_through_stacks(
    model: nn.Module, stacks: StackedAdapters, row_adapters: Sequence[str | None]
) -> Iterator[None]:
    """While inside, every layer of ``stacks`` (inside ``model``) adds row i's adapter
    ``row_adapters[i]`` (None: the base, nothing added) to its output, as the ledger feature
    ``"adapter_rows"``. The caller makes the layers compute the base alone meanwhile (no active
    adapter), so nothing is added twice."""
    if not any(name is not None for name in row_adapters):  # every row is the base
        yield
        return
    rows = _AdapterRows(stacks, row_adapters)
    apply_feature(model, rows)
    try:
        yield
    finally:
        remove_feature(model, rows)
