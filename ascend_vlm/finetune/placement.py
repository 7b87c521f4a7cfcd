"""Where a training process runs (:class:`ProcessPlacement`: rank, device, process group) and how
a failed collective is told apart from other errors."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ascend_vlm.finetune.restarts import attempt_store, restart_count


@dataclass(frozen=True)
class ProcessPlacement:
    """Where this process runs: its rank (global and on its node) among ``world_size``
    processes, its device and its autocast dtype (None: no autocast)."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    autocast_dtype: torch.dtype | None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()

    def all_reduce_sum(self, values: Sequence[float]) -> list[float]:
        """Element-wise sum of ``values`` over ranks: float64 on the CPU (gloo); float32 on NPU,
        as HCCL's float64 all-reduce support is not confirmed in our reference notes."""
        dtype = torch.float64 if self.device.type == "cpu" else torch.float32
        tensor = torch.tensor(list(values), dtype=dtype)
        if dist.is_initialized():
            tensor = tensor.to(self.device)
            dist.all_reduce(tensor)
        return tensor.cpu().tolist()

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)


def _npu_available() -> bool:
    """True when a real torch_npu sees a device (``kernel_backend.active_backend() == "npu"``)."""
    from ascend_vlm.kernel_backend import active_backend

    return active_backend() == "npu"


def init_process_placement(collective_timeout: float | None = None) -> ProcessPlacement:
    """Join torchrun's process group (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` from its env).

    NPU: backend ``hccl`` on ``npu:<local_rank>`` with bf16 autocast (torch_npu registers the
    "hccl" backend on import, Ascend/pytorch ``torch_npu/_init/registry/distributed.py``).
    Otherwise ``gloo`` on the CPU in fp32. A single process needs no process group.
    ``collective_timeout`` (seconds, None: torch's default) bounds every collective of the
    group; on NPU, HCCL's own ``HCCL_EXEC_TIMEOUT`` bounds the device side too.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if _npu_available():
        torch.npu.set_device(local_rank)
        device, backend, dtype = torch.device("npu", local_rank), "hccl", torch.bfloat16
    else:
        device, backend, dtype = torch.device("cpu"), "gloo", None
    if world_size > 1 and not dist.is_initialized():
        timeout = None if collective_timeout is None else timedelta(seconds=collective_timeout)
        dist.init_process_group(backend=backend, timeout=timeout, **attempt_store(timeout))
    return ProcessPlacement(rank, local_rank, world_size, device, dtype)


class CollectiveFailure(RuntimeError):
    """A training step's collective timed out or lost a peer: the job cannot go on."""


# Words of the errors gloo raises (as plain RuntimeErrors) when a collective times out or a
# peer's connection goes away. HCCL's on the NPU are not known here: they pass unchanged.
_COMMUNICATION_FAILURES = (
    "timed out",
    "connection closed",
    "connection reset",
    "broken pipe",
    "socket closed",
)


def is_communication_failure(error: RuntimeError) -> bool:
    """True for gloo's errors of a collective that timed out or lost its peer."""
    text = str(error).lower()
    return any(marker in text for marker in _COMMUNICATION_FAILURES)


# How long the ranks that noticed a failed collective wait for the others to answer a roll call.
ROLL_CALL_SECONDS = 5.0


def unresponsive_ranks() -> list[int] | None:
    """The ranks that do not answer a roll call in the job's TCP store (``MASTER_ADDR`` /
    ``MASTER_PORT``, torchrun's or rank 0's) within :data:`ROLL_CALL_SECONDS`.

    After a collective times out, gloo closes the connections it timed out on, so the process
    group can no longer ask; the store still can. Every rank that noticed the failure answers;
    a rank that is hung or gone does not. None when the store does not answer either.
    """
    if not dist.is_initialized() or "MASTER_ADDR" not in os.environ:
        return None
    rank, world_size = dist.get_rank(), dist.get_world_size()
    wait = timedelta(seconds=ROLL_CALL_SECONDS)
    prefix = f"ascend_vlm/roll-call/{restart_count()}"
    try:
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=wait
        )
        store.set(f"{prefix}/{rank}", "here")
        deadline = time.monotonic() + ROLL_CALL_SECONDS
        while True:
            answered = {r for r in range(world_size) if store.check([f"{prefix}/{r}"])}
            if len(answered) == world_size or time.monotonic() > deadline:
                return sorted(set(range(world_size)) - answered)
            time.sleep(0.1)
    except RuntimeError:  # the store is gone or hung with its host (rank 0)
        return None


def collective_failure(error: RuntimeError, step: int, timeout: float) -> CollectiveFailure:
    """The :class:`CollectiveFailure` of ``error`` at ``step``, naming the ranks that stopped
    responding when a roll call finds them, else the rank that noticed."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    silent = unresponsive_ranks()
    if silent:
        who = f"rank {', '.join(map(str, silent))} stopped responding (noticed by rank {rank})"
    else:
        who = f"rank {rank} noticed that another rank is hung, stopped or gone"
    first_line = str(error).strip().splitlines()[0]
    return CollectiveFailure(
        f"step {step}: {who}: a collective did not complete within --collective-timeout "
        f"{timeout:g} s or lost its peer ({first_line})"
    )
