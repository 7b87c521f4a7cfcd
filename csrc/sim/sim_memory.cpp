// Simulated AscendCL: device memory pool, pinned host memory, host registration (UVA) and copies.
//
// Error codes for misuse: the docs (hicann/runtime docs/api_docs) state the preconditions
// (aclrtFree only takes aclrtMalloc pointers, aclrtHostRegister needs a 4K-aligned pointer, a
// mapped device address is no copy endpoint, ...) but not the code each violation yields. The sim
// follows the implementation's split (e.g. aclrtFreeImpl): ACL-layer argument checks return
// ACL_ERROR_INVALID_PARAM (null pointer, zero size, bad enum, count > destMax), runtime-layer
// failures return ACL_ERROR_RT_* (ACL_ERROR_RT_PARAM_INVALID: unknown, freed, foreign or mapped
// address; ACL_ERROR_RT_ADDR_UNALIGNED: misaligned address; ACL_ERROR_RT_MEMORY_ALLOCATION: pool
// full).
#include <sys/mman.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <string>

#include "acl/acl.h"
#include "sim_state.h"

namespace ascend_vlm::sim {
namespace {

constexpr size_t kDeviceAlignment = 512;
constexpr size_t kPageSize = 4096;
constexpr size_t kHostOffset = 64;  // aclrtMallocHost addresses: 64-byte, not 4 KB, aligned

bool soc_supports_host_register() {
  const std::string soc = aclrtGetSocName();
  return soc.rfind("Ascend910B", 0) == 0 || soc.rfind("Ascend910_93", 0) == 0;
}

size_t round_up(size_t value, size_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

// kMapped: the device address of registered host memory. Device code may use it, but CANN
// documents that it "cannot be used for memory operations such as copies" (aclrtHostRegister).
enum class Space { kHost, kDevice, kMapped };

struct Resolved {
  Space space = Space::kHost;
  char* address = nullptr;  // where the bytes really live
  bool valid = true;        // false: inside a device range but the span overruns it
  bool pinned = false;      // host memory from aclrtMallocHost or a registered range
};

// Finds the map entry whose [base, base + size) contains `address`, or end().
template <typename Map, typename SizeOf>
typename Map::const_iterator containing(const Map& map, uintptr_t address, SizeOf size_of) {
  auto it = map.upper_bound(address);
  if (it == map.begin()) return map.end();
  --it;
  return address < it->first + size_of(it->second) ? it : map.end();
}

// Classifies `ptr .. ptr + count` as device memory (an aclrtMalloc block), the device alias of a
// registered host range (translated to its host bytes) or host memory.
Resolved resolve(const State& s, const void* ptr, size_t count) {
  const auto address = reinterpret_cast<uintptr_t>(ptr);
  Resolved out;
  out.address = reinterpret_cast<char*>(const_cast<void*>(ptr));
  auto block =
      containing(s.device_allocations, address, [](const DeviceAllocation& a) { return a.size; });
  if (block != s.device_allocations.end()) {
    out.space = Space::kDevice;
    out.valid = address + count <= block->first + block->second.size;
    return out;
  }
  auto alias = containing(s.mapped_alias_to_host, address,
                          [&s](uintptr_t host) { return s.mapped_by_host.at(host).size; });
  if (alias != s.mapped_alias_to_host.end()) {
    const MappedRegion& region = s.mapped_by_host.at(alias->second);
    out.space = Space::kMapped;
    out.address = static_cast<char*>(region.host) + (address - alias->first);
    out.valid = address + count <= alias->first + region.size;
    return out;
  }
  out.pinned =
      containing(s.host_allocations, address, [](const HostAllocation& a) { return a.size; }) !=
          s.host_allocations.end() ||
      containing(s.mapped_by_host, address, [](const MappedRegion& r) { return r.size; }) !=
          s.mapped_by_host.end();
  return out;
}

std::atomic<uint64_t>& counter_for(State& s, const CopyPlan& plan) {
  if (plan.kernel) return s.bytes_kernel;
  switch (plan.kind) {
    case ACL_MEMCPY_HOST_TO_DEVICE:
      return s.bytes_h2d;
    case ACL_MEMCPY_DEVICE_TO_HOST:
      return s.bytes_d2h;
    case ACL_MEMCPY_DEVICE_TO_DEVICE:
      return s.bytes_d2d;
    default:
      return s.bytes_h2h;
  }
}

}  // namespace

aclError plan_copy_locked(void* dst, size_t dest_max, const void* src, size_t count,
                          aclrtMemcpyKind kind, CopyPlan* plan) {
  // Kinds 0-7 are the documented aclrtMemcpyKind values; anything else is refused.
  if (dst == nullptr || src == nullptr || count > dest_max || kind < ACL_MEMCPY_HOST_TO_HOST ||
      kind > ACL_MEMCPY_INTER_DEVICE_TO_DEVICE) {
    return ACL_ERROR_INVALID_PARAM;
  }
  State& s = state();
  const Resolved to = resolve(s, dst, count);
  const Resolved from = resolve(s, src, count);
  if (!to.valid || !from.valid || to.space == Space::kMapped || from.space == Space::kMapped) {
    return ACL_ERROR_RT_PARAM_INVALID;
  }
  const bool to_device = to.space == Space::kDevice;
  const bool from_device = from.space == Space::kDevice;
  const aclrtMemcpyKind actual =
      to_device ? (from_device ? ACL_MEMCPY_DEVICE_TO_DEVICE : ACL_MEMCPY_HOST_TO_DEVICE)
                : (from_device ? ACL_MEMCPY_DEVICE_TO_HOST : ACL_MEMCPY_HOST_TO_HOST);
  // The direction is what the addresses say, whatever `kind` claims: hicann/runtime
  // docs/zh/api_ref/11-03_memory_copy_and_set.md documents `kind` of aclrtMemcpy as reserved, the
  // runtime working out from the two addresses whether (and how) the copy can be done.
  *plan = {to.address,
           from.address,
           count,
           actual,
           (to_device || to.pinned) && (from_device || from.pinned),
           /*kernel=*/false};
  return ACL_SUCCESS;
}

aclError plan_kernel_copy_locked(void* dst, const void* src, size_t count, CopyPlan* plan) {
  if (dst == nullptr || src == nullptr) return ACL_ERROR_INVALID_PARAM;
  State& s = state();
  const Resolved to = resolve(s, dst, count);
  const Resolved from = resolve(s, src, count);
  // Device code reaches device memory and mapped host memory, never plain host addresses.
  if (!to.valid || !from.valid || to.space == Space::kHost || from.space == Space::kHost) {
    return ACL_ERROR_RT_PARAM_INVALID;
  }
  *plan = {to.address, from.address, count, ACL_MEMCPY_DEVICE_TO_DEVICE, true, /*kernel=*/true};
  return ACL_SUCCESS;
}

void perform_copy_locked(const CopyPlan& plan) {
  if (plan.count == 0) return;
  std::memmove(plan.to, plan.from, plan.count);
  counter_for(state(), plan).fetch_add(plan.count);
}

}  // namespace ascend_vlm::sim

using ascend_vlm::sim::State;
using ascend_vlm::sim::state;

extern "C" {

aclError aclrtMalloc(void** devPtr, size_t size, aclrtMemMallocPolicy /*policy*/) {
  if (aclError rc = ascend_vlm::sim::require_initialized()) return rc;
  // An unknown policy is not an error: CANN falls back to huge pages from 2 MB on (aclrtMalloc
  // docs), which the pool does not distinguish.
  if (devPtr == nullptr || size == 0) return ACL_ERROR_INVALID_PARAM;
  const int32_t device = ascend_vlm::sim::current_device();
  if (device < 0) return ACL_ERROR_RT_CONTEXT_NULL;
  // hicann/runtime docs/api_docs/aclrtMalloc.md: size rounded up to 32 bytes plus 32 bytes.
  const size_t accounted = ascend_vlm::sim::round_up(size, 32) + 32;
  if (accounted < size) return ACL_ERROR_RT_MEMORY_ALLOCATION;  // overflow: absurd size
  State& s = state();
  std::unique_lock lock(s.memory_mutex);
  if (accounted > s.capacity[device] - s.used[device]) return ACL_ERROR_RT_MEMORY_ALLOCATION;
  void* block = nullptr;
  if (posix_memalign(&block, ascend_vlm::sim::kDeviceAlignment, size) != 0) {
    return ACL_ERROR_RT_MEMORY_ALLOCATION;
  }
  s.device_allocations[reinterpret_cast<uintptr_t>(block)] = {device, size, accounted};
  s.used[device] += accounted;
  *devPtr = block;
  return ACL_SUCCESS;
}

aclError aclrtFree(void* devPtr) {
  if (aclError rc = ascend_vlm::sim::require_initialized()) return rc;
  if (devPtr == nullptr) return ACL_ERROR_INVALID_PARAM;
  State& s = state();
  std::unique_lock lock(s.memory_mutex);
  auto it = s.device_allocations.find(reinterpret_cast<uintptr_t>(devPtr));
  if (it == s.device_allocations.end()) return ACL_ERROR_RT_PARAM_INVALID;
  s.used[it->second.device] -= it->second.accounted;
  s.device_allocations.erase(it);
  std::free(devPtr);
  return ACL_SUCCESS;
}

aclError aclrtMallocHost(void** hostPtr, size_t size) {
  if (aclError rc = ascend_vlm::sim::require_initialized()) return rc;
  if (hostPtr == nullptr || size == 0) return ACL_ERROR_INVALID_PARAM;
  void* block = nullptr;
  // hicann/runtime docs/zh/api_ref/11-02_host_memory_management.md: aclrtMallocHost promises a
  // 64-byte aligned start, nothing more. The simulator hands out an address 64 bytes past a page
  // boundary, so code that registers it without aligning to 4 KB itself fails here as on CANN.
  if (size > SIZE_MAX - ascend_vlm::sim::kHostOffset ||
      posix_memalign(&block, ascend_vlm::sim::kPageSize, size + ascend_vlm::sim::kHostOffset) !=
          0) {
    return ACL_ERROR_BAD_ALLOC;
  }
  char* address = static_cast<char*>(block) + ascend_vlm::sim::kHostOffset;
  State& s = state();
  std::unique_lock lock(s.memory_mutex);
  s.host_allocations[reinterpret_cast<uintptr_t>(address)] = {size, block};
  *hostPtr = address;
  return ACL_SUCCESS;
}

aclError aclrtFreeHost(void* hostPtr) {
  if (aclError rc = ascend_vlm::sim::require_initialized()) return rc;
  if (hostPtr == nullptr) return ACL_ERROR_INVALID_PARAM;
  State& s = state();
  std::unique_lock lock(s.memory_mutex);
  const auto base = reinterpret_cast<uintptr_t>(hostPtr);
  auto it = s.host_allocations.find(base);
  // Freeing memory that is still registered would leave the device alias dangling.
  if (it == s.host_allocations.end() || s.mapped_by_host.count(base) != 0) {
    return ACL_ERROR_RT_PARAM_INVALID;
  }
  void* block = it->second.block;
  s.host_allocations.erase(it);
  std::free(block);
  return ACL_SUCCESS;
}

aclError aclrtHostRegister(void* ptr, uint64_t size, aclrtHostRegisterType type, void** devPtr) {
  if (aclError rc = ascend_vlm::sim::require_initialized()) return rc;
  if (ptr == nullptr || devPtr == nullptr || size == 0) return ACL_ERROR_INVALID_PARAM;
  // IOMEMORY and READONLY are documented as reserved, "currently not supported".
  if (type == ACL_HOST_REGISTER_IOMEMORY || type == ACL_HOST_REGISTER_READONLY) {
    return ACL_ERROR_RT_FEATURE_NOT_SUPPORT;
  }
  if (type != ACL_HOST_REGISTER_MAPPED) return ACL_ERROR_INVALID_PARAM;
  // Host registration exists on Atlas A2/A3 only (aclrtHostRegister product support table).
  if (!ascend_vlm::sim::soc_supports_host_register()) return ACL_ERROR_RT_FEATURE_NOT_SUPPORT;
  if (reinterpret_cast<uintptr_t>(ptr) % ascend_vlm::sim::kPageSize != 0) {
    return ACL_ERROR_RT_ADDR_UNALIGNED;
  }
  State& s = state();
  std::unique_lock lock(s.memory_mutex);
  const auto base = reinterpret_cast<uintptr_t>(ptr);
  if (ascend_vlm::sim::resolve(s, ptr, 0).space != ascend_vlm::sim::Space::kHost) {
    return ACL_ERROR_RT_PARAM_INVALID;  // device memory cannot be registered as host memory
  }
  // Overlap with an existing registration: the next one at or after base, or one before it
  // reaching into [base, base + size).
  auto next = s.mapped_by_host.lower_bound(base);
  if (next != s.mapped_by_host.end() && next->first < base + size)
    return ACL_ERROR_RT_PARAM_INVALID;
  if (next != s.mapped_by_host.begin() &&
      std::prev(next)->first + std::prev(next)->second.size > base) {
    return ACL_ERROR_RT_PARAM_INVALID;
  }
  const size_t alias_bytes = ascend_vlm::sim::round_up(size, ascend_vlm::sim::kPageSize);
  void* alias =
      mmap(nullptr, alias_bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (alias == MAP_FAILED) return ACL_ERROR_RT_MEMORY_ALLOCATION;
  s.mapped_by_host[base] = {ptr, static_cast<size_t>(size), alias, alias_bytes};
  s.mapped_alias_to_host[reinterpret_cast<uintptr_t>(alias)] = base;
  *devPtr = alias;
  return ACL_SUCCESS;
}

aclError aclrtHostUnregister(void* ptr) {
  if (aclError rc = ascend_vlm::sim::require_initialized()) return rc;
  if (ptr == nullptr) return ACL_ERROR_INVALID_PARAM;
  State& s = state();
  std::unique_lock lock(s.memory_mutex);
  auto it = s.mapped_by_host.find(reinterpret_cast<uintptr_t>(ptr));
  if (it == s.mapped_by_host.end()) return ACL_ERROR_RT_PARAM_INVALID;
  s.mapped_alias_to_host.erase(reinterpret_cast<uintptr_t>(it->second.device_alias));
  munmap(it->second.device_alias, it->second.alias_bytes);
  s.mapped_by_host.erase(it);
  return ACL_SUCCESS;
}

aclError aclrtMemcpy(void* dst, size_t destMax, const void* src, size_t count,
                     aclrtMemcpyKind kind) {
  if (aclError rc = ascend_vlm::sim::require_initialized()) return rc;
  State& s = state();
  std::shared_lock lock(s.memory_mutex);
  ascend_vlm::sim::CopyPlan plan;
  if (aclError rc = ascend_vlm::sim::plan_copy_locked(dst, destMax, src, count, kind, &plan)) {
    return rc;
  }
  ascend_vlm::sim::perform_copy_locked(plan);
  return ACL_SUCCESS;
}

}  // extern "C"
