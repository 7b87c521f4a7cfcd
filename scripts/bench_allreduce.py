"""Dense all-reduce vs sparse-mask all-reduce (exact and top-k) on gloo CPU ranks.

For each world size, spawns that many gloo ranks; each holds a DDP-like bucket set (64 MiB of
fp32 by default, cut at DDP's default 25 MiB bucket cap). At each chunk density, the same
random fraction of chunks is non-zero on every rank (so the density is also the union's),
with different values per rank. Per repetition the methods run back to back on fresh copies,
in an order rotated every repetition:

- ``dense``: what DDP's default ``allreduce_hook`` does (divide by world size, all-reduce);
- ``dense/again``: the same once more, so its ratio shows the measurement noise;
- ``exact``: ``sparse_allreduce_hook`` in exact mode (dense fallback cached for 16 steps);
- ``exact/probe``: exact mode with ``dense_recheck_steps=0`` (mask exchanged every step);
- ``topk``: top-k mode, ``topk_ratio=0.01`` after ``start_topk_iter=2`` warm-up steps;
- ``bound``: only what exact mode cannot avoid, as if the union were known in advance: the
  local scan of every bucket (``nonzero_mask``) and one all-reduce of a buffer of the union's
  size; no mask round, gather, divide or scatter. ``dense / bound`` is the highest speedup any
  exact-mode implementation can reach on this machine.
- ``bound+copy``: ``bound`` plus the copies every packing implementation makes: gather the
  union's chunks into the packing buffer, divide by world size, scatter the result back. Only
  the mask round is missing, so ``dense / bound+copy`` is the ceiling for exact mode as built.

Time is the slowest rank's wall time for the whole bucket set, as median and best over the
repetitions; ``speedup`` divides the dense time (both dense rows pooled) by the method's, and
``bytes`` is dense payload / sent payload per rank (mask included). On a shared machine the
best-of-n ratio is the steadier one (contention only adds time). Usage::

    .venv/bin/python scripts/bench_allreduce.py [--world-sizes 2 4] [--total-mib 64] [--reps 7]
"""

import argparse
import datetime
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a source checkout

from ascend_vlm.distributed import SparseAllReduceState
from ascend_vlm.distributed.gradient_chunks import GradientChunks, union_rows
from ascend_vlm.distributed.sparse_allreduce import _reduce_bucket

DENSITIES = (0.01, 0.10, 0.50, 1.00)
DDP_BUCKET_CAP_MIB = 25  # torch.nn.parallel.DistributedDataParallel's bucket_cap_mb default
WARMUP_REPS = 2
# Set to the link rate inside the emulated link, so the re-run command does not re-enter it.
LINK_RATE_ENV = "ASCEND_VLM_LINK_RATE"


