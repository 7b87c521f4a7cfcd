// Sanitizer driver for the simulated AscendCL and the C++ runtime layer (`make sanitize`).
//
// `runtime_stress all` runs every check (ASan + UBSan build); `runtime_stress stress` runs only
// the multi-threaded stream checks (TSan build). Exit status 0 means every expectation held.
// The checks of the simulator's own rules and counters are built only against the simulator
// (ASCEND_VLM_BACKEND_SIM), so -DASCEND_VLM_BUILD_TESTS=ON also builds against real CANN.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "acl/acl.h"
#ifdef ASCEND_VLM_BACKEND_SIM
#include "acl_sim_ext.h"
#endif
#include "runtime/acl_error.h"
#include "runtime/acl_symbols.h"
#include "runtime/context.h"
#include "runtime/memory.h"
#include "runtime/stream.h"

namespace {

using ascend_vlm::AclError;
using ascend_vlm::Buffer;
using ascend_vlm::BufferKind;
using ascend_vlm::Event;
using ascend_vlm::Runtime;
using ascend_vlm::Stream;

std::atomic<int> failures{0};

void expect(bool condition, const char* what, int line) {
  if (!condition) {
    ++failures;
    std::fprintf(stderr, "runtime_stress:%d: expectation failed: %s\n", line, what);
  }
}
#define EXPECT(condition) expect((condition), #condition, __LINE__)
#define EXPECT_CODE(call, code) expect((call) == (code), #call " == " #code, __LINE__)

template <typename Fn>
aclError acl_code_of(Fn&& fn) {
  try {
    fn();
  } catch (const AclError& error) {
    return error.code();
  }
  return ACL_SUCCESS;
}

// Queues a host callback that keeps `stream` busy until `gate_open` becomes true.
void hold_until(Stream& stream, std::atomic<bool>& gate_open) {
  stream.launch_host_func([&gate_open] {
    while (!gate_open) std::this_thread::yield();
  });
}

// Copies `rounds` values through a pipeline of `stages` streams ordered by events; stage i's
// copy of slot r waits for stage i-1's event, so sentinels reaching the output mean a broken
// ordering.
void check_event_pipeline(int stages, int rounds) {
  const size_t slot = 64;  // aclrtMemcpyAsync wants 64-byte aligned addresses
  const size_t nbytes = slot * rounds;
  Buffer source(BufferKind::kPinned, nbytes);
  Buffer output(BufferKind::kPinned, nbytes);
  auto* in = static_cast<uint64_t*>(source.host_ptr());
  for (size_t k = 0; k < nbytes / sizeof(uint64_t); ++k) in[k] = 7u * k + 1u;
  std::memset(output.host_ptr(), 0xFF, nbytes);
  std::vector<std::unique_ptr<Buffer>> buffers;
  std::vector<std::unique_ptr<Stream>> streams;
  std::vector<std::unique_ptr<Event>> done;
  for (int i = 0; i < stages; ++i) {
    buffers.push_back(std::make_unique<Buffer>(BufferKind::kDevice, nbytes));
    ascend_vlm::memcpy_sync(buffers.back()->ptr(), nbytes, output.host_ptr(), nbytes,
                            ACL_MEMCPY_HOST_TO_DEVICE);
    streams.push_back(std::make_unique<Stream>(i % 8));
    done.push_back(std::make_unique<Event>(false));
  }
  auto at = [slot](const Buffer& b, int r) { return static_cast<char*>(b.ptr()) + r * slot; };
  for (int r = 0; r < rounds; ++r) {
    streams[0]->memcpy_async(at(*buffers[0], r), slot, at(source, r), slot,
                             ACL_MEMCPY_HOST_TO_DEVICE);
    done[0]->record(*streams[0]);
    for (int i = 1; i < stages; ++i) {
      streams[i]->wait_event(*done[i - 1]);
      streams[i]->memcpy_async(at(*buffers[i], r), slot, at(*buffers[i - 1], r), slot,
                               ACL_MEMCPY_DEVICE_TO_DEVICE);
      done[i]->record(*streams[i]);
    }
    streams.back()->memcpy_async(at(output, r), slot, at(*buffers.back(), r), slot,
                                 ACL_MEMCPY_DEVICE_TO_HOST);
  }
  streams.back()->synchronize();
  EXPECT(std::memcmp(source.host_ptr(), output.host_ptr(), nbytes) == 0);
}

// Several threads, each with its own stream, copying and running host callbacks concurrently.
void check_threads(int threads, int iterations) {
  std::vector<std::thread> workers;
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([t, iterations] {
      Stream stream;
      Buffer host(BufferKind::kPinned, 4096);
      Buffer device(BufferKind::kDevice, 4096);
      Buffer back(BufferKind::kPinned, 4096);
      std::atomic<int> callbacks{0};
      auto* values = static_cast<uint32_t*>(host.host_ptr());
      for (int step = 0; step < iterations; ++step) {
        for (int k = 0; k < 1024; ++k) values[k] = t * 100000u + step;
        stream.memcpy_async(device.ptr(), 4096, host.ptr(), 4096, ACL_MEMCPY_HOST_TO_DEVICE);
        stream.memcpy_async(back.ptr(), 4096, device.ptr(), 4096, ACL_MEMCPY_DEVICE_TO_HOST);
        stream.launch_host_func([&callbacks] { ++callbacks; });
        stream.synchronize();
        EXPECT(static_cast<uint32_t*>(back.host_ptr())[1023] == t * 100000u + step);
      }
      EXPECT(callbacks.load() == iterations);
    });
  }
  for (auto& worker : workers) worker.join();
}

