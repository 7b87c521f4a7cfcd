// Extensions that exist only in the simulated AscendCL runtime (no CANN counterpart).
//
// Used by csrc/bindings.cpp under `#ifdef ASCEND_VLM_BACKEND_SIM` and by the C++ test driver.
#ifndef ASCEND_VLM_SIM_ACL_SIM_EXT_H_
#define ASCEND_VLM_SIM_ACL_SIM_EXT_H_

#include <stddef.h>
#include <stdint.h>

#include "acl/acl_base.h"

#ifdef __cplusplus
extern "C" {
#endif

// Bytes moved by executed copies, per effective direction, and by the copy kernel.
typedef struct aclsimCopyStats {
  uint64_t hostToHost;
  uint64_t hostToDevice;
  uint64_t deviceToHost;
  uint64_t deviceToDevice;
  uint64_t kernel;
} aclsimCopyStats;

aclError aclsimGetCopyStats(aclsimCopyStats* stats);
aclError aclsimResetCopyStats();

// Capacity of one device's memory pool. At aclInit every device gets the byte count in the env
// variable ASCEND_VLM_SIM_DEVICE_MEM (default 1 GiB); this call changes it afterwards and fails
// with ACL_ERROR_INVALID_PARAM if `bytes` is below what is already allocated on that device.
aclError aclsimSetDeviceMemoryCapacity(int32_t deviceId, size_t bytes);

// Queues the simulator's one device kernel on `stream`: device code copying `count` bytes between
// device addresses. Unlike aclrtMemcpy it accepts the device address of registered (mapped) host
// memory, which is how UVA zero-copy is exercised: the kernel reads or writes the host bytes in
// place. A plain host address is refused with ACL_ERROR_RT_PARAM_INVALID.
aclError aclsimLaunchCopyKernel(void* dst, const void* src, size_t count, aclrtStream stream);

#ifdef __cplusplus
}
#endif

#endif  // ASCEND_VLM_SIM_ACL_SIM_EXT_H_
