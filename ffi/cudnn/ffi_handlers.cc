// Typed XLA FFI handlers of the cuDNN paged prefill.
//   instantiate: reads the attributes into a Config (per call site).
//   initialize:  builds or fetches the cuDNN plan for this device (outside any graph capture).
//   execute:     binds buffer pointers and enqueues; command-buffer compatible.
#include "ffi_handlers.h"

#include <atomic>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

#include "paged_prefill.h"
#include "xla/ffi/api/ffi.h"

namespace jaxattn::cudnn {
namespace {

namespace ffi = xla::ffi;

std::atomic<int64_t> execute_count{0};

struct PrefillState {
  static ffi::TypeId id;

  explicit PrefillState(Config c) : config(std::move(c)) {}

  // The plan of `device`, built on first use.
  std::shared_ptr<const Plan> PlanFor(int device) {
    std::lock_guard<std::mutex> lock(mu);
    auto& plan = plans[device];
    if (!plan) plan = GetPlan(config, device);
    return plan;
  }

  const Config config;
  std::mutex mu;
  std::map<int, std::shared_ptr<const Plan>> plans;
};

ffi::TypeId PrefillState::id = {};
XLA_FFI_TypeInfo state_type_info = ffi::MakeTypeInfo<PrefillState>();

// Runs `fn`, turning any C++ exception into an ffi::Error: nothing may cross the FFI boundary.
template <typename Fn>
ffi::Error Guarded(const char* stage, Fn&& fn) {
  try {
    return fn();
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string("jaxattn cudnn paged prefill (") + stage + "): " + e.what());
  } catch (...) {
    return ffi::Error::Internal(std::string("jaxattn cudnn paged prefill (") + stage + "): unknown exception");
  }
}

template <typename T>
T Attr(const ffi::Dictionary& attrs, std::string_view name) {
  ffi::ErrorOr<T> value = attrs.get<T>(name);
  if (value.has_error()) {
    throw std::invalid_argument("attribute '" + std::string(name) + "': " + value.error().message());
  }
  return *value;
}

ffi::ErrorOr<std::unique_ptr<PrefillState>> Instantiate(ffi::Dictionary attrs) {
  std::unique_ptr<PrefillState> state;
  ffi::Error error = Guarded("instantiate", [&]() -> ffi::Error {
    Config config = MakeConfig([&](const char* n) { return Attr<int64_t>(attrs, n); },
                               [&](const char* n) { return Attr<float>(attrs, n); },
                               [&](const char* n) { return Attr<bool>(attrs, n); });
    if (std::string problem = config.Check(); !problem.empty()) {
      return ffi::Error::InvalidArgument("jaxattn cudnn paged prefill: " + problem);
    }
    state = std::make_unique<PrefillState>(std::move(config));
    return ffi::Error::Success();
  });
  if (error.failure()) return ffi::Unexpected(std::move(error));
  return std::move(state);
}

ffi::Error Initialize(int32_t device, PrefillState* state) {
  return Guarded("initialize", [&]() -> ffi::Error {
    state->PlanFor(device);
    return ffi::Error::Success();
  });
}

const int32_t* Int32Data(const ffi::AnyBuffer& buffer) {
  return static_cast<const int32_t*>(buffer.untyped_data());
}

ffi::Error Execute(cudaStream_t stream, int32_t device, PrefillState* state, ffi::AnyBuffer q,
                   ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages, ffi::AnyBuffer seq_len_q,
                   ffi::AnyBuffer seq_len_kv, ffi::AnyBuffer ragged_offsets, ffi::AnyBuffer block_tables,
                   ffi::RemainingArgs optional_args, ffi::Result<ffi::AnyBuffer> out,
                   ffi::Result<ffi::AnyBuffer> workspace, ffi::RemainingRets optional_rets) {
  execute_count.fetch_add(1, std::memory_order_relaxed);
  return Guarded("execute", [&]() -> ffi::Error {
    const Config& c = state->config;
    Buffers buffers;
    buffers.q = q.untyped_data();
    buffers.k_pages = k_pages.untyped_data();
    buffers.v_pages = v_pages.untyped_data();
    buffers.seq_len_q = Int32Data(seq_len_q);
    buffers.seq_len_kv = Int32Data(seq_len_kv);
    buffers.ragged_offsets = Int32Data(ragged_offsets);
    buffers.block_tables = Int32Data(block_tables);
    buffers.out = out->untyped_data();
    buffers.workspace = workspace->untyped_data();
    if (c.has_sinks) {
      auto sinks = optional_args.get<ffi::AnyBuffer>(0);
      if (sinks.has_error()) return sinks.error();
      buffers.sinks = static_cast<const float*>(sinks->untyped_data());
    }
    if (c.return_lse) {
      auto lse = optional_rets.get<ffi::AnyBuffer>(0);
      if (lse.has_error()) return lse.error();
      buffers.lse = static_cast<float*>((*lse)->untyped_data());
    }
    // The plan was built in initialize; PlanFor only looks it up here.
    Run(*state->PlanFor(device), buffers, stream);
    return ffi::Error::Success();
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER(kInstantiate, Instantiate, ffi::Ffi::BindInstantiate().Attrs());

XLA_FFI_DEFINE_HANDLER(kInitialize, Initialize,
                       ffi::Ffi::BindInitialize().Ctx<ffi::DeviceOrdinal>().Ctx<ffi::State<PrefillState>>());

XLA_FFI_DEFINE_HANDLER(kExecute, Execute,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::PlatformStream<cudaStream_t>>()
                           .Ctx<ffi::DeviceOrdinal>()
                           .Ctx<ffi::State<PrefillState>>()
                           .Arg<ffi::AnyBuffer>()  // q [T, Hq, D]
                           .Arg<ffi::AnyBuffer>()  // k_pages
                           .Arg<ffi::AnyBuffer>()  // v_pages
                           .Arg<ffi::AnyBuffer>()  // seq_len_q int32 [B]
                           .Arg<ffi::AnyBuffer>()  // seq_len_kv int32 [B]
                           .Arg<ffi::AnyBuffer>()  // ragged_offsets int32 [B + 1]
                           .Arg<ffi::AnyBuffer>()  // block_tables int32 [B, P]
                           .RemainingArgs()        // sinks float32 [Hq] when has_sinks
                           .Ret<ffi::AnyBuffer>()  // out [T, Hq, D]
                           .Ret<ffi::AnyBuffer>()  // workspace uint8 [WorkspaceSize]
                           .RemainingRets(),       // lse float32 [B, Hq, max_q_len] when return_lse
                       {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_Error* PagedPrefillInstantiate(XLA_FFI_CallFrame* call_frame) { return kInstantiate(call_frame); }
XLA_FFI_Error* PagedPrefillInitialize(XLA_FFI_CallFrame* call_frame) { return kInitialize(call_frame); }
XLA_FFI_Error* PagedPrefillExecute(XLA_FFI_CallFrame* call_frame) { return kExecute(call_frame); }

void* PagedPrefillStateTypeId() { return &PrefillState::id; }
void* PagedPrefillStateTypeInfo() { return &state_type_info; }
int64_t PagedPrefillExecuteCount() { return execute_count.load(std::memory_order_relaxed); }

}  // namespace jaxattn::cudnn
