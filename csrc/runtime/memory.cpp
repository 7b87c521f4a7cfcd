#include "memory.h"

#include <map>
#include <mutex>
#include <stdexcept>
#include <string>

#include "acl_error.h"
#include "acl_symbols.h"
#include "context.h"

namespace ascend_vlm {
namespace {

// aclrtHostRegister needs a 4 KB aligned address; aclrtMallocHost only promises 64 bytes.
constexpr size_t kPageSize = 4096;

size_t round_up(size_t value, size_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

const char* allocating_function(BufferKind kind) {
  return kind == BufferKind::kDevice ? "aclrtMalloc" : "aclrtMallocHost";
}

// Live buffer ranges by base address.
std::mutex& ranges_mutex() {
  static std::mutex* mutex = new std::mutex();
  return *mutex;
}
std::map<uintptr_t, BufferRange>& ranges() {
  static auto* table = new std::map<uintptr_t, BufferRange>();
  return *table;
}

void add_range(const void* base, size_t size, BufferKind kind, bool device_side) {
  std::lock_guard lock(ranges_mutex());
  const auto address = reinterpret_cast<uintptr_t>(base);
  ranges()[address] = {address, size, kind, device_side};
}

void remove_range(const void* base) {
  std::lock_guard lock(ranges_mutex());
  ranges().erase(reinterpret_cast<uintptr_t>(base));
}

// Allocates the host side of a pinned or mapped buffer; for mapped buffers also registers a
// page-aligned range covering `nbytes`. Returns the aclrtMallocHost block; `host` and `device`
// receive the addresses the buffer hands out.
void* allocate_host(BufferKind kind, size_t nbytes, void** host, void** device) {
  if (kind == BufferKind::kPinned) {
    ASCEND_VLM_ACL_CALL(aclrtMallocHost, host, nbytes);
    return *host;
  }
  if (nbytes == 0) {
    throw AclError(ACL_ERROR_INVALID_PARAM, "aclrtMallocHost", "nbytes: expected > 0, got 0");
  }
  const OptionalAcl& acl = optional_acl();
  if (acl.host_register == nullptr || acl.host_unregister == nullptr) {
    throw AclError(ACL_ERROR_RT_FEATURE_NOT_SUPPORT, "aclrtHostRegister",
                   std::string("this AscendCL does not export aclrtHostRegister/"
                               "aclrtHostUnregister; ") +
                       kHostRegisterRequirement);
  }
  const size_t span = round_up(nbytes, kPageSize);
  void* block = nullptr;
  ASCEND_VLM_ACL_CALL(aclrtMallocHost, &block, span + kPageSize);
  void* aligned = reinterpret_cast<void*>(round_up(reinterpret_cast<uintptr_t>(block), kPageSize));
  const aclError rc = acl.host_register(aligned, span, kAclHostRegisterMapped, device);
  if (rc != ACL_SUCCESS) {
    (void)aclrtFreeHost(block);
    throw AclError(rc, "aclrtHostRegister",
                   rc == ACL_ERROR_RT_FEATURE_NOT_SUPPORT ? kHostRegisterRequirement : "");
  }
  *host = aligned;
  return block;
}

}  // namespace

const char* const kHostRegisterRequirement =
    "mapped host memory needs aclrtHostRegister: CANN >= 8.1.RC1 on an Atlas A2/A3 SoC "
    "(Ascend910B*, Ascend910_93*); ascend_vlm.runtime.capabilities() reports what this "
    "machine offers";

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

Buffer::Buffer(BufferKind kind, int64_t nbytes, int policy) : kind_(kind) {
  if (nbytes < 0) {
    throw AclError(ACL_ERROR_INVALID_PARAM, allocating_function(kind),
                   "nbytes: expected a byte count >= 0, got " + std::to_string(nbytes));
  }
  Runtime& runtime = Runtime::instance();
  session_ = runtime.enter(&device_);
  nbytes_ = static_cast<size_t>(nbytes);
  runtime.retain_device(device_);
  void* block = nullptr;
  try {
    if (kind == BufferKind::kDevice) {
      ASCEND_VLM_ACL_CALL(aclrtMalloc, &device_address_, nbytes_,
                          static_cast<aclrtMemMallocPolicy>(policy));
    } else {
      block = allocate_host(kind, nbytes_, &host_, &device_address_);
    }
  } catch (...) {
    runtime.release_device(device_);
    throw;
  }
  const BufferKind owned_kind = kind;
  void* const host = host_;
  void* const device = device_address_;
  if (host != nullptr) add_range(host, nbytes_, kind, /*device_side=*/false);
  if (device != nullptr) add_range(device, nbytes_, kind, /*device_side=*/true);
  std::function<aclError()> release = [owned_kind, block, host, device]() -> aclError {
    if (host != nullptr) remove_range(host);
    if (device != nullptr) remove_range(device);
    if (owned_kind == BufferKind::kDevice) return aclrtFree(device);
    aclError rc = ACL_SUCCESS;
    if (owned_kind == BufferKind::kMapped) rc = optional_acl().host_unregister(host);
    const aclError freed = aclrtFreeHost(block);
    return rc != ACL_SUCCESS ? rc : freed;
  };
  resource_ = runtime.track(
      session_, device_,
      kind == BufferKind::kDevice ? ResourceOrder::kDeviceMemory : ResourceOrder::kHostMemory,
      std::move(release));
}

Buffer::~Buffer() { (void)Runtime::instance().release(resource_); }

void Buffer::free() {
  // Host-visible memory stays until the Buffer goes (views may alias it).
  if (kind_ == BufferKind::kDevice && !closed_) (void)Runtime::instance().release(resource_);
  closed_ = true;
}

void Buffer::require_open(const char* what) const {
  if (closed_) {
    throw std::invalid_argument(std::string(buffer_kind_name(kind_)) + "." + what +
                                ": the buffer was freed");
  }
  Runtime::instance().enter_session(session_, device_, allocating_function(kind_));
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

std::optional<BufferRange> find_buffer_range(uintptr_t address) {
  std::lock_guard lock(ranges_mutex());
  auto it = ranges().upper_bound(address);
  if (it == ranges().begin()) return std::nullopt;
  --it;
  if (address >= it->first + it->second.size) return std::nullopt;
  return it->second;
}

}  // namespace ascend_vlm