// destroy() racing threads that queue copies, callbacks, event records and waits on the same
// stream: each call either runs on the live stream or raises ACL_ERROR_RT_INVALID_HANDLE, never
// touches a destroyed handle (TSan reports the unguarded handle read otherwise).
void check_destroy_race(int threads, int rounds) {
  Buffer host(BufferKind::kPinned, 4096);
  Buffer device(BufferKind::kDevice, 4096);
  for (int round = 0; round < rounds; ++round) {
    Stream stream;
    std::atomic<int> ready{0};
    std::vector<std::thread> workers;
    for (int t = 0; t < threads; ++t) {
      workers.emplace_back([&] {
        Event event(false);
        ++ready;
        while (true) {
          const aclError code = acl_code_of([&] {
            stream.memcpy_async(device.ptr(), 4096, host.ptr(), 4096, ACL_MEMCPY_HOST_TO_DEVICE);
            stream.launch_host_func([] {});
            event.record(stream);
            stream.wait_event(event);
            stream.synchronize();
          });
          if (code != ACL_SUCCESS) {
            EXPECT(code == ACL_ERROR_RT_INVALID_HANDLE);
            return;
          }
        }
      });
    }
    while (ready.load() < threads) std::this_thread::yield();
    stream.destroy();
    for (auto& worker : workers) worker.join();
    EXPECT(stream.destroyed());
  }
}

// Threads opening and closing sessions around streams with callbacks, while another reference
// keeps the session alive; then the last reference drops with a callback still queued.
void check_session_churn(int threads, int iterations) {
  Runtime& runtime = Runtime::instance();
  while (runtime.initialized()) runtime.finalize();  // start from no references
  runtime.init();
  std::vector<std::thread> workers;
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([&runtime, iterations] {
      for (int i = 0; i < iterations; ++i) {
        runtime.init();
        {
          Stream stream;
          std::atomic<int> ran{0};
          stream.launch_host_func([&ran] { ++ran; });
          stream.synchronize();
          EXPECT(ran.load() == 1);
        }
        runtime.finalize();
      }
    });
  }
  for (auto& worker : workers) worker.join();
  EXPECT(runtime.refcount() == 1);
  auto stream = std::make_unique<Stream>();
  std::atomic<bool> gate_open{false};
  hold_until(*stream, gate_open);
  stream->launch_host_func([] {});  // queued behind the gate: dropped by the teardown
  std::thread closer([&runtime] { runtime.finalize(); });
  std::this_thread::sleep_for(std::chrono::milliseconds(10));
  gate_open = true;
  closer.join();
  EXPECT(!runtime.initialized());
  stream.reset();  // stale: must not touch the (next) session
}

