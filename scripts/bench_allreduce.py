"""DDP step time of gradient-communication options on an embedding whose rows are touched at
random: the default hook, ``sparse_allreduce_hook`` with its defaults, torch's fp16/bf16
compression hooks and PowerSGD, and ``nn.Embedding(sparse=True)``.

Every rank holds one model per method, all starting from the same weights: a single
``nn.Embedding`` of ``--total-mib`` fp32 (rows of ``--width``), the loss ``sum(embed(tokens) *
w)``. Each step every rank draws its own random ``density`` of the rows (its batch's tokens,
distinct per rank) and ``w``; every method sees the same draws. One round runs one step of
each method, in an order rotated every round; the step (forward, backward with DDP's
communication, SGD step) is timed on the slowest rank, and the table shows the median over
``--rounds`` rounds after ``--warmup`` rounds. Methods:

- ``default``: DDP with no hook (its built-in all-reduce of the dense gradient);
- ``default (A/A)``: a second, identical model; its ratio to ``default`` (column A/A) is the
  noise of the measurement;
- ``ours``: ``register_sparse_allreduce(model, SparseAllReduceState())``;
- ``fp16``, ``bf16``: ``fp16_compress_hook``, ``bf16_compress_hook``;
- ``PowerSGD r1``, ``PowerSGD r4``: ``powerSGD_hook`` of rank 1 and 4 (error feedback, warm
  start, compressing from the second step);
- ``sparse embedding``: ``nn.Embedding(sparse=True)`` under DDP (gloo's sparse all-reduce);
- ``bound``: what no exact method can avoid: ``no communication`` (the same step with a hook
  that sends nothing) plus ``send touched rows`` (every rank all-gathers its touched rows'
  values, no ids, timed on its own).

``deviation`` is ``max |w - w_default| / max |w_default - w_initial|`` of the embedding after
every step run (warm-up included): 0 for exact methods. Usage::

    .venv/bin/python scripts/bench_allreduce.py [--link-rate 2gbit] [--densities 0.1 1.0]
        [--total-mib 64] [--width 64] [--rounds 7] [--warmup 3] [--json PATH]

``--link-rate`` re-runs the command inside ``scripts/emulated_link.sh`` (a network namespace
whose loopback is shaped by ``tc``; needs root), where the ranks talk over 127.0.0.1 only.
"""

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as power_sgd
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _bench_record, run from anywhere
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a source checkout

from _bench_record import show_table

from ascend_vlm.distributed import SparseAllReduceState, register_sparse_allreduce

WORLD_SIZE = 2
STEP_METHODS = (
    "default",
    "default (A/A)",
    "ours",
    "fp16",
    "bf16",
    "PowerSGD r1",
    "PowerSGD r4",
    "sparse embedding",
    "no communication",
)
TORCH_HOOKS = ("fp16", "bf16", "PowerSGD r1", "PowerSGD r4")
SEND = "send touched rows"
HEADER = ["density", "method", "step ms", "vs default", "A/A", "deviation"]
LEARNING_RATE = 0.1
# Set to the link rate inside the emulated link, so the re-run command does not re-enter it.
LINK_RATE_ENV = "ASCEND_VLM_LINK_RATE"


