// XLA FFI handler for TensorRT-LLM's XQA paged decode kernel (one compiled variant per library).
//
// Decode (JaxattnXqaExecute; variants built without SPEC_DEC), one request per query token:
// Operands:  q [T, Hq, D], k_pages, v_pages (HND or NHD, described by element strides),
//            page_table int32 [T, P], seq_lens int32 [T] (0 = no keys), scales f32 [2]
//            (q_scale, kv_scale), sinks f32 [Hq] or [0].
// Results:   out [T, Hq, D], scratch u8 [N] (sized at trace time by jaxattn_xqa_workspace).
//            Rows of tokens without keys are zero: the Hopper kernel's are zeroed here after it;
//            the generic kernel writes zeros given the sinks the caller passes (trtllm._sinks).
// Speculative decode (JaxattnXqaSpecExecute; SPEC_DEC variants), one request per sequence:
// Operands:  q [T, Hq, D], k_pages, v_pages, page_table int32 [B, P], seq_lens int32 [B],
//            scales, sinks as above, q_cu_seq_lens int32 [B + 1] (non-decreasing, in [0, T],
//            each length <= q_seq_len), mask uint32 [T, ceil(q_seq_len / 32)], row_valid int32 [T].
// Results:   as above. XQA writes only the rows of requests with tokens; a kernel launched after
//            it zeroes every row whose row_valid is 0 (the caller flags rows outside every
//            request and rows of requests it gave no keys).
// Split:     XQA splits each sequence over CTAs by a formula of the SM count; the attribute
//            split_sm_count (0: the device's) is the count it is given, so that the caller picks
//            the split (the trace-time workspace query takes the same count).
// Stages:    instantiate creates this call's semaphore state (one per custom call in the HLO, so
//            calls that may run concurrently never share semaphores); initialize allocates and
//            zeroes it once per device (XQA leaves its semaphores zero after every launch);
//            execute only enqueues kernels on XLA's stream, so it is command-buffer safe: under
//            CUDA graphs it runs when XLA records the graph, with static shapes and attributes.
#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <exception>
#include <stdexcept>
#include <memory>
#include <mutex>
#include <string>

#include "xla/ffi/api/ffi.h"
#include "xqa.h"

namespace ffi = xla::ffi;

namespace jaxattn::xqa {
namespace {

constexpr int kMaxDevices = 64;
std::array<std::atomic<int>, kMaxDevices> g_sm_count{};  // 0 until the device is initialized
std::mutex g_init_mutex;
std::atomic<int64_t> g_host_executions{0};  // diagnostics: how often XLA ran execute on the host

std::string dims_str(ffi::AnyBuffer const& b) {
  std::string s = "[";
  for (size_t i = 0; i < b.dimensions().size(); ++i) {
    s += (i ? ", " : "") + std::to_string(b.dimensions()[i]);
  }
  return s + "]";
}

bool same_dims(ffi::AnyBuffer const& a, ffi::AnyBuffer const& b) {
  auto const da = a.dimensions();
  auto const db = b.dimensions();
  return std::equal(da.begin(), da.end(), db.begin(), db.end());
}

ffi::Error cuda_error(char const* what, cudaError_t err) {
  return ffi::Error::Internal(std::string("jaxattn trtllm: ") + what + ": " +
                              cudaGetErrorString(err));
}

// Per custom-call instance: a zeroed semaphore array per device, allocated on first use there.
struct SemaphoreState {
  static ffi::TypeId id;

  explicit SemaphoreState(uint64_t count) : count(count) {}
  SemaphoreState(SemaphoreState const&) = delete;
  SemaphoreState& operator=(SemaphoreState const&) = delete;
  ~SemaphoreState() {
    for (uint32_t* buffer : buffers) {
      if (buffer != nullptr) cudaFree(buffer);  // errors at process exit are moot
    }
  }

  uint32_t* get(int32_t device) {
    std::lock_guard<std::mutex> lock(mutex);
    return buffers[device];
  }

