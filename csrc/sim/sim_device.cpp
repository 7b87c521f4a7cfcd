// Simulated AscendCL: process lifecycle, devices, contexts, memory info and the sim-only
// extensions.
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "acl/acl.h"
#include "acl_sim_ext.h"
#include "sim_state.h"

namespace ascend_vlm::sim {
namespace {

constexpr size_t kDefaultDeviceMemory = size_t{1} << 30;
constexpr uint32_t kDefaultDeviceCount = 2;
constexpr uint32_t kMaxDeviceCount = 64;
constexpr const char* kDefaultSoc = "Ascend910B1";

thread_local SimContext* current_context = nullptr;

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

bool valid_device(const State& s, int32_t device) {
  return device >= 0 && static_cast<uint32_t>(device) < s.device_count;
}

// Registered at the first aclInit when ASCEND_VLM_SIM_LEAK_REPORT is set.
void print_leak_report() {
  aclsimResourceCounts c{};
  (void)aclsimGetResourceCounts(&c);
  std::fprintf(stderr,
               "aclsim resources at exit: streams=%llu events=%llu deviceAllocations=%llu "
               "hostAllocations=%llu hostRegistrations=%llu subscribedStreams=%llu "
               "deviceRefs=%llu liveContexts=%llu resetsWithLiveHandles=%llu initCalls=%llu "
               "finalizeCalls=%llu\n",
               static_cast<unsigned long long>(c.streams),
               static_cast<unsigned long long>(c.events),
               static_cast<unsigned long long>(c.deviceAllocations),
               static_cast<unsigned long long>(c.hostAllocations),
               static_cast<unsigned long long>(c.hostRegistrations),
               static_cast<unsigned long long>(c.subscribedStreams),
               static_cast<unsigned long long>(c.deviceRefs),
               static_cast<unsigned long long>(c.liveContexts),
               static_cast<unsigned long long>(c.resetsWithLiveHandles),
               static_cast<unsigned long long>(c.initCalls),
               static_cast<unsigned long long>(c.finalizeCalls));
}

// Drops one (or, with `force`, every) reference of `device`; the last one releases its context.
aclError reset_device(int32_t device, bool force) {
  if (aclError rc = require_initialized()) return rc;
  State& s = state();
  if (!valid_device(s, device)) return ACL_ERROR_RT_INVALID_DEVICEID;
  std::lock_guard lock(s.devices_mutex);
  if (s.device_refs[device] == 0) return ACL_ERROR_RT_CONTEXT_NULL;  // nothing to reset
  s.device_refs[device] = force ? 0 : s.device_refs[device] - 1;
  if (s.device_refs[device] > 0) return ACL_SUCCESS;
  release_device_handles(device);
  s.contexts[device]->live = false;
  s.contexts[device] = nullptr;
  return ACL_SUCCESS;
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
  SimContext* context = current_context;
  return context != nullptr && context->live ? context->device : -1;
}

}  // namespace ascend_vlm::sim

using ascend_vlm::sim::State;
using ascend_vlm::sim::state;

extern "C" {

aclError aclInit(const char* /*configPath*/) {
  State& s = state();
  std::lock_guard lock(s.lifecycle_mutex);
  // hicann/runtime aclInitImpl: a repeated aclInit only bumps a reference count.
  if (s.initialized) {
    ++s.init_refcount;
    return ACL_ERROR_REPEAT_INITIALIZE;
  }
  // Once per process: after aclFinalize, AscendCL is not initialised again (the code is the
  // simulator's choice; CANN states the rule, not a code).
  if (s.finalized) return ACL_ERROR_REPEAT_INITIALIZE;
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
    std::lock_guard devices(s.devices_mutex);
    s.device_refs.assign(s.device_count, 0);
    s.contexts.assign(s.device_count, nullptr);
  }
  {
    std::lock_guard handles(s.handles_mutex);
    s.default_streams.assign(s.device_count, nullptr);
  }
  const char* report = std::getenv("ASCEND_VLM_SIM_LEAK_REPORT");
  if (report != nullptr && *report != '\0') std::atexit(ascend_vlm::sim::print_leak_report);
  s.init_refcount = 1;
  s.initialized = true;
  ++s.init_calls;
  return ACL_SUCCESS;
}

aclError aclFinalize() {
  State& s = state();
  std::lock_guard lock(s.lifecycle_mutex);
  if (!s.initialized) return ACL_ERROR_REPEAT_FINALIZE;
  s.initialized = false;
  s.finalized = true;
  s.init_refcount = 0;
  ++s.finalize_calls;
  {
    // Release every blocked wait (event waits, blocking callbacks) before stopping the workers.
    std::lock_guard progress(s.progress_mutex);
    s.shutting_down = true;
  }
  s.progress.notify_all();
  // Queued work stops; the handles, memory and registrations stay allocated and counted: CANN's
  // aclFinalize does not release them (the process exit does).
  std::vector<std::shared_ptr<ascend_vlm::sim::SimStream>> workers;
  {
    std::lock_guard handles(s.handles_mutex);
    for (auto& [handle, stream] : s.streams) workers.push_back(stream);
    for (auto& stream : s.default_streams) {
      if (stream) workers.push_back(stream);
    }
  }
  for (auto& stream : workers) stream->stop();
  {
    std::lock_guard reports(s.report_mutex);
    s.reports.clear();
  }
  s.report_ready.notify_all();
  return ACL_SUCCESS;
}

const char* aclrtGetSocName() {
  const char* soc = std::getenv("ASCEND_VLM_SIM_SOC");
  return soc != nullptr && *soc != '\0' ? soc : ascend_vlm::sim::kDefaultSoc;
}

aclError aclrtGetDeviceCount(uint32_t* count) {
  if (aclError rc = ascend_vlm::sim::require_initialized()) return rc;
  if (count == nullptr) return ACL_ERROR_INVALID_PARAM;
  *count = state().device_count;
  return ACL_SUCCESS;
}

aclError aclrtSetDevice(int32_t deviceId) {
  if (aclError rc = ascend_vlm::sim::require_initialized()) return rc;
  State& s = state();
  if (!ascend_vlm::sim::valid_device(s, deviceId)) return ACL_ERROR_RT_INVALID_DEVICEID;
  std::lock_guard lock(s.devices_mutex);
  if (s.contexts[deviceId] == nullptr) {
    s.all_contexts.push_back(std::make_unique<ascend_vlm::sim::SimContext>(deviceId));
    s.contexts[deviceId] = s.all_contexts.back().get();
  }
  ++s.device_refs[deviceId];
  ascend_vlm::sim::current_context = s.contexts[deviceId];
  return ACL_SUCCESS;
}

aclError aclrtResetDevice(int32_t deviceId) {
  return ascend_vlm::sim::reset_device(deviceId, /*force=*/false);
}

aclError aclrtResetDeviceForce(int32_t deviceId) {
  return ascend_vlm::sim::reset_device(deviceId, /*force=*/true);
}

aclError aclrtGetCurrentContext(aclrtContext* context) {
  if (aclError rc = ascend_vlm::sim::require_initialized()) return rc;
  if (context == nullptr) return ACL_ERROR_INVALID_PARAM;
  if (ascend_vlm::sim::current_device() < 0) return ACL_ERROR_RT_CONTEXT_NULL;
  *context = ascend_vlm::sim::current_context;
  return ACL_SUCCESS;
}

aclError aclrtSetCurrentContext(aclrtContext context) {
  if (aclError rc = ascend_vlm::sim::require_initialized()) return rc;
  if (context == nullptr) return ACL_ERROR_INVALID_PARAM;
  State& s = state();
  std::lock_guard lock(s.devices_mutex);
  for (auto& known : s.all_contexts) {
    if (known.get() == context) {
      if (!known->live) return ACL_ERROR_RT_CONTEXT_NULL;  // its device was reset
      ascend_vlm::sim::current_context = known.get();
      return ACL_SUCCESS;
    }
  }
  return ACL_ERROR_RT_PARAM_INVALID;
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
  if (free == nullptr || total == nullptr || attr < ACL_DDR_MEM || attr > ACL_HBM_MEM_P2P_HUGE1G) {
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

void* aclsimFindSymbol(const char* name) {
  if (name == nullptr) return nullptr;
  const char* hidden = std::getenv("ASCEND_VLM_SIM_HIDE_SYMBOLS");
  if (hidden != nullptr) {
    const std::string list = std::string(",") + hidden + ",";
    if (list.find(std::string(",") + name + ",") != std::string::npos) return nullptr;
  }
  struct Entry {
    const char* name;
    void* address;
  };
  const Entry optional[] = {
      {"aclrtHostRegister", reinterpret_cast<void*>(&aclrtHostRegister)},
      {"aclrtHostUnregister", reinterpret_cast<void*>(&aclrtHostUnregister)},
      {"aclrtSynchronizeStreamWithTimeout",
       reinterpret_cast<void*>(&aclrtSynchronizeStreamWithTimeout)},
      {"aclrtSynchronizeEventWithTimeout",
       reinterpret_cast<void*>(&aclrtSynchronizeEventWithTimeout)},
      {"aclrtResetDeviceForce", reinterpret_cast<void*>(&aclrtResetDeviceForce)},
      {"aclrtGetSocName", reinterpret_cast<void*>(&aclrtGetSocName)},
  };
  for (const Entry& entry : optional) {
    if (std::strcmp(entry.name, name) == 0) return entry.address;
  }
  return nullptr;
}

aclError aclsimGetResourceCounts(aclsimResourceCounts* counts) {
  if (counts == nullptr) return ACL_ERROR_INVALID_PARAM;
  State& s = state();
  *counts = {};
  {
    std::lock_guard handles(s.handles_mutex);
    counts->streams = s.streams.size();
    counts->events = s.events.size();
    counts->subscribedStreams = s.stream_subscriber.size();
  }
  {
    std::shared_lock memory(s.memory_mutex);
    counts->deviceAllocations = s.device_allocations.size();
    counts->hostAllocations = s.host_allocations.size();
    counts->hostRegistrations = s.mapped_by_host.size();
  }
  {
    std::lock_guard devices(s.devices_mutex);
    for (uint64_t refs : s.device_refs) counts->deviceRefs += refs;
    for (auto* context : s.contexts) counts->liveContexts += context != nullptr ? 1 : 0;
  }
  counts->resetsWithLiveHandles = s.resets_with_live_handles.load();
  counts->initCalls = s.init_calls.load();
  counts->finalizeCalls = s.finalize_calls.load();
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
  if (!ascend_vlm::sim::valid_device(s, deviceId)) return ACL_ERROR_RT_INVALID_DEVICEID;
  std::unique_lock lock(s.memory_mutex);
  if (bytes < s.used[deviceId]) return ACL_ERROR_INVALID_PARAM;
  s.capacity[deviceId] = bytes;
  return ACL_SUCCESS;
}

}  // extern "C"
