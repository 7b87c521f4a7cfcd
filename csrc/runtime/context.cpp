#include "context.h"

#include <pthread.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <future>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <unordered_set>
#include <vector>

#include "acl_error.h"

namespace ascend_vlm {
namespace {

// aclrtProcessReport timeout, and the idle sleep when there is nothing to report on.
constexpr int32_t kReportPollMs = 50;
constexpr auto kReportIdleWait = std::chrono::milliseconds(200);

struct ThreadBinding {
  uint64_t session = 0;
  int32_t device = -1;
};
thread_local ThreadBinding thread_binding;

}  // namespace

struct CallbackPayload;

struct Runtime::State {
  mutable std::mutex mutex;
  int refcount = 0;
  bool owns_acl = false;  // false when someone else (e.g. torch_npu) already ran aclInit
  std::atomic<bool> initialized{false};
  std::atomic<uint64_t> session{0};
  std::atomic<int32_t> device{0};
  std::set<int32_t> used_devices;

  std::mutex reporter_mutex;
  std::condition_variable reporter_wake;
  uint64_t reporter_thread_id = 0;  // 0 until the report thread starts
  uint64_t subscriptions = 0;       // bumped by subscribe(); wakes an idle report thread
  std::unordered_set<CallbackPayload*> pending_callbacks;
  int running_callbacks = 0;
  std::condition_variable callbacks_idle;
};

struct CallbackPayload {
  std::function<void()> fn;
};

namespace {

// The process-wide state; deliberately never destroyed (exit-time callers still find it).
Runtime::State& shared_state() {
  static Runtime::State* state = new Runtime::State();
  return *state;
}

void run_callback(void* user_data) {
  auto* payload = static_cast<CallbackPayload*>(user_data);
  {
    // A session teardown may have claimed this payload as an orphan (and freed it) between
    // aclrtProcessReport handing it over and this point: then it is not ours to touch.
    Runtime::State& st = shared_state();
    std::lock_guard lock(st.reporter_mutex);
    if (st.pending_callbacks.erase(payload) == 0) return;
    ++st.running_callbacks;
  }
  try {
    payload->fn();
  } catch (...) {
    // The contract says callbacks do not throw; an exception must still not cross into ACL.
  }
  delete payload;
  Runtime::State& st = shared_state();
  {
    std::lock_guard lock(st.reporter_mutex);
    --st.running_callbacks;
  }
  st.callbacks_idle.notify_all();
}

// Body of the process-wide report thread. It outlives sessions (it is never joined); a teardown
// only waits, outside the session lock, for a callback that is running.
void report_loop(Runtime::State& st, std::promise<uint64_t>* ready) {
  ready->set_value(static_cast<uint64_t>(pthread_self()));
  uint64_t bound_session = 0;
  while (true) {
    if (st.initialized && bound_session != st.session) {
      bound_session = st.session;
      (void)aclrtSetDevice(st.device);  // real CANN runs callbacks in the thread's context
    }
    uint64_t seen = 0;
    {
      std::lock_guard lock(st.reporter_mutex);
      seen = st.subscriptions;
    }
    const aclError rc = aclrtProcessReport(kReportPollMs);
    if (rc != ACL_SUCCESS && rc != ACL_ERROR_WAIT_CALLBACK_TIMEOUT) {
      // No session or no subscribed stream yet: sleep until subscribe() wakes us.
      std::unique_lock lock(st.reporter_mutex);
      st.reporter_wake.wait_for(lock, kReportIdleWait, [&] { return st.subscriptions != seen; });
    }
  }
}

// Ends the session: devices, aclFinalize (which discards queued work and pending callbacks).
// Returns the callbacks that will never run; the caller hands them to finish_close() after
// unlocking, because dropping a Python callable needs the GIL and a GIL holder may be waiting for
// the session lock.
std::unordered_set<CallbackPayload*> close_session_locked(Runtime::State& st) {
  for (int32_t device : st.used_devices) (void)aclrtResetDevice(device);
  // Teardown must finish even if AscendCL complains; the session is gone either way.
  if (st.owns_acl) (void)aclFinalize();
  std::unordered_set<CallbackPayload*> orphans;
  {
    std::lock_guard reporter_lock(st.reporter_mutex);
    orphans.swap(st.pending_callbacks);
  }
  st.used_devices.clear();
  st.refcount = 0;
  st.initialized = false;
  return orphans;
}

// Second half of a teardown, run without the session lock: frees the callbacks that will never
// run and waits for one that is running, so nothing it references is released under it (unless
// the teardown runs inside that callback).
void finish_close(Runtime::State& st, const std::unordered_set<CallbackPayload*>& orphans) {
  for (CallbackPayload* payload : orphans) delete payload;
  std::unique_lock lock(st.reporter_mutex);
  if (static_cast<uint64_t>(pthread_self()) == st.reporter_thread_id) return;
  st.callbacks_idle.wait(lock, [&] { return st.running_callbacks == 0; });
}

// Calls aclInit (tolerating an earlier aclInit by another library) and starts a new session.
void open_session_locked(Runtime::State& st) {
  const aclError rc = aclInit(nullptr);
  if (rc != ACL_SUCCESS && rc != ACL_ERROR_REPEAT_INITIALIZE) check_acl(rc, "aclInit");
  st.owns_acl = rc == ACL_SUCCESS;
  st.session.fetch_add(1);
  st.initialized = true;
}

}  // namespace

Runtime& Runtime::instance() {
  static Runtime* runtime = new Runtime();
  return *runtime;
}

Runtime::State& Runtime::state() const { return shared_state(); }

void Runtime::init() {
  State& st = state();
  std::lock_guard lock(st.mutex);
  if (st.refcount == 0) open_session_locked(st);
  ++st.refcount;
}

void Runtime::finalize() {
  State& st = state();
  std::unordered_set<CallbackPayload*> orphans;
  {
    std::lock_guard lock(st.mutex);
    if (st.refcount == 0 || --st.refcount > 0) return;
    orphans = close_session_locked(st);
  }
  finish_close(st, orphans);
}

void Runtime::shutdown() {
  State& st = state();
  std::unordered_set<CallbackPayload*> orphans;
  {
    std::lock_guard lock(st.mutex);
    if (!st.initialized) return;
    orphans = close_session_locked(st);
  }
  finish_close(st, orphans);
}

int Runtime::refcount() const {
  std::lock_guard lock(state().mutex);
  return state().refcount;
}

bool Runtime::initialized() const { return state().initialized.load(); }

uint64_t Runtime::enter() {
  State& st = state();
  if (st.initialized && thread_binding.session == st.session &&
      thread_binding.device == st.device) {
    return thread_binding.session;
  }
  std::lock_guard lock(st.mutex);
  if (st.refcount == 0) {
    open_session_locked(st);
    st.refcount = 1;  // the implicit reference, dropped by finalize() or shutdown()
  }
  const int32_t device = st.device;
  ASCEND_VLM_ACL_CALL(aclrtSetDevice, device);
  st.used_devices.insert(device);
  thread_binding = {st.session, device};
  return thread_binding.session;
}

bool Runtime::session_alive(uint64_t session) const {
  return state().initialized && state().session == session;
}

void Runtime::enter_session(uint64_t session, const char* function) {
  if (!session_alive(session)) {
    throw AclError(ACL_ERROR_UNINITIALIZE, function,
                   "the object was created before the runtime was finalized");
  }
  enter();
}

uint32_t Runtime::device_count() {
  enter();
  uint32_t count = 0;
  ASCEND_VLM_ACL_CALL(aclrtGetDeviceCount, &count);
  return count;
}

void Runtime::set_device(int32_t device) {
  enter();
  State& st = state();
  std::lock_guard lock(st.mutex);
  const aclError rc = aclrtSetDevice(device);
  if (rc != ACL_SUCCESS) {
    uint32_t count = 0;
    (void)aclrtGetDeviceCount(&count);
    throw AclError(rc, "aclrtSetDevice",
                   "device: expected an id in [0, " + std::to_string(count) + "), got " +
                       std::to_string(device));
  }
  st.device = device;
  st.used_devices.insert(device);
  thread_binding = {st.session, device};
}

int32_t Runtime::current_device() {
  enter();
  int32_t device = -1;
  ASCEND_VLM_ACL_CALL(aclrtGetDevice, &device);
  return device;
}

std::pair<size_t, size_t> Runtime::mem_info() {
  enter();
  size_t free = 0;
  size_t total = 0;
  ASCEND_VLM_ACL_CALL(aclrtGetMemInfo, ACL_HBM_MEM, &free, &total);
  return {free, total};
}

void Runtime::subscribe(aclrtStream stream) {
  State& st = state();
  uint64_t thread_id = 0;
  {
    std::lock_guard lock(st.reporter_mutex);
    if (st.reporter_thread_id == 0) {
      std::promise<uint64_t> ready;
      std::future<uint64_t> started = ready.get_future();
      std::thread(report_loop, std::ref(st), &ready).detach();
      st.reporter_thread_id = started.get();
    }
    thread_id = st.reporter_thread_id;
  }
  ASCEND_VLM_ACL_CALL(aclrtSubscribeReport, thread_id, stream);
  {
    std::lock_guard lock(st.reporter_mutex);
    ++st.subscriptions;
  }
  st.reporter_wake.notify_all();
}

aclError Runtime::unsubscribe(aclrtStream stream) {
  State& st = state();
  uint64_t thread_id = 0;
  {
    std::lock_guard lock(st.reporter_mutex);
    thread_id = st.reporter_thread_id;
  }
  return aclrtUnSubscribeReport(thread_id, stream);
}

void Runtime::launch_callback(aclrtStream stream, std::function<void()> fn) {
  State& st = state();
  auto* payload = new CallbackPayload{std::move(fn)};
  {
    std::lock_guard lock(st.reporter_mutex);
    st.pending_callbacks.insert(payload);
  }
  const aclError rc = aclrtLaunchCallback(run_callback, payload, ACL_CALLBACK_BLOCK, stream);
  if (rc != ACL_SUCCESS) {
    {
      std::lock_guard lock(st.reporter_mutex);
      st.pending_callbacks.erase(payload);
    }
    delete payload;
    check_acl(rc, "aclrtLaunchCallback");
  }
}

}  // namespace ascend_vlm