  uint64_t const count;
  std::mutex mutex;
  std::array<uint32_t*, kMaxDevices> buffers{};
};

ffi::TypeId SemaphoreState::id = {};
XLA_FFI_TypeInfo const kSemaphoreStateInfo = ffi::MakeTypeInfo<SemaphoreState>();

ffi::ErrorOr<std::unique_ptr<SemaphoreState>> Instantiate(ffi::Dictionary attrs) {
  ffi::ErrorOr<int64_t> count = attrs.get<int64_t>("semaphore_count");
  if (count.has_error()) return ffi::Unexpected(count.error());
  if (*count < 0) {
    return ffi::Unexpected(
        ffi::Error::InvalidArgument("jaxattn trtllm: semaphore_count must be >= 0"));
  }
  return std::make_unique<SemaphoreState>(static_cast<uint64_t>(*count));
}

// Device part of initialize (device current): allocates and zeroes this call's semaphores.
std::string allocate_semaphores(SemaphoreState& state, int32_t device) {
  std::lock_guard<std::mutex> lock(state.mutex);
  if (state.count == 0 || state.buffers[device] != nullptr) return {};
  size_t const bytes = sizeof(uint32_t) * state.count;
  uint32_t* buffer = nullptr;
  if (cudaError_t err = cudaMalloc(&buffer, bytes); err != cudaSuccess) {
    return std::string("cudaMalloc(semaphores): ") + cudaGetErrorString(err);
  }
  // Waited for here: XLA's non-blocking streams do not order against the legacy stream.
  cudaError_t err = cudaMemset(buffer, 0, bytes);
  if (err == cudaSuccess) err = cudaStreamSynchronize(cudaStreamLegacy);
  if (err != cudaSuccess) {
    cudaFree(buffer);
    return std::string("zeroing semaphores: ") + cudaGetErrorString(err);
  }
  state.buffers[device] = buffer;
  return {};
}

// Zeroes the output rows whose flag is 0 after XQA (the Hopper kernel's rows of tokens without
// keys, with seq_lens as the flags; the spec-decode rows XQA does not own, with row_valid).
// Launched as a programmatic dependent of the XQA kernel: it waits for XQA's grid to finish
// before it reads or writes anything.
__global__ void zero_rows_without_keys(uint32_t const* __restrict__ keep, uint4* __restrict__ out,
                                       uint32_t row_vectors) {
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  if (keep[blockIdx.x] != 0) return;
  uint4* const row = out + uint64_t{blockIdx.x} * row_vectors;
  for (uint32_t i = threadIdx.x; i < row_vectors; i += blockDim.x) row[i] = make_uint4(0, 0, 0, 0);
}

cudaError_t launch_zero_rows(uint32_t const* keep, void* out, uint32_t rows, uint64_t row_bytes,
                             cudaStream_t stream) {
  cudaLaunchAttribute pdl{};
  pdl.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  pdl.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(rows);
  config.blockDim = dim3(128);
  config.stream = stream;
  config.attrs = &pdl;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, zero_rows_without_keys, keep, static_cast<uint4*>(out),
                            static_cast<uint32_t>(row_bytes / sizeof(uint4)));
}

// Once per device (device current): the SM count launches use, and XQA's kernel attributes.
std::string init_device(int32_t device) {
  std::lock_guard<std::mutex> lock(g_init_mutex);
  if (g_sm_count[device].load() != 0) return {};
  int sm_count = 0;
  if (cudaError_t err = cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device);
      err != cudaSuccess) {
    return std::string("cudaDeviceGetAttribute: ") + cudaGetErrorString(err);
  }
  try {
    init_current_device();
  } catch (std::exception const& e) {
    return e.what();
  }
  g_sm_count[device].store(sm_count);
  return {};
}

