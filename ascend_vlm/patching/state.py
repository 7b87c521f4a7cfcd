"""`PatchState`: what the adapters of one installation of `patch` work with."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ascend_vlm.patching.ledger import Edits
from ascend_vlm.patching.report import PatchReport


@dataclass
class PatchState:
    """The options `patch` runs with, the report being written, and the ledger's edits every
    change goes through (so removing the patch feature reverts it)."""

    options: dict
    report: PatchReport
    edits: Edits

    def rebind(self, module: nn.Module, name: str, value: object) -> None:
        """Set instance attribute `name` of `module` to `value` (`Edits.set_attribute`)."""
        self.edits.set_attribute(module, name, value)
