// RAII AscendCL streams and events, and copies between buffers or raw addresses.
#ifndef ASCEND_VLM_RUNTIME_STREAM_H_
#define ASCEND_VLM_RUNTIME_STREAM_H_

#include <cstddef>
#include <cstdint>
#include <functional>

#include "acl/acl.h"

namespace ascend_vlm {

class Event;

// A dedicated stream on the current device, subscribed to the report thread so that host
// callbacks can run. Work on one stream runs in issue order.
class Stream {
 public:
  // `priority` 0 (highest) to 7 (aclrtCreateStreamWithConfig).
  explicit Stream(uint32_t priority = 0);
  // destroy(), ignoring errors.
  ~Stream();
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  aclrtStream handle() const;
  uint32_t priority() const { return priority_; }
  int32_t device() const { return device_; }

  // Blocks the calling thread until all work queued so far has finished.
  void synchronize();
  // Work queued after this call starts only once `event`'s latest record has completed.
  void wait_event(const Event& event);
  // Queues a copy of `count` bytes; `dst_max` bounds the destination.
  void memcpy_async(void* dst, size_t dst_max, const void* src, size_t count, aclrtMemcpyKind kind);
  // Queues `fn` to run on the report thread after prior work; later work waits for it.
  void launch_host_func(std::function<void()> fn);
  // Waits for queued work, then destroys the stream. A stream error reported by that wait is
  // thrown and leaves the stream alive; call destroy() again to finish.
  void destroy();
  bool destroyed() const { return handle_ == nullptr; }

 private:
  aclrtStream handle_ = nullptr;
  uint32_t priority_;
  int32_t device_ = -1;
  uint64_t session_ = 0;
};

class Event {
 public:
  // `timing` events carry timestamps (ACL_EVENT_TIME_LINE); others only order work.
  explicit Event(bool timing = true);
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  aclrtEvent handle() const;
  bool timing() const { return timing_; }

  // Captures the work queued on `stream` so far.
  void record(Stream& stream);
  // True once the latest record has completed (or if the event was never recorded).
  bool query() const;
  // Blocks the calling thread until the latest record has completed.
  void synchronize() const;
  // Milliseconds from this event's completion to `end`'s; both must be timing events whose
  // records have completed.
  float elapsed_ms(const Event& end) const;

 private:
  aclrtEvent handle_ = nullptr;
  bool timing_;
  uint64_t session_ = 0;
};

// Synchronous copy (aclrtMemcpy).
void memcpy_sync(void* dst, size_t dst_max, const void* src, size_t count, aclrtMemcpyKind kind);

}  // namespace ascend_vlm

#endif  // ASCEND_VLM_RUNTIME_STREAM_H_
