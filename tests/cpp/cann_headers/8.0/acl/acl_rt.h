// Declaration stub (header compile check), CANN 8.0: no host registration, no timed waits.
#ifndef ASCEND_VLM_STUB_ACL_RT_H_
#define ASCEND_VLM_STUB_ACL_RT_H_

#include "acl/acl_rt_common.h"

#endif  // ASCEND_VLM_STUB_ACL_RT_H_
