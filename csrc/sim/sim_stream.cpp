// Simulated AscendCL: streams (in-order worker queues), events, async copies and host callbacks.
#include <pthread.h>

#include <chrono>
#include <exception>
#include <utility>

#include "acl/acl.h"
#include "acl_sim_ext.h"
#include "sim_state.h"

namespace ascend_vlm::sim {
namespace {

// Priority range 0~7 as noted for aclrtCreateStreamWithConfig in the project's NPU API notes;
// hicann/runtime's docs call the argument reserved (0). Validated, not modelled.
constexpr uint32_t kMaxStreamPriority = 7;
// aclrtCreateEventWithFlag docs: SYNC 0x1, CAPTURE_STREAM_PROGRESS 0x2, TIME_LINE 0x8,
// DEVICE_USE_ONLY 0x10, EXTERNAL 0x20, IPC 0x40; other bits are not supported.
constexpr uint32_t kKnownEventFlags = ACL_EVENT_SYNC | ACL_EVENT_CAPTURE_STREAM_PROGRESS |
                                      ACL_EVENT_TIME_LINE | ACL_EVENT_DEVICE_USE_ONLY |
                                      ACL_EVENT_EXTERNAL | ACL_EVENT_IPC;

uint64_t this_thread_id() { return static_cast<uint64_t>(pthread_self()); }

// Creates a stream and its worker thread; a failure is an error code, never an exception
// escaping into C callers.
aclError new_stream(int32_t device, std::shared_ptr<SimStream>* out) {
  try {
    *out = std::make_shared<SimStream>(device);
  } catch (const std::exception&) {
    return ACL_ERROR_RT_RESOURCE_ALLOC_FAIL;
  }
  return ACL_SUCCESS;
}

// ACL_ERROR_RT_CONTEXT_NULL without a current context, ACL_ERROR_RT_STREAM_CONTEXT if the
// handle belongs to another device's context (the simulator uses the stream code for events too).
aclError check_context(int32_t owner) {
  const int32_t device = current_device();
  if (device < 0) return ACL_ERROR_RT_CONTEXT_NULL;
  return device == owner ? ACL_SUCCESS : ACL_ERROR_RT_STREAM_CONTEXT;
}

aclError find_event(aclrtEvent handle, std::shared_ptr<SimEvent>* out) {
  if (handle == nullptr) return ACL_ERROR_INVALID_PARAM;
  State& s = state();
  {
    std::lock_guard lock(s.handles_mutex);
    auto it = s.events.find(handle);
    if (it == s.events.end()) return ACL_ERROR_RT_INVALID_HANDLE;
    *out = it->second;
  }
  return check_context((*out)->device);
}

// Blocks until `event` has completed record sequence `target` (or the runtime shuts down), at
// most `timeout_ms` when >= 0; false on timeout.
bool wait_for_event(const SimEvent& event, uint64_t target, int32_t timeout_ms = -1) {
  State& s = state();
  std::unique_lock lock(s.progress_mutex);
  auto done = [&] { return event.completed_seq >= target || s.shutting_down; };
  if (timeout_ms < 0) {
    s.progress.wait(lock, done);
    return true;
  }
  return s.progress.wait_for(lock, std::chrono::milliseconds(timeout_ms), done);
}

aclError create_stream(aclrtStream* stream, uint32_t priority, uint32_t flag) {
  if (aclError rc = require_initialized()) return rc;
  // Unknown stream flags give a plain stream (aclrtCreateStreamWithConfig docs), so only the
  // priority is checked.
  (void)flag;
  if (stream == nullptr || priority > kMaxStreamPriority) return ACL_ERROR_INVALID_PARAM;
  const int32_t device = current_device();
  if (device < 0) return ACL_ERROR_RT_CONTEXT_NULL;
  std::shared_ptr<SimStream> created;
  if (aclError rc = new_stream(device, &created)) return rc;
  State& s = state();
  std::lock_guard lock(s.handles_mutex);
  s.streams[created.get()] = created;
  *stream = created.get();
  return ACL_SUCCESS;
}

aclError create_event(aclrtEvent* event, uint32_t flags) {
  if (aclError rc = require_initialized()) return rc;
  if (event == nullptr) return ACL_ERROR_INVALID_PARAM;
  const int32_t device = current_device();
  if (device < 0) return ACL_ERROR_RT_CONTEXT_NULL;
  auto created = std::make_shared<SimEvent>();
  created->device = device;
  created->timing = (flags & ACL_EVENT_TIME_LINE) != 0;
  created->sync = (flags & ACL_EVENT_SYNC) != 0;
  State& s = state();
  std::lock_guard lock(s.handles_mutex);
  s.events[created.get()] = created;
  *event = created.get();
  return ACL_SUCCESS;
}

}  // namespace

SimStream::SimStream(int32_t owner) : device(owner), worker_([this] { run(); }) {}

SimStream::~SimStream() { stop(); }

void SimStream::stop() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  work_ready_.notify_all();
  if (worker_.joinable() && worker_.get_id() != std::this_thread::get_id()) worker_.join();
}

