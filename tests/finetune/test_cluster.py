"""Past one machine: the emulated cluster link enforces its rate; two torchrun "nodes" over it
train as one node does; a killed rank restarts and resumes to the uninterrupted result; a hung
rank fails the job in bounded time naming the step and rank; a torn checkpoint is skipped."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tiny_finetune import (
    COMMON,
    ROOT,
    finetune_command,
    finetune_env,
    run_checked,
    start_process,
    tiny_config,
)

from ascend_vlm.default_model import default_model_path
from ascend_vlm.finetune import checkpoint
from ascend_vlm.finetune.train import train

LINK = Path(__file__).resolve().parents[2] / "scripts" / "emulated_link.sh"


@functools.cache
def _namespace_problem() -> str | None:
    """Why a shaped network namespace cannot be made here, None when it can."""
    try:
        done = subprocess.run(
            [str(LINK), "1gbit", "--", "true"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"scripts/emulated_link.sh did not run: {error}"
    if done.returncode != 0:
        return f"no network namespace with tc tbf here: {done.stderr.strip()[-200:]}"
    return None


needs_link = pytest.mark.skipif(_namespace_problem() is not None, reason=str(_namespace_problem()))


def _finetune(output_dir: Path, *extra: str) -> list[str]:
    return [f"--output-dir={output_dir}", f"--model-path={default_model_path()}", *COMMON, *extra]


def _torchrun(*launcher: str) -> list[str]:
    """The fine-tune command under torchrun with ``launcher`` arguments."""
    return finetune_command(2, *launcher)


def _losses(output_dir: Path) -> dict[int, float]:
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}


def _adapter(output_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(output_dir / "adapter" / "adapter_model.safetensors")


def _single_node(output_dir: Path, *extra: str) -> None:
    run_checked([*_torchrun("--standalone", "--nproc_per_node=2"), *_finetune(output_dir, *extra)])


@needs_link
def test_the_link_helper_enforces_its_rate():
    # 20 MB over a 200 Mbit/s link: 0.8 s when the filter holds the rate.
    code = """
import socket, threading, time
size, chunk = 20_000_000, b"x" * 1_000_000
server = socket.create_server(("127.0.0.1", 0))
def drain():
    connection, _ = server.accept()
    while connection.recv(1 << 20):
        pass
