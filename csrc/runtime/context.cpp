#include "context.h"

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <unordered_set>
#include <vector>

#include "acl_error.h"
#include "acl_symbols.h"

namespace ascend_vlm {
namespace {

// aclrtProcessReport timeout, and the longest wait of an idle report thread for a subscription.
constexpr int32_t kReportPollMs = 50;
constexpr auto kReportIdleWait = std::chrono::milliseconds(200);
constexpr int32_t kDefaultSyncTimeoutMs = 600000;

// The context the calling thread is bound to: (device, generation of that device's context).
struct ThreadContext {
  int32_t device = -1;
  uint64_t generation = 0;
};
thread_local ThreadContext thread_context;
// The session and device the calling thread last entered (the fast path of enter()).
struct ThreadSession {
  uint64_t session = 0;
  int32_t device = -1;
};
thread_local ThreadSession thread_session;
thread_local bool on_report_thread = false;

int32_t sync_timeout_from_env() {
  const char* text = std::getenv("ASCEND_VLM_SYNC_TIMEOUT_MS");
  if (text == nullptr || *text == '\0') return kDefaultSyncTimeoutMs;
  errno = 0;
  char* end = nullptr;
  const long value = std::strtol(text, &end, 10);
  if (errno != 0 || *end != '\0' || value < -1 || value > INT32_MAX) return kDefaultSyncTimeoutMs;
  return static_cast<int32_t>(value);
}

bool is_a2_a3_soc(const std::string& soc) {
  return soc.rfind("Ascend910B", 0) == 0 || soc.rfind("Ascend910_93", 0) == 0;
}

}  // namespace

struct CallbackPayload {
  std::function<void()> fn;
};

struct Reporter {
  int32_t device;
  uint64_t thread_id = 0;
  int streams = 0;             // subscribed (or being subscribed) streams
  uint64_t subscriptions = 0;  // bumped by each subscription; wakes an idle report thread
  bool stop = false;
};

struct Resource {
  uint64_t session;
  int32_t device;
  ResourceOrder order;
  std::function<aclError()> release;
};

struct Runtime::State {
  // Process lifecycle and the session.
  mutable std::mutex mutex;
  bool acl_initialized = false;  // aclInit has run (by us or, with owns_acl false, by others)
  bool owns_acl = false;
  bool shut_down = false;
  int refcount = 0;
  std::atomic<bool> alive{false};
  std::atomic<uint64_t> session{0};
  std::atomic<int32_t> device{0};
  std::set<int32_t> session_devices;  // devices the session holds a reference on

  // Devices: our single aclrtSetDevice reference per device, and its default context.
  struct DeviceSlot {
    uint64_t refs = 0;
    aclrtContext context = nullptr;
    uint64_t generation = 0;
  };
  std::mutex devices_mutex;
  std::map<int32_t, DeviceSlot> devices;
  uint64_t generations = 0;

  // The resource ledger.
  std::mutex ledger_mutex;
  std::map<uint64_t, Resource> ledger;
  uint64_t next_resource = 1;

  std::atomic<int32_t> sync_timeout_ms{sync_timeout_from_env()};