// Streams, events and buffers on two devices while the current device switches back and forth:
// copies, records and callbacks on each, destroyed in interleaved order.
void check_two_devices(int rounds) {
  Runtime& runtime = Runtime::instance();
  for (int round = 0; round < rounds; ++round) {
    std::vector<std::unique_ptr<Stream>> streams;
    std::vector<std::unique_ptr<Event>> events;
    std::vector<std::unique_ptr<Buffer>> buffers;
    std::atomic<int> callbacks{0};
    for (int device : {0, 1, 0, 1}) {
      runtime.set_device(device);
      streams.push_back(std::make_unique<Stream>());
      events.push_back(std::make_unique<Event>(false));
      buffers.push_back(std::make_unique<Buffer>(BufferKind::kDevice, 4096));
      buffers.push_back(std::make_unique<Buffer>(BufferKind::kPinned, 4096));
      std::memset(buffers.back()->host_ptr(), device + 1, 4096);
    }
    runtime.set_device(round % 2);
    for (size_t i = 0; i < streams.size(); ++i) {
      Buffer& device = *buffers[2 * i];
      Buffer& host = *buffers[2 * i + 1];
      streams[i]->memcpy_async(device.ptr(), 4096, host.ptr(), 4096, ACL_MEMCPY_HOST_TO_DEVICE);
      events[i]->record(*streams[i]);
      streams[(i + 1) % streams.size()]->wait_event(*events[i]);  // also across devices
      streams[i]->launch_host_func([&callbacks] { ++callbacks; });
    }
    runtime.set_device(1 - round % 2);
    for (size_t i : {1u, 0u, 3u, 2u}) streams[i]->destroy();
    for (auto& event : events) event->synchronize();
    EXPECT(callbacks.load() == 4);
    std::vector<unsigned char> back(4096);
    runtime.set_device(1);  // buffers[6] lives on device 1: copies run in the current context
    ascend_vlm::memcpy_sync(back.data(), back.size(), buffers[6]->ptr(), 4096,
                            ACL_MEMCPY_DEVICE_TO_HOST);
    EXPECT(back[0] == 2 && back[4095] == 2);
    runtime.set_device(0);
  }
}