reader = threading.Thread(target=drain)
reader.start()
sender = socket.create_connection(server.getsockname())
start = time.perf_counter()
for _ in range(size // len(chunk)):
    sender.sendall(chunk)
sender.close()
reader.join()
print(size * 8 / (time.perf_counter() - start))
"""
    done = subprocess.run(
        [str(LINK), "200mbit", "--", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    rate = float(done.stdout)
    assert 0.8 * 200e6 <= rate <= 1.2 * 200e6, rate


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["2gb", "--", "true"], "RATE: expected a number with a tc unit"),
        (["2gbit", "true"], "usage:"),
    ],
)
def test_the_link_helper_refuses_bad_calls(argv, message):
    done = subprocess.run([str(LINK), *argv], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and message in done.stderr


@pytest.mark.slow
@needs_link
def test_two_nodes_over_the_link_train_as_one_node(tmp_path):
    one = tmp_path / "one_node"
    _single_node(one)
    two = tmp_path / "two_nodes"
    node = [
        *_torchrun(
            "--nnodes=2",
            "--nproc_per_node=1",
            "--rdzv-backend=c10d",
            "--rdzv-endpoint=127.0.0.1:29517",
            "--rdzv-id=two-nodes",
        ),
        *_finetune(two),
    ]
    quoted = shlex.join(node)
    script = f"{quoted} > {tmp_path}/node0.log 2>&1 & first=$!; "
    script += f"{quoted} > {tmp_path}/node1.log 2>&1; status=$?; wait $first; "
    script += "exit $(( status || $? ))"
    done = subprocess.run(
        [str(LINK), "2gbit", "--", "bash", "-c", script], env=finetune_env(), cwd=ROOT, timeout=300
    )
    logs = "".join((tmp_path / f"node{n}.log").read_text()[-1500:] for n in (0, 1))
    assert done.returncode == 0, logs
    assert _losses(two) == _losses(one)
    assert sorted(_losses(two)) == [1, 2, 3, 4]


def _workers(parent: int) -> dict[int, int]:
    """rank -> pid of the torchrun workers under process ``parent``."""
    workers = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        ranks = [item[5:] for item in environ if item.startswith(b"RANK=")]
        if ppid == parent and ranks:
            workers[int(ranks[0])] = int(entry.name)
    return workers


def _stop_job(job: subprocess.Popen) -> None:
    """Kill torchrun's workers (they run in sessions of their own), then the agent."""
    for pid in _workers(job.pid).values():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    job.kill()
    job.wait()


def _wait_for_step(output_dir: Path, step: int, job: subprocess.Popen, limit: float = 120) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        assert job.poll() is None, "the job ended before the step to interrupt"
        metrics = output_dir / "metrics.jsonl"
        with contextlib.suppress(json.JSONDecodeError):  # a line being written
            if metrics.is_file() and max(_losses(metrics.parent), default=0) >= step:
                return
        time.sleep(0.02)
    raise AssertionError(f"step {step} not reached in {limit} s")


LONG_RUN = ("--max-steps=30", "--save-every=3")


@pytest.mark.slow
def test_a_killed_rank_restarts_and_resumes_to_the_uninterrupted_result(tmp_path):
    uninterrupted = tmp_path / "uninterrupted"
    _single_node(uninterrupted, *LONG_RUN)
    killed = tmp_path / "killed"
    launcher = _torchrun("--standalone", "--nproc_per_node=2", "--max-restarts=1")
    job = start_process([*launcher, *_finetune(killed, *LONG_RUN)])
    try:
        _wait_for_step(killed, 8, job)
        rank1 = _workers(job.pid)[1]
        os.kill(rank1, signal.SIGSTOP)  # no further step between the check and the kill
        stopped_after = max(_losses(killed))
        os.kill(rank1, signal.SIGKILL)
        _, err = job.communicate(timeout=300)
    finally:
        _stop_job(job)
    assert job.returncode == 0, err[-3000:]
    assert "restarted its workers (restart 1 on this node): resuming from the latest" in err
    (resumed_at,) = map(int, re.findall(r"resume: continuing after step (\d+) from", err))
    # The newest checkpoint (every 3 steps) at or before the last step logged before the kill.
    assert resumed_at == stopped_after // 3 * 3 and resumed_at >= 6
    assert _losses(killed) == _losses(uninterrupted)
    expected, got = _adapter(uninterrupted), _adapter(killed)
    assert expected.keys() == got.keys()
    assert all(torch.equal(got[name], expected[name]) for name in expected)


@pytest.mark.slow
def test_a_hung_rank_fails_the_job_in_bounded_time_naming_step_and_rank(tmp_path):
    output_dir = tmp_path / "hung"
    extra = ("--max-steps=400", "--save-every=1000", "--collective-timeout=15")
    job = start_process(
        [*_torchrun("--standalone", "--nproc_per_node=2"), *_finetune(output_dir, *extra)]
    )
    stopped = None
    try:
        _wait_for_step(output_dir, 3, job)
        stopped = _workers(job.pid)[1]
        os.kill(stopped, signal.SIGSTOP)  # alive but silent: a hang, not a crash
        started = time.monotonic()
        _, err = job.communicate(timeout=120)
        elapsed = time.monotonic() - started
    finally:
        _stop_job(job)
        if stopped is not None:
            with contextlib.suppress(ProcessLookupError):  # the agent has usually killed it
                os.kill(stopped, signal.SIGKILL)
    assert job.returncode != 0
    assert elapsed < 90
    failed = re.findall(
        r"CollectiveFailure: step (\d+): rank 1 stopped responding \(noticed by rank 0\): a "
        r"collective did not complete",
        err,
    )
    assert failed and int(failed[0]) > 3, err[-2000:]
    assert "--collective-timeout 15 s" in err


def test_a_torn_checkpoint_is_never_resumed_from(tmp_path, caplog):
    config = tiny_config(tmp_path, max_steps=4, save_every=1, stop_after_steps=3)
    train(config)
    root = checkpoint.checkpoint_root(tmp_path)
    assert (root / checkpoint.LATEST).read_text() == "checkpoint-3"
    # A save cut short leaves a folder without its state ...
    (root / "checkpoint-4").mkdir()
    (root / "checkpoint-4" / checkpoint.TRAINER_STATE).write_bytes(b"partial")
    # ... and a disk that lost the end of the newest complete checkpoint's weights.
    weights = root / "checkpoint-3" / checkpoint.WEIGHT_FILES[0]
    weights.write_bytes(weights.read_bytes()[:100])
    with caplog.at_level(logging.WARNING):
        assert checkpoint.resolve_checkpoint(tmp_path, "latest") == root / "checkpoint-2"
    assert "checkpoint-3 (named by latest) is incomplete" in caplog.text
    train(dataclasses.replace(config, stop_after_steps=None, resume="latest"))
    uninterrupted = tmp_path / "uninterrupted"
    train(tiny_config(uninterrupted, max_steps=4, save_every=1))
    assert _losses(tmp_path) == _losses(uninterrupted)  # steps 3 and 4 re-run from step 2


@pytest.mark.slow
def test_a_restart_does_not_continue_another_jobs_run(tmp_path):
    # A finished run, then a new job into its folder without --resume: every attempt of the
    # new job refuses the folder, restarts included, and the old run stays as it was.
    _single_node(tmp_path)
    adapter = _adapter(tmp_path)
    command = [
        *_torchrun("--standalone", "--nproc_per_node=2", "--max-restarts=1"),
        *_finetune(tmp_path, "--max-steps=8"),
    ]
    done = subprocess.run(
        command, capture_output=True, text=True, env=finetune_env(), cwd=ROOT, timeout=300
    )
    assert done.returncode != 0
    assert done.stderr.count("expected a folder without a saved run") >= 2  # both attempts
    assert sorted(_losses(tmp_path)) == [1, 2, 3, 4]
    assert all(torch.equal(_adapter(tmp_path)[k], v) for k, v in adapter.items())


@pytest.mark.parametrize("value", [0, -1, True, float("inf"), 1e300])
def test_bad_collective_timeouts_are_named(tmp_path, value):
    with pytest.raises(ValueError, match="collective_timeout: expected seconds in"):
        tiny_config(tmp_path, collective_timeout=value)
