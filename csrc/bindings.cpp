// ascend_vlm._C: thin pybind11 bindings over csrc/runtime. Argument checking with Python-level
// messages and the documented public API live in ascend_vlm/runtime/.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <string>

#include "runtime/acl_error.h"
#include "runtime/acl_symbols.h"
#include "runtime/context.h"
#include "runtime/memory.h"
#include "runtime/op_registry.h"
#include "runtime/stream.h"

#ifdef ASCEND_VLM_BACKEND_SIM
#include "acl_sim_ext.h"
#endif

// The build passes the package version read from ascend_vlm/_version.py (CMakeLists.txt).
#ifndef ASCEND_VLM_VERSION
#error "ASCEND_VLM_VERSION is not defined: build _C through CMakeLists.txt"
#endif

namespace py = pybind11;
using ascend_vlm::AclError;
using ascend_vlm::Buffer;
using ascend_vlm::BufferKind;
using ascend_vlm::Event;
using ascend_vlm::Runtime;
using ascend_vlm::Stream;

namespace {

#ifdef ASCEND_VLM_BACKEND_SIM
constexpr const char* kBackend = "sim";
#else
constexpr const char* kBackend = "cann";
#endif

bool interpreter_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing() != 0;
#else
  return _Py_IsFinalizing() != 0;
#endif
}

uintptr_t address(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr); }
void* pointer(uintptr_t value) { return reinterpret_cast<void*>(value); }

// Destroying a stream waits for its queued work, which may include Python callbacks that need
// the GIL: release it while waiting (unless the interpreter is already shutting down).
struct ReleaseGilDelete {
  void operator()(Stream* stream) const {
    if (PyGILState_Check() && !interpreter_finalizing()) {
      py::gil_scoped_release release;
      delete stream;
    } else {
      delete stream;
    }
  }
};

void launch_python_callback(Stream& stream, py::function fn) {
  // The callable is dropped on whichever thread runs or discards the callback: take the GIL.
  std::shared_ptr<py::object> callable(new py::object(std::move(fn)), [](py::object* object) {
    py::gil_scoped_acquire gil;
    delete object;
  });
  stream.launch_host_func([callable] {
    py::gil_scoped_acquire gil;
    try {
      (*callable)();
    } catch (py::error_already_set& error) {
      error.discard_as_unraisable("ascend_vlm.runtime host callback");
    }
  });
}