ffi::Error Initialize(int32_t device, SemaphoreState* semaphores) {
  if (device < 0 || device >= kMaxDevices) {
    return ffi::Error::InvalidArgument("jaxattn trtllm: device ordinal out of range");
  }
  if (g_sm_count[device].load() != 0 && (semaphores->count == 0 || semaphores->get(device))) {
    return ffi::Error::Success();  // the common case: nothing to do, no device switch
  }
  int previous = 0;
  if (cudaError_t err = cudaGetDevice(&previous); err != cudaSuccess) {
    return cuda_error("cudaGetDevice", err);
  }
  if (cudaError_t err = cudaSetDevice(device); err != cudaSuccess) {
    return cuda_error("cudaSetDevice", err);
  }
  std::string failure = init_device(device);
  if (failure.empty()) failure = allocate_semaphores(*semaphores, device);
  cudaSetDevice(previous);
  if (!failure.empty()) {
    return ffi::Error::Internal("jaxattn trtllm: XQA device init failed: " + failure);
  }
  return ffi::Error::Success();
}

ffi::DataType input_dtype(VariantInfo const& info) {
  return info.input_fp16 ? ffi::DataType::F16 : ffi::DataType::BF16;
}

ffi::Error check_operands(VariantInfo const& info, ffi::AnyBuffer const& q,
                          ffi::AnyBuffer const& k, ffi::AnyBuffer const& v,
                          ffi::AnyBuffer const& table, ffi::AnyBuffer const& seq_lens,
                          ffi::AnyBuffer const& scales, ffi::AnyBuffer const& sinks,
                          ffi::AnyBuffer const& out, int64_t num_kv_heads, int64_t stride_page,
                          bool spec) {
  auto bad = [](std::string what) {
    return ffi::Error::InvalidArgument("jaxattn trtllm: " + what);
  };
  auto const qd = q.dimensions();
  if (qd.size() != 3 || qd[2] != info.head_dim || qd[1] != num_kv_heads * info.group_size) {
    return bad("q must be [T, " + std::to_string(num_kv_heads * info.group_size) + ", " +
               std::to_string(info.head_dim) + "] for this XQA variant, got " + dims_str(q));
  }
  if (q.element_type() != input_dtype(info) || out.element_type() != input_dtype(info) ||
      out.dimensions().size() != 3 || out.element_count() != q.element_count()) {
    return bad("q and out must be " + std::string(info.input_fp16 ? "float16" : "bfloat16") +
               " arrays of the same shape");
  }
  auto const cache_dtype = info.cache_fp8 ? ffi::DataType::F8E4M3FN : input_dtype(info);
  if (k.element_type() != cache_dtype || v.element_type() != cache_dtype ||
      k.dimensions().size() != 4 || !same_dims(k, v)) {
    return bad("k_pages and v_pages must be 4-D arrays of the variant's cache dtype and equal "
               "shape, got " + dims_str(k) + " and " + dims_str(v));
  }
  // Requests: one per query token (decode), one per sequence (speculative decode).
  auto const td = table.dimensions();
  int64_t const requests = spec && td.size() == 2 ? td[0] : qd[0];
  if (table.element_type() != ffi::DataType::S32 || td.size() != 2 || td[0] != requests ||
      seq_lens.element_type() != ffi::DataType::S32 ||
      seq_lens.element_count() != static_cast<size_t>(requests) || requests < 1) {
    return bad(std::string(spec ? "page_table must be int32 [B, P] and seq_lens int32 [B]"
                                : "page_table must be int32 [T, P] and seq_lens int32 [T]") +
               " with " + (spec ? "B=" : "T=") + std::to_string(requests));
  }
  if (scales.element_type() != ffi::DataType::F32 || scales.element_count() != 2 ||
      sinks.element_type() != ffi::DataType::F32 ||
      (sinks.element_count() != 0 && sinks.element_count() != static_cast<size_t>(qd[1]))) {
    return bad("scales must be float32 [2] and sinks float32 [Hq] or [0]");
  }
  if (static_cast<uint64_t>(stride_page) * k.dimensions()[0] != k.element_count()) {
    return bad("stride_page does not match the page pool " + dims_str(k));
  }
  return ffi::Error::Success();
}

