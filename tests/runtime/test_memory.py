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
    ptr = _C._testing_acl.malloc(256)
    _C._testing_acl.free(ptr)
    with raises_acl(ACL_ERROR_RT_PARAM_INVALID, "aclrtFree"):
        _C._testing_acl.free(ptr)
    foreign = np.zeros(64, dtype=np.uint8)
    with raises_acl(ACL_ERROR_RT_PARAM_INVALID, "aclrtFree"):
        _C._testing_acl.free(foreign.ctypes.data)
    with raises_acl(ACL_ERROR_RT_PARAM_INVALID, "aclrtFreeHost"):
        _C._testing_acl.free_host(foreign.ctypes.data)


@requires_sim
def test_host_register_misuse():
    pinned = runtime.PinnedBuffer(2 * PAGE)
    with raises_acl(ACL_ERROR_RT_PARAM_INVALID, "aclrtHostUnregister"):
        _C._testing_acl.host_unregister(pinned.ptr)  # never registered
    page = pinned.ptr + (-pinned.ptr % PAGE)  # the first page boundary inside the buffer
    with raises_acl(ACL_ERROR_RT_ADDR_UNALIGNED, "aclrtHostRegister"):
        _C._testing_acl.host_register(page + 64, PAGE)
    device_alias = _C._testing_acl.host_register(page, PAGE)
    assert device_alias not in (0, page)
    with raises_acl(ACL_ERROR_RT_PARAM_INVALID, "aclrtHostRegister"):
        _C._testing_acl.host_register(page, PAGE)  # overlaps the live registration
    _C._testing_acl.host_unregister(page)
    with raises_acl(ACL_ERROR_RT_PARAM_INVALID, "aclrtHostUnregister"):
        _C._testing_acl.host_unregister(page)


@requires_sim
def test_malloc_host_promises_64_bytes_only_and_mapped_buffers_align_themselves():
    """aclrtMallocHost is 64-byte aligned; aclrtHostRegister needs 4 KB (issue 15, item 7)."""
    raw = _C._testing_acl.malloc_host(PAGE)
    assert raw % 64 == 0 and raw % PAGE != 0  # the simulator never hands out a page boundary
    with raises_acl(ACL_ERROR_RT_ADDR_UNALIGNED, "aclrtHostRegister"):
        _C._testing_acl.host_register(raw, PAGE)
    registered = _C._testing_acl.host_register(raw + (-raw % PAGE), 64)
    assert registered != 0
    with raises_acl(ACL_ERROR_RT_PARAM_INVALID, "aclrtFreeHost"):
        _C._testing_acl.free_host(raw + (-raw % PAGE))  # not the address aclrtMallocHost returned
    _C._testing_acl.host_unregister(raw + (-raw % PAGE))
    _C._testing_acl.free_host(raw)
    mapped = runtime.MappedBuffer(100)
    assert mapped.host_ptr % PAGE == 0
    np.frombuffer(mapped, dtype=np.uint8)[:] = 3  # the whole view is usable


@requires_sim
@pytest.mark.parametrize(("value", "code"), [(0x04, 207000), (0x08, 207000), (0x10, 100000)])
def test_host_register_types_other_than_mapped(value, code):
    """IOMEMORY/READONLY are documented but "currently not supported"; others are invalid."""
    pinned = runtime.PinnedBuffer(2 * PAGE)
    with raises_acl(code, "aclrtHostRegister"):
        _C._testing_acl.host_register(pinned.ptr + (-pinned.ptr % PAGE), PAGE, value)


@requires_sim
def test_copy_direction_is_inferred_from_the_addresses():
    """hicann/runtime api_ref 11-03: aclrtMemcpy's kind is reserved, the addresses decide."""
    device = runtime.DeviceBuffer(64)
    host = runtime.PinnedBuffer(64)
    np.frombuffer(host, dtype=np.uint8)[:] = 7
    runtime.sim_reset_stats()
    runtime.memcpy(device, host, 64, kind="d2d")  # a wrong kind: the copy is still host-to-device
    assert runtime.sim_stats()["h2d"] == 64
    for kind in (5, 6, 7):  # documented kinds the old headers lacked
        _C.memcpy(device.ptr, 64, host.ptr, 64, kind)
    with raises_acl(ACL_ERROR_INVALID_PARAM, "aclrtMemcpy"):
        _C.memcpy(device.ptr, 64, host.ptr, 64, 8)  # unknown kind
    with pytest.raises(ValueError, match=r"nbytes: 128 bytes do not fit in dst"):
        runtime.memcpy(device, host, 128)
    with pytest.raises(TypeError, match="src: expected a DeviceBuffer"):
        runtime.memcpy(device, 3.5, 3)