[[noreturn]] void sim_only(const char* function) {
  throw std::runtime_error(std::string(function) +
                           ": only available on the simulated runtime; this build uses '" +
                           kBackend + "'");
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "AscendCL runtime bindings (backend: " + std::string(kBackend) + ")";
  m.attr("__version__") = ASCEND_VLM_VERSION;

  py::register_exception_translator([](std::exception_ptr raised) {
    try {
      if (raised) std::rethrow_exception(raised);
    } catch (const AclError& error) {
      py::object cls = py::module_::import("ascend_vlm._errors").attr("AclError");
      py::object instance = cls(error.code(), error.name(), error.function(), error.detail());
      PyErr_SetObject(cls.ptr(), instance.ptr());
    }
  });

  m.def("acl_backend", [] { return kBackend; });
  m.def("init", [] { Runtime::instance().init(); });
  m.def(
      "finalize", [] { Runtime::instance().finalize(); }, py::call_guard<py::gil_scoped_release>());
  m.def(
      "shutdown", [] { Runtime::instance().shutdown(); }, py::call_guard<py::gil_scoped_release>());
  m.def("refcount", [] { return Runtime::instance().refcount(); });
  m.def("is_initialized", [] { return Runtime::instance().initialized(); });
  m.def("device_count", [] { return Runtime::instance().device_count(); });
  m.def("set_device", [](int32_t device) { Runtime::instance().set_device(device); });
  m.def("current_device", [] { return Runtime::instance().current_device(); });
  m.def("mem_info", [] { return Runtime::instance().mem_info(); });
  m.def("sync_timeout_ms", [] { return Runtime::instance().sync_timeout_ms(); });
  m.def("set_sync_timeout_ms",
        [](int32_t timeout_ms) { Runtime::instance().set_sync_timeout_ms(timeout_ms); });
  m.def("capabilities", [] {
    const ascend_vlm::Capabilities caps = Runtime::instance().capabilities();
    py::dict out;
    out["soc_name"] = caps.soc_name;
    out["host_register_exported"] = caps.host_register_exported;
    out["host_register_soc"] = caps.host_register_soc;
    out["stream_sync_timeout"] = caps.stream_sync_timeout;
    out["event_sync_timeout"] = caps.event_sync_timeout;
    return out;
  });
  m.def("host_register_requirement",
        [] { return std::string(ascend_vlm::kHostRegisterRequirement); });
  m.def("find_buffer_range", [](uintptr_t address) -> py::object {
    const auto range = ascend_vlm::find_buffer_range(address);
    if (!range) return py::none();
    return py::make_tuple(range->base, range->size, range->kind, range->device_side);
  });

  py::enum_<BufferKind>(m, "BufferKind")
      .value("DEVICE", BufferKind::kDevice)
      .value("PINNED", BufferKind::kPinned)
      .value("MAPPED", BufferKind::kMapped);

  py::class_<Buffer>(m, "Buffer", py::buffer_protocol())
      .def(py::init([](BufferKind kind, int64_t nbytes, int policy) {
             return new Buffer(kind, nbytes, policy);
           }),
           py::arg("kind"), py::arg("nbytes"), py::arg("policy") = 0)
      .def_property_readonly("kind", &Buffer::kind)
      .def_property_readonly("nbytes", &Buffer::nbytes)
      .def_property_readonly("device", &Buffer::device)
      .def_property_readonly("closed", &Buffer::closed)
      .def_property_readonly("ptr", [](const Buffer& b) { return address(b.ptr()); })
      .def_property_readonly("host_ptr", [](const Buffer& b) { return address(b.host_ptr()); })
      .def_property_readonly("device_ptr", [](const Buffer& b) { return address(b.device_ptr()); })
      .def("free", &Buffer::free)
      .def_buffer([](Buffer& b) {
        return py::buffer_info(b.host_ptr(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(b.nbytes())}, {py::ssize_t{1}},
                               /*readonly=*/false);
      });

  py::class_<Stream, std::unique_ptr<Stream, ReleaseGilDelete>>(m, "Stream")
      .def(py::init<uint32_t>(), py::arg("priority") = 0)
      .def_property_readonly("handle", [](const Stream& s) { return address(s.handle()); })
      .def_property_readonly("priority", &Stream::priority)
      .def_property_readonly("device", &Stream::device)
      .def_property_readonly("destroyed", &Stream::destroyed)
      .def("synchronize", &Stream::synchronize, py::arg("timeout_ms") = Stream::kDefaultTimeout,
           py::call_guard<py::gil_scoped_release>())
      .def("wait_event", &Stream::wait_event)
      .def(
          "memcpy_async",
          [](Stream& s, uintptr_t dst, size_t dst_max, uintptr_t src, size_t count, int kind) {
            s.memcpy_async(pointer(dst), dst_max, pointer(src), count,
                           static_cast<aclrtMemcpyKind>(kind));
          },
          py::arg("dst"), py::arg("dst_max"), py::arg("src"), py::arg("count"), py::arg("kind"),
          // pageable host memory makes the copy synchronous (see aclrtMemcpyAsync)
          py::call_guard<py::gil_scoped_release>())
      .def("launch_host_func", &launch_python_callback)
      .def("destroy", &Stream::destroy, py::call_guard<py::gil_scoped_release>());

  py::class_<Event>(m, "Event")
      .def(py::init<bool>(), py::arg("timing") = true)
      .def_property_readonly("handle", [](const Event& e) { return address(e.handle()); })
      .def_property_readonly("timing", &Event::timing)
      .def_property_readonly("device", &Event::device)
      .def("record", &Event::record)
      .def("query", &Event::query)
      .def("make_stream_wait",
           [](const Event& e, uintptr_t stream) { e.make_stream_wait(pointer(stream)); })
      .def("synchronize", &Event::synchronize, py::arg("timeout_ms") = Stream::kDefaultTimeout,
           py::call_guard<py::gil_scoped_release>())
      .def("elapsed_ms", &Event::elapsed_ms);

  m.def(
      "memcpy",
      [](uintptr_t dst, size_t dst_max, uintptr_t src, size_t count, int kind) {
        ascend_vlm::memcpy_sync(pointer(dst), dst_max, pointer(src), count,
                                static_cast<aclrtMemcpyKind>(kind));
      },
      py::arg("dst"), py::arg("dst_max"), py::arg("src"), py::arg("count"), py::arg("kind"),
      py::call_guard<py::gil_scoped_release>());

  m.def("sim_stats", []() -> py::dict {
#ifdef ASCEND_VLM_BACKEND_SIM
    aclsimCopyStats stats{};
    ascend_vlm::check_acl(aclsimGetCopyStats(&stats), "aclsimGetCopyStats");
    py::dict out;
    out["h2h"] = stats.hostToHost;
    out["h2d"] = stats.hostToDevice;
    out["d2h"] = stats.deviceToHost;
    out["d2d"] = stats.deviceToDevice;
    out["kernel"] = stats.kernel;
    return out;
#else
    sim_only("sim_stats");
#endif
  });
  m.def("sim_reset_stats", [] {
#ifdef ASCEND_VLM_BACKEND_SIM
    ascend_vlm::check_acl(aclsimResetCopyStats(), "aclsimResetCopyStats");
#else
    sim_only("sim_reset_stats");
#endif
  });
  m.def(
      "sim_copy_kernel",
      [](Stream& stream, uintptr_t dst, uintptr_t src, size_t count) {
#ifdef ASCEND_VLM_BACKEND_SIM
        stream.use([&](aclrtStream queue) {
          ascend_vlm::check_acl(aclsimLaunchCopyKernel(pointer(dst), pointer(src), count, queue),
                                "aclsimLaunchCopyKernel");
        });
#else
        (void)stream;
        (void)dst;
        (void)src;
        (void)count;
        sim_only("sim_copy_kernel");
#endif
      },
      py::arg("stream"), py::arg("dst"), py::arg("src"), py::arg("count"));
  m.def("sim_resources", []() -> py::dict {
#ifdef ASCEND_VLM_BACKEND_SIM
    aclsimResourceCounts counts{};
    ascend_vlm::check_acl(aclsimGetResourceCounts(&counts), "aclsimGetResourceCounts");
    py::dict out;
    out["streams"] = counts.streams;
    out["events"] = counts.events;
    out["device_allocations"] = counts.deviceAllocations;
    out["host_allocations"] = counts.hostAllocations;
    out["host_registrations"] = counts.hostRegistrations;
    out["subscribed_streams"] = counts.subscribedStreams;
    out["device_refs"] = counts.deviceRefs;
    out["live_contexts"] = counts.liveContexts;
    out["resets_with_live_handles"] = counts.resetsWithLiveHandles;
    out["init_calls"] = counts.initCalls;
    out["finalize_calls"] = counts.finalizeCalls;
    return out;
#else
    sim_only("sim_resources");
#endif
  });
  m.def("sim_set_device_memory", [](int32_t device, size_t nbytes) {
#ifdef ASCEND_VLM_BACKEND_SIM
    Runtime::instance().enter();
    ascend_vlm::check_acl(aclsimSetDeviceMemoryCapacity(device, nbytes),
                          "aclsimSetDeviceMemoryCapacity");
#else
    (void)device;
    (void)nbytes;
    sim_only("sim_set_device_memory");
#endif
  });

  // Raw, unchecked AscendCL calls for tests that must provoke the runtime's own misuse errors
  // (double free, foreign handles, ...) which the RAII classes above make impossible. The
  // leading underscore keeps them out of the extension's public surface.
  py::module_ acl = m.def_submodule(
      "_testing_acl", "Raw AscendCL calls for the test suite only; no safety net, not public API.");
  acl.def("malloc", [](size_t nbytes) {
    Runtime::instance().enter();
    void* ptr = nullptr;
    ASCEND_VLM_ACL_CALL(aclrtMalloc, &ptr, nbytes, ACL_MEM_MALLOC_HUGE_FIRST);
    return address(ptr);
  });
  acl.def("free", [](uintptr_t ptr) {
    Runtime::instance().enter();
    ASCEND_VLM_ACL_CALL(aclrtFree, pointer(ptr));
  });
  acl.def("free_host", [](uintptr_t ptr) {
    Runtime::instance().enter();
    ASCEND_VLM_ACL_CALL(aclrtFreeHost, pointer(ptr));
  });
  acl.def(
      "host_register",
      [](uintptr_t ptr, uint64_t nbytes, int type) {
        Runtime::instance().enter();
        auto host_register = ascend_vlm::optional_acl().host_register;
        if (host_register == nullptr) {
          throw AclError(ACL_ERROR_RT_FEATURE_NOT_SUPPORT, "aclrtHostRegister",
                         ascend_vlm::kHostRegisterRequirement);
        }
        void* device = nullptr;
        ascend_vlm::check_acl(host_register(pointer(ptr), nbytes, type, &device),
                              "aclrtHostRegister");
        return address(device);
      },
      py::arg("ptr"), py::arg("nbytes"), py::arg("type") = ascend_vlm::kAclHostRegisterMapped);
  acl.def("host_unregister", [](uintptr_t ptr) {
    Runtime::instance().enter();
    auto host_unregister = ascend_vlm::optional_acl().host_unregister;
    if (host_unregister == nullptr) {
      throw AclError(ACL_ERROR_RT_FEATURE_NOT_SUPPORT, "aclrtHostUnregister",
                     ascend_vlm::kHostRegisterRequirement);
    }
    ascend_vlm::check_acl(host_unregister(pointer(ptr)), "aclrtHostUnregister");
  });
  acl.def("malloc_host", [](size_t nbytes) {
    Runtime::instance().enter();
    void* ptr = nullptr;
    ASCEND_VLM_ACL_CALL(aclrtMallocHost, &ptr, nbytes);
    return address(ptr);
  });
  acl.def(
      "process_report",
      [](int32_t timeout) {
        Runtime::instance().enter();
        return aclrtProcessReport(timeout);
      },
      py::call_guard<py::gil_scoped_release>());
  acl.def("destroy_stream", [](uintptr_t handle) {
    Runtime::instance().enter();
    ASCEND_VLM_ACL_CALL(aclrtDestroyStream, pointer(handle));
  });
  acl.def("destroy_event", [](uintptr_t handle) {
    Runtime::instance().enter();
    ASCEND_VLM_ACL_CALL(aclrtDestroyEvent, pointer(handle));
  });

  using ascend_vlm::AttrSpec;
  using ascend_vlm::OpDescriptor;
  using ascend_vlm::OpRegistry;
  using ascend_vlm::TensorSpec;
  py::class_<TensorSpec>(m, "TensorSpec")
      .def(py::init<>())
      .def_readwrite("name", &TensorSpec::name)
      .def_readwrite("dtypes", &TensorSpec::dtypes)
      .def_readwrite("formats", &TensorSpec::formats)
      .def_readwrite("rank", &TensorSpec::rank)
      .def_readwrite("dynamic_dims", &TensorSpec::dynamic_dims)
      .def_readwrite("all_dims_dynamic", &TensorSpec::all_dims_dynamic)
      .def_readwrite("optional", &TensorSpec::optional);
  py::class_<AttrSpec>(m, "AttrSpec")
      .def(py::init<>())
      .def_readwrite("name", &AttrSpec::name)
      .def_readwrite("type", &AttrSpec::type)
      .def_readwrite("default", &AttrSpec::default_value);
  py::class_<OpDescriptor>(m, "OpDescriptor")
      .def(py::init<>())
      .def_readwrite("name", &OpDescriptor::name)
      .def_readwrite("summary", &OpDescriptor::summary)
      .def_readwrite("npu_kernel", &OpDescriptor::npu_kernel)
      .def_readwrite("inputs", &OpDescriptor::inputs)
      .def_readwrite("outputs", &OpDescriptor::outputs)
      .def_readwrite("attrs", &OpDescriptor::attrs);
  m.def("register_op", [](const OpDescriptor& op) { OpRegistry::global().add(op); });
  m.def("unregister_op", [](const std::string& name) { return OpRegistry::global().remove(name); });
  m.def("find_op", [](const std::string& name) { return OpRegistry::global().find(name); });
  m.def("registered_ops", [] { return OpRegistry::global().names(); });
}