// Speculative-decode operands (SPEC_DEC variants).
struct SpecOperands {
  ffi::AnyBuffer q_cu_seq_lens;
  ffi::AnyBuffer mask;
  ffi::AnyBuffer row_valid;
  int64_t q_seq_len;
};

ffi::Error check_spec_operands(SpecOperands const& spec, int64_t num_tokens, int64_t requests) {
  auto bad = [](std::string what) {
    return ffi::Error::InvalidArgument("jaxattn trtllm: " + what);
  };
  if (spec.q_seq_len < 1 || spec.q_seq_len > num_tokens) {
    return bad("q_seq_len must be in 1..T, got " + std::to_string(spec.q_seq_len));
  }
  int64_t const words = (spec.q_seq_len + 31) / 32;
  auto const md = spec.mask.dimensions();
  if (spec.q_cu_seq_lens.element_type() != ffi::DataType::S32 ||
      spec.q_cu_seq_lens.element_count() != static_cast<size_t>(requests + 1) ||
      spec.mask.element_type() != ffi::DataType::U32 || md.size() != 2 || md[0] != num_tokens ||
      md[1] != words || spec.row_valid.element_type() != ffi::DataType::S32 ||
      spec.row_valid.element_count() != static_cast<size_t>(num_tokens)) {
    return bad("q_cu_seq_lens must be int32 [B + 1], mask uint32 [T, " + std::to_string(words) +
               "] and row_valid int32 [T] with B=" + std::to_string(requests) +
               ", T=" + std::to_string(num_tokens) + ", got mask " + dims_str(spec.mask));
  }
  return ffi::Error::Success();
}

