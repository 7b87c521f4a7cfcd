// Simulated AscendCL umbrella header: like CANN's `acl/acl.h`, it pulls in the runtime API.
#ifndef ASCEND_VLM_SIM_ACL_H_
#define ASCEND_VLM_SIM_ACL_H_

#include "acl/acl_base.h"
#include "acl/acl_rt.h"

#ifdef __cplusplus
extern "C" {
#endif

// Initialise / tear down AscendCL for the process. `configPath` may be NULL.
ACL_FUNC_VISIBILITY aclError aclInit(const char* configPath);
ACL_FUNC_VISIBILITY aclError aclFinalize();

#ifdef __cplusplus
}
#endif

#endif  // ASCEND_VLM_SIM_ACL_H_
