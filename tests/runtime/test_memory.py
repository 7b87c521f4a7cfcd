"""Buffers: allocation, OOM, misuse error codes, zero-copy views and their lifetime."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from _runtime_helpers import (
    ACL_ERROR_INVALID_PARAM,
    ACL_ERROR_RT_ADDR_UNALIGNED,
    ACL_ERROR_RT_MEMORY_ALLOCATION,
    ACL_ERROR_RT_PARAM_INVALID,
    requires_sim,
    run_python,
)

import ascend_vlm
from ascend_vlm import _C, runtime

PAGE = 4096


@contextlib.contextmanager
def raises_acl(code: int, function: str) -> Iterator[pytest.ExceptionInfo[ascend_vlm.AclError]]:
    """Assert the block raises an AclError with ``code`` from ``function``."""
    with pytest.raises(ascend_vlm.AclError) as info:
        yield info
    assert (info.value.code, info.value.function) == (code, function)


@pytest.fixture
def small_pool():
    """Shrink the current device's simulated pool to 1 MiB for one test."""
    _, total = runtime.mem_info()
    runtime.sim_set_device_memory(1 << 20)
    yield 1 << 20
    runtime.sim_set_device_memory(total)


def roundtrip(host_bytes: bytes) -> bytes:
    """Copy bytes host -> device -> host through pinned buffers and return what came back."""
    n = len(host_bytes)
    with runtime.PinnedBuffer(n) as src, runtime.PinnedBuffer(n) as dst:
        np.frombuffer(src, dtype=np.uint8)[:] = np.frombuffer(host_bytes, dtype=np.uint8)
        device = runtime.DeviceBuffer(n)
        runtime.memcpy(device, src, n)
        runtime.memcpy(dst, device, n)
        return bytes(np.frombuffer(dst, dtype=np.uint8))


def test_sync_roundtrip_through_device():
    payload = bytes(range(256)) * 17
    assert roundtrip(payload) == payload


@pytest.mark.parametrize("policy", ["huge_first", "normal_only", "huge_only_p2p"])
def test_device_buffer_policies_and_context_manager(policy):
    with runtime.DeviceBuffer(1000, policy=policy) as buffer:
        assert buffer.nbytes == 1000 and buffer.ptr > 0
    assert buffer.closed
    with pytest.raises(ValueError, match="the buffer was freed"):
        _ = buffer.ptr


def test_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match="policy: expected one of"):
        runtime.DeviceBuffer(64, policy="fast")
    with pytest.raises(TypeError, match="nbytes: expected an int, got float"):
        runtime.PinnedBuffer(64.0)
    with pytest.raises(BufferError):
        np.frombuffer(runtime.DeviceBuffer(64), dtype=np.uint8)
    with pytest.raises(ValueError, match="pinned memory has no device address"):
        _ = runtime.PinnedBuffer(64).device_ptr


@pytest.mark.parametrize("cls", [runtime.DeviceBuffer, runtime.PinnedBuffer, runtime.MappedBuffer])
@pytest.mark.parametrize("nbytes", [0, -1])
def test_zero_or_negative_size_is_invalid_param(cls, nbytes):
    function = "aclrtMalloc" if cls is runtime.DeviceBuffer else "aclrtMallocHost"
    with raises_acl(ACL_ERROR_INVALID_PARAM, function) as info:
        cls(nbytes)
    if nbytes < 0:
        assert "nbytes: expected a byte count >= 0, got -1" in str(info.value)


@pytest.mark.parametrize(
    ("kind", "function"),
    [(_C.BufferKind.DEVICE, "aclrtMalloc"), (_C.BufferKind.PINNED, "aclrtMallocHost")],
)
def test_native_size_check_states_the_same_rule(kind, function):
    with raises_acl(ACL_ERROR_INVALID_PARAM, function) as info:
        _C.Buffer(kind, -1)  # below the Python checks: the C++ constructor's own message
    assert "nbytes: expected a byte count >= 0, got -1" in str(info.value)


