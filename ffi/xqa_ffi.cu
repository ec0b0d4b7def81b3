// XLA FFI handler for TensorRT-LLM's XQA paged decode kernel (one compiled variant per library).
//
// Operands:  q [T, Hq, D], k_pages, v_pages (HND or NHD, described by element strides),
//            page_table int32 [T, P], seq_lens int32 [T] (0 = no keys), scales f32 [2]
//            (q_scale, kv_scale), sinks f32 [Hq] or [0].
// Results:   out [T, Hq, D], workspace u8 [N] (semaphores + scratch, sized at trace time by
//            jaxattn_xqa_workspace_bytes; its semaphores are zeroed in-stream when used).
// Execute only enqueues work on XLA's stream (memset + kernel), so it is command-buffer safe:
// under CUDA graphs it runs when XLA records the graph, with static shapes and attributes.
#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <exception>
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

ffi::Error Initialize(int32_t device) {
  if (device < 0 || device >= kMaxDevices) {
    return ffi::Error::InvalidArgument("jaxattn trtllm: device ordinal out of range");
  }
  std::lock_guard<std::mutex> lock(g_init_mutex);
  if (g_sm_count[device].load() != 0) return ffi::Error::Success();
  int previous = 0;
  if (cudaError_t err = cudaGetDevice(&previous); err != cudaSuccess) {
    return cuda_error("cudaGetDevice", err);
  }
  if (cudaError_t err = cudaSetDevice(device); err != cudaSuccess) {
    return cuda_error("cudaSetDevice", err);
  }
  int sm_count = 0;
  cudaError_t err = cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device);
  std::string failure;
  if (err != cudaSuccess) {
    failure = std::string("cudaDeviceGetAttribute: ") + cudaGetErrorString(err);
  } else {
    try {
      init_current_device();
    } catch (std::exception const& e) {
      failure = e.what();
    }
  }
  cudaSetDevice(previous);
  if (!failure.empty()) {
    return ffi::Error::Internal("jaxattn trtllm: XQA device init failed: " + failure);
  }
  g_sm_count[device].store(sm_count);
  return ffi::Error::Success();
}

ffi::DataType input_dtype(VariantInfo const& info) {
  return info.input_fp16 ? ffi::DataType::F16 : ffi::DataType::BF16;
}

