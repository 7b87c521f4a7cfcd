// Simulated AscendCL: process lifecycle, devices, memory info and the sim-only extensions.
#include <sys/mman.h>

#include <cerrno>
#include <cstdlib>
#include <string>

#include "acl/acl.h"
#include "acl_sim_ext.h"
#include "sim_state.h"

namespace ascend_vlm::sim {
namespace {

constexpr size_t kDefaultDeviceMemory = size_t{1} << 30;
constexpr uint32_t kDefaultDeviceCount = 2;
constexpr uint32_t kMaxDeviceCount = 64;

struct ThreadBinding {
  int32_t device = -1;
  uint64_t epoch = 0;
};
thread_local ThreadBinding thread_binding;

// Parses a positive decimal integer env variable; `fallback` when unset or malformed.
uint64_t env_positive(const char* name, uint64_t fallback) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return fallback;
  errno = 0;
  char* end = nullptr;
  const unsigned long long value = std::strtoull(text, &end, 10);
  if (errno != 0 || *end != '\0' || value == 0) return fallback;
  return value;
}

void release_all_memory(State& s) {
  std::unique_lock lock(s.memory_mutex);
  for (auto& [base, allocation] : s.device_allocations) std::free(reinterpret_cast<void*>(base));
  for (auto& [host, region] : s.mapped_by_host) munmap(region.device_alias, region.alias_bytes);
  for (auto& [base, size] : s.host_allocations) std::free(reinterpret_cast<void*>(base));
  s.device_allocations.clear();
  s.mapped_by_host.clear();
  s.mapped_alias_to_host.clear();
  s.host_allocations.clear();
  for (auto& bytes : s.used) bytes = 0;
}

}  // namespace

State& state() {
  static State* instance = new State();
  return *instance;
}

aclError require_initialized() {
  return state().initialized.load() ? ACL_SUCCESS : ACL_ERROR_UNINITIALIZE;
}

int32_t current_device() {
  return thread_binding.epoch == state().epoch.load() ? thread_binding.device : -1;
}

}  // namespace ascend_vlm::sim

using ascend_vlm::sim::State;
using ascend_vlm::sim::state;