#ifdef ASCEND_VLM_BACKEND_SIM
// The simulator's CANN rules, on raw AscendCL calls.
void check_cann_rules() {
  Runtime& runtime = Runtime::instance();
  runtime.set_device(0);
  Stream on_zero;
  Event event_zero;
  runtime.set_device(1);
  Stream on_one;
  // A stream used from another device's context: ACL_ERROR_RT_STREAM_CONTEXT.
  aclrtStream raw = on_zero.handle();  // binds device 0's context
  runtime.bind_device(1);
  EXPECT_CODE(aclrtSynchronizeStream(raw), ACL_ERROR_RT_STREAM_CONTEXT);
  // Through the runtime the same call runs in device 0's context.
  on_zero.synchronize();
  // One report thread per device: a thread serving device 0 cannot take a device-1 stream.
  runtime.bind_device(0);
  aclrtStream raw_zero = nullptr;
  EXPECT_CODE(aclrtCreateStream(&raw_zero), ACL_SUCCESS);
  const uint64_t fake_thread = 0x5EED;
  EXPECT_CODE(aclrtSubscribeReport(fake_thread, raw_zero), ACL_SUCCESS);
  runtime.bind_device(1);
  aclrtStream raw_one = nullptr;
  EXPECT_CODE(aclrtCreateStream(&raw_one), ACL_SUCCESS);
  EXPECT_CODE(aclrtSubscribeReport(fake_thread, raw_one), ACL_ERROR_RT_THREAD_SUBSCRIBE);
  EXPECT_CODE(aclrtDestroyStream(raw_one), ACL_SUCCESS);
  runtime.bind_device(0);
  EXPECT_CODE(aclrtUnSubscribeReport(fake_thread, raw_zero), ACL_SUCCESS);
  EXPECT_CODE(aclrtDestroyStream(raw_zero), ACL_SUCCESS);
  // aclrtProcessReport on a thread without streams, and an idle poll.
  EXPECT_CODE(aclrtProcessReport(5), ACL_ERROR_RT_THREAD_SUBSCRIBE);
  // Documented constants: event IPC flag, memory attributes, memcpy kinds 5-7.
  aclrtEvent ipc = nullptr;
  EXPECT_CODE(aclrtCreateEventWithFlag(&ipc, ACL_EVENT_IPC), ACL_SUCCESS);
  EXPECT_CODE(aclrtDestroyEvent(ipc), ACL_SUCCESS);
  EXPECT_CODE(aclrtCreateEventWithFlag(&ipc, 0x80u), ACL_ERROR_INVALID_PARAM);
  size_t free_bytes = 0;
  size_t total = 0;
  EXPECT_CODE(aclrtGetMemInfo(ACL_HBM_MEM_P2P_HUGE1G, &free_bytes, &total), ACL_SUCCESS);
  EXPECT_CODE(aclrtGetMemInfo(static_cast<aclrtMemAttr>(12), &free_bytes, &total),
              ACL_ERROR_INVALID_PARAM);
  // Reference-counted set/reset: the runtime holds one reference per device in use.
  aclsimResourceCounts counts{};
  EXPECT_CODE(aclsimGetResourceCounts(&counts), ACL_SUCCESS);
  EXPECT(counts.deviceRefs == 2 && counts.liveContexts == 2);
  EXPECT_CODE(aclrtSetDevice(1), ACL_SUCCESS);  // a foreign reference (e.g. torch_npu)
  EXPECT_CODE(aclrtResetDevice(1), ACL_SUCCESS);
  EXPECT_CODE(aclsimGetResourceCounts(&counts), ACL_SUCCESS);
  EXPECT(counts.deviceRefs == 2 && counts.liveContexts == 2);
  // Timed synchronisation.
  std::atomic<bool> gate_open{false};
  runtime.set_device(0);
  hold_until(on_zero, gate_open);
  EXPECT(acl_code_of([&] { on_zero.synchronize(10); }) == ascend_vlm::kAclErrorRtStreamSyncTimeout);
  event_zero.record(on_zero);
  EXPECT(acl_code_of([&] { event_zero.synchronize(0); }) ==
         ascend_vlm::kAclErrorRtEventSyncTimeout);
  gate_open = true;
  on_zero.synchronize();
  event_zero.synchronize();
}

