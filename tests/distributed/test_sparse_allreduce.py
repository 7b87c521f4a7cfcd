"""sparse_allreduce_hook against DDP's default allreduce_hook, in spawned gloo ranks.

Spawning costs seconds, so each world size runs one job that loops over all cases: world
sizes 1 and 2 share the 2-rank job (singleton subgroups), 3 and 4 share the 4-rank job.
"""

from __future__ import annotations

import math
import pickle
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _gloo_ranks import run_ranks
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from ascend_vlm.distributed import (
    SparseAllReduceState,
    SparseAllReduceStats,
    register_sparse_allreduce,
    sparse_allreduce_hook,
)

CHUNK = 64
# Neither size is a multiple of CHUNK; with a tiny bucket cap each parameter is its own bucket.
SIZES = (64 * 37 + 13, 1000)
TINY_BUCKET_MB = 0.001
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DENSITIES = (0.0, 0.01, 0.5, 1.0)
PATTERNS = ("same", "uneven", "rank0_zero")
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


class GradientSource(nn.Module):
    """Parameters whose gradients equal, bit for bit, the targets passed to ``forward``."""

    def __init__(self, sizes: tuple[int, ...], dtype: torch.dtype) -> None:
        super().__init__()
        self.weights = nn.ParameterList(nn.Parameter(torch.zeros(n, dtype=dtype)) for n in sizes)

    def forward(self, targets: list[torch.Tensor]) -> torch.Tensor:
        return sum((w * t).sum() for w, t in zip(self.weights, targets, strict=True))


def chunk_sparse(numel: int, density: float, generator: torch.Generator) -> torch.Tensor:
    """fp32 values in ceil(density * chunks) random chunks (30% zeros in them), +0.0 elsewhere."""
    num_chunks = math.ceil(numel / CHUNK)
    chosen = torch.zeros(num_chunks, dtype=torch.bool)
    picked = torch.randperm(num_chunks, generator=generator)[: math.ceil(density * num_chunks)]
    chosen[picked] = True
    kept = torch.rand(numel, generator=generator) > 0.3
    inside = chosen.repeat_interleave(CHUNK)[:numel] & kept
    return torch.where(inside, torch.randn(numel, generator=generator), 0.0)


def cases(group_rank: int, group_size: int) -> Iterator[tuple[str, list[torch.Tensor]]]:
    """(label, fp32 targets per parameter) for every density and pattern, plus signed zeros."""
    for case_index, (density, pattern) in enumerate(
        (d, p) for d in DENSITIES for p in PATTERNS if not (d == 0.0 and p != "same")
    ):
        generator = torch.Generator().manual_seed(1000 * case_index + group_rank)
        local = density
        if pattern == "uneven":
            local = density * (group_rank + 1) / group_size
        elif pattern == "rank0_zero" and group_rank == 0:
            local = 0.0
        yield f"{pattern}@{density}", [chunk_sparse(n, local, generator) for n in SIZES]
    signed_zero = [torch.zeros(n) for n in SIZES]
    if group_rank == 0:
        signed_zero[0][:CHUNK] = -0.0
    yield "signed_zero", signed_zero


def reduced_gradients(model: DDP, targets: list[torch.Tensor]) -> list[torch.Tensor]:
    for weight in model.module.weights:
        weight.grad = None
    model(targets).backward()
    return [weight.grad.clone() for weight in model.module.weights]


def assert_matches_default(
    got: torch.Tensor,
    want: torch.Tensor,
    target: torch.Tensor,
    group: dist.ProcessGroup,
    label: str,
) -> None:
    """Bitwise for <= 2 ranks; else |got - want| <= world * eps * sum_i |x_i / world|."""
    world = group.size()
    if world <= 2:
        same_bits = torch.equal(got.view(BITS[got.dtype]), want.view(BITS[want.dtype]))
        assert same_bits, f"{label}: differs from allreduce_hook at {(got != want).nonzero()[:5]}"
        return
    abs_sum = target.double().abs().div_(world)
    dist.all_reduce(abs_sum, group=group)
    bound = world * torch.finfo(got.dtype).eps * abs_sum
    error = (got.double() - want.double()).abs()
    assert bool((error <= bound).all()), f"{label}: max error {error.max()} beyond ulp bound"


