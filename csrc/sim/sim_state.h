// Internal state of the simulated AscendCL runtime (not part of the ACL API).
//
// Model: every device owns a capacity-limited memory pool whose allocations are real host memory,
// so copies really move bytes. A stream is an in-order task queue drained by one worker thread.
// Events carry a record sequence number: a record task completes sequence N, waits and
// synchronisations block until the sequence seen when they were issued has completed. Host
// callbacks are posted by the stream worker to the report queue of the thread subscribed to the
// stream and run inside that thread's aclrtProcessReport call.
#ifndef ASCEND_VLM_SIM_SIM_STATE_H_
#define ASCEND_VLM_SIM_SIM_STATE_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "acl/acl.h"

namespace ascend_vlm::sim {

using Clock = std::chrono::steady_clock;

// One in-order queue of device work with its own worker thread. Stream priorities are
// validated but not modelled: every stream's worker is an ordinary OS thread.
class SimStream {
 public:
  SimStream();
  ~SimStream();
  SimStream(const SimStream&) = delete;
  SimStream& operator=(const SimStream&) = delete;

  // Appends a task and returns its ticket; a non-success return value of the task becomes the
  // stream's pending error.
  uint64_t enqueue(std::function<aclError()> task);
  // Blocks until the task with `ticket` has run.
  void wait_for(uint64_t ticket);
  // Blocks until every task enqueued so far has run; returns and clears the pending error.
  aclError synchronize();
  bool idle();

 private:
  void run();

  std::mutex mutex_;
  std::condition_variable work_ready_;
  std::condition_variable work_done_;
  std::deque<std::function<aclError()>> queue_;
  uint64_t submitted_ = 0;
  uint64_t completed_ = 0;
  aclError pending_error_ = ACL_SUCCESS;
  bool stopping_ = false;
  std::thread worker_;
};

struct SimEvent {
  bool timing = true;  // ACL_EVENT_TIME_LINE: carries timestamps
  bool sync = true;    // ACL_EVENT_SYNC: streams may wait on it
  // Guarded by State::progress_mutex.
  uint64_t recorded_seq = 0;
  uint64_t completed_seq = 0;
  Clock::time_point completed_at{};
};

struct DeviceAllocation {
  int32_t device;
  size_t size;       // bytes the caller asked for
  size_t accounted;  // bytes charged to the pool (32-byte rounded plus 32-byte pad, like CANN)
};

struct MappedRegion {
  void* host;
  size_t size;
  void* device_alias;  // PROT_NONE reservation: unique, never host-dereferenceable
  size_t alias_bytes;
};

struct Report {
  aclrtCallback fn;
  void* user_data;
  std::shared_ptr<bool> done;  // guarded by State::progress_mutex
};

struct State {
  std::mutex lifecycle_mutex;
  std::atomic<bool> initialized{false};
  std::atomic<uint64_t> epoch{1};  // bumped by aclFinalize; stale thread bindings compare it
  uint32_t device_count = 2;

  // Device memory, host allocations and registrations. Copies hold it shared, so no free can
  // run under a copy in flight.
  std::shared_mutex memory_mutex;
  std::vector<size_t> capacity;
  std::vector<size_t> used;
  std::map<uintptr_t, DeviceAllocation> device_allocations;  // keyed by base address
  std::map<uintptr_t, size_t> host_allocations;              // aclrtMallocHost: base -> size
  std::map<uintptr_t, MappedRegion> mapped_by_host;
  std::map<uintptr_t, uintptr_t> mapped_alias_to_host;

  std::atomic<uint64_t> bytes_h2h{0}, bytes_h2d{0}, bytes_d2h{0}, bytes_d2d{0}, bytes_kernel{0};

  std::mutex handles_mutex;
  std::unordered_map<void*, std::shared_ptr<SimStream>> streams;
  std::unordered_map<void*, std::shared_ptr<SimEvent>> events;
  std::vector<std::shared_ptr<SimStream>> default_streams;  // per device, created on first use
  std::unordered_map<void*, uint64_t> stream_subscriber;    // stream -> report thread id
  std::unordered_map<uint64_t, int> thread_subscriptions;   // report thread id -> stream count

  // Cross-stream progress: event completion, callback completion and shutdown.
  std::mutex progress_mutex;
  std::condition_variable progress;
  bool shutting_down = false;

  std::mutex report_mutex;
  std::condition_variable report_ready;
  std::unordered_map<uint64_t, std::deque<Report>> reports;
};

// The process-wide simulator state. Deliberately never destroyed, so that calls made from
// static destructors or atexit handlers still find it.
State& state();

// Returns ACL_ERROR_UNINITIALIZE unless aclInit has run.
aclError require_initialized();
// The calling thread's device from aclrtSetDevice, or -1.
int32_t current_device();
// Resolves a stream handle (nullptr = the current device's default stream).
aclError find_stream(aclrtStream handle, std::shared_ptr<SimStream>* out);

// A validated copy: where the bytes really live, the direction the addresses imply, and whether
// every host endpoint is pinned (inside an aclrtMallocHost block or a registered range).
struct CopyPlan {
  char* to = nullptr;
  const char* from = nullptr;
  size_t count = 0;
  aclrtMemcpyKind kind = ACL_MEMCPY_DEFAULT;
  bool host_pinned = true;
  bool kernel = false;  // device code (aclsimLaunchCopyKernel) rather than a DMA copy
};

// Validates a copy against the allocation tables; memory_mutex must be held. Shared by
// aclrtMemcpy and aclrtMemcpyAsync (which validates again when the task runs).
aclError plan_copy_locked(void* dst, size_t dest_max, const void* src, size_t count,
                          aclrtMemcpyKind kind, CopyPlan* plan);
// Validates a device-side copy by the simulator's copy kernel: both ends must be device
// addresses (aclrtMalloc memory or the device address of registered host memory).
aclError plan_kernel_copy_locked(void* dst, const void* src, size_t count, CopyPlan* plan);
// Moves the bytes of a plan and counts them per direction; memory_mutex must be held.
void perform_copy_locked(const CopyPlan& plan);

}  // namespace ascend_vlm::sim

#endif  // ASCEND_VLM_SIM_SIM_STATE_H_