uint64_t SimStream::enqueue(std::function<aclError()> task) {
  uint64_t ticket = 0;
  {
    std::lock_guard lock(mutex_);
    queue_.push_back(std::move(task));
    ticket = ++submitted_;
  }
  work_ready_.notify_one();
  return ticket;
}

void SimStream::wait_for(uint64_t ticket) {
  std::unique_lock lock(mutex_);
  work_done_.wait(lock, [&] { return completed_ >= ticket || stopping_; });
}

aclError SimStream::synchronize(int32_t timeout_ms) {
  std::unique_lock lock(mutex_);
  const uint64_t target = submitted_;
  auto done = [&] { return completed_ >= target || stopping_; };
  if (timeout_ms < 0) {
    work_done_.wait(lock, done);
  } else if (!work_done_.wait_for(lock, std::chrono::milliseconds(timeout_ms), done)) {
    return ACL_ERROR_RT_STREAM_SYNC_TIMEOUT;
  }
  return std::exchange(pending_error_, ACL_SUCCESS);
}

bool SimStream::idle() {
  std::lock_guard lock(mutex_);
  return completed_ == submitted_;
}

void SimStream::run() {
  std::unique_lock lock(mutex_);
  while (true) {
    work_ready_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
    if (stopping_) break;  // aclFinalize / destroy: queued work is discarded, as on reset
    std::function<aclError()> task = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    const aclError rc = task();
    lock.lock();
    if (rc != ACL_SUCCESS && pending_error_ == ACL_SUCCESS) pending_error_ = rc;
    ++completed_;
    work_done_.notify_all();
  }
  work_done_.notify_all();
}

aclError find_stream(aclrtStream handle, std::shared_ptr<SimStream>* out) {
  State& s = state();
  const int32_t device = current_device();
  if (handle == nullptr) {
    if (device < 0) return ACL_ERROR_RT_CONTEXT_NULL;
    std::lock_guard lock(s.handles_mutex);
    auto& stream = s.default_streams.at(device);
    if (!stream) {
      if (aclError rc = new_stream(device, &stream)) return rc;
    }
    *out = stream;
    return ACL_SUCCESS;
  }
  {
    std::lock_guard lock(s.handles_mutex);
    auto it = s.streams.find(handle);
    if (it == s.streams.end()) return ACL_ERROR_RT_INVALID_HANDLE;
    *out = it->second;
  }
  return check_context((*out)->device);
}

void release_device_handles(int32_t device) {
  State& s = state();
  std::vector<std::shared_ptr<SimStream>> doomed;
  bool live_handles = false;
  {
    std::lock_guard lock(s.handles_mutex);
    for (auto it = s.streams.begin(); it != s.streams.end();) {
      if (it->second->device != device) {
        ++it;
        continue;
      }
      live_handles = true;
      auto subscriber = s.stream_subscriber.find(it->first);
      if (subscriber != s.stream_subscriber.end()) {
        --s.thread_subscriptions[subscriber->second];
        s.stream_subscriber.erase(subscriber);
      }
      doomed.push_back(it->second);
      it = s.streams.erase(it);
    }
    for (auto it = s.events.begin(); it != s.events.end();) {
      if (it->second->device == device) {
        live_handles = true;
        it = s.events.erase(it);
      } else {
        ++it;
      }
    }
    if (s.default_streams.at(device)) doomed.push_back(std::move(s.default_streams[device]));
  }
  if (live_handles) ++s.resets_with_live_handles;
  s.report_ready.notify_all();
  // CANN: the reset waits for the default stream's unfinished tasks, then releases the streams.
  for (auto& stream : doomed) (void)stream->synchronize();
}

}  // namespace ascend_vlm::sim

