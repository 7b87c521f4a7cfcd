"""`PatchReport`: what `patch` swapped in one model and what it left alone, and why."""

from __future__ import annotations

from dataclasses import dataclass, field

from ascend_vlm._compat.attention import ATTENTION_NAME
from ascend_vlm.models.family_spec import KINDS

# Ends the op text of a swap the generic path made after a numerical probe agreed with it.
PROBE_VERIFIED = "probe-verified"


@dataclass
class PatchReport:
    """What `patch` did to one model: swapped modules per kind and what was left alone and why."""

    model_type: str
    swapped: dict[tuple[str, str, str], int] = field(default_factory=dict)
    left_alone: dict[tuple[str, str, str], int] = field(default_factory=dict)
    attention_implementation: str = ATTENTION_NAME

    def record_swapped(self, kind: str, module: str, op: str) -> None:
        """One more module of class `module` and `kind` routed to `op`."""
        self.swapped[(kind, module, op)] = self.swapped.get((kind, module, op), 0) + 1

    def record_left_alone(self, kind: str, module: str, reason: str) -> None:
        """One more module of class `module` and `kind` kept, because of `reason`."""
        key = (kind, module, reason)
        self.left_alone[key] = self.left_alone.get(key, 0) + 1

    def swapped_count(self, kind: str) -> int:
        """Number of modules of `kind` (one of KINDS) routed to a fused op."""
        return sum(n for (k, _, _), n in self.swapped.items() if k == kind)

    def probe_verified(self) -> list[tuple[str, str, str, int]]:
        """(kind, module, op, count) of the swaps a numerical probe verified (`strict=False` on
        a model no family describes), sorted."""
        return [
            (kind, module, op, count)
            for (kind, module, op), count in sorted(self.swapped.items())
            if op.endswith(PROBE_VERIFIED)
        ]

    def left_alone_count(self, kind: str) -> int:
        return sum(n for (k, _, _), n in self.left_alone.items() if k == kind)

    def as_dict(self) -> dict:
        return {
            "model_type": self.model_type,
            "attention_implementation": self.attention_implementation,
            "swapped": [
                {"kind": k, "module": m, "op": op, "count": n}
                for (k, m, op), n in sorted(self.swapped.items())
            ],
            "left_alone": [
                {"kind": k, "module": m, "reason": why, "count": n}
                for (k, m, why), n in sorted(self.left_alone.items())
            ],
            "probe_verified": sum(count for *_, count in self.probe_verified()),
            "totals": {
                kind: {
                    "swapped": self.swapped_count(kind),
                    "left_alone": self.left_alone_count(kind),
                }
                for kind in KINDS
            },
        }

    def __str__(self) -> str:
        rows = [("kind", "module", "count", "-> op / left alone because")]
        rows += [(k, m, str(n), f"-> {op}") for (k, m, op), n in sorted(self.swapped.items())]
        rows += [
            (k, m, str(n), f"kept: {why}") for (k, m, why), n in sorted(self.left_alone.items())
        ]
        widths = [max(len(row[i]) for row in rows) for i in range(3)]
        lines = [f"ascend_vlm.patch report for model_type={self.model_type!r}"]
        for index, row in enumerate(rows):
            lines.append(
                "  ".join(cell.ljust(w) for cell, w in zip(row[:3], widths, strict=True))
                + "  "
                + row[3]
            )
            if index == 0:
                lines.append("  ".join("-" * w for w in widths) + "  " + "-" * len(row[3]))
        return "\n".join(lines)