ffi::Error Run(cudaStream_t stream, int32_t device, SemaphoreState* semaphores, ffi::AnyBuffer q,
               ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages, ffi::AnyBuffer page_table,
               ffi::AnyBuffer seq_lens, ffi::AnyBuffer scales, ffi::AnyBuffer sinks,
               SpecOperands const* spec, ffi::Result<ffi::AnyBuffer> out,
               ffi::Result<ffi::AnyBuffer> scratch, int64_t num_kv_heads, int64_t stride_page,
               int64_t stride_token, int64_t stride_head, int64_t sliding_window,
               int64_t semaphore_count, int64_t enable_pdl, int64_t split_sm_count) {
  g_host_executions.fetch_add(1, std::memory_order_relaxed);
  try {
    VariantInfo const info = variant_info();
    if ((info.spec_dec != 0) != (spec != nullptr)) {
      return ffi::Error::InvalidArgument(
          std::string("jaxattn trtllm: this XQA variant was built ") +
          (info.spec_dec ? "for speculative decode (call its spec handler)"
                         : "for decode only (no speculative decode)"));
    }
    if (ffi::Error err = check_operands(info, q, k_pages, v_pages, page_table, seq_lens, scales,
                                        sinks, *out, num_kv_heads, stride_page, spec != nullptr);
        err.failure()) {
      return err;
    }
    auto const num_tokens = static_cast<uint32_t>(q.dimensions()[0]);
    auto const batch = static_cast<uint32_t>(page_table.dimensions()[0]);
    if (spec != nullptr) {
      if (ffi::Error err = check_spec_operands(*spec, num_tokens, batch); err.failure()) {
        return err;
      }
    }
    uint32_t const q_seq_len = spec != nullptr ? static_cast<uint32_t>(spec->q_seq_len) : 1U;
    int const sm_count = device >= 0 && device < kMaxDevices ? g_sm_count[device].load() : 0;
    if (sm_count == 0) {
      return ffi::Error::Internal("jaxattn trtllm: execute before initialize on device " +
                                  std::to_string(device));
    }
    if (split_sm_count < 0) {
      return ffi::Error::InvalidArgument("jaxattn trtllm: split_sm_count must be >= 0");
    }
    // XQA derives its split count (CTAs per sequence) from the SM count it is given; the caller
    // may pass another count to pick the split (the trace-time workspace used the same one).
    int const launch_sms = split_sm_count > 0 ? static_cast<int>(split_sm_count) : sm_count;
    auto const max_pages = static_cast<uint32_t>(page_table.dimensions()[1]);
    Workspace const ws = workspace_layout(launch_sms, batch, static_cast<uint32_t>(num_kv_heads),
                                          max_pages, q_seq_len);
    if (semaphore_count < 0 || static_cast<uint64_t>(semaphore_count) != semaphores->count) {
      return ffi::Error::Internal("jaxattn trtllm: semaphore state does not match its call");
    }
    if (scratch->size_bytes() < ws.scratch_bytes || semaphores->count < ws.semaphore_count) {
      return ffi::Error::InvalidArgument(
          "jaxattn trtllm: this launch (split for " + std::to_string(launch_sms) + " SMs) needs " +
          std::to_string(ws.scratch_bytes) + " scratch bytes and " +
          std::to_string(ws.semaphore_count) + " semaphores, the call has " +
          std::to_string(scratch->size_bytes()) + " and " + std::to_string(semaphores->count) +
          "; it was sized for another device");
    }
    bool const splits = ws.semaphore_count != 0;
    LaunchArgs args{};
    args.sm_count = static_cast<uint32_t>(launch_sms);
    args.num_kv_heads = static_cast<uint32_t>(num_kv_heads);
    args.sliding_window = static_cast<uint32_t>(sliding_window);
    args.q_scale = static_cast<float const*>(scales.untyped_data());
    args.kv_scale = args.q_scale + 1;
    args.out = out->untyped_data();
    args.q = q.untyped_data();
    args.sinks = sinks.element_count() ? static_cast<float const*>(sinks.untyped_data()) : nullptr;
    args.k_pages = k_pages.untyped_data();
    args.v_pages = v_pages.untyped_data();
    args.page_table = static_cast<int32_t const*>(page_table.untyped_data());
    args.max_pages_per_seq = max_pages;
    args.seq_lens = static_cast<uint32_t const*>(seq_lens.untyped_data());
    args.batch = batch;
    args.semaphores = splits ? semaphores->get(device) : nullptr;
    args.scratch = splits ? scratch->untyped_data() : nullptr;
    args.enable_pdl = enable_pdl != 0;
    args.stride_page = static_cast<uint64_t>(stride_page);
    args.stride_token = static_cast<uint64_t>(stride_token);
    args.stride_head = static_cast<uint64_t>(stride_head);
    args.q_seq_len = q_seq_len;
    if (spec != nullptr) {
      args.q_cu_seq_lens = static_cast<uint32_t const*>(spec->q_cu_seq_lens.untyped_data());
      args.mask = static_cast<uint32_t const*>(spec->mask.untyped_data());
    }
    args.stream = stream;
    if (splits && args.semaphores == nullptr) {
      return ffi::Error::Internal("jaxattn trtllm: no semaphores on device " +
                                  std::to_string(device) + " (initialize did not run there)");
    }
    launch(args);
    uint32_t const* keep = nullptr;
    if (spec != nullptr) {
      keep = static_cast<uint32_t const*>(spec->row_valid.untyped_data());
    } else if (info.hopper_kernel) {
      keep = args.seq_lens;  // one request per token
    }
    if (keep != nullptr && num_tokens > 0) {
      if (cudaError_t err = launch_zero_rows(keep, args.out, num_tokens,
                                             out->size_bytes() / num_tokens, stream);
          err != cudaSuccess) {
        return cuda_error("zero_rows_without_keys", err);
      }
    }
    return ffi::Error::Success();
  } catch (std::exception const& e) {
    return ffi::Error::Internal(std::string("jaxattn trtllm: XQA launch failed: ") + e.what());
  }
}

