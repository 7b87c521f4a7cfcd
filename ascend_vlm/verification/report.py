"""`VerifyReport`: how far each captured module of a model is from the reference, against the
noise floor, and the first module over the line."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ascend_vlm._files import atomic_write_text
from ascend_vlm.verification.end_to_end import EndToEndReport


def capture_label(name: str, call: int) -> str:
    """How a capture is named to a reader: the point's name, with its call index after the
    first call."""
    return name if call == 0 else f"{name} [call {call}]"


@dataclass(frozen=True)
class ModuleError:
    """One capture (``name``, its ``call`` index within a forward) at execution ``depth``: the
    model's error against the reference, the noise floor's (the stock model in the test dtype on
    the CPU) and whether the model's relative L2 exceeds ``threshold`` = k * floor + slack."""

    depth: int
    name: str
    call: int
    kind: str
    relative_l2: float
    max_abs: float
    cosine: float
    floor_relative_l2: float
    floor_max_abs: float
    floor_cosine: float
    threshold: float

    @property
    def flagged(self) -> bool:
        return self.relative_l2 > self.threshold

    @property
    def ratio(self) -> float:
        """The model's relative L2 over the floor's (inf over a zero floor, 0 when both are)."""
        if self.floor_relative_l2 == 0.0:
            return 0.0 if self.relative_l2 == 0.0 else float("inf")
        return self.relative_l2 / self.floor_relative_l2

    @property
    def label(self) -> str:
        return capture_label(self.name, self.call)


@dataclass
class VerifyReport:
    """What `ascend_vlm.verify` found: the settings (``backend``: the kernel backend the ops
    ran, `kernel_backend.active_backend`), one :class:`ModuleError` per capture in
    execution order, the first flagged one (None when none is), the captures the reference made
    that the model did not (``not_captured``: a module another feature replaced), the host's
    peak memory rise over the run (None where not measurable), the end-to-end comparison (None
    unless asked for) and the path of the flagged module's repro (None unless asked for, or
    ``repro_problem`` saying why it could not be written)."""

    model_type: str
    patched: bool
    device: str
    backend: str
    dtype: str
    reference_dtype: str
    k: float
    slack: float
    inputs: int
    modules: list[ModuleError]
    not_captured: list[str] = field(default_factory=list)
    peak_host_bytes: int | None = None
    end_to_end: EndToEndReport | None = None
    repro: str | None = None
    repro_problem: str | None = None

    @property
    def first_flagged(self) -> ModuleError | None:
        """The first module in execution order whose error exceeds its threshold."""
        return next((module for module in self.modules if module.flagged), None)

    @property
    def flagged(self) -> list[ModuleError]:
        return [module for module in self.modules if module.flagged]

    def as_dict(self) -> dict:
        first = self.first_flagged
        return {
            "model_type": self.model_type,
            "patched": self.patched,
            "device": self.device,
            "backend": self.backend,
            "dtype": self.dtype,
            "reference_dtype": self.reference_dtype,
            "k": self.k,
            "slack": self.slack,
            "inputs": self.inputs,
            "first_flagged": None if first is None else {**asdict(first), "ratio": first.ratio},
            "flagged": len(self.flagged),
            "not_captured": self.not_captured,
            "peak_host_bytes": self.peak_host_bytes,
            "end_to_end": None if self.end_to_end is None else self.end_to_end.to_json(),
            "repro": self.repro,
            "repro_problem": self.repro_problem,
            "modules": [
                {**asdict(module), "ratio": module.ratio, "flagged": module.flagged}
                for module in self.modules
            ],
        }

    def write_json(self, path: str | os.PathLike) -> None:
        """Write :meth:`as_dict` to ``path`` (replaced atomically)."""
        atomic_write_text(Path(path), json.dumps(self.as_dict(), indent=2) + "\n")

    def verdict(self) -> str:
        first = self.first_flagged
        if first is None:
            return (
                f"no module exceeds {self.k:g} x its noise floor + {self.slack:g} "
                f"({len(self.modules)} captures)"
            )
        return (
            f"first module over {self.k:g} x its noise floor: {first.label} ({first.kind}), "
            f"relative L2 {first.relative_l2:.3g} = {first.ratio:.3g} x its floor "
            f"{first.floor_relative_l2:.3g} ({len(self.flagged)} of {len(self.modules)} "
            f"captures flagged)"
        )

    def __str__(self) -> str:
        state = "patched" if self.patched else "stock"
        lines = [
            f"ascend_vlm.verify report for model_type={self.model_type!r}: {state} model in "
            f"{self.dtype} on {self.device} ({self.backend} kernels) vs the "
            f"{self.reference_dtype} reference on the CPU, {self.inputs} input(s)",
            self.verdict(),
        ]
        header = ("depth", "module", "kind", "rel L2", "floor", "x floor", "max abs", "cosine", "")
        rows = [header] + [
            (
                str(m.depth),
                m.label,
                m.kind,
                f"{m.relative_l2:.3g}",
                f"{m.floor_relative_l2:.3g}",
                f"{m.ratio:.3g}",
                f"{m.max_abs:.3g}",
                f"{m.cosine:.6f}",
                "FLAGGED" if m.flagged else "",
            )
            for m in self.modules
        ]
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        for index, row in enumerate(rows):
            lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
            if index == 0:
                lines.append("  ".join("-" * w for w in widths).rstrip())
        if self.not_captured:
            lines.append(f"not captured in the model: {', '.join(self.not_captured)}")
        if self.end_to_end is not None:
            lines += ["", self.end_to_end.table()]
        if self.repro is not None:
            lines.append(f"repro of the first flagged module: {self.repro}")
        if self.repro_problem is not None:
            lines.append(f"no repro of the first flagged module: {self.repro_problem}")
        return "\n".join(lines)
