#include "stream.h"

#include <utility>

#include "acl_error.h"
#include "context.h"

namespace ascend_vlm {

Stream::Stream(uint32_t priority) : priority_(priority) {
  Runtime& runtime = Runtime::instance();
  session_ = runtime.enter();
  device_ = runtime.current_device();
  ASCEND_VLM_ACL_CALL(aclrtCreateStreamWithConfig, &handle_, priority, 0u);
  try {
    runtime.subscribe(handle_);
  } catch (...) {
    (void)aclrtDestroyStream(handle_);
    handle_ = nullptr;
    throw;
  }
}

Stream::~Stream() {
  if (destroyed() || !Runtime::instance().session_alive(session_)) return;
  try {
    destroy();
  } catch (const AclError&) {
    // Destructors must not throw; a stream we cannot destroy is reclaimed by aclFinalize.
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
  Runtime::instance().enter_session(session_, "aclrtStream");
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
  Runtime::instance().enter_session(session_, "aclrtStream");
  call(stream);
}

void Stream::synchronize() {
  use([](aclrtStream stream) { ASCEND_VLM_ACL_CALL(aclrtSynchronizeStream, stream); });
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
  // a stream error surfaces here and the stream stays valid.
  aclError drained = ACL_SUCCESS;
  try {
    Runtime::instance().enter_session(session_, "aclrtDestroyStream");
    drained = aclrtSynchronizeStream(stream);
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
  check_acl(drained, "aclrtSynchronizeStream");
  const aclError unsubscribed = Runtime::instance().unsubscribe(stream);
  ASCEND_VLM_ACL_CALL(aclrtDestroyStream, stream);
  check_acl(unsubscribed, "aclrtUnSubscribeReport");
}

Event::Event(bool timing) : timing_(timing) {
  session_ = Runtime::instance().enter();
  const uint32_t flags = timing ? (ACL_EVENT_SYNC | ACL_EVENT_TIME_LINE) : ACL_EVENT_SYNC;
  ASCEND_VLM_ACL_CALL(aclrtCreateEventWithFlag, &handle_, flags);
}

Event::~Event() {
  if (handle_ != nullptr && Runtime::instance().session_alive(session_)) {
    (void)aclrtDestroyEvent(handle_);
  }
}

aclrtEvent Event::handle() const {
  Runtime::instance().enter_session(session_, "aclrtEvent");
  return handle_;
}

void Event::record(Stream& stream) {
  stream.use([this](aclrtStream queue) { ASCEND_VLM_ACL_CALL(aclrtRecordEvent, handle(), queue); });
}

bool Event::query() const {
  aclrtEventRecordedStatus status = ACL_EVENT_RECORDED_STATUS_NOT_READY;
  ASCEND_VLM_ACL_CALL(aclrtQueryEventStatus, handle(), &status);
  return status == ACL_EVENT_RECORDED_STATUS_COMPLETE;
}

void Event::synchronize() const { ASCEND_VLM_ACL_CALL(aclrtSynchronizeEvent, handle()); }

float Event::elapsed_ms(const Event& end) const {
  float ms = 0.0f;
  ASCEND_VLM_ACL_CALL(aclrtEventElapsedTime, &ms, handle(), end.handle());
  return ms;
}

void memcpy_sync(void* dst, size_t dst_max, const void* src, size_t count, aclrtMemcpyKind kind) {
  Runtime::instance().enter();
  ASCEND_VLM_ACL_CALL(aclrtMemcpy, dst, dst_max, src, count, kind);
}

}  // namespace ascend_vlm
