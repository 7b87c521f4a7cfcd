"""One switch for transformers' ``Trainer`` and the trainers built on it (TRL's ``SFTTrainer``):
:class:`AscendVLMCallback` patches the model when training begins, registers the sparse
all-reduce hook on the model DDP wraps, and adds the hook's savings to the logs.

Usage::

    trainer = Trainer(model, args, train_dataset=..., callbacks=[AscendVLMCallback()])
    trainer = SFTTrainer(model, args=..., callbacks=[AscendVLMCallback(sparse_allreduce=True)])
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from transformers import TrainerCallback

from ascend_vlm.distributed import SparseAllReduceState, register_sparse_allreduce

# The fields on_log adds while the sparse hook is registered.
BYTES_SAVED_LOG = "comm_bytes_saved"
DENSITY_LOG = "comm_density"


class AscendVLMCallback(TrainerCallback):
    """A ``transformers.TrainerCallback`` that puts ascend_vlm into a Trainer's run.

    ``patch`` (default True): on ``on_train_begin`` run :func:`ascend_vlm.patching.patch` on the
    model being trained (the base model under a PEFT wrapper, so LoRA's layers stay on the
    path). ``patch`` swaps forwards and keeps every parameter name, so what the Trainer saves (the adapter, or the whole model)
    loads in stock transformers and PEFT. A model patched already stays as it is.

    ``sparse_allreduce``: None (default) keeps DDP's own all-reduce; a
    :class:`~ascend_vlm.distributed.SparseAllReduceState`, or True for one with its defaults
    (made then, on the default process group), registers
    :func:`~ascend_vlm.distributed.sparse_allreduce_hook` on the ``DistributedDataParallel``
    wrapper of the trained model when the wrapper first runs forward: Trainer and accelerate
    wrap the model after the callbacks have met it, and DDP takes a hook until the first
    backward. One process (no process group) trains as without it. While the hook runs,
    ``on_log`` adds ``comm_bytes_saved`` (bytes this rank did not hand to all-reduce since the
    last log, against DDP's default hook) and ``comm_density`` (fraction of gradient chunks
    sent since the last log) to the logs and to ``state.log_history``. Trainer calls its
    ``report_to`` callbacks before the ones passed in ``callbacks``; they see the fields when
    this callback is put first (``trainer.callback_handler.callbacks.insert(0, callback)``).
    """

    def __init__(
        self, patch: bool = True, sparse_allreduce: SparseAllReduceState | bool | None = None
    ) -> None:
        if sparse_allreduce is False:
            sparse_allreduce = None
        if sparse_allreduce not in (None, True) and not isinstance(
            sparse_allreduce, SparseAllReduceState
        ):
            raise TypeError(
                "sparse_allreduce: expected None, a bool or a SparseAllReduceState, got "
                f"{type(sparse_allreduce).__name__}"
            )
        self.patch = patch
        # True: a default state, made when the hook is registered (it needs the process group).
        self.sparse_state: SparseAllReduceState | bool | None = sparse_allreduce
        self.hook_registered = False
        self._watch: Any = None
        self._logged = (0, 0, 0, 0)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        model = kwargs.get("model")
        if model is None:
            raise ValueError("model: expected the trained model in on_train_begin, got None")
        if self.patch:
            from ascend_vlm.patching import patch

            patch(model)  # under a PEFT wrapper: its base model; a second call changes nothing
        if self.sparse_state is not None and not self.hook_registered and _distributed():
            self._watch_for_ddp(model)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._stop_watching()

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        if not self.hook_registered or logs is None:
            return
        stats = self.sparse_state.stats
        now = (stats.bytes_dense, stats.bytes_sent, stats.chunks_probed, stats.chunks_nonzero)
        dense, sent, probed, nonzero = (a - b for a, b in zip(now, self._logged, strict=True))
        self._logged = now
        fields = {
            BYTES_SAVED_LOG: int(dense - sent),
            DENSITY_LOG: nonzero / probed if probed else 1.0,
        }
        logs.update(fields)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(fields)

    def _watch_for_ddp(self, model: torch.nn.Module) -> None:
        """Register the hook on the DDP wrapper of ``model`` at its first forward: a global
        forward pre-hook sees every module call, the wrapper's included, and removes itself."""

        def on_forward(module: torch.nn.Module, _inputs: Any) -> None:
            if isinstance(module, DistributedDataParallel) and module.module is model:
                if self.sparse_state is True:
                    self.sparse_state = SparseAllReduceState()
                register_sparse_allreduce(module, self.sparse_state)
                self.hook_registered = True
                self._stop_watching()

        self._watch = torch.nn.modules.module.register_module_forward_pre_hook(on_forward)

    def _stop_watching(self) -> None:
        if self._watch is not None:
            self._watch.remove()
            self._watch = None


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
