// Declaration stub (header compile check), CANN 8.1.RC1 and later: the 8.0 set plus host
// registration (Atlas A2/A3) and the synchronisations with a timeout.
#ifndef ASCEND_VLM_STUB_ACL_RT_H_
#define ASCEND_VLM_STUB_ACL_RT_H_

#include "acl/acl_rt_common.h"

#ifdef __cplusplus
extern "C" {
#endif

static const int32_t ACL_ERROR_RT_STREAM_SYNC_TIMEOUT = 507046;
static const int32_t ACL_ERROR_RT_EVENT_SYNC_TIMEOUT = 507047;

typedef enum aclrtHostRegisterType {
  ACL_HOST_REGISTER_MAPPED = 0,
  ACL_HOST_REGISTER_IOMEMORY = 0x04,
  ACL_HOST_REGISTER_READONLY = 0x08,
} aclrtHostRegisterType;

ACL_FUNC_VISIBILITY aclError aclrtHostRegister(void* ptr, uint64_t size, aclrtHostRegisterType type,
                                               void** devPtr);
ACL_FUNC_VISIBILITY aclError aclrtHostUnregister(void* ptr);
ACL_FUNC_VISIBILITY aclError aclrtSynchronizeStreamWithTimeout(aclrtStream stream, int32_t timeout);
ACL_FUNC_VISIBILITY aclError aclrtSynchronizeEventWithTimeout(aclrtEvent event, int32_t timeout);

#ifdef __cplusplus
}
#endif

#endif  // ASCEND_VLM_STUB_ACL_RT_H_
