"""A dispatch mode that records which ops reach the dispatcher (shared by the ops tests)."""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode


class RecordOps(TorchDispatchMode):
    """``with RecordOps() as recorder:`` — ``recorder.names`` lists each op, e.g.
    ``"aten.cat.default"`` or ``"ascend_vlm.swiglu.default"``, in call order."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))