void check_misuse_codes() {
  Runtime::instance().enter();  // raw AscendCL calls below need a bound session
  void* ptr = nullptr;
  EXPECT_CODE(aclrtMalloc(&ptr, 0, ACL_MEM_MALLOC_HUGE_FIRST), ACL_ERROR_INVALID_PARAM);
  EXPECT_CODE(aclrtMalloc(nullptr, 64, ACL_MEM_MALLOC_HUGE_FIRST), ACL_ERROR_INVALID_PARAM);
  EXPECT_CODE(aclrtMalloc(&ptr, 64, ACL_MEM_MALLOC_HUGE_FIRST), ACL_SUCCESS);
  EXPECT_CODE(aclrtFree(ptr), ACL_SUCCESS);
  EXPECT_CODE(aclrtFree(ptr), ACL_ERROR_RT_PARAM_INVALID);  // double free
  int local = 0;
  EXPECT_CODE(aclrtFree(&local), ACL_ERROR_RT_PARAM_INVALID);  // foreign pointer
  EXPECT_CODE(aclrtFreeHost(&local), ACL_ERROR_RT_PARAM_INVALID);
  EXPECT_CODE(aclrtHostUnregister(&local), ACL_ERROR_RT_PARAM_INVALID);  // never registered
  void* host = nullptr;
  void* alias = nullptr;
  EXPECT_CODE(aclrtMallocHost(&host, 3 * 4096), ACL_SUCCESS);
  // aclrtMallocHost promises 64-byte alignment only; registration needs a 4 KB boundary.
  EXPECT(reinterpret_cast<uintptr_t>(host) % 64 == 0);
  EXPECT_CODE(aclrtHostRegister(host, 4096, ACL_HOST_REGISTER_MAPPED, &alias),
              ACL_ERROR_RT_ADDR_UNALIGNED);
  char* page = static_cast<char*>(host) + (4096 - reinterpret_cast<uintptr_t>(host) % 4096);
  EXPECT_CODE(aclrtHostRegister(page, 8192, ACL_HOST_REGISTER_MAPPED, &alias), ACL_SUCCESS);
  EXPECT_CODE(aclrtHostRegister(page, 4096, ACL_HOST_REGISTER_MAPPED, &alias),
              ACL_ERROR_RT_PARAM_INVALID);
  EXPECT_CODE(aclrtHostRegister(page, 4096, ACL_HOST_REGISTER_READONLY, &alias),
              ACL_ERROR_RT_FEATURE_NOT_SUPPORT);
  EXPECT_CODE(aclrtHostUnregister(page), ACL_SUCCESS);
  EXPECT_CODE(aclrtFreeHost(host), ACL_SUCCESS);
  EXPECT_CODE(aclrtFreeHost(host), ACL_ERROR_RT_PARAM_INVALID);

  aclrtStream bogus_stream = &local;
  EXPECT_CODE(aclrtSynchronizeStream(bogus_stream), ACL_ERROR_RT_INVALID_HANDLE);
  EXPECT_CODE(aclrtDestroyEvent(&local), ACL_ERROR_RT_INVALID_HANDLE);
  EXPECT_CODE(aclrtCreateStreamWithConfig(&bogus_stream, 8, 0), ACL_ERROR_INVALID_PARAM);
  aclrtEvent timing_only = nullptr;
  EXPECT_CODE(aclrtCreateEventWithFlag(&timing_only, ACL_EVENT_TIME_LINE), ACL_SUCCESS);
  EXPECT_CODE(aclrtCreateEventWithFlag(&timing_only, 0x80u), ACL_ERROR_INVALID_PARAM);
  EXPECT_CODE(aclrtStreamWaitEvent(nullptr, timing_only), ACL_ERROR_RT_PARAM_INVALID);
  EXPECT_CODE(aclrtDestroyEvent(timing_only), ACL_SUCCESS);

  // Destroying a stream waits for its queued work.
  Stream stream;
  std::atomic<bool> release{false};
  hold_until(stream, release);
  std::thread opener([&release] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    release = true;
  });
  EXPECT(acl_code_of([&] { stream.destroy(); }) == ACL_SUCCESS);
  EXPECT(release.load() && stream.destroyed());
  opener.join();

  // A copy whose target is freed while it waits in the queue fails at synchronize, once.
  Stream gated;
  std::atomic<bool> gate_open{false};
  hold_until(gated, gate_open);
  void* doomed = nullptr;
  Buffer source(BufferKind::kPinned, 64);
  EXPECT_CODE(aclrtMalloc(&doomed, 64, ACL_MEM_MALLOC_HUGE_FIRST), ACL_SUCCESS);
  gated.memcpy_async(doomed, 64, source.ptr(), 64, ACL_MEMCPY_HOST_TO_DEVICE);
  Runtime::instance().enter();  // the raw free runs in the current device's context
  EXPECT_CODE(aclrtFree(doomed), ACL_SUCCESS);
  gate_open = true;
  EXPECT(acl_code_of([&] { gated.synchronize(); }) == ACL_ERROR_RT_PARAM_INVALID);
  EXPECT(acl_code_of([&] { gated.synchronize(); }) == ACL_SUCCESS);

  Event never;
  Event recorded;
  Stream other;
  recorded.record(other);
  other.synchronize();
  EXPECT(acl_code_of([&] { recorded.elapsed_ms(never); }) == ACL_ERROR_RT_EVENT_TIMESTAMP_INVALID);
}

void check_out_of_memory() {
  Runtime::instance().enter();  // raw AscendCL calls below need a bound session
  size_t free_bytes = 0;
  size_t total = 0;
  EXPECT_CODE(aclrtGetMemInfo(ACL_HBM_MEM, &free_bytes, &total), ACL_SUCCESS);
  EXPECT_CODE(aclsimSetDeviceMemoryCapacity(Runtime::instance().current_device(), 1 << 20),
              ACL_SUCCESS);
  {
    Buffer half(BufferKind::kDevice, 1 << 19);
    EXPECT(acl_code_of([] { Buffer again(BufferKind::kDevice, 1 << 19); }) ==
           ACL_ERROR_RT_MEMORY_ALLOCATION);
  }
  EXPECT(acl_code_of([] { Buffer fits(BufferKind::kDevice, 1 << 19); }) == ACL_SUCCESS);
  EXPECT_CODE(aclsimSetDeviceMemoryCapacity(Runtime::instance().current_device(), total),
              ACL_SUCCESS);
}