def bucket_sizes(total_mib: int) -> list[int]:
    """fp32 element counts of DDP-style buckets: full 25 MiB buckets, then the remainder."""
    full, rest = divmod(total_mib, DDP_BUCKET_CAP_MIB)
    mibs = [DDP_BUCKET_CAP_MIB] * full + ([rest] if rest else [])
    return [mib * 2**20 // 4 for mib in mibs]


def chunk_sparse_buckets(
    sizes: list[int], density: float, chunk_size: int, rank: int
) -> list[torch.Tensor]:
    """Same non-zero chunks on every rank (seeded alike), values differing per rank."""
    buckets = []
    for index, numel in enumerate(sizes):
        num_chunks = math.ceil(numel / chunk_size)
        chosen = torch.randperm(num_chunks, generator=torch.Generator().manual_seed(index))
        keep = torch.zeros(num_chunks, dtype=torch.bool)
        keep[chosen[: math.ceil(density * num_chunks)]] = True
        values = torch.randn(numel, generator=torch.Generator().manual_seed(100 + rank))
        buckets.append(torch.where(keep.repeat_interleave(chunk_size)[:numel], values, 0.0))
    return buckets


def dense_allreduce(buffer: torch.Tensor, index: int, is_last: bool) -> torch.futures.Future:
    buffer.div_(dist.get_world_size())
    return dist.all_reduce(buffer, async_op=True).get_future()


def union_bounds(chunk_size: int, sources: list[torch.Tensor]):
    """The ``bound`` and ``bound+copy`` methods, with the union agreed on before timing.

    The union is computed as the hook computes it (MAX over the chunk masks). Returns
    ``({name: reduce_bucket}, bytes_ratio)``.
    """
    unions, spaces = [], []
    for source in sources:
        chunks = GradientChunks(source, chunk_size)
        union = chunks.nonzero_mask()
        dist.all_reduce(union, op=dist.ReduceOp.MAX)
        row_ids, with_tail, _ = union_rows(union, chunks)
        unions.append((row_ids, with_tail))
        spaces.append(source.new_empty(chunks.packed_numel(row_ids, with_tail)))

    def scan_and_send(buffer: torch.Tensor, index: int, is_last: bool) -> torch.futures.Future:
        GradientChunks(buffer, chunk_size).nonzero_mask()
        return dist.all_reduce(spaces[index], async_op=True).get_future()

    def scan_copy_and_send(buffer: torch.Tensor, index: int, is_last: bool) -> torch.futures.Future:
        chunks = GradientChunks(buffer, chunk_size)
        chunks.nonzero_mask()
        row_ids, with_tail = unions[index]
        packed = chunks.gather(row_ids, with_tail, spaces[index]).div_(dist.get_world_size())
        work = dist.all_reduce(packed, async_op=True)
        return work.get_future().then(
            lambda fut: chunks.scatter_(row_ids, with_tail, fut.value()[0])
        )

    dense_numel = sum(source.numel() for source in sources)
    bytes_ratio = dense_numel / max(1, sum(space.numel() for space in spaces))
    return {"bound": scan_and_send, "bound+copy": scan_copy_and_send}, bytes_ratio


def timed(reduce_bucket, sources: list[torch.Tensor]) -> float:
    """Slowest rank's seconds to reduce fresh copies of all buckets (copying not timed)."""
    buffers = [source.clone() for source in sources]
    dist.barrier()
    started = time.perf_counter()
    futures = [  # DDP hooks buckets in index order, the last one flagged is_last
        reduce_bucket(buffer, index, index == len(buffers) - 1)
        for index, buffer in enumerate(buffers)
    ]
    torch.futures.wait_all(futures)
    elapsed = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def rank_main(rank: int, world_size: int, store: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=600),
    )
    sizes = bucket_sizes(args.total_mib)
    for density in DENSITIES:
        sources = chunk_sparse_buckets(sizes, density, args.chunk_size, rank)
        states = {
            "exact": SparseAllReduceState(chunk_size=args.chunk_size),
            "exact/probe": SparseAllReduceState(chunk_size=args.chunk_size, dense_recheck_steps=0),
            "topk": SparseAllReduceState(
                mode="topk", chunk_size=args.chunk_size, start_topk_iter=WARMUP_REPS
            ),
        }
        methods = {"dense": dense_allreduce, "dense/again": dense_allreduce} | {
            name: (lambda b, i, last, s=state: _reduce_bucket(s, b, i, last))
            for name, state in states.items()
        }
        bounds, bound_bytes_ratio = union_bounds(args.chunk_size, sources)
        methods |= bounds
        other_bytes = {"dense": 1.0, "dense/again": 1.0} | dict.fromkeys(bounds, bound_bytes_ratio)
        seconds: dict[str, list[float]] = {name: [] for name in methods}
        for rep in range(WARMUP_REPS + args.reps):
            if rep == WARMUP_REPS:
                for state in states.values():
                    state.reset_stats()
            names = list(methods)
            shift = rep % len(names)  # rotate the order so no method always runs first
            for name in names[shift:] + names[:shift]:
                elapsed = timed(methods[name], sources)
                if rep >= WARMUP_REPS:
                    seconds[name].append(elapsed)
        if rank == 0:
            dense_samples = seconds["dense"] + seconds["dense/again"]
            dense_median, dense_best = statistics.median(dense_samples), min(dense_samples)
            for name in methods:
                median, best = statistics.median(seconds[name]), min(seconds[name])
                bytes_ratio = (
                    states[name].stats.bytes_ratio if name in states else other_bytes[name]
                )
                print(
                    f"| {world_size} | {100 * density:3.0f}% | {name:<11} | {1e3 * median:6.1f} "
                    f"| {1e3 * best:6.1f} | {dense_median / median:5.2f}x "
                    f"| {dense_best / best:5.2f}x | {bytes_ratio:5.1f}x |",
                    flush=True,
                )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--total-mib", type=int, default=64)
    parser.add_argument("--chunk-size", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument(
        "--link-rate",
        help="run over an emulated link of this rate (tc units, e.g. 2gbit): the ranks talk "
        "over a loopback shaped by scripts/emulated_link.sh",
    )
    args = parser.parse_args()
    if args.link_rate is not None and not args.link_rate:
        parser.error("--link-rate: expected a rate in tc units (e.g. 2gbit), got ''")
    if args.link_rate and os.environ.get(LINK_RATE_ENV) != args.link_rate:
        # Re-run this command inside the emulated link; the variable marks the inner run.
        helper = Path(__file__).resolve().parent / "emulated_link.sh"
        os.environ[LINK_RATE_ENV] = args.link_rate
        command = [str(helper), args.link_rate, "--", sys.executable, *sys.argv]
        os.execv(command[0], command)
    print("command:", " ".join([os.path.relpath(sys.executable), *sys.argv]))
    link = f"emulated {args.link_rate} link (one shaped loopback)" if args.link_rate else "loopback"
    print(
        f"torch {torch.__version__}, gloo on CPU over {link}, {os.cpu_count()} cores "
        f"(load average {os.getloadavg()[0]:.1f} at start), "
        f"buckets (MiB): {[n * 4 // 2**20 for n in bucket_sizes(args.total_mib)]}, "
        f"chunk_size={args.chunk_size}, median of {args.reps} reps after {WARMUP_REPS} warm-up"
    )
    print("| ranks | density | method      | median ms | best ms | speedup (median) |", end="")
    print(" speedup (best) | bytes |")
    print("|--:|--:|:--|--:|--:|--:|--:|--:|")
    with tempfile.TemporaryDirectory() as tmp:
        for world_size in args.world_sizes:
            store = os.path.join(tmp, f"store_{world_size}")
            mp.spawn(rank_main, args=(world_size, store, args), nprocs=world_size)


if __name__ == "__main__":
    main()
