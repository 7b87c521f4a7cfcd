// RAII owners of AscendCL memory: device memory, pinned host memory, and mapped (UVA) host
// memory that the device addresses directly.
#ifndef ASCEND_VLM_RUNTIME_MEMORY_H_
#define ASCEND_VLM_RUNTIME_MEMORY_H_

#include <cstddef>
#include <cstdint>
#include <optional>

#include "acl/acl.h"

namespace ascend_vlm {

enum class BufferKind {
  kDevice,  // aclrtMalloc: device memory, not host-accessible
  kPinned,  // aclrtMallocHost: page-locked host memory, fast DMA source/target
  kMapped,  // aclrtMallocHost + aclrtHostRegister(MAPPED): host memory with a device address
};

const char* buffer_kind_name(BufferKind kind);

// What the requirement of host registration is, for error messages and capabilities().
extern const char* const kHostRegisterRequirement;

class Buffer {
 public:
  // Allocates `nbytes` (> 0) of `kind` memory on the current device. A negative size raises
  // AclError(ACL_ERROR_INVALID_PARAM) naming the allocating function; zero is rejected by
  // AscendCL itself with the same code; a full device pool raises ACL_ERROR_RT_MEMORY_ALLOCATION.
  // A mapped buffer where this AscendCL cannot register host memory raises
  // AclError(ACL_ERROR_RT_FEATURE_NOT_SUPPORT, "aclrtHostRegister") naming the requirement.
  // `policy` is passed to aclrtMalloc as is (CANN documents its own handling of any value).
  Buffer(BufferKind kind, int64_t nbytes, int policy = ACL_MEM_MALLOC_HUGE_FIRST);
  ~Buffer();
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  // Device memory is returned to the pool now, so no queued copy or kernel may still use it:
  // the caller synchronizes first (ascend_vlm.runtime.DeviceBuffer.free() waits for the streams
  // holding the buffer before calling this). Host-visible memory may still be aliased by views
  // the buffer cannot see, so free() only closes the handle and the memory goes back when the
  // Buffer is destroyed. Idempotent.
  void free();
  bool closed() const { return closed_; }

  BufferKind kind() const { return kind_; }
  size_t nbytes() const { return nbytes_; }
  int32_t device() const { return device_; }
  // Address copies use: the device pointer of device memory, the host pointer otherwise.
  void* ptr() const;
  // Host address (pinned and mapped kinds). Mapped memory starts on a 4 KB page boundary.
  void* host_ptr() const;
  // Device address (device and mapped kinds). For mapped memory this is the address device code
  // dereferences; CANN documents it as unusable for aclrtMemcpy (the simulator accepts it only
  // in its copy kernel).
  void* device_ptr() const;

 private:
  void require_open(const char* what) const;

  BufferKind kind_;
  size_t nbytes_ = 0;
  int32_t device_ = -1;
  uint64_t session_ = 0;
  uint64_t resource_ = 0;  // ledger id
  void* host_ = nullptr;
  void* device_address_ = nullptr;
  bool closed_ = false;
};

// A live buffer address range: [base, base + size) of `kind` memory (for mapped buffers, the
// host range and the device range are both registered).
struct BufferRange {
  uintptr_t base;
  size_t size;
  BufferKind kind;
  bool device_side;  // the range is a device address (device memory, or a mapped device alias)
};

// The live buffer range containing `address`, if any: lets callers check raw addresses before
// they reach AscendCL.
std::optional<BufferRange> find_buffer_range(uintptr_t address);

}  // namespace ascend_vlm

#endif  // ASCEND_VLM_RUNTIME_MEMORY_H_
