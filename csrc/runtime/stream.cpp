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
  if (handle_ == nullptr || !Runtime::instance().session_alive(session_)) return;
  try {
    destroy();
  } catch (const AclError&) {
    // Destructors must not throw; a stream we cannot destroy is reclaimed by aclFinalize.
  }
}

aclrtStream Stream::handle() const {
  if (handle_ == nullptr) {
    throw AclError(ACL_ERROR_RT_INVALID_HANDLE, "aclrtStream", "the stream was destroyed");
  }
  Runtime::instance().enter_session(session_, "aclrtStream");
  return handle_;
}

void Stream::synchronize() { ASCEND_VLM_ACL_CALL(aclrtSynchronizeStream, handle()); }

void Stream::wait_event(const Event& event) {
  ASCEND_VLM_ACL_CALL(aclrtStreamWaitEvent, handle(), event.handle());
}

void Stream::memcpy_async(void* dst, size_t dst_max, const void* src, size_t count,
                          aclrtMemcpyKind kind) {
  ASCEND_VLM_ACL_CALL(aclrtMemcpyAsync, dst, dst_max, src, count, kind, handle());
}

void Stream::launch_host_func(std::function<void()> fn) {
  Runtime::instance().launch_callback(handle(), std::move(fn));
}

void Stream::destroy() {
  aclrtStream stream = handle();
  // Drain first (as CANN asks before aclrtDestroyStream), while callbacks can still be reported;
  // a stream error surfaces here and the stream stays valid.
  ASCEND_VLM_ACL_CALL(aclrtSynchronizeStream, stream);
  handle_ = nullptr;  // from here on the handle is gone whatever AscendCL reports
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
  ASCEND_VLM_ACL_CALL(aclrtRecordEvent, handle(), stream.handle());
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
