// Internal state of the simulated AscendCL runtime (not part of the ACL API).
//
// Model: every device owns a capacity-limited memory pool whose allocations are real host memory,
// so copies really move bytes. A stream is an in-order task queue drained by one worker thread.
// Events carry a record sequence number: a record task completes sequence N, waits and
// synchronisations block until the sequence seen when they were issued has completed. Host
// callbacks are posted by the stream worker to the report queue of the thread subscribed to the
// stream and run inside that thread's aclrtProcessReport call.
//
// Rules of CANN the simulator enforces (each is a way real hardware fails that CI must catch):
// - aclInit once per process; aclFinalize frees no memory, registration or stream (they stay
//   counted in aclsimResourceCounts); a second aclInit after aclFinalize is refused.
// - aclrtSetDevice / aclrtResetDevice are reference counted per device (not per thread): the
//   device's default context lives until the count returns to zero. Every thread has a current
//   context (aclrtSetDevice or aclrtSetCurrentContext); streams and events belong to the context
//   they were created in and calls on them from another context fail with
//   ACL_ERROR_RT_STREAM_CONTEXT.
// - A report thread serves the streams of one device only; aclrtProcessReport returns
//   ACL_ERROR_RT_REPORT_TIMEOUT when nothing was reported in time and
//   ACL_ERROR_RT_THREAD_SUBSCRIBE for a thread no stream is subscribed to.
// - aclrtMallocHost memory is 64-byte aligned (and deliberately not 4 KB aligned), while
//   aclrtHostRegister needs 4 KB alignment.
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
  explicit SimStream(int32_t device);
  ~SimStream();
  SimStream(const SimStream&) = delete;
  SimStream& operator=(const SimStream&) = delete;

  // Appends a task and returns its ticket; a non-success return value of the task becomes the
  // stream's pending error.
  uint64_t enqueue(std::function<aclError()> task);
  // Blocks until the task with `ticket` has run.
  void wait_for(uint64_t ticket);
  // Blocks until every task enqueued so far has run, or `timeout_ms` (>= 0) has passed:
  // ACL_ERROR_RT_STREAM_SYNC_TIMEOUT. Returns and clears the pending error. -1 waits forever.
  aclError synchronize(int32_t timeout_ms = -1);
  bool idle();
  // Discards queued work and joins the worker (aclFinalize, device reset); idempotent.
  void stop();
  const int32_t device;

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

// The default context of one device, from aclrtSetDevice until the device's reference count
// returns to zero. Never deleted, so a stale handle is recognised (live == false).
struct SimContext {
  explicit SimContext(int32_t owner) : device(owner) {}
  const int32_t device;
  std::atomic<bool> live{true};
};

struct SimEvent {
  int32_t device = -1;
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

struct HostAllocation {
  size_t size;
  void* block;  // what posix_memalign returned (the address handed out is 64 bytes past it)
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
  bool finalized = false;  // aclFinalize ran: AscendCL cannot be initialised again
  uint64_t init_refcount = 0;
  std::atomic<uint64_t> init_calls{0}, finalize_calls{0};
  uint32_t device_count = 2;

  // Devices: aclrtSetDevice reference counts and default contexts (nullptr after the reset).
  std::mutex devices_mutex;
  std::vector<uint64_t> device_refs;
  std::vector<SimContext*> contexts;
  std::vector<std::unique_ptr<SimContext>> all_contexts;
  std::atomic<uint64_t> resets_with_live_handles{0};

  // Device memory, host allocations and registrations. Copies hold it shared, so no free can
  // run under a copy in flight.
  std::shared_mutex memory_mutex;
  std::vector<size_t> capacity;
  std::vector<size_t> used;
  std::map<uintptr_t, DeviceAllocation> device_allocations;  // keyed by base address
  std::map<uintptr_t, HostAllocation> host_allocations;      // aclrtMallocHost, by address
  std::map<uintptr_t, MappedRegion> mapped_by_host;
  std::map<uintptr_t, uintptr_t> mapped_alias_to_host;

  std::atomic<uint64_t> bytes_h2h{0}, bytes_h2d{0}, bytes_d2h{0}, bytes_d2d{0}, bytes_kernel{0};

  std::mutex handles_mutex;
  std::unordered_map<void*, std::shared_ptr<SimStream>> streams;
  std::unordered_map<void*, std::shared_ptr<SimEvent>> events;
  std::vector<std::shared_ptr<SimStream>> default_streams;  // per device, created on first use
  std::unordered_map<void*, uint64_t> stream_subscriber;    // stream -> report thread id
  std::unordered_map<uint64_t, int> thread_subscriptions;   // report thread id -> stream count
  std::unordered_map<uint64_t, int32_t> thread_device;      // report thread id -> its device

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
// The device of the calling thread's current context, or -1 (none, or its device was reset).
int32_t current_device();
// Resolves a stream handle (nullptr = the current device's default stream) that must belong to
// the calling thread's current context: ACL_ERROR_RT_CONTEXT_NULL without a context,
// ACL_ERROR_RT_STREAM_CONTEXT for a stream of another device.
aclError find_stream(aclrtStream handle, std::shared_ptr<SimStream>* out);
// Destroys what a device reset to zero releases: its default stream, and the streams and events
// still alive in its context (counted in resets_with_live_handles). Caller holds devices_mutex.
void release_device_handles(int32_t device);

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
