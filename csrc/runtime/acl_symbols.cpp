#include "acl_symbols.h"

#ifdef ASCEND_VLM_BACKEND_SIM
#include "acl_sim_ext.h"
#else
#include <dlfcn.h>
#endif

namespace ascend_vlm {
namespace {

#ifdef ASCEND_VLM_BACKEND_SIM
void* find_symbol(const char* name) { return aclsimFindSymbol(name); }
#else
// The libascendcl this process loaded: the object that defines aclrtMalloc (found with dladdr, so
// the very library the extension was linked against), else whichever "libascendcl.so" is loaded.
void* libascendcl() {
  static void* const handle = [] {
    Dl_info info{};
    if (dladdr(reinterpret_cast<void*>(&aclrtMalloc), &info) != 0 && info.dli_fname != nullptr) {
      if (void* found = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD)) return found;
    }
    return dlopen("libascendcl.so", RTLD_LAZY | RTLD_NOLOAD);
  }();
  return handle;
}

void* find_symbol(const char* name) {
  void* library = libascendcl();
  return library != nullptr ? dlsym(library, name) : nullptr;
}
#endif

template <typename Fn>
void resolve(Fn* slot, const char* name) {
  *slot = reinterpret_cast<Fn>(find_symbol(name));
}

}  // namespace

const OptionalAcl& optional_acl() {
  static const OptionalAcl resolved = [] {
    OptionalAcl acl;
    resolve(&acl.host_register, "aclrtHostRegister");
    resolve(&acl.host_unregister, "aclrtHostUnregister");
    resolve(&acl.synchronize_stream_with_timeout, "aclrtSynchronizeStreamWithTimeout");
    resolve(&acl.synchronize_event_with_timeout, "aclrtSynchronizeEventWithTimeout");
    resolve(&acl.get_soc_name, "aclrtGetSocName");
    return acl;
  }();
  return resolved;
}

}  // namespace ascend_vlm