class EmbeddingLoss(nn.Module):
    """``sum(embed(tokens) * weights)``: the gradient is ``weights`` on the tokens' rows."""

    def __init__(self, rows: int, width: int, sparse: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(rows, width, sparse=sparse)

    def forward(self, tokens: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return (self.embed(tokens) * weights).sum()


def no_communication(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP hook that sends nothing: the step's local work alone."""
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def bf16_compress(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """``bf16_compress_hook`` under another name: DDP refuses that name unless NCCL or XCCL
    runs it, but the hook itself only casts and all-reduces, which gloo does in bf16."""
    return default_hooks.bf16_compress_hook(state, bucket)


def build_model(method: str, initial: torch.Tensor, ours: SparseAllReduceState) -> DDP:
    """The DDP-wrapped model of ``method`` with its hook, starting from ``initial`` weights;
    ``ours`` is the sparse hook's state (used by the method "ours" only)."""
    module = EmbeddingLoss(*initial.shape, sparse=method == "sparse embedding")
    with torch.no_grad():
        module.embed.weight.copy_(initial)
    model = DDP(module)
    if method == "ours":
        register_sparse_allreduce(model, ours)
    elif method in ("fp16", "bf16"):
        hook = {"fp16": default_hooks.fp16_compress_hook, "bf16": bf16_compress}
        model.register_comm_hook(None, hook[method])
    elif method.startswith("PowerSGD"):
        rank = int(method.removeprefix("PowerSGD r"))
        state = power_sgd.PowerSGDState(None, matrix_approximation_rank=rank, start_powerSGD_iter=2)
        model.register_comm_hook(state, power_sgd.powerSGD_hook)
    elif method == "no communication":
        model.register_comm_hook(None, no_communication)
    return model


def slowest(seconds: float) -> float:
    """The largest of every rank's ``seconds``."""
    elapsed = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def timed_step(model: DDP, optimizer: torch.optim.Optimizer, draw: tuple) -> float:
    dist.barrier()
    started = time.perf_counter()
    optimizer.zero_grad()
    model(*draw).backward()
    optimizer.step()
    return slowest(time.perf_counter() - started)


def timed_send(rows: torch.Tensor) -> float:
    dist.barrier()
    started = time.perf_counter()
    dist.all_gather([torch.empty_like(rows) for _ in range(WORLD_SIZE)], rows)
    return slowest(time.perf_counter() - started)


def run_density(rank: int, density: float, args: argparse.Namespace) -> dict[str, float] | None:
    """One density's rounds; on rank 0, ``{method: median seconds}`` plus deviations."""
    num_rows = args.total_mib * 2**20 // (4 * args.width)
    touched = max(1, round(density * num_rows))
    initial = torch.randn(num_rows, args.width, generator=torch.Generator().manual_seed(0))
    ours_state = SparseAllReduceState()
    models = {method: build_model(method, initial, ours_state) for method in STEP_METHODS}
    optimizers = {
        m: torch.optim.SGD(model.parameters(), lr=LEARNING_RATE) for m, model in models.items()
    }
    names = [*STEP_METHODS, SEND]
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(args.warmup + args.rounds):
        generator = torch.Generator().manual_seed(1000 * round_index + rank)
        tokens = torch.randperm(num_rows, generator=generator)[:touched]
        draw = (tokens, torch.randn(touched, args.width, generator=generator))
        shift = round_index % len(names)  # rotate so no method always runs first
        for name in names[shift:] + names[:shift]:
            if name == SEND:
                elapsed = timed_send(draw[1])
            else:
                elapsed = timed_step(models[name], optimizers[name], draw)
            if round_index >= args.warmup:
                seconds[name].append(elapsed)
    if rank != 0:
        return None
    medians = {name: statistics.median(samples) for name, samples in seconds.items()}
    reference = models["default"].module.embed.weight.detach()
    update = (reference - initial).abs().max().item()
    deviations = {
        name: (model.module.embed.weight.detach() - reference).abs().max().item() / update
        for name, model in models.items()
        if name != "no communication"
    }
    medians["bound"] = medians["no communication"] + medians[SEND]
    return {"medians": medians, "deviations": deviations, "ours": ours_state.stats.summary()}


def table_rows(density: float, result: dict) -> list[list[str]]:
    """The table's rows for one density (see :data:`HEADER`)."""
    medians, deviations = result["medians"], result["deviations"]
    default = medians["default"]
    noise = f"{default / medians['default (A/A)']:.2f}"
    rows = []
    for name in [*STEP_METHODS, SEND, "bound"]:
        ratio = f"{default / medians[name]:.2f}x"
        deviation = f"{deviations[name]:.1e}" if name in deviations else "-"
        rows.append(
            [f"{100 * density:g}%", name, f"{1e3 * medians[name]:.1f}", ratio, noise, deviation]
        )
    return rows


def verdicts(results: dict[float, dict]) -> list[str]:
    """The issue's targets, checked against this run, and the sparse hook's counters."""
    lines = []
    for density, result in results.items():
        medians = result["medians"]
        ours, label = medians["ours"], f"{100 * density:g}%"
        noise = f"A/A noise {100 * abs(medians['default'] / medians['default (A/A)'] - 1):.0f}%"
        if density < 1.0:
            fastest_hook = min(medians[name] for name in TORCH_HOOKS)
            lines.append(
                f"{label}: ours / bound = {ours / medians['bound']:.2f} (target <= 1.20); fastest "
                f"torch hook / ours = {fastest_hook / ours:.2f} (target > 1); sparse embedding / "
                f"ours = {medians['sparse embedding'] / ours:.2f}; {noise}"
            )
        else:
            lines.append(
                f"{label}: ours / default = {ours / medians['default']:.2f} (target <= 1.05); "
                + noise
            )
        lines.append(f"{label}: ours' counters: {result['ours']}")
    return lines


def rank_main(rank: int, store: str, args: argparse.Namespace, queue: mp.SimpleQueue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=datetime.timedelta(seconds=900),
    )
    try:
        for density in args.densities:
            result = run_density(rank, density, args)
            if rank == 0:
                queue.put((density, result))
    finally:
        dist.destroy_process_group()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--densities", type=float, nargs="+", default=[0.1, 1.0])
    parser.add_argument("--total-mib", type=int, default=64)
    parser.add_argument("--width", type=int, default=64, help="embedding row width (elements)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the table to this file")
    parser.add_argument(
        "--link-rate",
        help="run over an emulated link of this rate (tc units, e.g. 2gbit): the ranks talk "
        "over a loopback shaped by scripts/emulated_link.sh",
    )
    args = parser.parse_args(argv)
    if any(not 0.0 < density <= 1.0 for density in args.densities):
        parser.error(f"--densities: expected fractions in (0, 1], got {args.densities}")
    if args.warmup < 2:
        parser.error(
            f"--warmup: expected >= 2 (PowerSGD compresses from step 2), got {args.warmup}"
        )
    if args.rounds < 1 or args.total_mib < 1 or args.width < 1:
        parser.error("--rounds, --total-mib, --width: expected integers >= 1")
    if args.link_rate is not None and not args.link_rate:
        parser.error("--link-rate: expected a rate in tc units (e.g. 2gbit), got ''")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.link_rate and os.environ.get(LINK_RATE_ENV) != args.link_rate:
        # Re-run this command inside the emulated link; the variable marks the inner run.
        helper = Path(__file__).resolve().parent / "emulated_link.sh"
        os.environ[LINK_RATE_ENV] = args.link_rate
        command = [str(helper), args.link_rate, "--", sys.executable, *sys.argv]
        os.execv(command[0], command)
    shown_argv = sys.argv[1:] if argv is None else argv
    print("command:", " ".join([os.path.relpath(sys.executable), sys.argv[0], *shown_argv]))
    link = f"emulated {args.link_rate} link" if args.link_rate else "loopback (no link limit)"
    print(
        f"torch {torch.__version__}, {WORLD_SIZE} gloo ranks on CPU over {link}, "
        f"{os.cpu_count()} cores (load average {os.getloadavg()[0]:.1f} at start), embedding of "
        f"{args.total_mib} MiB fp32 in rows of {args.width}, median of {args.rounds} rounds "
        f"after {args.warmup}"
    )
    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(rank_main, args=(os.path.join(tmp, "store"), args, queue), nprocs=WORLD_SIZE)
    results = dict(queue.get() for _ in args.densities)
    rows = [row for density, result in results.items() for row in table_rows(density, result)]
    show_table(HEADER, rows, args.json, sys.argv[0], shown_argv)
    for line in verdicts(results):
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