def check_exact_cases(group: dist.ProcessGroup) -> None:
    group_rank, group_size = dist.get_rank(group), group.size()
    for dtype in DTYPES:
        reference = DDP(
            GradientSource(SIZES, dtype), process_group=group, bucket_cap_mb=TINY_BUCKET_MB
        )
        reference.register_comm_hook(group, allreduce_hook)
        hooked = {}
        # Always sparse; dense above half; dense above half and cached for 3 steps.
        for threshold, recheck in ((1.0, 0), (0.5, 0), (0.5, 3)):
            model = DDP(
                GradientSource(SIZES, dtype), process_group=group, bucket_cap_mb=TINY_BUCKET_MB
            )
            state = SparseAllReduceState(
                group, chunk_size=CHUNK, density_threshold=threshold, dense_recheck_steps=recheck
            )
            hooked[f"threshold={threshold},recheck={recheck}"] = (
                register_sparse_allreduce(model, state),
                model,
            )
        num_cases = 0
        for label, targets in cases(group_rank, group_size):
            num_cases += 1
            targets = [t.to(dtype) for t in targets]
            want = reduced_gradients(reference, targets)
            for config, (_, model) in hooked.items():
                got = reduced_gradients(model, targets)
                for index, (g, w, t) in enumerate(zip(got, want, targets, strict=True)):
                    name = f"world={group_size} {dtype} {label} {config} param {index}"
                    assert_matches_default(g, w, t, group, name)
        for config, (state, _) in hooked.items():
            # DDP's first iteration uses one bucket; it rebuilds to one per parameter after.
            assert state.stats.steps == num_cases, config
            assert state.stats.buckets == 2 * num_cases - 1, config
        assert hooked["threshold=1.0,recheck=0"][0].stats.dense_fallbacks == 0
        expected = expected_dense_fallbacks(group_size, dtype, threshold=0.5)
        assert expected > 0  # the cases must exercise the fallback
        assert hooked["threshold=0.5,recheck=0"][0].stats.dense_fallbacks == expected


def expected_dense_fallbacks(group_size: int, dtype: torch.dtype, threshold: float) -> int:
    """How many buckets of `cases` send densely without re-check caching: those whose union of
    nonzero chunks (any set bit, -0.0 included, over every rank's targets in ``dtype``) exceeds
    ``threshold`` of their chunks. Every rank's targets are regenerated here from their seeds.

    The first case is all zeros (DDP's one-bucket first step sends nothing), so only the later
    steps count, with one bucket per parameter."""
    per_rank = [list(cases(rank, group_size)) for rank in range(group_size)]
    count = 0
    for step in range(1, len(per_rank[0])):
        for index, numel in enumerate(SIZES):
            num_chunks = math.ceil(numel / CHUNK)
            union = torch.zeros(num_chunks, dtype=torch.bool)
            for targets in per_rank:
                bits = targets[step][1][index].to(dtype).view(BITS[dtype])
                padded = torch.nn.functional.pad(bits, (0, num_chunks * CHUNK - numel))
                union |= padded.view(num_chunks, CHUNK).ne(0).any(dim=1)
            count += int(union.sum()) > threshold * num_chunks
    return count


def check_stats_bookkeeping() -> None:
    """One step with a known union: chunks {0, 1} on rank 0 and {1, 2} on rank 1."""
    rank = dist.get_rank()
    model = DDP(GradientSource(SIZES, torch.float32), bucket_cap_mb=TINY_BUCKET_MB)
    state = register_sparse_allreduce(model, SparseAllReduceState(chunk_size=CHUNK))
    targets = [torch.zeros(n) for n in SIZES]
    reduced_gradients(model, targets)  # DDP rebuilds its buckets after this first step
    state.reset_stats()
    targets[0][rank * CHUNK + 1 : (rank + 2) * CHUNK - 1] = 1.0
    reduced_gradients(model, targets)
    stats = state.stats
    num_chunks = sum(math.ceil(n / CHUNK) for n in SIZES)
    assert (stats.buckets, stats.steps, stats.dense_fallbacks) == (2, 1, 0)
    assert (stats.chunks_probed, stats.chunks_nonzero) == (num_chunks, 3)
    assert stats.bytes_dense == 4 * sum(SIZES)
    assert stats.bytes_sent == num_chunks + 3 * CHUNK * 4
    assert stats.seconds > 0.0
    # The next step packs the same union into the buffer kept for its bucket.
    (bucket_index,) = state.packing_spaces
    space = state.packing_spaces[bucket_index]
    reduced_gradients(model, targets)
    assert state.packing_spaces[bucket_index] is space
    assert space.numel() >= 3 * CHUNK