def test_torch_tensors_and_buffer_objects_are_endpoints():
    source = torch.arange(1024, dtype=torch.float32)
    target = torch.zeros(1024, dtype=torch.float32)
    device = runtime.DeviceBuffer(source.nbytes)
    runtime.memcpy(device, source, source.nbytes)
    runtime.memcpy(target, device, source.nbytes)
    assert torch.equal(source, target)
    back = bytearray(16)
    runtime.memcpy(back, device, 16)
    assert bytes(back) == source.numpy().tobytes()[:16]
    with pytest.raises(ValueError, match="dst: expected a writable buffer"):
        runtime.memcpy(b"x" * 16, device, 16)
    with pytest.raises(ValueError, match="src: expected a contiguous CPU tensor"):
        runtime.memcpy(device, source.view(32, 32).t(), 16)


class _NpuTensorLike:
    """What the runtime reads of a torch_npu tensor, over simulated device memory."""

    def __init__(self, memory: runtime.DeviceBuffer, numel: int, contiguous: bool = True):
        self.device = type("NpuDevice", (), {"type": "npu", "index": 0})()
        self._memory, self._numel, self._contiguous = memory, numel, contiguous

    def data_ptr(self) -> int:
        return self._memory.ptr

    def is_contiguous(self) -> bool:
        return self._contiguous

    def numel(self) -> int:
        return self._numel

    def element_size(self) -> int:
        return 4


def test_npu_tensors_are_device_endpoints():
    memory = runtime.DeviceBuffer(64)
    source = torch.arange(16, dtype=torch.float32)
    runtime.sim_reset_stats()
    runtime.memcpy(_NpuTensorLike(memory, 16), source, 64)
    back = torch.zeros(16)
    runtime.memcpy(back, _NpuTensorLike(memory, 16), 64)
    assert torch.equal(back, source)
    assert (runtime.sim_stats()["h2d"], runtime.sim_stats()["d2h"]) == (64, 64)
    with pytest.raises(ValueError, match=r"^nbytes: 64 bytes do not fit in dst \(NPU tensor of 32"):
        runtime.memcpy(_NpuTensorLike(memory, 8), source, 64)
    with pytest.raises(ValueError, match=r"^src: expected a contiguous NPU tensor"):
        runtime.memcpy(back, _NpuTensorLike(memory, 16, contiguous=False), 64)


# Issue 16, item 9: each of these used to crash the process (rc 139) or read past the tensor.
RAW_ADDRESS_CASES = {
    "device_from_foreign_int": (
        "runtime.memcpy(runtime.DeviceBuffer(1024), 12345, 16)",
        "src: address 0x3039 is not inside a live buffer",
    ),
    "pinned_from_foreign_int": (
        "runtime.memcpy(runtime.PinnedBuffer(16), 12345, 16)",
        "src: address 0x3039 is not inside a live buffer",
    ),
    "past_the_end_of_a_device_buffer": (
        "d = runtime.DeviceBuffer(1024)\nruntime.memcpy(d, d.ptr + 1_000_000, 16)",
        "is not inside a live buffer",
    ),
    "tensor_shorter_than_the_copy": (
        "import torch\nd = runtime.DeviceBuffer(1024)\nruntime.memcpy(d, torch.zeros(4), 1024)",
        "nbytes: 1024 bytes do not fit in src (Tensor of 16 bytes)",
    ),
    "tensor_data_ptr_int": (
        "import torch\nd = runtime.DeviceBuffer(1024)\n"
        "runtime.memcpy(d, torch.zeros(4).data_ptr(), 1024)",
        "is not inside a live buffer",
    ),
    "offset_running_past_a_buffer": (
        "d = runtime.DeviceBuffer(1024)\nruntime.memcpy(runtime.PinnedBuffer(64), d.ptr + 1000, 64)",
        "nbytes: 64 bytes from src",
    ),
    "freed_buffer_address": (
        "d = runtime.DeviceBuffer(64)\np = d.ptr\nd.free()\n"
        "runtime.memcpy(runtime.PinnedBuffer(64), p, 64)",
        "is not inside a live buffer",
    ),
}


@pytest.mark.parametrize("case", sorted(RAW_ADDRESS_CASES))
def test_raw_addresses_raise_instead_of_crashing(case):
    statement, message = RAW_ADDRESS_CASES[case]
    code = (
        "from ascend_vlm import runtime\n"
        "try:\n"
        + "".join(f"    {line}\n" for line in statement.split("\n"))
        + "except ValueError as error:\n"
        "    print('ValueError:', error)\n"
    )
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ValueError:"), result.stdout
    assert message in result.stdout


def test_int_addresses_inside_buffers_are_bounds_checked_in_process():
    device = runtime.DeviceBuffer(256)
    host = runtime.PinnedBuffer(256)
    np.frombuffer(host, dtype=np.uint8)[:] = np.arange(256, dtype=np.uint8)
    runtime.memcpy(device.ptr + 128, host.ptr + 128, 128)  # offsets inside both: fine
    back = np.zeros(128, dtype=np.uint8)
    runtime.memcpy(back, device.ptr + 128, 128)
    assert np.array_equal(back, np.arange(128, 256, dtype=np.uint8))
    with pytest.raises(ValueError, match=r"nbytes: 129 bytes from dst .* \(128 bytes left\)"):
        runtime.memcpy(device.ptr + 128, host, 129)


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
    runtime.memcpy(check, device, n)
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
    runtime.memcpy(check, device, PAGE)
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