ffi::Error check_operands(VariantInfo const& info, ffi::AnyBuffer const& q,
                          ffi::AnyBuffer const& k, ffi::AnyBuffer const& v,
                          ffi::AnyBuffer const& table, ffi::AnyBuffer const& seq_lens,
                          ffi::AnyBuffer const& scales, ffi::AnyBuffer const& sinks,
                          ffi::AnyBuffer const& out, int64_t num_kv_heads, int64_t stride_page) {
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
  int64_t const num_tokens = qd[0];
  auto const td = table.dimensions();
  if (table.element_type() != ffi::DataType::S32 || td.size() != 2 || td[0] != num_tokens ||
      seq_lens.element_type() != ffi::DataType::S32 || seq_lens.element_count() != num_tokens) {
    return bad("page_table must be int32 [T, P] and seq_lens int32 [T] with T=" +
               std::to_string(num_tokens));
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

ffi::Error Execute(cudaStream_t stream, int32_t device, ffi::AnyBuffer q, ffi::AnyBuffer k_pages,
                   ffi::AnyBuffer v_pages, ffi::AnyBuffer page_table, ffi::AnyBuffer seq_lens,
                   ffi::AnyBuffer scales, ffi::AnyBuffer sinks, ffi::Result<ffi::AnyBuffer> out,
                   ffi::Result<ffi::AnyBuffer> workspace, int64_t num_kv_heads,
                   int64_t stride_page, int64_t stride_token, int64_t stride_head,
                   int64_t sliding_window) {
  g_host_executions.fetch_add(1, std::memory_order_relaxed);
  try {
    VariantInfo const info = variant_info();
    if (ffi::Error err = check_operands(info, q, k_pages, v_pages, page_table, seq_lens, scales,
                                        sinks, *out, num_kv_heads, stride_page);
        err.failure()) {
      return err;
    }
    int const sm_count = device >= 0 && device < kMaxDevices ? g_sm_count[device].load() : 0;
    if (sm_count == 0) {
      return ffi::Error::Internal("jaxattn trtllm: execute before initialize on device " +
                                  std::to_string(device));
    }
    auto const batch = static_cast<uint32_t>(q.dimensions()[0]);
    auto const max_pages = static_cast<uint32_t>(page_table.dimensions()[1]);
    Workspace const ws =
        workspace_layout(sm_count, batch, static_cast<uint32_t>(num_kv_heads), max_pages);
    if (workspace->size_bytes() < ws.total_bytes) {
      return ffi::Error::InvalidArgument(
          "jaxattn trtllm: workspace of " + std::to_string(workspace->size_bytes()) +
          " bytes is smaller than the " + std::to_string(ws.total_bytes) + " this launch needs (" +
          std::to_string(sm_count) + " SMs); it was sized for another device");
    }
    auto* const ws_base = static_cast<uint8_t*>(workspace->untyped_data());
    if (ws.semaphore_bytes != 0) {
      if (cudaError_t err = cudaMemsetAsync(ws_base, 0, ws.semaphore_bytes, stream);
          err != cudaSuccess) {
        return cuda_error("cudaMemsetAsync(semaphores)", err);
      }
    }
    LaunchArgs args{};
    args.sm_count = static_cast<uint32_t>(sm_count);
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
    args.semaphores = ws.semaphore_bytes ? reinterpret_cast<uint32_t*>(ws_base) : nullptr;
    args.scratch = ws.semaphore_bytes ? ws_base + ws.scratch_offset : nullptr;
    args.stride_page = static_cast<uint64_t>(stride_page);
    args.stride_token = static_cast<uint64_t>(stride_token);
    args.stride_head = static_cast<uint64_t>(stride_head);
    args.stream = stream;
    launch(args);
    return ffi::Error::Success();
  } catch (std::exception const& e) {
    return ffi::Error::Internal(std::string("jaxattn trtllm: XQA launch failed: ") + e.what());
  }
}

}  // namespace
}  // namespace jaxattn::xqa

#define JAXATTN_EXPORT extern "C" __attribute__((visibility("default")))

JAXATTN_EXPORT XLA_FFI_Error* JaxattnXqaInitialize(XLA_FFI_CallFrame*);
JAXATTN_EXPORT XLA_FFI_Error* JaxattnXqaExecute(XLA_FFI_CallFrame*);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxattnXqaInitialize, jaxattn::xqa::Initialize,
                              ffi::Ffi::BindInitialize().Ctx<ffi::DeviceOrdinal>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxattnXqaExecute, jaxattn::xqa::Execute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()  // q
                                  .Arg<ffi::AnyBuffer>()  // k_pages
                                  .Arg<ffi::AnyBuffer>()  // v_pages
                                  .Arg<ffi::AnyBuffer>()  // page_table
                                  .Arg<ffi::AnyBuffer>()  // seq_lens
                                  .Arg<ffi::AnyBuffer>()  // scales
                                  .Arg<ffi::AnyBuffer>()  // sinks
                                  .Ret<ffi::AnyBuffer>()  // out
                                  .Ret<ffi::AnyBuffer>()  // workspace
                                  .Attr<int64_t>("num_kv_heads")
                                  .Attr<int64_t>("stride_page")
                                  .Attr<int64_t>("stride_token")
                                  .Attr<int64_t>("stride_head")
                                  .Attr<int64_t>("sliding_window"),
                              {ffi::Traits::kCmdBufferCompatible});

// Trace-time queries (ctypes): the workspace bytes a launch of this shape needs (-1 when the
// kernel's 32-bit scratch offsets overflow), and the variant's compile-time constants.
JAXATTN_EXPORT int64_t jaxattn_xqa_workspace_bytes(int32_t sm_count, int32_t batch,
                                                   int32_t num_kv_heads,
                                                   int32_t max_pages_per_seq) {
  try {
    return static_cast<int64_t>(
        jaxattn::xqa::workspace_layout(sm_count, batch, num_kv_heads, max_pages_per_seq)
            .total_bytes);
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
                             info.hopper_kernel};
  for (size_t i = 0; i < sizeof(fields) / sizeof(fields[0]); ++i) values[i] = fields[i];
}