def ddp_with_hook(module: nn.Module, state: SparseAllReduceState | None, **ddp_options) -> DDP:
    """DDP over the world group with the sparse hook, or with allreduce_hook if no state."""
    model = DDP(module, **ddp_options)
    if state is None:
        model.register_comm_hook(None, allreduce_hook)
    else:
        register_sparse_allreduce(model, state)
    return model


class TinyTagger(nn.Module):
    """Embedding + linear classifier: rows of tokens absent from a step get no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.head = nn.Linear(16, 5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens).mean(dim=1))


def train_tagger(
    rank: int, state: SparseAllReduceState | None, grads_are_bucket_views: bool = False
) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = ddp_with_hook(TinyTagger(), state, gradient_as_bucket_view=grads_are_bucket_views)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    for step in range(20):
        generator = torch.Generator().manual_seed(100 * step + rank)
        # Rank r only sees tokens [20 r, 20 r + 28): rows 48-63 never get a gradient.
        tokens = torch.randint(20 * rank, 20 * rank + 28, (4, 6), generator=generator)
        labels = torch.randint(0, 5, (4,), generator=generator)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(tokens), labels).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def check_training_identical(rank: int) -> None:
    default = train_tagger(rank, None)
    for grads_are_bucket_views in (False, True):
        state = SparseAllReduceState(chunk_size=16)
        hooked = train_tagger(rank, state, grads_are_bucket_views)
        for got, want in zip(hooked, default, strict=True):
            assert torch.equal(got, want), f"20 steps diverged ({grads_are_bucket_views=})"
    assert state.stats.steps == 20
    assert 0.0 < state.stats.chunk_density < 0.8, state.stats.summary()


class TwoModalityModel(nn.Module):
    """A text layer every sample uses and an image adapter only samples with images use."""

    def __init__(self) -> None:
        super().__init__()
        self.text = nn.Linear(8, 8)
        self.image_adapter = nn.Linear(8, 8)

    def forward(self, text: torch.Tensor, image: torch.Tensor | None) -> torch.Tensor:
        hidden = self.text(text)
        return hidden if image is None else hidden + self.image_adapter(image)


def train_two_modalities(rank: int, state: SparseAllReduceState | None) -> list[torch.Tensor]:
    """Rank 0 never sees images; rank 1 sees them on even steps only."""
    torch.manual_seed(0)
    model = ddp_with_hook(TwoModalityModel(), state, find_unused_parameters=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(6):
        generator = torch.Generator().manual_seed(10 * step + rank)
        text = torch.randn(4, 8, generator=generator)
        image = torch.randn(4, 8, generator=generator) if rank == 1 and step % 2 == 0 else None
        optimizer.zero_grad()
        model(text, image).square().mean().backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def check_image_adapter_unused_on_some_ranks(rank: int) -> None:
    state = SparseAllReduceState(chunk_size=8, density_threshold=1.0)
    for got, want in zip(
        train_two_modalities(rank, state), train_two_modalities(rank, None), strict=True
    ):
        assert torch.equal(got, want), "hook diverged when a modality adapter was unused"
    # Odd steps: no rank used the adapter, so about half of the gradient chunks stayed zero.
    assert 0.5 < state.stats.chunk_density < 1.0, state.stats.summary()


def train_regression(rank: int, state: SparseAllReduceState | None, steps: int) -> float:
    """Full-batch least squares on per-rank data; returns the final loss averaged over ranks."""
    data = torch.Generator().manual_seed(7)
    true_weight = torch.randn(32, 64, generator=data)
    local = torch.Generator().manual_seed(8 + rank)
    inputs = torch.randn(256, 64, generator=local)
    outputs = inputs @ true_weight.T + 0.1 * torch.randn(256, 32, generator=local)
    torch.manual_seed(0)
    model = ddp_with_hook(nn.Linear(64, 32, bias=False), state)
    optimizer = torch.optim.SGD(model.parameters(), lr=2.0)
    for _ in range(steps):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(inputs), outputs).backward()
        optimizer.step()
    with torch.no_grad():
        loss = nn.functional.mse_loss(model(inputs), outputs).reshape(1)
    dist.all_reduce(loss)
    return loss.item() / dist.get_world_size()


def check_topk_converges(rank: int) -> None:
    steps = 200
    dense_loss = train_regression(rank, None, steps)
    state = SparseAllReduceState(mode="topk", chunk_size=16, topk_ratio=0.1, start_topk_iter=5)
    topk_loss = train_regression(rank, state, steps)
    assert topk_loss <= 1.01 * dense_loss, (topk_loss, dense_loss)
    assert state.stats.warmup_buckets == 5
    assert state.stats.bytes_ratio > 3.0, state.stats.summary()


def check_topk_loses_nothing(dtype: torch.dtype) -> None:
    """Over steps: world * sum(averaged output) + sum_r residual_r == sum_r sum(gradients)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    (numel,) = sizes = (SIZES[0],)
    model = DDP(GradientSource(sizes, dtype))
    state = SparseAllReduceState(mode="topk", chunk_size=CHUNK, topk_ratio=0.1, start_topk_iter=2)
    register_sparse_allreduce(model, state)
    generator = torch.Generator().manual_seed(rank)
    sent_total, gradient_total = torch.zeros(numel), torch.zeros(numel)
    for _ in range(6):
        target = torch.randn(numel, generator=generator).to(dtype)
        gradient_total += target.float()
        (reduced,) = reduced_gradients(model, [target])
        sent_total += reduced.float()
    # The output is averaged: multiply by world; the residual is per rank: sum it.
    balance = gradient_total - state.residuals[0]
    dist.all_reduce(balance)
    tolerance = 1e-5 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(world * sent_total, balance, rtol=tolerance, atol=tolerance)
    assert float(state.residuals[0].abs().sum()) > 0.0, "top-k sent everything"


