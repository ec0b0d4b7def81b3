// XLA FFI handler for FlashInfer's SM90 MLA paged attention kernel
// (flashinfer::mla::BatchMLAPageAttentionHopper, from the installed flashinfer-python's headers,
// which are on the include path; nothing of it is copied here).
//
// The kernel is persistent and cooperative: CTA (x, y) of a grid (cluster, clusters) runs the
// works work_indptr[y] .. work_indptr[y + 1] (each a tile of one request's packed (token, head)
// rows against a range of its keys), writes finished rows to out and split ones to the partial
// buffers, then, after a grid-wide sync, merges split rows (merge entry x + cluster * y).
// FlashInfer plans the works on the host; jaxattn plans them on the device
// (jaxattn/backends/flashinfer.py, ``plan``) so that the launch is command-buffer safe.
//
// Operands:  q_nope [T, H, R], q_pe [T, H, Dr] (R, Dr: compile-time JAXATTN_MLA_HEAD_DIM_*),
//            pages [num_pages, page, R + Dr] (c_kv then k_rope, read in place by strides; bf16/fp16
//              like q, or fp8 e4m3 read with unit scales: the caller folds the pool's scale into
//              q and the output),
//            kv_indices int32 [B * P] (the block tables, row-major),
//            works int32 [8, W]: q_indptr, kv_indptr (in pages), partial_indptr (-1: final),
//              q_len, kv_len, packed q_start, kv_start, kv_end of each work,
//            work_indptr int32 [clusters + 1],
//            merge int32 [5, M] (M >= cluster * clusters): packed row start, end, partial row
//              start, end, stride of each merge entry.
// Results:   out [T, H, R]; partial_o [rows, R] and partial_lse f32 [rows] (scratch, sized
//            by the plan).
// Attributes: sm_scale, causal (bottom-right), cluster (grid x: 1 or 2), clusters (grid y).
#include <flashinfer/attention/mla_hopper.cuh>

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxattn::mla {
namespace {

using DType = JAXATTN_MLA_DTYPE;       // q, out, partial_o
using DTypeKV = JAXATTN_MLA_KV_DTYPE;  // pages: DType, or __nv_fp8_e4m3 (dequantized in the kernel)
constexpr uint32_t kRank = JAXATTN_MLA_HEAD_DIM_CKV;
constexpr uint32_t kRope = JAXATTN_MLA_HEAD_DIM_KPE;
constexpr int kWorkFields = 8;
constexpr int kMergeFields = 5;
using Params = flashinfer::MLAParams<DType, DTypeKV, DType, int32_t>;

constexpr ffi::DataType kDataType =
    std::is_same_v<DType, __nv_bfloat16> ? ffi::DataType::BF16 : ffi::DataType::F16;
constexpr ffi::DataType kPageType =
    std::is_same_v<DTypeKV, __nv_fp8_e4m3> ? ffi::DataType::F8E4M3FN : kDataType;

ffi::Error invalid(std::string const& what) {
  return ffi::Error::InvalidArgument("jaxattn flashinfer mla: " + what);
}

template <typename BufferT>
bool dims_are(BufferT const& b, std::initializer_list<int64_t> dims) {
  auto const d = b.dimensions();
  return std::equal(d.begin(), d.end(), dims.begin(), dims.end());
}

ffi::Error Execute(cudaStream_t stream, ffi::AnyBuffer q_nope, ffi::AnyBuffer q_pe,
                   ffi::AnyBuffer pages, ffi::Buffer<ffi::S32> kv_indices,
                   ffi::Buffer<ffi::S32> works, ffi::Buffer<ffi::S32> work_indptr,
                   ffi::Buffer<ffi::S32> merge, ffi::Result<ffi::AnyBuffer> out,
                   ffi::Result<ffi::AnyBuffer> partial_o, ffi::Result<ffi::Buffer<ffi::F32>> partial_lse,
                   float sm_scale, bool causal, int64_t cluster, int64_t clusters) {
  for (ffi::AnyBuffer const* b : {&q_nope, &q_pe, &*out, &*partial_o}) {
    if (b->element_type() != kDataType) {
      return invalid("q_nope, q_pe, out and partial_o must have the compiled dtype");
    }
  }
  if (pages.element_type() != kPageType) return invalid("pages must have the compiled page dtype");
  auto const qd = q_nope.dimensions();
  auto const pd = pages.dimensions();
  if (qd.size() != 3 || qd[2] != kRank || !dims_are(q_pe, {qd[0], qd[1], kRope}) ||
      !dims_are(*out, {qd[0], qd[1], kRank})) {
    return invalid("q_nope/out must be [T, H, " + std::to_string(kRank) + "] and q_pe [T, H, " +
                   std::to_string(kRope) + "]");
  }
  if (pd.size() != 3 || pd[2] != kRank + kRope) {
    return invalid("pages must be [num_pages, page, " + std::to_string(kRank + kRope) + "]");
  }
  auto const wd = works.dimensions();
  auto const md = merge.dimensions();
  if (wd.size() != 2 || wd[0] != kWorkFields || md.size() != 2 || md[0] != kMergeFields ||
      !dims_are(work_indptr, {clusters + 1}) || (cluster != 1 && cluster != 2) ||
      cluster * clusters > md[1]) {
    return invalid("plan operands do not match the grid (" + std::to_string(cluster) + ", " +
                   std::to_string(clusters) + ")");
  }
  auto const od = partial_o->dimensions();
  if (od.size() != 2 || od[1] != kRank || !dims_are(*partial_lse, {od[0]})) {
    return invalid("partial_o must be [rows, R] and partial_lse [rows]");
  }

  Params params;
  auto* base = static_cast<DTypeKV*>(pages.untyped_data());
  params.q_nope = static_cast<DType*>(q_nope.untyped_data());
  params.q_pe = static_cast<DType*>(q_pe.untyped_data());
  params.ckv = base;
  params.kpe = base + kRank;
  params.kv_indices = kv_indices.typed_data();
  int32_t* field = works.typed_data();
  int64_t const num_works = wd[1];
  params.q_indptr = field;
  params.kv_indptr = field + num_works;
  params.partial_indptr = field + 2 * num_works;
  params.q_len = field + 3 * num_works;
  params.kv_len = field + 4 * num_works;
  params.q_start = field + 5 * num_works;
  params.kv_start = field + 6 * num_works;
  params.kv_end = field + 7 * num_works;
  params.work_indptr = work_indptr.typed_data();
  int32_t* entry = merge.typed_data();
  int64_t const num_entries = md[1];
  params.merge_packed_offset_start = entry;
  params.merge_packed_offset_end = entry + num_entries;
  params.merge_partial_packed_offset_start = entry + 2 * num_entries;
  params.merge_partial_packed_offset_end = entry + 3 * num_entries;
  params.merge_partial_stride = entry + 4 * num_entries;
  params.final_o = static_cast<DType*>(out->untyped_data());
  params.final_lse = nullptr;
  params.partial_o = static_cast<DType*>(partial_o->untyped_data());
  params.partial_lse = partial_lse->typed_data();
  params.num_heads = flashinfer::uint_fastdiv(static_cast<uint32_t>(qd[1]));
  params.block_size = flashinfer::uint_fastdiv(static_cast<uint32_t>(pd[1]));
  params.q_nope_stride_n = qd[1] * kRank;
  params.q_nope_stride_h = kRank;
  params.q_pe_stride_n = qd[1] * kRope;
  params.q_pe_stride_h = kRope;
  params.ckv_stride_page = params.kpe_stride_page = pd[1] * pd[2];
  params.ckv_stride_n = params.kpe_stride_n = pd[2];
  params.o_stride_n = qd[1] * kRank;
  params.o_stride_h = kRank;
  params.sm_scale = sm_scale;
  params.return_lse_base_on_e = false;

  using flashinfer::MaskMode;
  cudaError_t status =
      causal ? flashinfer::mla::BatchMLAPageAttentionHopper<MaskMode::kCausal, kRank, kRope>(
                   params, cluster, clusters, stream)
             : flashinfer::mla::BatchMLAPageAttentionHopper<MaskMode::kNone, kRank, kRope>(
                   params, cluster, clusters, stream);
  if (status != cudaSuccess) {
    return ffi::Error::Internal(std::string("jaxattn flashinfer mla: launch failed: ") +
                                cudaGetErrorString(status));
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxattn::mla

extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* JaxattnMlaExecute(XLA_FFI_CallFrame*);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxattnMlaExecute, jaxattn::mla::Execute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()            // q_nope
                                  .Arg<ffi::AnyBuffer>()            // q_pe
                                  .Arg<ffi::AnyBuffer>()            // pages
                                  .Arg<ffi::Buffer<ffi::S32>>()     // kv_indices
                                  .Arg<ffi::Buffer<ffi::S32>>()     // works
                                  .Arg<ffi::Buffer<ffi::S32>>()     // work_indptr
                                  .Arg<ffi::Buffer<ffi::S32>>()     // merge
                                  .Ret<ffi::AnyBuffer>()            // out
                                  .Ret<ffi::AnyBuffer>()            // partial_o
                                  .Ret<ffi::Buffer<ffi::F32>>()     // partial_lse
                                  .Attr<float>("sm_scale")
                                  .Attr<bool>("causal")
                                  .Attr<int64_t>("cluster")
                                  .Attr<int64_t>("clusters"),
                              {ffi::Traits::kCmdBufferCompatible});
