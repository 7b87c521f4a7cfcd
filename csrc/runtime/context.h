// Process-wide AscendCL state: one aclInit per process, reference-counted sessions, device
// contexts, the ledger of AscendCL resources, and one report thread per device for host callbacks.
//
// Model (each rule is one CANN imposes on real hardware):
// - aclInit runs once per process, on first use; if another library (torch_npu) initialised
//   AscendCL first, it stays theirs. aclFinalize runs only at exit (shutdown()) and only if this
//   runtime was first.
// - A device is opened with exactly one aclrtSetDevice while anything of ours uses it (the session
//   or a resource created on it) and reset with exactly one aclrtResetDevice when the last such
//   user is gone, after its streams and events are destroyed. Threads enter a device's context
//   with aclrtSetCurrentContext, which takes no reference.
// - Every call on a stream, event or buffer runs in the context of the device it was created on.
// - A session (init() ... last finalize()) owns the streams, events and device memory created in
//   it: its end drains and destroys the streams, destroys the events and frees the device memory.
//   Host memory (pinned and mapped buffers) may still be viewed by numpy/torch, so it is released
//   when its buffer object goes, or at shutdown().
#ifndef ASCEND_VLM_RUNTIME_CONTEXT_H_
#define ASCEND_VLM_RUNTIME_CONTEXT_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>

#include "acl/acl.h"

namespace ascend_vlm {

// Release order within a session end: streams before events before memory, as CANN documents.
enum class ResourceOrder { kStream = 0, kEvent = 1, kDeviceMemory = 2, kHostMemory = 3 };

// What this AscendCL (CANN release and SoC) offers; see ascend_vlm.runtime.capabilities().
struct Capabilities {
  std::string soc_name;         // aclrtGetSocName, "" if unavailable
  bool host_register_exported;  // aclrtHostRegister/Unregister are exported (CANN >= 8.1.RC1)
  bool host_register_soc;       // the SoC is an Atlas A2/A3 one (Ascend910B*, Ascend910_93*)
  bool stream_sync_timeout;     // aclrtSynchronizeStreamWithTimeout is exported
  bool event_sync_timeout;      // aclrtSynchronizeEventWithTimeout is exported
};

class Runtime {
 public:
  // The single process-wide instance; never destroyed, so exit-time callers still find it.
  static Runtime& instance();

  // Adds a session reference; the first opens a session (and, once per process, runs aclInit).
  void init();
  // Drops a reference; the last one ends the session (see the model above). Without references
  // it does nothing.
  void finalize();
  // Ends the session whatever the reference count, releases every resource left (host memory
  // too), resets the devices and runs aclFinalize if this runtime initialised AscendCL. For
  // process exit: the runtime cannot be used afterwards.
  void shutdown();
  int refcount() const;
  bool initialized() const;

  // Makes the runtime usable from the calling thread: opens a session implicitly (one reference)
  // if needed and binds the thread to the current device's context. Returns the session id that
  // objects remember; `device` (if given) receives the current device.
  uint64_t enter(int32_t* device = nullptr);
  // Throws AclError(ACL_ERROR_UNINITIALIZE) naming `function` unless `session` is still live,
  // then binds the calling thread to `device`'s context.
  void enter_session(uint64_t session, int32_t device, const char* function);
  bool session_alive(uint64_t session) const;

  uint32_t device_count();
  // Selects the device new objects are created on, for every thread of this process.
  void set_device(int32_t device);
  int32_t current_device();
  // (free, total) bytes of the current device's memory.
  std::pair<size_t, size_t> mem_info();

  // Takes a reference on `device` for a resource about to be created there and binds the calling
  // thread to its context; the first reference runs aclrtSetDevice. Throws AclError.
  void retain_device(int32_t device);
  // Drops a reference taken by retain_device(); the last one runs aclrtResetDevice.
  void release_device(int32_t device) noexcept;
  // Binds the calling thread to the context of `device`, which must be retained.
  void bind_device(int32_t device);

  // Records a resource of `session` on `device` (retained by the caller for it) and how to
  // release it (called with the thread bound to `device`). Returns its ledger id.
  uint64_t track(uint64_t session, int32_t device, ResourceOrder order,
                 std::function<aclError()> release);
  // Releases a tracked resource now and drops its device reference. If a session end or
  // shutdown() already released it, does nothing and returns ACL_SUCCESS.
  aclError release(uint64_t id);

  // Milliseconds stream and event synchronisations wait before raising the *_SYNC_TIMEOUT error
  // (-1: forever). Initially ASCEND_VLM_SYNC_TIMEOUT_MS, default 600000.
  int32_t sync_timeout_ms() const;
  void set_sync_timeout_ms(int32_t timeout_ms);

  Capabilities capabilities();

  // Subscribes `stream` (of `device`) to that device's report thread, started on first use, so
  // host callbacks run.
  void subscribe(aclrtStream stream, int32_t device);
  // Undoes subscribe(); the device's report thread stops with its last stream. Returns the
  // AscendCL result instead of throwing (used while tearing a stream down).
  aclError unsubscribe(aclrtStream stream, int32_t device);
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