ROW_SHAPES = ((300, 64), (64,), (37, 5), (10,), (7, 3, 2))


def row_sparse(shape: tuple[int, ...], density: float, generator: torch.Generator) -> torch.Tensor:
    """fp32 values (a fifth of them -0.0) in a random ``density`` of the leading-dim rows (a 1-D
    parameter is one row), +0.0 elsewhere."""
    values = torch.randn(shape, generator=generator)
    values[torch.rand(shape, generator=generator) < 0.2] = -0.0
    leading = shape[0] if len(shape) > 1 else 1
    touched = torch.rand(leading, generator=generator) < density
    return torch.where(touched.view(-1, *[1] * (len(shape) - 1)), values, 0.0)


def row_cases(group_rank: int) -> Iterator[tuple[str, list[torch.Tensor]]]:
    """Each rank touches its own random rows (different tokens per batch), or rank 0 none."""
    for case_index, density in enumerate((0.0, 0.05, 0.3, 1.0)):
        for pattern in ("independent", "rank0_zero"):
            generator = torch.Generator().manual_seed(1000 * case_index + group_rank)
            local = 0.0 if pattern == "rank0_zero" and group_rank == 0 else density
            yield f"{pattern}@{density}", [row_sparse(s, local, generator) for s in ROW_SHAPES]