@requires_sim
def test_out_of_memory_raises_memory_allocation(small_pool):
    first = runtime.DeviceBuffer(small_pool // 2)
    with raises_acl(ACL_ERROR_RT_MEMORY_ALLOCATION, "aclrtMalloc"):
        runtime.DeviceBuffer(small_pool // 2)  # the 32-byte pad no longer fits
    first.free()
    runtime.DeviceBuffer(small_pool // 2)  # freeing made room again


@requires_sim
def test_pool_size_from_env_in_fresh_process():
    code = (
        "import ascend_vlm\n"
        "from ascend_vlm import runtime\n"
        "print(runtime.mem_info()[1])\n"
        "try:\n"
        "    runtime.DeviceBuffer(3 << 20)\n"
        "except ascend_vlm.AclError as e:\n"
        "    print(e.code, e.name)\n"
    )
    result = run_python(code, ASCEND_VLM_SIM_DEVICE_MEM=str(2 << 20))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:2] == [str(2 << 20), "207001 ACL_ERROR_RT_MEMORY_ALLOCATION"]


@requires_sim
def test_shrinking_pool_below_usage_is_invalid_param(small_pool):
    held = runtime.DeviceBuffer(small_pool // 2)
    with raises_acl(ACL_ERROR_INVALID_PARAM, "aclsimSetDeviceMemoryCapacity"):
        runtime.sim_set_device_memory(1024)
    held.free()


@requires_sim
def test_double_free_and_foreign_pointer_are_param_invalid():
    ptr = _C.acl.malloc(256)
    _C.acl.free(ptr)
    with raises_acl(ACL_ERROR_RT_PARAM_INVALID, "aclrtFree"):
        _C.acl.free(ptr)
    foreign = np.zeros(64, dtype=np.uint8)
    with raises_acl(ACL_ERROR_RT_PARAM_INVALID, "aclrtFree"):
        _C.acl.free(foreign.ctypes.data)
    with raises_acl(ACL_ERROR_RT_PARAM_INVALID, "aclrtFreeHost"):
        _C.acl.free_host(foreign.ctypes.data)


@requires_sim
def test_host_register_misuse():
    pinned = runtime.PinnedBuffer(2 * PAGE)
    with raises_acl(ACL_ERROR_RT_PARAM_INVALID, "aclrtHostUnregister"):
        _C.acl.host_unregister(pinned.ptr)  # never registered
    with raises_acl(ACL_ERROR_RT_ADDR_UNALIGNED, "aclrtHostRegister"):
        _C.acl.host_register(pinned.ptr + 64, PAGE)
    device_alias = _C.acl.host_register(pinned.ptr, PAGE)
    assert device_alias not in (0, pinned.ptr)
    with raises_acl(ACL_ERROR_RT_PARAM_INVALID, "aclrtHostRegister"):
        _C.acl.host_register(pinned.ptr, PAGE)  # overlaps the live registration
    with raises_acl(ACL_ERROR_RT_PARAM_INVALID, "aclrtFreeHost"):
        _C.acl.free_host(pinned.ptr)  # still registered
    _C.acl.host_unregister(pinned.ptr)
    with raises_acl(ACL_ERROR_RT_PARAM_INVALID, "aclrtHostUnregister"):
        _C.acl.host_unregister(pinned.ptr)


@requires_sim
def test_copy_direction_must_match_addresses():
    device = runtime.DeviceBuffer(64)
    host = runtime.PinnedBuffer(64)
    with raises_acl(ACL_ERROR_RT_PARAM_INVALID, "aclrtMemcpy"):
        runtime.memcpy(device, host, 64, kind="d2d")
    with raises_acl(ACL_ERROR_RT_PARAM_INVALID, "aclrtMemcpy"):
        runtime.memcpy(device.ptr + 32, host, 64, kind="h2d")  # runs past the allocation
    with pytest.raises(ValueError, match=r"nbytes: 128 bytes do not fit in dst"):
        runtime.memcpy(device, host, 128)
    with pytest.raises(TypeError, match="src: expected a DeviceBuffer"):
        runtime.memcpy(device, b"abc", 3)


def test_raw_addresses_from_torch_tensors():
    source = torch.arange(1024, dtype=torch.float32)
    target = torch.zeros(1024, dtype=torch.float32)
    device = runtime.DeviceBuffer(source.nbytes)
    runtime.memcpy(device, source.data_ptr(), source.nbytes, kind="h2d")
    runtime.memcpy(target.data_ptr(), device, source.nbytes)  # kind inferred: "default"
    assert torch.equal(source, target)


@requires_sim
def test_zero_copy_identity_counts_no_host_copies():
    n = 8 * PAGE
    mapped = runtime.MappedBuffer(n)
    view = np.frombuffer(mapped, dtype=np.uint32)
    view[:] = np.arange(view.size, dtype=np.uint32) * 3
    expected = view.copy()
    device = runtime.DeviceBuffer(n)
    stream = runtime.Stream()
    runtime.sim_reset_stats()
    # Device code reads the mapped memory through its device address: no copy at all.
    runtime.sim_copy_kernel(device, mapped, n, stream)
    stream.synchronize()
    assert runtime.sim_stats() == {"h2h": 0, "h2d": 0, "d2h": 0, "d2d": 0, "kernel": n}
    check = np.zeros_like(expected)
    runtime.memcpy(check.ctypes.data, device, n)
    assert np.array_equal(check, expected)

    # Device code writes into the mapped memory: the host view sees it at once.
    pattern = runtime.PinnedBuffer(n)
    np.frombuffer(pattern, dtype=np.uint8)[:] = 0xAB
    other = runtime.DeviceBuffer(n)
    runtime.memcpy(other, pattern, n)
    runtime.sim_reset_stats()
    runtime.sim_copy_kernel(mapped.device_ptr, other, n, stream)
    stream.synchronize()
    assert np.all(view.view(np.uint8) == 0xAB)
    assert runtime.sim_stats() == {"h2h": 0, "h2d": 0, "d2h": 0, "d2d": 0, "kernel": n}


@requires_sim
def test_mapped_device_address_is_not_a_copy_endpoint():
    mapped = runtime.MappedBuffer(PAGE)
    device = runtime.DeviceBuffer(PAGE)
    with raises_acl(ACL_ERROR_RT_PARAM_INVALID, "aclrtMemcpy"):
        runtime.memcpy(device, mapped.device_ptr, PAGE, kind="d2d")
    runtime.memcpy(device, mapped, PAGE)  # through its pinned host address instead
    with raises_acl(ACL_ERROR_RT_PARAM_INVALID, "aclsimLaunchCopyKernel"):
        runtime.sim_copy_kernel(device, mapped.host_ptr, PAGE, runtime.Stream())


@requires_sim
def test_views_outlive_the_python_handle():
    mapped = runtime.MappedBuffer(PAGE)
    array = np.frombuffer(mapped, dtype=np.float32)
    tensor = torch.frombuffer(mapped, dtype=torch.float32)
    device_ptr = mapped.device_ptr
    array[:] = 2.5
    del mapped
    gc.collect()
    runtime.PinnedBuffer(PAGE)  # a new allocation must not reuse the still-viewed memory
    assert torch.all(tensor == 2.5)
    tensor[:] = 7.0
    assert np.all(array == 7.0)
    device = runtime.DeviceBuffer(PAGE)
    stream = runtime.Stream()
    runtime.sim_copy_kernel(device, device_ptr, PAGE, stream)  # still registered
    stream.synchronize()
    check = np.zeros(PAGE // 4, dtype=np.float32)
    runtime.memcpy(check.ctypes.data, device, PAGE)
    assert np.all(check == 7.0)


def test_free_closes_host_buffer_but_keeps_views_valid():
    pinned = runtime.PinnedBuffer(PAGE)
    array = np.frombuffer(pinned, dtype=np.uint8)
    pinned.free()
    array[:] = 9  # memory still owned by the object the view references
    assert array.sum() == 9 * PAGE
    with pytest.raises(BufferError):
        np.frombuffer(pinned, dtype=np.uint8)
    with pytest.raises(ValueError, match=r"PinnedBuffer\.host_ptr: the buffer was freed"):
        _ = pinned.ptr
