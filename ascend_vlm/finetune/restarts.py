"""torchrun restarts of a run's workers (``--max-restarts``): the restarted group meets in a
store of its own, and continues the run it started in ``output_dir`` from the latest
checkpoint."""

from __future__ import annotations

import dataclasses
import logging
import os
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

if TYPE_CHECKING:
    from ascend_vlm.finetune.config import TrainConfig

logger = logging.getLogger(__name__)


# The torchrun job (TORCHELASTIC_RUN_ID) that last started or continued the run in a folder.
RUN_MARKER = ".torchrun_run_id"


def restart_count() -> int:
    """How often torchrun's agent on this node has restarted its workers so far."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def attempt_store(timeout: timedelta | None) -> dict[str, Any]:
    """``init_process_group`` arguments giving a restarted single-node worker group a store of
    its own.

    After ``torchrun --max-restarts`` restarts the workers they meet again in the agent's
    store, which still holds the previous attempt's keys, so the new ranks can read a dead
    peer's address and fail to connect. On one node every rank sees the same restart count, so
    a prefix per restart keeps the attempts apart. Across nodes the counts differ (an agent
    counts only its own workers' failures), so multi-node jobs set
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, which gives every round a fresh store and turns
    this off (``TORCHELASTIC_USE_AGENT_STORE`` is then not "True"). Empty (torch's own
    ``env://`` set-up) before any restart and in those cases."""
    restarts = restart_count()
    single_node = os.environ.get("LOCAL_WORLD_SIZE") == os.environ.get("WORLD_SIZE")
    if restarts == 0 or not single_node or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    agent = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ["WORLD_SIZE"]),
        is_master=False,
        timeout=timeout or timedelta(minutes=30),
    )
    return {
        "store": dist.PrefixStore(f"ascend_vlm/attempt-{restarts}", agent),
        "rank": int(os.environ["RANK"]),
        "world_size": int(os.environ["WORLD_SIZE"]),
    }


def torchrun_job_id() -> str | None:
    """This torchrun job's id (``TORCHELASTIC_RUN_ID``: ``--rdzv-id``, a fresh one with
    ``--standalone``), or None outside torchrun or for torchrun's shared default "none"."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    return None if run_id in (None, "", "none") else run_id


def resumed_after_restart(config: TrainConfig, is_main: bool) -> TrainConfig:
    """``config`` resuming from the latest checkpoint when this torchrun job has already
    started the run in ``output_dir`` (its ``TORCHELASTIC_RUN_ID`` is in the folder's
    :data:`RUN_MARKER`): its workers were restarted after a failure (``--max-restarts``), on
    this node or another. A job that only finds another job's run there is refused as
    without torchrun; a restart of a run started with ``--resume PATH`` continues from the
    latest checkpoint, not from PATH again."""
    run_id = torchrun_job_id()
    marker = Path(config.output_dir) / RUN_MARKER
    if run_id is None or not marker.is_file() or marker.read_text(encoding="utf-8") != run_id:
        return config
    if is_main:  # one log line per job, from the main rank
        logger.warning(
            "torchrun job %s restarted its workers (restart %d on this node): resuming from the "
            "latest checkpoint",
            run_id,
            restart_count(),
        )
    return dataclasses.replace(config, resume="latest")
