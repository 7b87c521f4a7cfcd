// Declaration stub (header compile check): the umbrella header, as in CANN.
#ifndef ASCEND_VLM_STUB_ACL_H_
#define ASCEND_VLM_STUB_ACL_H_

#include "acl/acl_base.h"
#include "acl/acl_rt.h"

#endif  // ASCEND_VLM_STUB_ACL_H_