def check_row_chunk_cases(group: dist.ProcessGroup) -> None:
    """Default (row-chunk) states against allreduce_hook: one bucket and one per parameter."""
    group_rank, group_size = dist.get_rank(group), group.size()
    for dtype in DTYPES:
        for bucket_mb in (25, TINY_BUCKET_MB):
            reference = DDP(
                GradientSource(ROW_SHAPES, dtype), process_group=group, bucket_cap_mb=bucket_mb
            )
            reference.register_comm_hook(group, allreduce_hook)
            states = {}
            for threshold, recheck in ((0.5, 16), (1.0, 0)):
                model = DDP(
                    GradientSource(ROW_SHAPES, dtype), process_group=group, bucket_cap_mb=bucket_mb
                )
                state = SparseAllReduceState(
                    group, density_threshold=threshold, dense_recheck_steps=recheck
                )
                states[(threshold, recheck)] = (register_sparse_allreduce(model, state), model)
            for label, targets in row_cases(group_rank):
                targets = [t.to(dtype) for t in targets]
                want = reduced_gradients(reference, targets)
                for config, (_, model) in states.items():
                    got = reduced_gradients(model, targets)
                    for index, (g, w, t) in enumerate(zip(got, want, targets, strict=True)):
                        name = f"world={group_size} {dtype} cap={bucket_mb} {label} {config} param {index}"
                        assert_matches_default(g, w, t, group, name)
            if group_size == 1:
                continue
            for config, (state, _) in states.items():
                stats = state.stats
                # Sparse at low density, dense at full density (the ids make it larger).
                assert stats.chunks_probed > 0 and stats.dense_fallbacks > 0, (
                    config,
                    stats.summary(),
                )
                assert stats.bytes_ratio > 1.5, (config, stats.summary())


