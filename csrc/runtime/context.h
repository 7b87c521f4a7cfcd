// Process-wide AscendCL session: reference-counted init/finalize, the current device, and the
// report thread that runs host callbacks.
#ifndef ASCEND_VLM_RUNTIME_CONTEXT_H_
#define ASCEND_VLM_RUNTIME_CONTEXT_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <utility>

#include "acl/acl.h"

namespace ascend_vlm {

class Runtime {
 public:
  // The single process-wide instance; never destroyed, so exit-time callers still find it.
  static Runtime& instance();

  // Adds a reference; the first one calls aclInit. Thread-safe.
  void init();
  // Drops a reference; the last one tears the session down (devices, aclFinalize; queued work
  // and callbacks that have not started are dropped, one already running is waited for).
  // Without references it does nothing.
  void finalize();
  // Tears the session down whatever the reference count (interpreter exit).
  void shutdown();
  int refcount() const;
  bool initialized() const;

  // Makes the runtime usable from the calling thread: initialises it implicitly (one reference)
  // if needed and binds the thread to the current device. Returns the session id that objects
  // remember, so that a handle from an earlier session is never passed to AscendCL.
  uint64_t enter();
  // Throws AclError(ACL_ERROR_UNINITIALIZE) naming `function` unless `session` is still live,
  // then binds the calling thread like enter().
  void enter_session(uint64_t session, const char* function);
  bool session_alive(uint64_t session) const;

  uint32_t device_count();
  // Selects the device every thread of this process uses from now on.
  void set_device(int32_t device);
  int32_t current_device();
  // (free, total) bytes of the current device's memory.
  std::pair<size_t, size_t> mem_info();

  // Subscribes `stream` to the report thread so host callbacks run. That thread starts on first
  // use and lives as long as the process.
  void subscribe(aclrtStream stream);
  // Undoes subscribe(); returns the AscendCL result instead of throwing (used while tearing
  // a stream down, where the destroy must still happen).
  aclError unsubscribe(aclrtStream stream);
  // Queues `fn` on `stream`; it runs on the report thread once prior work completes, and the
  // stream waits for it (ACL_CALLBACK_BLOCK). `fn` must not throw.
  void launch_callback(aclrtStream stream, std::function<void()> fn);

  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  struct State;  // defined in context.cpp

 private:
  Runtime() = default;
  State& state() const;
};

}  // namespace ascend_vlm

#endif  // ASCEND_VLM_RUNTIME_CONTEXT_H_