ffi::Error Execute(cudaStream_t stream, int32_t device, SemaphoreState* semaphores,
                   ffi::AnyBuffer q, ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                   ffi::AnyBuffer page_table, ffi::AnyBuffer seq_lens, ffi::AnyBuffer scales,
                   ffi::AnyBuffer sinks, ffi::Result<ffi::AnyBuffer> out,
                   ffi::Result<ffi::AnyBuffer> scratch, int64_t num_kv_heads, int64_t stride_page,
                   int64_t stride_token, int64_t stride_head, int64_t sliding_window,
                   int64_t semaphore_count, int64_t enable_pdl, int64_t split_sm_count) {
  return Run(stream, device, semaphores, q, k_pages, v_pages, page_table, seq_lens, scales, sinks,
             nullptr, out, scratch, num_kv_heads, stride_page, stride_token, stride_head,
             sliding_window, semaphore_count, enable_pdl, split_sm_count);
}

ffi::Error SpecExecute(cudaStream_t stream, int32_t device, SemaphoreState* semaphores,
                       ffi::AnyBuffer q, ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                       ffi::AnyBuffer page_table, ffi::AnyBuffer seq_lens, ffi::AnyBuffer scales,
                       ffi::AnyBuffer sinks, ffi::AnyBuffer q_cu_seq_lens, ffi::AnyBuffer mask,
                       ffi::AnyBuffer row_valid, ffi::Result<ffi::AnyBuffer> out,
                       ffi::Result<ffi::AnyBuffer> scratch, int64_t num_kv_heads,
                       int64_t stride_page, int64_t stride_token, int64_t stride_head,
                       int64_t sliding_window, int64_t semaphore_count, int64_t enable_pdl,
                       int64_t q_seq_len, int64_t split_sm_count) {
  SpecOperands const spec{q_cu_seq_lens, mask, row_valid, q_seq_len};
  return Run(stream, device, semaphores, q, k_pages, v_pages, page_table, seq_lens, scales, sinks,
             &spec, out, scratch, num_kv_heads, stride_page, stride_token, stride_head,
             sliding_window, semaphore_count, enable_pdl, split_sm_count);
}

}  // namespace
}  // namespace jaxattn::xqa

#define JAXATTN_EXPORT extern "C" __attribute__((visibility("default")))

JAXATTN_EXPORT XLA_FFI_Error* JaxattnXqaInstantiate(XLA_FFI_CallFrame*);
JAXATTN_EXPORT XLA_FFI_Error* JaxattnXqaInitialize(XLA_FFI_CallFrame*);
JAXATTN_EXPORT XLA_FFI_Error* JaxattnXqaExecute(XLA_FFI_CallFrame*);
JAXATTN_EXPORT XLA_FFI_Error* JaxattnXqaSpecExecute(XLA_FFI_CallFrame*);

