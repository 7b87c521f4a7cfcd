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

// aclrtProcessReport timeout: bounds how long shutdown waits for the report thread to notice.
constexpr int32_t kReportPollMs = 50;
constexpr auto kReportIdleWait = std::chrono::milliseconds(20);

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
  std::thread reporter;
  std::shared_ptr<std::atomic<bool>> reporter_stop;  // owned per report thread
  uint64_t reporter_thread_id = 0;
  std::unordered_set<CallbackPayload*> pending_callbacks;
};

struct CallbackPayload {
  std::function<void()> fn;
  Runtime::State* state;
};

namespace {

void run_callback(void* user_data) {
  auto* payload = static_cast<CallbackPayload*>(user_data);
  {
    std::lock_guard lock(payload->state->reporter_mutex);
    payload->state->pending_callbacks.erase(payload);
  }
  try {
    payload->fn();
  } catch (...) {
    // The contract says callbacks do not throw; an exception must still not cross into ACL.
  }
  delete payload;
}

void report_loop(Runtime::State& st, std::shared_ptr<std::atomic<bool>> stop, int32_t device,
                 std::promise<uint64_t>* ready) {
  ready->set_value(static_cast<uint64_t>(pthread_self()));
  (void)aclrtSetDevice(device);  // real CANN needs a context on the thread running callbacks
  while (!*stop) {
    const aclError rc = aclrtProcessReport(kReportPollMs);
    if (rc != ACL_SUCCESS && rc != ACL_ERROR_WAIT_CALLBACK_TIMEOUT) {
      // Not subscribed yet (or shutting down): idle instead of spinning.
      std::unique_lock lock(st.reporter_mutex);
      st.reporter_wake.wait_for(lock, kReportIdleWait, [&] { return stop->load(); });
    }
  }
}

// Stops and joins the report thread if it runs; the next subscribe() starts a new one.
void stop_report_thread(Runtime::State& st) {
  std::thread reporter;
  {
    std::lock_guard lock(st.reporter_mutex);
    if (st.reporter_stop) st.reporter_stop->store(true);
    st.reporter_stop.reset();
    st.reporter_thread_id = 0;
    reporter = std::move(st.reporter);
  }
  st.reporter_wake.notify_all();
  if (reporter.joinable()) reporter.join();
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

Runtime::State& Runtime::state() const {
  static State* shared = new State();
  return *shared;
}

void Runtime::init() {
  State& st = state();
  std::lock_guard lock(st.mutex);
  if (st.refcount == 0) open_session_locked(st);
  ++st.refcount;
}

void Runtime::finalize() {
  {
    std::lock_guard lock(state().mutex);
    if (state().refcount == 0) return;
    if (--state().refcount > 0) return;
  }
  shutdown();
}

void Runtime::shutdown() {
  State& st = state();
  // Stop the report thread before taking the session lock: a Python callback it is running may
  // be waiting for the GIL held by a thread that is itself waiting for the session lock.
  stop_report_thread(st);
  std::lock_guard lock(st.mutex);
  if (!st.initialized) return;
  stop_report_thread(st);  // in case a racing stream creation restarted it
  for (int32_t device : st.used_devices) (void)aclrtResetDevice(device);
  // Teardown must finish even if AscendCL complains; the session is gone either way.
  if (st.owns_acl) (void)aclFinalize();
  std::unordered_set<CallbackPayload*> orphans;
  {
    std::lock_guard reporter_lock(st.reporter_mutex);
    orphans.swap(st.pending_callbacks);
  }
  for (CallbackPayload* payload : orphans) delete payload;  // callbacks dropped with the streams
  st.used_devices.clear();
  st.refcount = 0;
  st.initialized = false;
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
    if (!st.reporter.joinable()) {
      std::promise<uint64_t> ready;
      std::future<uint64_t> started = ready.get_future();
      st.reporter_stop = std::make_shared<std::atomic<bool>>(false);
      st.reporter =
          std::thread(report_loop, std::ref(st), st.reporter_stop, st.device.load(), &ready);
      st.reporter_thread_id = started.get();
    }
    thread_id = st.reporter_thread_id;
  }
  ASCEND_VLM_ACL_CALL(aclrtSubscribeReport, thread_id, stream);
  st.reporter_wake.notify_all();
}

void Runtime::unsubscribe(aclrtStream stream) {
  State& st = state();
  uint64_t thread_id = 0;
  {
    std::lock_guard lock(st.reporter_mutex);
    thread_id = st.reporter_thread_id;
  }
  ASCEND_VLM_ACL_CALL(aclrtUnSubscribeReport, thread_id, stream);
}

void Runtime::launch_callback(aclrtStream stream, std::function<void()> fn) {
  State& st = state();
  auto* payload = new CallbackPayload{std::move(fn), &st};
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
