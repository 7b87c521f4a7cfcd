// RAII AscendCL streams and events, and copies between buffers or raw addresses.
#ifndef ASCEND_VLM_RUNTIME_STREAM_H_
#define ASCEND_VLM_RUNTIME_STREAM_H_

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>

#include "acl/acl.h"

namespace ascend_vlm {

class Event;

// A dedicated stream on the device that is current when it is created, subscribed to that
// device's report thread so that host callbacks can run. Work on one stream runs in issue order.
// Every call runs in the context of the stream's device, whatever device is current.
//
// Thread safety: every member may be called from any thread. Calls that use the handle register
// as users under `mutex_`; destroy() first refuses new users, waits for the running ones, then
// drains and destroys, so a call racing destroy() raises AclError(ACL_ERROR_RT_INVALID_HANDLE)
// instead of passing a destroyed handle to AscendCL.
class Stream {
 public:
  // `priority` 0 (highest) to 7 (aclrtCreateStreamWithConfig).
  explicit Stream(uint32_t priority = 0);
  // destroy(), ignoring errors.
  ~Stream();
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  // The handle, for display and raw tests only: it may be destroyed by another thread right
  // after this returns; issue work through use().
  aclrtStream handle() const;
  uint32_t priority() const { return priority_; }
  int32_t device() const { return device_; }

  // Blocks the calling thread until all work queued so far has finished, at most `timeout_ms`
  // (-1: forever; default: Runtime::sync_timeout_ms()). A timeout raises
  // AclError(ACL_ERROR_RT_STREAM_SYNC_TIMEOUT) naming the stream, its device and the timeout.
  void synchronize(int32_t timeout_ms = kDefaultTimeout);
  // Work queued after this call starts only once `event`'s latest record has completed (the
  // event may belong to another device).
  void wait_event(const Event& event);
  // Queues a copy of `count` bytes; `dst_max` bounds the destination.
  void memcpy_async(void* dst, size_t dst_max, const void* src, size_t count, aclrtMemcpyKind kind);
  // Queues `fn` to run on the device's report thread after prior work; later work waits for it.
  void launch_host_func(std::function<void()> fn);
  // Runs `call(handle)` in the stream's device context while destroy() is held off. Throws
  // AclError(ACL_ERROR_RT_INVALID_HANDLE) if the stream is destroyed or being destroyed.
  void use(const std::function<void(aclrtStream)>& call);
  // Refuses new work, waits for calls in progress and for queued work (with the synchronisation
  // timeout), then destroys the stream. A stream error or timeout reported by that wait is thrown
  // and leaves the stream alive; call destroy() again to finish.
  void destroy();
  bool destroyed() const;

  // Marks "use Runtime::sync_timeout_ms()".
  static constexpr int32_t kDefaultTimeout = -2;

 private:
  // The live handle; throws unless the stream is open. Requires `mutex_` held.
  aclrtStream open_handle_locked(const char* function) const;

  mutable std::mutex mutex_;
  std::condition_variable idle_;  // signalled when `users_` drops to zero
  int users_ = 0;                 // calls inside use()
  bool closing_ = false;          // destroy() in progress: new users are refused
  aclrtStream handle_ = nullptr;
  uint32_t priority_;
  int32_t device_ = -1;
  uint64_t session_ = 0;
  uint64_t resource_ = 0;  // ledger id
};

class Event {
 public:
  // `timing` events carry timestamps (ACL_EVENT_TIME_LINE); others only order work. The event
  // belongs to the current device; it can only be recorded on streams of that device.
  explicit Event(bool timing = true);
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  // The handle, after checking the event's session is live (no context switch).
  aclrtEvent handle() const;
  bool timing() const { return timing_; }
  int32_t device() const { return device_; }

  // Captures the work queued on `stream` so far.
  void record(Stream& stream);
  // True once the latest record has completed (or if the event was never recorded).
  bool query() const;
  // Blocks the calling thread until the latest record has completed, at most `timeout_ms` (as
  // Stream::synchronize; a timeout raises ACL_ERROR_RT_EVENT_SYNC_TIMEOUT).
  void synchronize(int32_t timeout_ms = Stream::kDefaultTimeout) const;
  // Work queued on `foreign` (a stream this runtime does not own, e.g. torch_npu's current
  // stream from its `npu_stream` handle) after this call starts only once the latest record has
  // completed. Runs in the event's device context; a handle AscendCL does not know raises.
  void make_stream_wait(aclrtStream foreign) const;
  // Milliseconds from this event's completion to `end`'s; both must be timing events whose
  // records have completed.
  float elapsed_ms(const Event& end) const;

 private:
  // Binds the calling thread to the event's device, after checking the session.
  aclrtEvent enter(const char* function) const;

  aclrtEvent handle_ = nullptr;
  bool timing_;
  int32_t device_ = -1;
  uint64_t session_ = 0;
  uint64_t resource_ = 0;  // ledger id
};

// Synchronous copy (aclrtMemcpy), in the context of the current device.
void memcpy_sync(void* dst, size_t dst_max, const void* src, size_t count, aclrtMemcpyKind kind);

}  // namespace ascend_vlm

#endif  // ASCEND_VLM_RUNTIME_STREAM_H_
