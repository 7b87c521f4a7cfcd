"""Run a job in spawned gloo ranks (CPU) and surface the first rank's failure as a test error."""

from __future__ import annotations

import datetime
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run_ranks(world_size: int, tmp_path: Path, job: Callable[..., None], *args: Any) -> None:
    """Call ``job(rank, world_size, *args)`` in ``world_size`` spawned processes.

    ``job`` must be a module-level function; the default process group is gloo over a
    FileStore in ``tmp_path``. A failing rank makes ``mp.spawn`` stop the others and raise.
    """
    store_file = tmp_path / f"store_{job.__name__}_{world_size}"
    mp.spawn(_rank_main, args=(world_size, str(store_file), job, args), nprocs=world_size)


def _rank_main(
    rank: int, world_size: int, store_file: str, job: Callable[..., None], args: tuple
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store_file}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        job(rank, world_size, *args)
    finally:
        dist.destroy_process_group()