void check_zero_copy() {
  Buffer mapped(BufferKind::kMapped, 8192);
  Buffer device(BufferKind::kDevice, 8192);
  Stream stream;
  std::memset(mapped.host_ptr(), 0x5A, 8192);
  EXPECT_CODE(aclsimResetCopyStats(), ACL_SUCCESS);
  EXPECT_CODE(aclsimLaunchCopyKernel(device.ptr(), mapped.device_ptr(), 8192, stream.handle()),
              ACL_SUCCESS);
  stream.synchronize();
  aclsimCopyStats stats{};
  EXPECT_CODE(aclsimGetCopyStats(&stats), ACL_SUCCESS);
  EXPECT(stats.hostToDevice == 0 && stats.deviceToDevice == 0 && stats.kernel == 8192);
  std::vector<unsigned char> back(8192);
  ascend_vlm::memcpy_sync(back.data(), back.size(), device.ptr(), 8192, ACL_MEMCPY_DEVICE_TO_HOST);
  EXPECT(back[0] == 0x5A && back[8191] == 0x5A);
  // CANN: a mapped device address cannot be used for copies.
  EXPECT_CODE(
      aclrtMemcpy(device.ptr(), 8192, mapped.device_ptr(), 8192, ACL_MEMCPY_DEVICE_TO_DEVICE),
      ACL_ERROR_RT_PARAM_INVALID);
}

#endif  // ASCEND_VLM_BACKEND_SIM

void check_reentrancy() {
  Runtime& runtime = Runtime::instance();
  runtime.init();
  runtime.init();
  auto stale = std::make_unique<Stream>();
  runtime.finalize();
  EXPECT(runtime.initialized());
  runtime.finalize();
  while (runtime.initialized()) runtime.finalize();  // drop the implicit reference as well
  runtime.finalize();
  EXPECT(acl_code_of([&] { stale->synchronize(); }) == ACL_ERROR_UNINITIALIZE);
  stale.reset();                          // must not touch the next session
  Buffer fresh(BufferKind::kDevice, 64);  // implicit re-initialisation
  EXPECT(runtime.initialized());
}

#ifdef ASCEND_VLM_BACKEND_SIM
// After shutdown everything is released, devices reset, and aclInit ran once.
void check_no_leaks_after_shutdown() {
  aclsimResourceCounts counts{};
  EXPECT_CODE(aclsimGetResourceCounts(&counts), ACL_SUCCESS);
  EXPECT(counts.streams == 0 && counts.events == 0 && counts.deviceAllocations == 0);
  EXPECT(counts.hostAllocations == 0 && counts.hostRegistrations == 0);
  EXPECT(counts.subscribedStreams == 0 && counts.deviceRefs == 0 && counts.liveContexts == 0);
  EXPECT(counts.resetsWithLiveHandles == 0);
  EXPECT(counts.initCalls == 1 && counts.finalizeCalls == 1);
}
#endif

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "all";
  if (mode != "all" && mode != "stress") {
    std::fprintf(stderr, "usage: runtime_stress [all|stress]\n");
    return 2;
  }
  check_event_pipeline(8, 1000);
  check_threads(4, 200);
  check_session_churn(4, 50);
  check_destroy_race(3, 20);
  check_two_devices(mode == "all" ? 20 : 5);
  if (mode == "all") {
#ifdef ASCEND_VLM_BACKEND_SIM
    check_cann_rules();
    check_misuse_codes();
    check_out_of_memory();
    check_zero_copy();
#endif
    check_reentrancy();
  }
  Runtime::instance().shutdown();
#ifdef ASCEND_VLM_BACKEND_SIM
  check_no_leaks_after_shutdown();
#endif
  std::printf("runtime_stress %s: %d failure(s)\n", mode.c_str(), failures.load());
  return failures.load() == 0 ? 0 : 1;
}
