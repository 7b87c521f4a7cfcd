#include "stream.h"

#include <cstdio>
#include <string>
#include <utility>

#include "acl_error.h"
#include "acl_symbols.h"
#include "context.h"

namespace ascend_vlm {
namespace {

int32_t effective_timeout(int32_t timeout_ms) {
  if (timeout_ms == Stream::kDefaultTimeout) return Runtime::instance().sync_timeout_ms();
  if (timeout_ms < -1) {
    throw AclError(ACL_ERROR_INVALID_PARAM, "aclrtSynchronizeStreamWithTimeout",
                   "timeout_ms: expected -1 (forever) or >= 0, got " + std::to_string(timeout_ms));
  }
  return timeout_ms;
}

std::string describe(const char* what, const void* handle, int32_t device, int32_t timeout_ms) {
  char address[32];
  std::snprintf(address, sizeof(address), "%p", handle);
  return std::string(what) + " " + address + " on device " + std::to_string(device) +
         " did not complete within " + std::to_string(timeout_ms) + " ms";
}

// Waits for `stream`, at most `timeout_ms` where this AscendCL offers the timed wait (without it,
// a plain aclrtSynchronizeStream waits forever: capabilities() says which).
aclError synchronize_stream(aclrtStream stream, int32_t timeout_ms) {
  auto timed = optional_acl().synchronize_stream_with_timeout;
  if (timed != nullptr && timeout_ms != -1) return timed(stream, timeout_ms);
  return aclrtSynchronizeStream(stream);
}

void check_stream_sync(aclError rc, aclrtStream stream, int32_t device, int32_t timeout_ms) {
  if (rc == kAclErrorRtStreamSyncTimeout) {
    throw AclError(rc, "aclrtSynchronizeStreamWithTimeout",
                   describe("stream", stream, device, timeout_ms));
  }
  check_acl(rc, "aclrtSynchronizeStream");
}

}  // namespace

Stream::Stream(uint32_t priority) : priority_(priority) {
  Runtime& runtime = Runtime::instance();
  session_ = runtime.enter(&device_);
  runtime.retain_device(device_);
  try {
    ASCEND_VLM_ACL_CALL(aclrtCreateStreamWithConfig, &handle_, priority, 0u);
    try {
      runtime.subscribe(handle_, device_);
    } catch (...) {
      (void)aclrtDestroyStream(handle_);
      throw;
    }
  } catch (...) {
    handle_ = nullptr;
    runtime.release_device(device_);
    throw;
  }
  const aclrtStream stream = handle_;
  const int32_t device = device_;
  // Also what a session end runs: drain (bounded), unsubscribe, destroy.
  resource_ = runtime.track(session_, device_, ResourceOrder::kStream, [stream, device] {
    Runtime& owner = Runtime::instance();
    (void)synchronize_stream(stream, owner.sync_timeout_ms());
    const aclError unsubscribed = owner.unsubscribe(stream, device);
    const aclError destroyed = aclrtDestroyStream(stream);
    return destroyed != ACL_SUCCESS ? destroyed : unsubscribed;
  });
}

Stream::~Stream() {
  if (destroyed() || !Runtime::instance().session_alive(session_)) return;
  try {
    destroy();
  } catch (const AclError&) {
    // Destructors must not throw; the session end or shutdown releases what is left.
  }
}

aclrtStream Stream::open_handle_locked(const char* function) const {
  if (handle_ == nullptr) {
    throw AclError(ACL_ERROR_RT_INVALID_HANDLE, function, "the stream was destroyed");
  }
  if (closing_) {
    throw AclError(ACL_ERROR_RT_INVALID_HANDLE, function,
                   "the stream is being destroyed by another thread");
  }
  return handle_;
}

aclrtStream Stream::handle() const {
  aclrtStream stream = nullptr;
  {
    std::lock_guard lock(mutex_);
    stream = open_handle_locked("aclrtStream");
  }
  Runtime::instance().enter_session(session_, device_, "aclrtStream");
  return stream;
}

bool Stream::destroyed() const {
  std::lock_guard lock(mutex_);
  return handle_ == nullptr;
}

void Stream::use(const std::function<void(aclrtStream)>& call) {
  aclrtStream stream = nullptr;
  {
    std::lock_guard lock(mutex_);
    stream = open_handle_locked("aclrtStream");
    ++users_;
  }
  struct Leave {
    Stream& self;
    ~Leave() {
      std::lock_guard lock(self.mutex_);
      if (--self.users_ == 0) self.idle_.notify_all();
    }
  } leave{*this};
  Runtime::instance().enter_session(session_, device_, "aclrtStream");
  call(stream);
}

void Stream::synchronize(int32_t timeout_ms) {
  const int32_t timeout = effective_timeout(timeout_ms);
  use([this, timeout](aclrtStream stream) {
    check_stream_sync(synchronize_stream(stream, timeout), stream, device_, timeout);
  });
}

void Stream::wait_event(const Event& event) {
  use([&event](aclrtStream stream) {
    ASCEND_VLM_ACL_CALL(aclrtStreamWaitEvent, stream, event.handle());
  });
}

void Stream::memcpy_async(void* dst, size_t dst_max, const void* src, size_t count,
                          aclrtMemcpyKind kind) {
  use([&](aclrtStream stream) {
    ASCEND_VLM_ACL_CALL(aclrtMemcpyAsync, dst, dst_max, src, count, kind, stream);
  });
}

void Stream::launch_host_func(std::function<void()> fn) {
  use([&fn](aclrtStream stream) { Runtime::instance().launch_callback(stream, std::move(fn)); });
}

void Stream::destroy() {
  aclrtStream stream = nullptr;
  {
    std::unique_lock lock(mutex_);
    stream = open_handle_locked("aclrtDestroyStream");
    closing_ = true;
    idle_.wait(lock, [this] { return users_ == 0; });
  }
  // Drain first (as CANN asks before aclrtDestroyStream), while callbacks can still be reported;
  // a stream error or timeout surfaces here and the stream stays valid.
  const int32_t timeout = Runtime::instance().sync_timeout_ms();
  aclError drained = ACL_SUCCESS;
  try {
    Runtime::instance().enter_session(session_, device_, "aclrtDestroyStream");
    drained = synchronize_stream(stream, timeout);
  } catch (...) {
    std::lock_guard lock(mutex_);
    closing_ = false;
    throw;
  }
  {
    std::lock_guard lock(mutex_);
    closing_ = false;
    // From here on the handle is gone whatever AscendCL reports.
    if (drained == ACL_SUCCESS) handle_ = nullptr;
  }
  check_stream_sync(drained, stream, device_, timeout);
  check_acl(Runtime::instance().release(resource_), "aclrtDestroyStream");
}

Event::Event(bool timing) : timing_(timing) {
  Runtime& runtime = Runtime::instance();
  session_ = runtime.enter(&device_);
  runtime.retain_device(device_);
  const uint32_t flags = timing ? (ACL_EVENT_SYNC | ACL_EVENT_TIME_LINE) : ACL_EVENT_SYNC;
  const aclError rc = aclrtCreateEventWithFlag(&handle_, flags);
  if (rc != ACL_SUCCESS) {
    runtime.release_device(device_);
    check_acl(rc, "aclrtCreateEventWithFlag");
  }
  const aclrtEvent event = handle_;
  resource_ = runtime.track(session_, device_, ResourceOrder::kEvent,
                            [event] { return aclrtDestroyEvent(event); });
}

Event::~Event() { (void)Runtime::instance().release(resource_); }

aclrtEvent Event::handle() const {
  if (!Runtime::instance().session_alive(session_)) {
    throw AclError(ACL_ERROR_UNINITIALIZE, "aclrtEvent",
                   "the object was created before the runtime was finalized");
  }
  return handle_;
}

aclrtEvent Event::enter(const char* function) const {
  Runtime::instance().enter_session(session_, device_, function);
  return handle_;
}

void Event::record(Stream& stream) {
  // In the stream's context: an event of another device is refused by AscendCL
  // (ACL_ERROR_RT_STREAM_CONTEXT).
  stream.use([this](aclrtStream queue) { ASCEND_VLM_ACL_CALL(aclrtRecordEvent, handle(), queue); });
}

void Event::make_stream_wait(aclrtStream foreign) const {
  ASCEND_VLM_ACL_CALL(aclrtStreamWaitEvent, foreign, enter("aclrtStreamWaitEvent"));
}

bool Event::query() const {
  aclrtEventRecordedStatus status = ACL_EVENT_RECORDED_STATUS_NOT_READY;
  ASCEND_VLM_ACL_CALL(aclrtQueryEventStatus, enter("aclrtQueryEventStatus"), &status);
  return status == ACL_EVENT_RECORDED_STATUS_COMPLETE;
}

void Event::synchronize(int32_t timeout_ms) const {
  const int32_t timeout = effective_timeout(timeout_ms);
  const aclrtEvent event = enter("aclrtSynchronizeEvent");
  auto timed = optional_acl().synchronize_event_with_timeout;
  if (timed == nullptr || timeout == -1) {
    ASCEND_VLM_ACL_CALL(aclrtSynchronizeEvent, event);
    return;
  }
  const aclError rc = timed(event, timeout);
  if (rc == kAclErrorRtEventSyncTimeout) {
    throw AclError(rc, "aclrtSynchronizeEventWithTimeout",
                   describe("event", event, device_, timeout));
  }
  check_acl(rc, "aclrtSynchronizeEventWithTimeout");
}

float Event::elapsed_ms(const Event& end) const {
  float ms = 0.0f;
  ASCEND_VLM_ACL_CALL(aclrtEventElapsedTime, &ms, enter("aclrtEventElapsedTime"), end.handle());
  return ms;
}

void memcpy_sync(void* dst, size_t dst_max, const void* src, size_t count, aclrtMemcpyKind kind) {
  Runtime::instance().enter();
  ASCEND_VLM_ACL_CALL(aclrtMemcpy, dst, dst_max, src, count, kind);
}

}  // namespace ascend_vlm