  // Report threads (one per device) and the callbacks they run.
  std::mutex reporter_mutex;
  std::condition_variable reporter_wake;
  std::map<int32_t, std::shared_ptr<Reporter>> reporters;
  std::unordered_set<CallbackPayload*> pending_callbacks;
  int running_callbacks = 0;
  std::condition_variable callbacks_idle;
};

namespace {

// The process-wide state; deliberately never destroyed (exit-time callers still find it).
Runtime::State& shared_state() {
  static Runtime::State* state = new Runtime::State();
  return *state;
}

void run_callback(void* user_data) {
  auto* payload = static_cast<CallbackPayload*>(user_data);
  Runtime::State& st = shared_state();
  {
    // shutdown() may have claimed this payload as an orphan (and freed it) between
    // aclrtProcessReport handing it over and this point: then it is not ours to touch.
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
  {
    std::lock_guard lock(st.reporter_mutex);
    --st.running_callbacks;
  }
  st.callbacks_idle.notify_all();
}

// Body of the report thread of one device. It runs in that device's context and stops once the
// device's last stream is unsubscribed.
void report_loop(Runtime::State& st, std::shared_ptr<Reporter> reporter,
                 std::promise<uint64_t>* ready) {
  on_report_thread = true;
  try {
    Runtime::instance().bind_device(reporter->device);  // callbacks run in the device's context
  } catch (const AclError&) {
    // aclrtProcessReport then fails and the loop waits for the stop below.
  }
  ready->set_value(static_cast<uint64_t>(pthread_self()));
  while (true) {
    uint64_t seen = 0;
    {
      std::lock_guard lock(st.reporter_mutex);
      if (reporter->stop) return;
      seen = reporter->subscriptions;
    }
    const aclError rc = aclrtProcessReport(kReportPollMs);
    // Nothing reported in time: ACL_ERROR_RT_REPORT_TIMEOUT on CANN 8.x, the older
    // ACL_ERROR_WAIT_CALLBACK_TIMEOUT on earlier releases. Poll again.
    if (rc == ACL_SUCCESS || rc == ACL_ERROR_RT_REPORT_TIMEOUT ||
        rc == ACL_ERROR_WAIT_CALLBACK_TIMEOUT) {
      continue;
    }
    // No stream subscribed yet (ACL_ERROR_RT_THREAD_SUBSCRIBE, formerly
    // ACL_ERROR_THREAD_NOT_SUBSCRIBE) or AscendCL gone: wait for a subscription or the stop.
    std::unique_lock lock(st.reporter_mutex);
    st.reporter_wake.wait_for(lock, kReportIdleWait,
                              [&] { return reporter->stop || reporter->subscriptions != seen; });
  }
}

// Runs aclInit once per process; after shutdown() the runtime stays closed.
void initialize_acl_locked(Runtime::State& st) {
  if (st.shut_down) {
    throw AclError(ACL_ERROR_UNINITIALIZE, "aclInit",
                   "the runtime was shut down (process exit); it cannot be used again");
  }
  if (st.acl_initialized) return;
  const aclError rc = aclInit(nullptr);
  // ACL_ERROR_REPEAT_INITIALIZE: another library (torch_npu) initialised AscendCL and will
  // finalize it; we must not.
  if (rc != ACL_SUCCESS && rc != ACL_ERROR_REPEAT_INITIALIZE) check_acl(rc, "aclInit");
  st.owns_acl = rc == ACL_SUCCESS;
  st.acl_initialized = true;
}

// Opens a session with one reference. Requires st.mutex.
void open_session_locked(Runtime::State& st) {
  initialize_acl_locked(st);
  st.session.fetch_add(1);
  st.refcount = 1;
  st.alive = true;
}

// Closes the session: returns the resources it owns (in release order) and its device
// references; the caller releases them without holding st.mutex, because draining a stream may
// wait for a Python callback that needs the GIL, whose holder may be waiting for st.mutex.
struct ClosedSession {
  std::vector<Resource> resources;
  std::set<int32_t> devices;
};

ClosedSession close_session_locked(Runtime::State& st, bool everything) {
  ClosedSession closed;
  const uint64_t session = st.session;
  {
    std::lock_guard lock(st.ledger_mutex);
    for (auto it = st.ledger.begin(); it != st.ledger.end();) {
      const bool owned =
          it->second.session == session && it->second.order != ResourceOrder::kHostMemory;
      if (everything || owned) {
        closed.resources.push_back(std::move(it->second));
        it = st.ledger.erase(it);
      } else {
        ++it;
      }
    }
  }
  std::stable_sort(closed.resources.begin(), closed.resources.end(),
                   [](const Resource& a, const Resource& b) { return a.order < b.order; });
  if (st.alive) closed.devices.swap(st.session_devices);
  st.refcount = 0;
  st.alive = false;
  return closed;
}

void release_resource(Runtime& runtime, Resource& resource) {
  try {
    runtime.bind_device(resource.device);
    (void)resource.release();
  } catch (const AclError&) {
    // Teardown goes on: the resource is gone with its device's reset at the latest.
  }
  runtime.release_device(resource.device);
}

void finish_close(Runtime& runtime, ClosedSession& closed) {
  for (Resource& resource : closed.resources) release_resource(runtime, resource);
  for (int32_t device : closed.devices) runtime.release_device(device);
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
  if (st.refcount == 0) {
    open_session_locked(st);
  } else {
    ++st.refcount;
  }
}

void Runtime::finalize() {
  State& st = state();
  ClosedSession closed;
  {
    std::lock_guard lock(st.mutex);
    if (st.refcount == 0 || --st.refcount > 0) return;
    closed = close_session_locked(st, /*everything=*/false);
  }
  finish_close(*this, closed);
}

void Runtime::shutdown() {
  State& st = state();
  ClosedSession closed;
  bool finalize_acl = false;
  {
    std::lock_guard lock(st.mutex);
    if (st.shut_down) return;
    st.shut_down = true;
    closed = close_session_locked(st, /*everything=*/true);
    finalize_acl = st.acl_initialized && st.owns_acl;
  }
  finish_close(*this, closed);
  if (finalize_acl) (void)aclFinalize();  // teardown goes on whatever AscendCL reports
  // Callbacks that will never run (their stream's work was discarded) are freed; one that is
  // running is waited for, so nothing it uses is released under it.
  std::unordered_set<CallbackPayload*> orphans;
  {
    std::lock_guard lock(st.reporter_mutex);
    orphans.swap(st.pending_callbacks);
  }
  for (CallbackPayload* payload : orphans) delete payload;
  if (on_report_thread) return;
  std::unique_lock lock(st.reporter_mutex);
  st.callbacks_idle.wait(lock, [&] { return st.running_callbacks == 0; });
}

int Runtime::refcount() const {
  std::lock_guard lock(state().mutex);
  return state().refcount;
}

bool Runtime::initialized() const { return state().alive.load(); }

uint64_t Runtime::enter(int32_t* device) {
  State& st = state();
  if (st.alive && thread_session.session == st.session && thread_session.device == st.device) {
    bind_device(thread_session.device);
    if (device != nullptr) *device = thread_session.device;
    return thread_session.session;
  }
  int32_t current = -1;
  uint64_t session = 0;
  {
    std::lock_guard lock(st.mutex);
    if (st.refcount == 0) open_session_locked(st);  // the implicit reference
    current = st.device;
    if (st.session_devices.count(current) == 0) {
      retain_device(current);
      st.session_devices.insert(current);
    }
    session = st.session;
  }
  bind_device(current);
  thread_session = {session, current};
  if (device != nullptr) *device = current;
  return session;
}

bool Runtime::session_alive(uint64_t session) const {
  return state().alive && state().session == session;
}

void Runtime::enter_session(uint64_t session, int32_t device, const char* function) {
  if (!session_alive(session)) {
    throw AclError(ACL_ERROR_UNINITIALIZE, function,
                   "the object was created before the runtime was finalized");
  }
  bind_device(device);
}

uint32_t Runtime::device_count() {
  enter();
  uint32_t count = 0;
  ASCEND_VLM_ACL_CALL(aclrtGetDeviceCount, &count);
  return count;
}

void Runtime::set_device(int32_t device) {
  const uint32_t count = device_count();
  if (device < 0 || static_cast<uint32_t>(device) >= count) {
    throw AclError(ACL_ERROR_RT_INVALID_DEVICEID, "aclrtSetDevice",
                   "device: expected an id in [0, " + std::to_string(count) + "), got " +
                       std::to_string(device));
  }
  State& st = state();
  uint64_t session = 0;
  {
    std::lock_guard lock(st.mutex);
    if (st.refcount == 0) open_session_locked(st);
    if (st.session_devices.count(device) == 0) {
      retain_device(device);
      st.session_devices.insert(device);
    }
    st.device = device;
    session = st.session;
  }
  bind_device(device);
  thread_session = {session, device};
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

void Runtime::retain_device(int32_t device) {
  State& st = state();
  std::lock_guard lock(st.devices_mutex);
  State::DeviceSlot& slot = st.devices[device];
  if (slot.refs == 0) {
    ASCEND_VLM_ACL_CALL(aclrtSetDevice, device);
    aclrtContext context = nullptr;
    const aclError rc = aclrtGetCurrentContext(&context);
    if (rc != ACL_SUCCESS) {
      (void)aclrtResetDevice(device);
      check_acl(rc, "aclrtGetCurrentContext");
    }
    slot.context = context;
    slot.generation = ++st.generations;
    thread_context = {device, slot.generation};  // aclrtSetDevice made it current here
  }
  ++slot.refs;
}

void Runtime::release_device(int32_t device) noexcept {
  State& st = state();
  std::lock_guard lock(st.devices_mutex);
  auto it = st.devices.find(device);
  if (it == st.devices.end() || it->second.refs == 0) return;
  if (--it->second.refs > 0) return;
  // The one reset that balances our one aclrtSetDevice; everything created on the device is
  // destroyed by now, as CANN asks.
  (void)aclrtResetDevice(device);
  it->second.context = nullptr;
}

void Runtime::bind_device(int32_t device) {
  State& st = state();
  aclrtContext context = nullptr;
  uint64_t generation = 0;
  {
    std::lock_guard lock(st.devices_mutex);
    auto it = st.devices.find(device);
    if (it == st.devices.end() || it->second.refs == 0) {
      throw AclError(ACL_ERROR_RT_CONTEXT_NULL, "aclrtSetCurrentContext",
                     "device " + std::to_string(device) + " is not open");
    }
    if (thread_context.device == device && thread_context.generation == it->second.generation) {
      return;
    }
    context = it->second.context;
    generation = it->second.generation;
  }
  ASCEND_VLM_ACL_CALL(aclrtSetCurrentContext, context);
  thread_context = {device, generation};
}

uint64_t Runtime::track(uint64_t session, int32_t device, ResourceOrder order,
                        std::function<aclError()> release) {
  State& st = state();
  std::lock_guard lock(st.ledger_mutex);
  const uint64_t id = st.next_resource++;
  st.ledger.emplace(id, Resource{session, device, order, std::move(release)});
  return id;
}

aclError Runtime::release(uint64_t id) {
  State& st = state();
  Resource resource;
  {
    std::lock_guard lock(st.ledger_mutex);
    auto it = st.ledger.find(id);
    if (it == st.ledger.end()) return ACL_SUCCESS;  // released by a session end or shutdown
    resource = std::move(it->second);
    st.ledger.erase(it);
  }
  aclError rc = ACL_SUCCESS;
  try {
    bind_device(resource.device);
    rc = resource.release();
  } catch (const AclError& error) {
    rc = error.code();
  }
  release_device(resource.device);
  return rc;
}

int32_t Runtime::sync_timeout_ms() const { return state().sync_timeout_ms.load(); }

void Runtime::set_sync_timeout_ms(int32_t timeout_ms) {
  if (timeout_ms < -1) {
    throw AclError(ACL_ERROR_INVALID_PARAM, "aclrtSynchronizeStreamWithTimeout",
                   "timeout_ms: expected -1 (forever) or >= 0, got " + std::to_string(timeout_ms));
  }
  state().sync_timeout_ms = timeout_ms;
}

Capabilities Runtime::capabilities() {
  enter();  // aclrtGetSocName needs AscendCL initialised
  const OptionalAcl& acl = optional_acl();
  Capabilities caps{};
  if (acl.get_soc_name != nullptr) {
    const char* soc = acl.get_soc_name();
    caps.soc_name = soc != nullptr ? soc : "";
  }
  caps.host_register_exported = acl.host_register != nullptr && acl.host_unregister != nullptr;
  caps.host_register_soc = is_a2_a3_soc(caps.soc_name);
  caps.stream_sync_timeout = acl.synchronize_stream_with_timeout != nullptr;
  caps.event_sync_timeout = acl.synchronize_event_with_timeout != nullptr;
  return caps;
}

void Runtime::subscribe(aclrtStream stream, int32_t device) {
  State& st = state();
  std::shared_ptr<Reporter> reporter;
  {
    std::lock_guard lock(st.reporter_mutex);
    std::shared_ptr<Reporter>& slot = st.reporters[device];
    if (!slot) {
      auto created = std::make_shared<Reporter>();
      created->device = device;
      std::promise<uint64_t> ready;
      std::future<uint64_t> started = ready.get_future();
      std::thread(report_loop, std::ref(st), created, &ready).detach();
      created->thread_id = started.get();
      slot = created;
    }
    reporter = slot;
    ++reporter->streams;  // counted before the subscription, so no concurrent stop races it
  }
  const aclError rc = aclrtSubscribeReport(reporter->thread_id, stream);
  {
    std::lock_guard lock(st.reporter_mutex);
    if (rc == ACL_SUCCESS) {
      ++reporter->subscriptions;
    } else if (--reporter->streams == 0) {
      reporter->stop = true;
      if (st.reporters[device] == reporter) st.reporters.erase(device);
    }
  }
  st.reporter_wake.notify_all();
  check_acl(rc, "aclrtSubscribeReport");
}

aclError Runtime::unsubscribe(aclrtStream stream, int32_t device) {
  State& st = state();
  std::shared_ptr<Reporter> reporter;
  {
    std::lock_guard lock(st.reporter_mutex);
    auto it = st.reporters.find(device);
    if (it == st.reporters.end()) return ACL_ERROR_STREAM_NOT_SUBSCRIBE;
    reporter = it->second;
  }
  const aclError rc = aclrtUnSubscribeReport(reporter->thread_id, stream);
  {
    std::lock_guard lock(st.reporter_mutex);
    if (--reporter->streams == 0) {
      // The thread is detached: it sees the stop within one aclrtProcessReport poll, and
      // unsubscribing must not wait for that (it may even run on that very thread).
      reporter->stop = true;
      auto it = st.reporters.find(device);
      if (it != st.reporters.end() && it->second == reporter) st.reporters.erase(it);
    }
  }
  st.reporter_wake.notify_all();
  return rc;
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
