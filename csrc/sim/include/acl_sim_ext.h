// Extensions that exist only in the simulated AscendCL runtime (no CANN counterpart).
//
// Used under `#ifdef ASCEND_VLM_BACKEND_SIM` by csrc/bindings.cpp, csrc/runtime/acl_symbols.cpp and
// the C++ test driver.
//
// Environment of the simulator: ASCEND_VLM_SIM_DEVICE_COUNT (default 2), ASCEND_VLM_SIM_DEVICE_MEM
// (bytes per device, default 1 GiB), ASCEND_VLM_SIM_SOC (aclrtGetSocName, default "Ascend910B1";
// aclrtHostRegister refuses SoCs other than Atlas A2/A3 ones, "Ascend910B*" and "Ascend910_93*"),
// ASCEND_VLM_SIM_HIDE_SYMBOLS (see aclsimFindSymbol) and ASCEND_VLM_SIM_LEAK_REPORT (when set, the
// resource counts are printed to stderr at process exit, after every atexit handler of the
// program that ran before the first aclInit).
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

// What `dlsym` on libascendcl would return for an entry point that not every CANN exports
// (aclrtHostRegister, aclrtSynchronizeStreamWithTimeout, ...), or NULL. The env variable
// ASCEND_VLM_SIM_HIDE_SYMBOLS (comma-separated names, read on every call) hides entry points, so
// a CANN that lacks them (e.g. 8.0, without host registration) can be played.
void* aclsimFindSymbol(const char* name);

// Live AscendCL resources of the process, for leak checks. aclFinalize does not free device
// memory, host memory, registrations or streams (as on CANN), so they stay counted afterwards.
typedef struct aclsimResourceCounts {
  uint64_t streams;                // created by aclrtCreateStream*, not destroyed
  uint64_t events;                 // created by aclrtCreateEvent*, not destroyed
  uint64_t deviceAllocations;      // aclrtMalloc blocks not freed
  uint64_t hostAllocations;        // aclrtMallocHost blocks not freed
  uint64_t hostRegistrations;      // aclrtHostRegister ranges not unregistered
  uint64_t subscribedStreams;      // aclrtSubscribeReport without aclrtUnSubscribeReport
  uint64_t deviceRefs;             // aclrtSetDevice calls not yet balanced by a reset, all devices
  uint64_t liveContexts;           // default contexts of devices not reset
  uint64_t resetsWithLiveHandles;  // resets to zero that found streams or events still alive
  uint64_t initCalls;              // successful aclInit calls
  uint64_t finalizeCalls;          // successful aclFinalize calls
} aclsimResourceCounts;

aclError aclsimGetResourceCounts(aclsimResourceCounts* counts);

#ifdef __cplusplus
}
#endif

#endif  // ASCEND_VLM_SIM_ACL_SIM_EXT_H_
