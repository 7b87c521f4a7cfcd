#include "memory.h"

#include <stdexcept>
#include <string>

#include "acl_error.h"
#include "context.h"

namespace ascend_vlm {
namespace {

const char* allocating_function(BufferKind kind) {
  return kind == BufferKind::kDevice ? "aclrtMalloc" : "aclrtMallocHost";
}

}  // namespace

const char* buffer_kind_name(BufferKind kind) {
  switch (kind) {
    case BufferKind::kDevice:
      return "DeviceBuffer";
    case BufferKind::kPinned:
      return "PinnedBuffer";
    case BufferKind::kMapped:
      return "MappedBuffer";
  }
  return "Buffer";
}

Buffer::Buffer(BufferKind kind, int64_t nbytes, aclrtMemMallocPolicy policy) : kind_(kind) {
  if (nbytes < 0) {
    throw AclError(ACL_ERROR_INVALID_PARAM, allocating_function(kind),
                   "nbytes: expected a byte count >= 0, got " + std::to_string(nbytes));
  }
  Runtime& runtime = Runtime::instance();
  session_ = runtime.enter();
  device_ = runtime.current_device();
  nbytes_ = static_cast<size_t>(nbytes);
  if (kind == BufferKind::kDevice) {
    ASCEND_VLM_ACL_CALL(aclrtMalloc, &device_address_, nbytes_, policy);
    return;
  }
  ASCEND_VLM_ACL_CALL(aclrtMallocHost, &host_, nbytes_);
  if (kind == BufferKind::kMapped) {
    const aclError rc =
        aclrtHostRegister(host_, nbytes_, ACL_HOST_REGISTER_MAPPED, &device_address_);
    if (rc != ACL_SUCCESS) {
      (void)aclrtFreeHost(host_);
      host_ = nullptr;
      check_acl(rc, "aclrtHostRegister");
    }
  }
}

Buffer::~Buffer() { release(); }

void Buffer::release() noexcept {
  // After aclFinalize the session's memory is already gone; its addresses may be reused.
  if (Runtime::instance().session_alive(session_)) {
    if (kind_ == BufferKind::kMapped && host_ != nullptr) (void)aclrtHostUnregister(host_);
    if (host_ != nullptr) (void)aclrtFreeHost(host_);
    if (kind_ == BufferKind::kDevice && device_address_ != nullptr) {
      (void)aclrtFree(device_address_);
    }
  }
  host_ = nullptr;
  device_address_ = nullptr;
  closed_ = true;
}

void Buffer::free() {
  if (kind_ == BufferKind::kDevice) {
    release();
  } else {
    closed_ = true;
  }
}

void Buffer::require_open(const char* what) const {
  if (closed_) {
    throw std::invalid_argument(std::string(buffer_kind_name(kind_)) + "." + what +
                                ": the buffer was freed");
  }
  Runtime::instance().enter_session(session_, allocating_function(kind_));
}

void* Buffer::ptr() const { return kind_ == BufferKind::kDevice ? device_ptr() : host_ptr(); }

void* Buffer::host_ptr() const {
  require_open("host_ptr");
  if (kind_ == BufferKind::kDevice) {
    throw std::invalid_argument("DeviceBuffer.host_ptr: device memory has no host address");
  }
  return host_;
}

void* Buffer::device_ptr() const {
  require_open("device_ptr");
  if (kind_ == BufferKind::kPinned) {
    throw std::invalid_argument(
        "PinnedBuffer.device_ptr: pinned memory has no device address; use a MappedBuffer");
  }
  return device_address_;
}

}  // namespace ascend_vlm