using ascend_vlm::sim::SimEvent;
using ascend_vlm::sim::SimStream;
using ascend_vlm::sim::State;
using ascend_vlm::sim::state;

extern "C" {

aclError aclrtCreateStream(aclrtStream* stream) {
  return ascend_vlm::sim::create_stream(stream, 0, 0);
}

aclError aclrtCreateStreamWithConfig(aclrtStream* stream, uint32_t priority, uint32_t flag) {
  return ascend_vlm::sim::create_stream(stream, priority, flag);
}

aclError aclrtDestroyStream(aclrtStream stream) {
  if (aclError rc = ascend_vlm::sim::require_initialized()) return rc;
  if (stream == nullptr) return ACL_ERROR_INVALID_PARAM;
  State& s = state();
  std::shared_ptr<SimStream> doomed;
  if (aclError rc = ascend_vlm::sim::find_stream(stream, &doomed)) return rc;
  // hicann/runtime docs/api_docs/aclrtDestroyStream.md: unfinished tasks are waited for, then
  // the stream is destroyed (callers must not use it meanwhile).
  (void)doomed->synchronize();
  std::lock_guard lock(s.handles_mutex);
  if (s.streams.erase(stream) == 0) return ACL_ERROR_RT_INVALID_HANDLE;  // destroyed meanwhile
  auto subscriber = s.stream_subscriber.find(stream);
  if (subscriber != s.stream_subscriber.end()) {
    --s.thread_subscriptions[subscriber->second];
    s.stream_subscriber.erase(subscriber);
  }
  return ACL_SUCCESS;  // the idle worker is joined when `doomed` goes out of scope
}

aclError aclrtSynchronizeStream(aclrtStream stream) {
  return aclrtSynchronizeStreamWithTimeout(stream, -1);
}

aclError aclrtSynchronizeStreamWithTimeout(aclrtStream stream, int32_t timeout) {
  if (aclError rc = ascend_vlm::sim::require_initialized()) return rc;
  if (timeout < -1) return ACL_ERROR_INVALID_PARAM;
  std::shared_ptr<SimStream> target;
  if (aclError rc = ascend_vlm::sim::find_stream(stream, &target)) return rc;
  return target->synchronize(timeout);
}

aclError aclrtMemcpyAsync(void* dst, size_t destMax, const void* src, size_t count,
                          aclrtMemcpyKind kind, aclrtStream stream) {
  if (aclError rc = ascend_vlm::sim::require_initialized()) return rc;
  std::shared_ptr<SimStream> target;
  if (aclError rc = ascend_vlm::sim::find_stream(stream, &target)) return rc;
  State& s = state();
  ascend_vlm::sim::CopyPlan plan;
  {
    std::shared_lock lock(s.memory_mutex);
    if (aclError rc = ascend_vlm::sim::plan_copy_locked(dst, destMax, src, count, kind, &plan)) {
      return rc;
    }
  }
  // hicann/runtime docs/zh/api_ref/11-03_memory_copy_and_set.md, aclrtMemcpyAsync constraints:
  // on Ascend EP an asynchronous copy within the host is refused with
  // ACL_ERROR_RT_FEATURE_NOT_SUPPORT. No address alignment is required of the caller.
  if (plan.kind == ACL_MEMCPY_HOST_TO_HOST) return ACL_ERROR_RT_FEATURE_NOT_SUPPORT;
  // Validated again when it runs: memory freed meanwhile (its address no longer resolving to
  // the same direction) yields a stream error, not a wild write.
  const aclrtMemcpyKind planned = plan.kind;
  const uint64_t ticket = target->enqueue([dst, destMax, src, count, kind, planned] {
    std::shared_lock lock(state().memory_mutex);
    ascend_vlm::sim::CopyPlan current;
    aclError rc = ascend_vlm::sim::plan_copy_locked(dst, destMax, src, count, kind, &current);
    if (rc == ACL_SUCCESS && current.kind != planned) rc = ACL_ERROR_RT_PARAM_INVALID;
    if (rc == ACL_SUCCESS) ascend_vlm::sim::perform_copy_locked(current);
    return rc;
  });
  // Same reference: with pageable (non-pinned) host memory the call returns only once the copy
  // has completed.
  if (!plan.host_pinned) target->wait_for(ticket);
  return ACL_SUCCESS;
}

aclError aclsimLaunchCopyKernel(void* dst, const void* src, size_t count, aclrtStream stream) {
  if (aclError rc = ascend_vlm::sim::require_initialized()) return rc;
  std::shared_ptr<SimStream> target;
  if (aclError rc = ascend_vlm::sim::find_stream(stream, &target)) return rc;
  {
    std::shared_lock lock(state().memory_mutex);
    ascend_vlm::sim::CopyPlan plan;
    if (aclError rc = ascend_vlm::sim::plan_kernel_copy_locked(dst, src, count, &plan)) return rc;
  }
  target->enqueue([dst, src, count] {
    std::shared_lock lock(state().memory_mutex);
    ascend_vlm::sim::CopyPlan plan;
    const aclError rc = ascend_vlm::sim::plan_kernel_copy_locked(dst, src, count, &plan);
    if (rc == ACL_SUCCESS) ascend_vlm::sim::perform_copy_locked(plan);
    return rc;
  });
  return ACL_SUCCESS;
}

aclError aclrtCreateEvent(aclrtEvent* event) {
  return ascend_vlm::sim::create_event(event, ACL_EVENT_SYNC | ACL_EVENT_TIME_LINE);
}

aclError aclrtCreateEventWithFlag(aclrtEvent* event, uint32_t flag) {
  if ((flag & ~ascend_vlm::sim::kKnownEventFlags) != 0) return ACL_ERROR_INVALID_PARAM;
  return ascend_vlm::sim::create_event(event, flag);
}

aclError aclrtDestroyEvent(aclrtEvent event) {
  if (aclError rc = ascend_vlm::sim::require_initialized()) return rc;
  std::shared_ptr<SimEvent> target;
  if (aclError rc = ascend_vlm::sim::find_event(event, &target)) return rc;
  State& s = state();
  std::lock_guard lock(s.handles_mutex);
  // Tasks already queued keep their own reference, so destroying early is safe.
  return s.events.erase(event) == 1 ? ACL_SUCCESS : ACL_ERROR_RT_INVALID_HANDLE;
}

aclError aclrtRecordEvent(aclrtEvent event, aclrtStream stream) {
  if (aclError rc = ascend_vlm::sim::require_initialized()) return rc;
  std::shared_ptr<SimEvent> target;
  if (aclError rc = ascend_vlm::sim::find_event(event, &target)) return rc;
  std::shared_ptr<SimStream> queue;
  if (aclError rc = ascend_vlm::sim::find_stream(stream, &queue)) return rc;
  State& s = state();
  uint64_t seq = 0;
  {
    std::lock_guard lock(s.progress_mutex);
    seq = ++target->recorded_seq;
  }
  queue->enqueue([target, seq] {
    State& st = state();
    {
      std::lock_guard lock(st.progress_mutex);
      if (seq > target->completed_seq) {
        target->completed_seq = seq;
        target->completed_at = ascend_vlm::sim::Clock::now();
      }
    }
    st.progress.notify_all();
    return ACL_SUCCESS;
  });
  return ACL_SUCCESS;
}

aclError aclrtStreamWaitEvent(aclrtStream stream, aclrtEvent event) {
  if (aclError rc = ascend_vlm::sim::require_initialized()) return rc;
  std::shared_ptr<SimEvent> target;
  // The event may come from another device (cross-device ordering); the stream may not.
  if (aclError rc = ascend_vlm::sim::find_event(event, &target);
      rc != ACL_SUCCESS && rc != ACL_ERROR_RT_STREAM_CONTEXT) {
    return rc;
  }
  // aclrtCreateEventWithFlag docs: events without ACL_EVENT_SYNC cannot be waited on.
  if (!target->sync) return ACL_ERROR_RT_PARAM_INVALID;
  std::shared_ptr<SimStream> queue;
  if (aclError rc = ascend_vlm::sim::find_stream(stream, &queue)) return rc;
  uint64_t seq = 0;
  {
    std::lock_guard lock(state().progress_mutex);
    seq = target->recorded_seq;  // waits for the latest record issued before this call
  }
  if (seq == 0) return ACL_SUCCESS;  // never recorded: nothing to wait for
  queue->enqueue([target, seq] {
    ascend_vlm::sim::wait_for_event(*target, seq);
    return ACL_SUCCESS;
  });
  return ACL_SUCCESS;
}

aclError aclrtQueryEventStatus(aclrtEvent event, aclrtEventRecordedStatus* status) {
  if (aclError rc = ascend_vlm::sim::require_initialized()) return rc;
  if (status == nullptr) return ACL_ERROR_INVALID_PARAM;
  std::shared_ptr<SimEvent> target;
  if (aclError rc = ascend_vlm::sim::find_event(event, &target)) return rc;
  std::lock_guard lock(state().progress_mutex);
  *status = target->completed_seq >= target->recorded_seq ? ACL_EVENT_RECORDED_STATUS_COMPLETE
                                                          : ACL_EVENT_RECORDED_STATUS_NOT_READY;
  return ACL_SUCCESS;
}

aclError aclrtSynchronizeEvent(aclrtEvent event) {
  return aclrtSynchronizeEventWithTimeout(event, -1);
}

aclError aclrtSynchronizeEventWithTimeout(aclrtEvent event, int32_t timeout) {
  if (aclError rc = ascend_vlm::sim::require_initialized()) return rc;
  if (timeout < -1) return ACL_ERROR_INVALID_PARAM;
  std::shared_ptr<SimEvent> target;
  if (aclError rc = ascend_vlm::sim::find_event(event, &target)) return rc;
  uint64_t seq = 0;
  {
    std::lock_guard lock(state().progress_mutex);
    seq = target->recorded_seq;
  }
  return ascend_vlm::sim::wait_for_event(*target, seq, timeout) ? ACL_SUCCESS
                                                                : ACL_ERROR_RT_EVENT_SYNC_TIMEOUT;
}

aclError aclrtEventElapsedTime(float* ms, aclrtEvent startEvent, aclrtEvent endEvent) {
  if (aclError rc = ascend_vlm::sim::require_initialized()) return rc;
  if (ms == nullptr) return ACL_ERROR_INVALID_PARAM;
  std::shared_ptr<SimEvent> start, end;
  if (aclError rc = ascend_vlm::sim::find_event(startEvent, &start)) return rc;
  if (aclError rc = ascend_vlm::sim::find_event(endEvent, &end)) return rc;
  std::lock_guard lock(state().progress_mutex);
  if (!start->timing || !end->timing || start->recorded_seq == 0 || end->recorded_seq == 0) {
    return ACL_ERROR_RT_EVENT_TIMESTAMP_INVALID;
  }
  if (start->completed_seq < start->recorded_seq || end->completed_seq < end->recorded_seq) {
    return ACL_ERROR_RT_EVENT_NOT_COMPLETE;
  }
  const std::chrono::duration<double, std::milli> elapsed = end->completed_at - start->completed_at;
  if (elapsed.count() < 0) return ACL_ERROR_RT_EVENT_TIMESTAMP_REVERSAL;
  *ms = static_cast<float>(elapsed.count());
  return ACL_SUCCESS;
}

aclError aclrtSubscribeReport(uint64_t threadId, aclrtStream stream) {
  if (aclError rc = ascend_vlm::sim::require_initialized()) return rc;
  if (stream == nullptr) return ACL_ERROR_INVALID_PARAM;
  std::shared_ptr<SimStream> target;
  if (aclError rc = ascend_vlm::sim::find_stream(stream, &target)) return rc;
  State& s = state();
  std::lock_guard lock(s.handles_mutex);
  if (s.streams.count(stream) == 0) return ACL_ERROR_RT_INVALID_HANDLE;
  // One report thread serves the streams of one device (the code is the simulator's choice).
  if (s.thread_subscriptions[threadId] > 0 && s.thread_device[threadId] != target->device) {
    return ACL_ERROR_RT_THREAD_SUBSCRIBE;
  }
  if (!s.stream_subscriber.emplace(stream, threadId).second) return ACL_ERROR_REPEAT_SUBSCRIBE;
  ++s.thread_subscriptions[threadId];
  s.thread_device[threadId] = target->device;
  return ACL_SUCCESS;
}

aclError aclrtUnSubscribeReport(uint64_t threadId, aclrtStream stream) {
  if (aclError rc = ascend_vlm::sim::require_initialized()) return rc;
  if (stream == nullptr) return ACL_ERROR_INVALID_PARAM;
  State& s = state();
  std::lock_guard lock(s.handles_mutex);
  auto it = s.stream_subscriber.find(stream);
  if (it == s.stream_subscriber.end() || it->second != threadId) {
    return ACL_ERROR_STREAM_NOT_SUBSCRIBE;
  }
  s.stream_subscriber.erase(it);
  --s.thread_subscriptions[threadId];
  s.report_ready.notify_all();  // a report thread left without streams stops waiting
  return ACL_SUCCESS;
}

aclError aclrtLaunchCallback(aclrtCallback fn, void* userData, aclrtCallbackBlockType blockType,
                             aclrtStream stream) {
  if (aclError rc = ascend_vlm::sim::require_initialized()) return rc;
  if (fn == nullptr || (blockType != ACL_CALLBACK_NO_BLOCK && blockType != ACL_CALLBACK_BLOCK)) {
    return ACL_ERROR_INVALID_PARAM;
  }
  std::shared_ptr<SimStream> queue;
  if (aclError rc = ascend_vlm::sim::find_stream(stream, &queue)) return rc;
  State& s = state();
  uint64_t subscriber = 0;
  {
    std::lock_guard lock(s.handles_mutex);
    auto it = s.stream_subscriber.find(stream);
    if (it == s.stream_subscriber.end()) return ACL_ERROR_STREAM_NOT_SUBSCRIBE;
    subscriber = it->second;
  }
  queue->enqueue([fn, userData, blockType, subscriber] {
    State& st = state();
    auto done = std::make_shared<bool>(false);
    {
      std::lock_guard lock(st.report_mutex);
      st.reports[subscriber].push_back({fn, userData, done});
    }
    st.report_ready.notify_all();
    if (blockType == ACL_CALLBACK_BLOCK) {
      std::unique_lock lock(st.progress_mutex);
      st.progress.wait(lock, [&] { return *done || st.shutting_down; });
    }
    return ACL_SUCCESS;
  });
  return ACL_SUCCESS;
}

aclError aclrtProcessReport(int32_t timeout) {
  if (aclError rc = ascend_vlm::sim::require_initialized()) return rc;
  if (timeout == 0 || timeout < -1) return ACL_ERROR_INVALID_PARAM;  // -1 (forever) or > 0 ms
  State& s = state();
  const uint64_t self = ascend_vlm::sim::this_thread_id();
  ascend_vlm::sim::Report report{};
  {
    std::unique_lock lock(s.report_mutex);
    auto& queue = s.reports[self];
    if (queue.empty()) {
      auto subscribed = [&] {
        std::lock_guard handles(s.handles_mutex);
        auto it = s.thread_subscriptions.find(self);
        return it != s.thread_subscriptions.end() && it->second > 0;
      };
      // CANN's codes: ACL_ERROR_RT_THREAD_SUBSCRIBE for a thread no stream is subscribed to,
      // ACL_ERROR_RT_REPORT_TIMEOUT when nothing was reported within `timeout`.
      if (!subscribed()) return ACL_ERROR_RT_THREAD_SUBSCRIBE;
      auto ready = [&] { return !s.reports[self].empty() || !s.initialized || !subscribed(); };
      if (timeout == -1) {
        s.report_ready.wait(lock, ready);
      } else if (!s.report_ready.wait_for(lock, std::chrono::milliseconds(timeout), ready)) {
        return ACL_ERROR_RT_REPORT_TIMEOUT;
      }
      if (!s.initialized) return ACL_ERROR_UNINITIALIZE;
      if (s.reports[self].empty()) return ACL_ERROR_RT_THREAD_SUBSCRIBE;
    }
    auto& ready_queue = s.reports[self];
    report = std::move(ready_queue.front());
    ready_queue.pop_front();
  }
  report.fn(report.user_data);
  {
    std::lock_guard lock(s.progress_mutex);
    *report.done = true;
  }
  s.progress.notify_all();
  return ACL_SUCCESS;
}

}  // extern "C"
