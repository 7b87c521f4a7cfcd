// AscendCL entry points that not every supported CANN exports, resolved at run time.
//
// The runtime builds against the AscendCL headers of CANN 8.0 and later. Functions documented only
// from a later release (aclrtHostRegister: CANN 8.1.RC1, Atlas A2/A3 only) or missing from some
// header sets are never named in a call: like torch_npu's FunctionLoader, they are looked up with
// `dlsym` in the loaded libascendcl (on the simulator: aclsimFindSymbol), and a missing one is a
// missing capability, not a build or load failure.
#ifndef ASCEND_VLM_RUNTIME_ACL_SYMBOLS_H_
#define ASCEND_VLM_RUNTIME_ACL_SYMBOLS_H_

#include <cstdint>

#include "acl/acl.h"

namespace ascend_vlm {

// aclError values that the headers of older CANN releases do not declare
// (hicann/runtime include/external/acl/error_codes/rt_error_codes.h).
constexpr aclError kAclErrorRtStreamSyncTimeout = 507046;  // ACL_ERROR_RT_STREAM_SYNC_TIMEOUT
constexpr aclError kAclErrorRtEventSyncTimeout = 507047;   // ACL_ERROR_RT_EVENT_SYNC_TIMEOUT
// aclrtHostRegisterType ACL_HOST_REGISTER_MAPPED (not declared where aclrtHostRegister is not).
constexpr int kAclHostRegisterMapped = 0;

// The optional entry points of the loaded AscendCL; a null member is absent.
struct OptionalAcl {
  // aclrtHostRegister(void* ptr, uint64_t size, aclrtHostRegisterType type, void** devPtr)
  aclError (*host_register)(void*, uint64_t, int, void**) = nullptr;
  aclError (*host_unregister)(void*) = nullptr;
  aclError (*synchronize_stream_with_timeout)(aclrtStream, int32_t) = nullptr;
  aclError (*synchronize_event_with_timeout)(aclrtEvent, int32_t) = nullptr;
  const char* (*get_soc_name)() = nullptr;
};

// Resolved once, on first use.
const OptionalAcl& optional_acl();

}  // namespace ascend_vlm

#endif  // ASCEND_VLM_RUNTIME_ACL_SYMBOLS_H_
