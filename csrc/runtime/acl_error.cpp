#include "acl_error.h"

#include <utility>

#include "acl_symbols.h"

namespace ascend_vlm {
namespace {

struct NamedCode {
  aclError code;
  const char* name;
};

// Codes from CANN's acl_base.h that the runtime calls used here can return.
constexpr NamedCode kNamedCodes[] = {
    {ACL_SUCCESS, "ACL_SUCCESS"},
    {ACL_ERROR_INVALID_PARAM, "ACL_ERROR_INVALID_PARAM"},
    {ACL_ERROR_UNINITIALIZE, "ACL_ERROR_UNINITIALIZE"},
    {ACL_ERROR_REPEAT_INITIALIZE, "ACL_ERROR_REPEAT_INITIALIZE"},
    {ACL_ERROR_REPEAT_SUBSCRIBE, "ACL_ERROR_REPEAT_SUBSCRIBE"},
    {ACL_ERROR_STREAM_NOT_SUBSCRIBE, "ACL_ERROR_STREAM_NOT_SUBSCRIBE"},
    {ACL_ERROR_THREAD_NOT_SUBSCRIBE, "ACL_ERROR_THREAD_NOT_SUBSCRIBE"},
    {ACL_ERROR_WAIT_CALLBACK_TIMEOUT, "ACL_ERROR_WAIT_CALLBACK_TIMEOUT"},
    {ACL_ERROR_REPEAT_FINALIZE, "ACL_ERROR_REPEAT_FINALIZE"},
    {ACL_ERROR_BAD_ALLOC, "ACL_ERROR_BAD_ALLOC"},
    {ACL_ERROR_FEATURE_UNSUPPORTED, "ACL_ERROR_FEATURE_UNSUPPORTED"},
    {ACL_ERROR_INTERNAL_ERROR, "ACL_ERROR_INTERNAL_ERROR"},
    {ACL_ERROR_RT_PARAM_INVALID, "ACL_ERROR_RT_PARAM_INVALID"},
    {ACL_ERROR_RT_INVALID_DEVICEID, "ACL_ERROR_RT_INVALID_DEVICEID"},
    {ACL_ERROR_RT_CONTEXT_NULL, "ACL_ERROR_RT_CONTEXT_NULL"},
    {ACL_ERROR_RT_STREAM_CONTEXT, "ACL_ERROR_RT_STREAM_CONTEXT"},
    {ACL_ERROR_RT_EVENT_TIMESTAMP_INVALID, "ACL_ERROR_RT_EVENT_TIMESTAMP_INVALID"},
    {ACL_ERROR_RT_EVENT_TIMESTAMP_REVERSAL, "ACL_ERROR_RT_EVENT_TIMESTAMP_REVERSAL"},
    {ACL_ERROR_RT_ADDR_UNALIGNED, "ACL_ERROR_RT_ADDR_UNALIGNED"},
    {ACL_ERROR_RT_STREAM_SUBSCRIBE, "ACL_ERROR_RT_STREAM_SUBSCRIBE"},
    {ACL_ERROR_RT_THREAD_SUBSCRIBE, "ACL_ERROR_RT_THREAD_SUBSCRIBE"},
    {ACL_ERROR_RT_STREAM_NO_CB_REG, "ACL_ERROR_RT_STREAM_NO_CB_REG"},
    {ACL_ERROR_RT_INVALID_HANDLE, "ACL_ERROR_RT_INVALID_HANDLE"},
    {ACL_ERROR_RT_FEATURE_NOT_SUPPORT, "ACL_ERROR_RT_FEATURE_NOT_SUPPORT"},
    {ACL_ERROR_RT_MEMORY_ALLOCATION, "ACL_ERROR_RT_MEMORY_ALLOCATION"},
    {ACL_ERROR_RT_MEMORY_FREE, "ACL_ERROR_RT_MEMORY_FREE"},
    {ACL_ERROR_RT_RESOURCE_ALLOC_FAIL, "ACL_ERROR_RT_RESOURCE_ALLOC_FAIL"},
    {ACL_ERROR_RT_INTERNAL_ERROR, "ACL_ERROR_RT_INTERNAL_ERROR"},
    {ACL_ERROR_RT_EVENT_NOT_COMPLETE, "ACL_ERROR_RT_EVENT_NOT_COMPLETE"},
    {ACL_ERROR_RT_REPORT_TIMEOUT, "ACL_ERROR_RT_REPORT_TIMEOUT"},
    {kAclErrorRtStreamSyncTimeout, "ACL_ERROR_RT_STREAM_SYNC_TIMEOUT"},
    {kAclErrorRtEventSyncTimeout, "ACL_ERROR_RT_EVENT_SYNC_TIMEOUT"},
};

std::string format_message(aclError code, const std::string& function, const std::string& detail) {
  std::string message =
      function + " failed with " + acl_error_name(code) + " (" + std::to_string(code) + ")";
  return detail.empty() ? message : message + ": " + detail;
}

}  // namespace

const char* acl_error_name(aclError code) {
  for (const NamedCode& entry : kNamedCodes) {
    if (entry.code == code) return entry.name;
  }
  return "ACL_ERROR_UNKNOWN";
}

AclError::AclError(aclError code, std::string function, std::string detail)
    : std::runtime_error(format_message(code, function, detail)),
      code_(code),
      function_(std::move(function)),
      detail_(std::move(detail)) {}

}  // namespace ascend_vlm