class RandomRowsModel(nn.Module):
    """An embedding (rows of 64 fp32) and a linear head: each step touches the batch's rows."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(2000, 64)
        self.head = nn.Linear(64, 5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens).mean(dim=1))


def train_random_rows(
    rank: int, state: SparseAllReduceState | None, steps: range, module: nn.Module | None = None
) -> nn.Module:
    """SGD with momentum on random tokens, different per rank and step; returns the module."""
    if module is None:
        torch.manual_seed(0)
        module = RandomRowsModel()
    model = ddp_with_hook(module, state)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in steps:
        generator = torch.Generator().manual_seed(100 * step + rank)
        tokens = torch.randint(0, 2000, (8, 25), generator=generator)
        labels = torch.randint(0, 5, (8,), generator=generator)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(tokens), labels).backward()
        optimizer.step()
    return module


def check_random_rows_training_and_round_trip(rank: int) -> None:
    """Default state: equal to allreduce_hook bit for bit over 10 steps, sending about the
    touched rows; a state pickled after 5 steps carries on equally on a new DDP wrapper."""
    default = train_random_rows(rank, None, range(10)).state_dict()
    state = SparseAllReduceState()
    hooked = train_random_rows(rank, state, range(10)).state_dict()
    for name, want in default.items():
        assert torch.equal(hooked[name], want), f"{name}: 10 steps diverged"
    stats = state.stats
    # About 200 of 2000 rows per rank, plus the dense head: never dense, several times fewer bytes.
    assert stats.dense_fallbacks == 0 and stats.bytes_ratio > 3.0, stats.summary()

    state = SparseAllReduceState()
    module = train_random_rows(rank, state, range(5))
    restored = pickle.loads(pickle.dumps(state))
    assert (restored.chunk_size, restored.stats.steps) == (None, 5)
    assert restored.row_layouts == {} and restored.message_spaces == {}
    resumed = train_random_rows(rank, restored, range(5, 10), module).state_dict()
    for name, want in default.items():
        assert torch.equal(resumed[name], want), f"{name}: diverged after the round trip"
    assert restored.stats.steps == 10 and restored.stats.dense_fallbacks == 0


def two_rank_job(rank: int, world_size: int) -> None:
    singleton_groups = [dist.new_group([r]) for r in range(world_size)]
    check_exact_cases(singleton_groups[rank])
    check_exact_cases(dist.group.WORLD)
    check_row_chunk_cases(singleton_groups[rank])
    check_row_chunk_cases(dist.group.WORLD)
    check_random_rows_training_and_round_trip(rank)
    check_stats_bookkeeping()
    check_training_identical(rank)
    check_image_adapter_unused_on_some_ranks(rank)
    check_topk_converges(rank)
    for dtype in (torch.float32, torch.bfloat16):
        check_topk_loses_nothing(dtype)


def four_rank_job(rank: int, world_size: int) -> None:
    first_three = dist.new_group([0, 1, 2])
    check_exact_cases(dist.group.WORLD)
    check_row_chunk_cases(dist.group.WORLD)
    if rank < 3:
        check_exact_cases(first_three)
        check_row_chunk_cases(first_three)


@pytest.mark.slow
def test_one_and_two_ranks(tmp_path: Path) -> None:
    run_ranks(2, tmp_path, two_rank_job)


@pytest.mark.slow
def test_three_and_four_ranks(tmp_path: Path) -> None:
    run_ranks(4, tmp_path, four_rank_job)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"chunk_size": 0}, "chunk_size: expected an int >= 1, got 0"),
        ({"chunk_size": -4}, "chunk_size: expected an int >= 1, got -4"),
        ({"chunk_size": 2.5}, "chunk_size: expected an int >= 1, got 2.5"),
        ({"density_threshold": 0.0}, r"density_threshold: expected a number in \(0, 1\], got 0.0"),
        ({"density_threshold": 1.5}, r"density_threshold: expected a number in \(0, 1\], got 1.5"),
        ({"topk_ratio": 0}, r"topk_ratio: expected a number in \(0, 1\], got 0"),
        ({"start_topk_iter": 1}, "start_topk_iter: expected an int >= 2, got 1"),
        ({"dense_recheck_steps": -1}, "dense_recheck_steps: expected an int >= 0, got -1"),
        ({"mode": "fast"}, "mode: expected one of"),
    ],
)
def test_bad_configuration_is_rejected(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SparseAllReduceState(**kwargs)


def test_state_needs_a_process_group() -> None:
    if dist.is_initialized():
        pytest.skip("another test left a default process group initialised")
    with pytest.raises(RuntimeError, match="process_group: none given"):
        SparseAllReduceState()


def test_non_ddp_use_is_rejected(single_rank_group: None) -> None:
    state = SparseAllReduceState()
    with pytest.raises(TypeError, match=r"bucket: expected torch\.distributed\.GradBucket"):
        sparse_allreduce_hook(state, torch.zeros(8))
    with pytest.raises(TypeError, match="state: expected SparseAllReduceState, got dict"):
        sparse_allreduce_hook({}, torch.zeros(8))
    with pytest.raises(
        TypeError, match=r"model: expected torch\.nn\.parallel\.DistributedDataParallel"
    ):
        register_sparse_allreduce(nn.Linear(2, 2), state)


def test_state_pickles_without_its_process_group(single_rank_group: None) -> None:
    state = SparseAllReduceState(dist.new_group([0]), mode="topk", chunk_size=8, topk_ratio=0.5)
    state.residuals[3] = torch.arange(5.0)
    state.stats.buckets = 7
    restored = pickle.loads(pickle.dumps(state))
    assert restored.process_group is None
    assert (restored.mode, restored.chunk_size, restored.topk_ratio) == ("topk", 8, 0.5)
    assert torch.equal(restored.residuals[3], torch.arange(5.0))
    assert restored.stats.buckets == 7
    restored.reset_stats()
    assert restored.stats.buckets == 0


def test_counting_waits_for_a_reset_in_progress(single_rank_group: None) -> None:
    """A bucket counted while reset_stats() runs on another thread lands wholly after it."""
    model = DDP(GradientSource((10,), torch.float32))
    state = register_sparse_allreduce(model, SparseAllReduceState(chunk_size=4))
    step = threading.Thread(target=lambda: model([torch.ones(10)]).backward())
    with state.stats_lock:  # what reset_stats() holds while it swaps the counters
        step.start()
        step.join(timeout=0.2)  # without the lock in the hook, the step would finish here
        state.stats = SparseAllReduceStats()
    step.join()
    stats = state.stats
    assert (stats.buckets, stats.steps, stats.bytes_dense) == (1, 1, 40)
    assert stats.seconds > 0.0


def test_unsupported_bucket_dtype_is_rejected(single_rank_group: None) -> None:
    model = DDP(GradientSource((10,), torch.float64))
    register_sparse_allreduce(model, SparseAllReduceState())
    with pytest.raises((TypeError, RuntimeError), match="bucket: expected gradients of dtype"):
        model([torch.ones(10, dtype=torch.float64)]).backward()