using jaxattn::xqa::SemaphoreState;

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxattnXqaInstantiate, jaxattn::xqa::Instantiate,
                              ffi::Ffi::BindInstantiate().Attrs<ffi::Dictionary>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxattnXqaInitialize, jaxattn::xqa::Initialize,
                              ffi::Ffi::BindInitialize()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Ctx<ffi::State<SemaphoreState>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxattnXqaExecute, jaxattn::xqa::Execute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Ctx<ffi::State<SemaphoreState>>()
                                  .Arg<ffi::AnyBuffer>()  // q
                                  .Arg<ffi::AnyBuffer>()  // k_pages
                                  .Arg<ffi::AnyBuffer>()  // v_pages
                                  .Arg<ffi::AnyBuffer>()  // page_table
                                  .Arg<ffi::AnyBuffer>()  // seq_lens
                                  .Arg<ffi::AnyBuffer>()  // scales
                                  .Arg<ffi::AnyBuffer>()  // sinks
                                  .Ret<ffi::AnyBuffer>()  // out
                                  .Ret<ffi::AnyBuffer>()  // scratch
                                  .Attr<int64_t>("num_kv_heads")
                                  .Attr<int64_t>("stride_page")
                                  .Attr<int64_t>("stride_token")
                                  .Attr<int64_t>("stride_head")
                                  .Attr<int64_t>("sliding_window")
                                  .Attr<int64_t>("semaphore_count")
                                  .Attr<int64_t>("enable_pdl")
                                  .Attr<int64_t>("split_sm_count"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxattnXqaSpecExecute, jaxattn::xqa::SpecExecute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Ctx<ffi::State<SemaphoreState>>()
                                  .Arg<ffi::AnyBuffer>()  // q
                                  .Arg<ffi::AnyBuffer>()  // k_pages
                                  .Arg<ffi::AnyBuffer>()  // v_pages
                                  .Arg<ffi::AnyBuffer>()  // page_table [B, P]
                                  .Arg<ffi::AnyBuffer>()  // seq_lens [B]
                                  .Arg<ffi::AnyBuffer>()  // scales
                                  .Arg<ffi::AnyBuffer>()  // sinks
                                  .Arg<ffi::AnyBuffer>()  // q_cu_seq_lens [B + 1]
                                  .Arg<ffi::AnyBuffer>()  // mask [T, words]
                                  .Arg<ffi::AnyBuffer>()  // row_valid [T]
                                  .Ret<ffi::AnyBuffer>()  // out
                                  .Ret<ffi::AnyBuffer>()  // scratch
                                  .Attr<int64_t>("num_kv_heads")
                                  .Attr<int64_t>("stride_page")
                                  .Attr<int64_t>("stride_token")
                                  .Attr<int64_t>("stride_head")
                                  .Attr<int64_t>("sliding_window")
                                  .Attr<int64_t>("semaphore_count")
                                  .Attr<int64_t>("enable_pdl")
                                  .Attr<int64_t>("q_seq_len")
                                  .Attr<int64_t>("split_sm_count"),
                              {ffi::Traits::kCmdBufferCompatible});

// The semaphore state's type, registered with jax.ffi.register_ffi_type before the target.
JAXATTN_EXPORT void* jaxattn_xqa_state_type_id() { return &SemaphoreState::id; }
JAXATTN_EXPORT void const* jaxattn_xqa_state_type_info() {
  return &jaxattn::xqa::kSemaphoreStateInfo;
}

// Trace-time queries (ctypes): the semaphores and scratch bytes a launch of this shape needs
// (returns -1 when the kernel's 32-bit scratch offsets overflow, -2 for a q_seq_len the variant
// cannot take), and the variant's constants.
JAXATTN_EXPORT int32_t jaxattn_xqa_workspace(int32_t sm_count, int32_t batch, int32_t num_kv_heads,
                                             int32_t max_pages_per_seq, int32_t q_seq_len,
                                             int64_t* semaphore_count, int64_t* scratch_bytes) {
  try {
    jaxattn::xqa::Workspace const ws = jaxattn::xqa::workspace_layout(
        sm_count, batch, num_kv_heads, max_pages_per_seq, q_seq_len);
    *semaphore_count = static_cast<int64_t>(ws.semaphore_count);
    *scratch_bytes = static_cast<int64_t>(ws.scratch_bytes);
    return 0;
  } catch (std::invalid_argument const&) {
    return -2;
  } catch (std::exception const&) {
    return -1;
  }
}

// Number of host executions of the execute handler: under CUDA graphs, only (re)recordings.
JAXATTN_EXPORT int64_t jaxattn_xqa_host_executions() {
  return jaxattn::xqa::g_host_executions.load();
}

JAXATTN_EXPORT void jaxattn_xqa_variant_info(uint32_t* values) {
  jaxattn::xqa::VariantInfo const info = jaxattn::xqa::variant_info();
  uint32_t const fields[] = {info.head_dim,  info.group_size,     info.page_size,
                             info.input_fp16, info.cache_fp8,     info.sliding_window,
                             info.hopper_kernel, info.spec_dec};
  for (size_t i = 0; i < sizeof(fields) / sizeof(fields[0]); ++i) values[i] = fields[i];
}
