// C++ form of an AscendCL failure; the bindings translate it to ascend_vlm.AclError.
#ifndef ASCEND_VLM_RUNTIME_ACL_ERROR_H_
#define ASCEND_VLM_RUNTIME_ACL_ERROR_H_

#include <stdexcept>
#include <string>

#include "acl/acl.h"

namespace ascend_vlm {

// Symbolic name of an aclError value ("ACL_ERROR_RT_PARAM_INVALID"), or "ACL_ERROR_UNKNOWN".
const char* acl_error_name(aclError code);

class AclError : public std::runtime_error {
 public:
  AclError(aclError code, std::string function, std::string detail = {});
  aclError code() const { return code_; }
  const char* name() const { return acl_error_name(code_); }
  const std::string& function() const { return function_; }
  const std::string& detail() const { return detail_; }

 private:
  aclError code_;
  std::string function_;
  std::string detail_;
};

// Throws AclError unless `code` is ACL_SUCCESS.
inline void check_acl(aclError code, const char* function, const std::string& detail = {}) {
  if (code != ACL_SUCCESS) throw AclError(code, function, detail);
}

}  // namespace ascend_vlm

// Calls an AscendCL function and throws AclError naming it on failure.
#define ASCEND_VLM_ACL_CALL(function, ...) ::ascend_vlm::check_acl(function(__VA_ARGS__), #function)

#endif  // ASCEND_VLM_RUNTIME_ACL_ERROR_H_
