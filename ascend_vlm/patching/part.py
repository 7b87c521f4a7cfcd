"""What every module adapter sees of the part it patches (`Part`, with the bound on its RoPE
tables, `rope_table_scale`)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from torch import nn


@dataclass
class Part:
    """What an adapter sees of the part (``name`` "text" or "vision") it patches: the part's
    modules and the options `patch` was called with."""

    name: str
    modules: list[nn.Module]
    options: dict[str, bool]

    def enabled(self, kind: str) -> bool:
        """Whether `patch`'s options ask for modules of `kind` (an option name: "attention",
        "norm", "rope", "mlp") here."""
        return (self.name == "text" or self.options["vision"]) and self.options[kind]

    @functools.cached_property
    def rope_table_scale(self) -> float:
        """A bound on |cos| and |sin| of the RoPE tables made in this part (`rope_table_scale`)."""
        return rope_table_scale(self.modules)


def rope_table_scale(modules: list[nn.Module]) -> float:
    """A bound on |cos| and |sin| of the RoPE tables made in one part of a model: the largest
    ``attention_scaling`` (or per-layer-type ``<type>_attention_scaling``, Gemma3) that its
    rotary embedding modules multiply their tables by, and at least 1.0 (unit tables).

    Read once at patch time; the factor is fixed at the module's construction (dynamic and
    longrope updates change the frequencies, not the factor). Any bound gives the same result
    (ops.rotary_embedding's ``table_scale``), so one bound serves every rotary module.
    """
    scales = [
        value
        for module in modules
        for name, value in vars(module).items()
        if name.endswith("attention_scaling") and type(value) in (float, int)
    ]
    return float(max([1.0, *scales]))