extern "C" {

aclError aclInit(const char* /*configPath*/) {
  State& s = state();
  std::lock_guard lock(s.lifecycle_mutex);
  if (s.initialized) return ACL_ERROR_REPEAT_INITIALIZE;
  s.device_count = static_cast<uint32_t>(ascend_vlm::sim::env_positive(
      "ASCEND_VLM_SIM_DEVICE_COUNT", ascend_vlm::sim::kDefaultDeviceCount));
  if (s.device_count > ascend_vlm::sim::kMaxDeviceCount) {
    s.device_count = ascend_vlm::sim::kMaxDeviceCount;
  }
  const size_t capacity = ascend_vlm::sim::env_positive("ASCEND_VLM_SIM_DEVICE_MEM",
                                                        ascend_vlm::sim::kDefaultDeviceMemory);
  {
    std::unique_lock memory(s.memory_mutex);
    s.capacity.assign(s.device_count, capacity);
    s.used.assign(s.device_count, 0);
  }
  {
    std::lock_guard handles(s.handles_mutex);
    s.default_streams.assign(s.device_count, nullptr);
  }
  s.initialized = true;
  return ACL_SUCCESS;
}

aclError aclFinalize() {
  State& s = state();
  std::lock_guard lock(s.lifecycle_mutex);
  if (!s.initialized) return ACL_ERROR_REPEAT_FINALIZE;
  s.initialized = false;
  {
    // Release every blocked wait (event waits, blocking callbacks) before joining the workers.
    std::lock_guard progress(s.progress_mutex);
    s.shutting_down = true;
  }
  s.progress.notify_all();
  std::vector<std::shared_ptr<ascend_vlm::sim::SimStream>> doomed;
  {
    std::lock_guard handles(s.handles_mutex);
    for (auto& [handle, stream] : s.streams) doomed.push_back(stream);
    for (auto& stream : s.default_streams) {
      if (stream) doomed.push_back(stream);
    }
    s.streams.clear();
    s.default_streams.clear();
    s.events.clear();
    s.stream_subscriber.clear();
    s.thread_subscriptions.clear();
  }
  doomed.clear();  // joins the workers
  {
    std::lock_guard reports(s.report_mutex);
    s.reports.clear();
  }
  s.report_ready.notify_all();
  ascend_vlm::sim::release_all_memory(s);
  {
    std::lock_guard progress(s.progress_mutex);
    s.shutting_down = false;
  }
  s.epoch.fetch_add(1);
  return ACL_SUCCESS;
}

aclError aclrtGetDeviceCount(uint32_t* count) {
  if (aclError rc = ascend_vlm::sim::require_initialized()) return rc;
  if (count == nullptr) return ACL_ERROR_INVALID_PARAM;
  *count = state().device_count;
  return ACL_SUCCESS;
}

aclError aclrtSetDevice(int32_t deviceId) {
  if (aclError rc = ascend_vlm::sim::require_initialized()) return rc;
  if (deviceId < 0 || static_cast<uint32_t>(deviceId) >= state().device_count) {
    return ACL_ERROR_RT_INVALID_DEVICEID;
  }
  ascend_vlm::sim::thread_binding = {deviceId, state().epoch.load()};
  return ACL_SUCCESS;
}

aclError aclrtResetDevice(int32_t deviceId) {
  if (aclError rc = ascend_vlm::sim::require_initialized()) return rc;
  if (deviceId < 0 || static_cast<uint32_t>(deviceId) >= state().device_count) {
    return ACL_ERROR_RT_INVALID_DEVICEID;
  }
  if (ascend_vlm::sim::current_device() == deviceId) ascend_vlm::sim::thread_binding = {};
  return ACL_SUCCESS;
}

aclError aclrtGetDevice(int32_t* deviceId) {
  if (aclError rc = ascend_vlm::sim::require_initialized()) return rc;
  if (deviceId == nullptr) return ACL_ERROR_INVALID_PARAM;
  const int32_t device = ascend_vlm::sim::current_device();
  if (device < 0) return ACL_ERROR_RT_CONTEXT_NULL;
  *deviceId = device;
  return ACL_SUCCESS;
}

aclError aclrtGetMemInfo(aclrtMemAttr attr, size_t* free, size_t* total) {
  if (aclError rc = ascend_vlm::sim::require_initialized()) return rc;
  if (free == nullptr || total == nullptr || attr < ACL_DDR_MEM || attr > ACL_HBM_MEM_P2P_NORMAL) {
    return ACL_ERROR_INVALID_PARAM;
  }
  const int32_t device = ascend_vlm::sim::current_device();
  if (device < 0) return ACL_ERROR_RT_CONTEXT_NULL;
  State& s = state();
  std::shared_lock lock(s.memory_mutex);
  *total = s.capacity[device];
  *free = s.capacity[device] - s.used[device];
  return ACL_SUCCESS;
}

aclError aclsimGetCopyStats(aclsimCopyStats* stats) {
  if (stats == nullptr) return ACL_ERROR_INVALID_PARAM;
  State& s = state();
  stats->hostToHost = s.bytes_h2h.load();
  stats->hostToDevice = s.bytes_h2d.load();
  stats->deviceToHost = s.bytes_d2h.load();
  stats->deviceToDevice = s.bytes_d2d.load();
  stats->kernel = s.bytes_kernel.load();
  return ACL_SUCCESS;
}

aclError aclsimResetCopyStats() {
  State& s = state();
  s.bytes_h2h = 0;
  s.bytes_h2d = 0;
  s.bytes_d2h = 0;
  s.bytes_d2d = 0;
  s.bytes_kernel = 0;
  return ACL_SUCCESS;
}

aclError aclsimSetDeviceMemoryCapacity(int32_t deviceId, size_t bytes) {
  if (aclError rc = ascend_vlm::sim::require_initialized()) return rc;
  State& s = state();
  if (deviceId < 0 || static_cast<uint32_t>(deviceId) >= s.device_count) {
    return ACL_ERROR_RT_INVALID_DEVICEID;
  }
  std::unique_lock lock(s.memory_mutex);
  if (bytes < s.used[deviceId]) return ACL_ERROR_INVALID_PARAM;
  s.capacity[deviceId] = bytes;
  return ACL_SUCCESS;
}

}  // extern "C"
