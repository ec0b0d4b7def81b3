// Python module jaxattn._cudnn_paged: FFI handler capsules, the trace-time workspace query and
// version/diagnostic helpers of the cuDNN paged prefill.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <cstdint>

#include "ffi_handlers.h"
#include "paged_prefill.h"

namespace nb = nanobind;
using namespace jaxattn::cudnn;

namespace {

nb::capsule Capsule(void* ptr) { return nb::capsule(ptr); }

Config ConfigFromDict(const nb::dict& d) {
  return MakeConfig([&](const char* n) { return nb::cast<int64_t>(d[n]); },
                    [&](const char* n) { return nb::cast<float>(d[n]); },
                    [&](const char* n) { return nb::cast<bool>(d[n]); });
}

}  // namespace

NB_MODULE(_cudnn_paged, m) {
  m.doc() = "cuDNN paged prefill XLA FFI handlers (built from ffi/cudnn)";

  m.def("handlers", []() {
    nb::dict d;
    d["instantiate"] = Capsule(reinterpret_cast<void*>(&PagedPrefillInstantiate));
    d["initialize"] = Capsule(reinterpret_cast<void*>(&PagedPrefillInitialize));
    d["execute"] = Capsule(reinterpret_cast<void*>(&PagedPrefillExecute));
    return d;
  }, "Stage name -> capsule of the handler, for jax.ffi.register_ffi_target(..., platform='CUDA').");

  m.def("state_type", []() {
    nb::dict d;
    d["type_id"] = Capsule(PagedPrefillStateTypeId());
    d["type_info"] = Capsule(PagedPrefillStateTypeInfo());
    return d;
  }, "The state type's registration, for jax.ffi.register_ffi_type(..., platform='CUDA').");

  m.def("workspace_size", [](const nb::dict& config, int device) {
    Config c = ConfigFromDict(config);
    std::shared_ptr<const Plan> plan;
    {
      nb::gil_scoped_release release;
      plan = GetPlan(c, device);
    }
    return WorkspaceSize(*plan);
  }, nb::arg("config"), nb::arg("device") = -1,
     "Builds (or fetches) the cuDNN plan of `config` (the FFI attributes) on `device` and returns its "
     "workspace bytes; RuntimeError with cuDNN's reason when it cannot be built.");

  m.def("check_config", [](const nb::dict& config) { return ConfigFromDict(config).Check(); },
        "Empty string when `config` is well formed, else what is wrong (no GPU needed).");

  m.def("backend_version", &BackendVersion, "cudnnGetVersion() of the loaded cuDNN library.");
  m.def("compiled_version", &CompiledVersion, "CUDNN_VERSION of the headers built against.");
  m.def("frontend_version", &FrontendVersion, "CUDNN_FRONTEND_VERSION built against.");
  m.def("execute_count", &PagedPrefillExecuteCount, "Times the execute handler's host code ran.");
}
