// One XQA kernel variant: a unity build of TensorRT-LLM's XQA decode kernel as shipped in the
// installed flashinfer-python (data/csrc/xqa, on the include path), plus the entry points of
// xqa.h. The variant is fixed by the -D flags of jaxattn/backends/_xqa_build.py:
//   JAXATTN_XQA_HOPPER=1  mha_sm90.cu (TMA + GMMA, fp8 KV on SM90), else mha.cu (generic).
//   SPEC_DEC=1            (mha.cu only) several query tokens per request, with a bit mask over
//                         each request's last q_len keys; q_len is a launch argument.
#if JAXATTN_XQA_HOPPER
#if SPEC_DEC
#error "jaxattn builds speculative decode from mha.cu only (JAXATTN_XQA_HOPPER=0)"
#endif
#include "mha_sm90.cu"
#else
#include "mha.cu"
#endif

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "xqa.h"

namespace jaxattn::xqa {
namespace {

uint64_t round_up_u64(uint64_t a, uint64_t b) { return (a + b - 1) / b * b; }

// The running end offset of XQA's Segmenter (utils.h): each segment starts aligned.
struct ByteSegmenter {
  uint64_t end = 0;
  void add(uint64_t item_bytes, uint64_t count, uint64_t alignment) {
    end = round_up_u64(end, alignment) + item_bytes * count;
  }
};

}  // namespace

VariantInfo variant_info() {
  return VariantInfo{validElemsPerHead,
                     headGrpSize,
                     tokensPerPage,
                     INPUT_FP16,
                     CACHE_ELEM_ENUM == 2,
                     SLIDING_WINDOW,
                     JAXATTN_XQA_HOPPER,
                     SPEC_DEC};
}

Workspace workspace_layout(uint32_t sm_count, uint32_t batch, uint32_t num_kv_heads,
                           uint32_t max_pages_per_seq, uint32_t q_seq_len) {
  uint32_t const max_seq_len = max_pages_per_seq * tokensPerPage;
#if SPEC_DEC
  if (q_seq_len == 0) throw std::invalid_argument("q_seq_len must be >= 1");
  // The grid's y dimension holds (KV head, block of rowsPerBlock (query token, head) rows); the
  // split count below still divides the SMs by batch * KV heads only, as the launch does.
  uint32_t const heads = batch * num_kv_heads * divUp(q_seq_len * headGrpSize, rowsPerBlock);
#else
  if (q_seq_len != 1) throw std::invalid_argument("q_seq_len must be 1 without SPEC_DEC");
  uint32_t const heads = batch * num_kv_heads;
#endif
  ByteSegmenter scratch;
#if JAXATTN_XQA_HOPPER
  // Split count of launchHopperF8MHAFlashInfer; scratch of ScratchMem (mha_sm90.cu).
  uint32_t const nb_sub_seq = std::min<uint32_t>(
      std::max<uint32_t>(1U, static_cast<uint32_t>(std::round(sm_count * 3 / heads * 0.25f))),
      divUp(max_seq_len, gemm0CtaTileNbTokens));
  uint64_t const chunks = uint64_t{nb_sub_seq} * heads;
  constexpr uint64_t alignment = sizeof(Vec<IOHead, ctaNbValidQHeads>);
  scratch.add(sizeof(ScratchMem::ColWiseVec), chunks, alignment);
  scratch.add(sizeof(Vec<IOHead, ctaNbValidQHeads>), chunks, alignment);
#else
  // Split count of launchMHAFlashInfer; scratch of the multi-block epilogue (mha.cu).
  uint32_t const nb_sub_seq =
      allowMultiBlockMode ? std::min<uint32_t>(std::max<uint32_t>(1U, sm_count / (batch * num_kv_heads)),
                                               divUp(max_seq_len, ctaTile.x))
                          : 1U;
  uint64_t const chunks = uint64_t{nb_sub_seq} * heads;
  using ScratchBufs = Vec<Array2D<LdGrain, nbValidRows, SharedMem::XSmemBuffer::cols>,
                          gemm1WarpsPerGrp * nbHeadSplits>;
  scratch.add(sizeof(SMemWarpRowMax), chunks, sizeof(SMemWarpRowMax));  // row max
  scratch.add(sizeof(SMemWarpRowMax), chunks, sizeof(SMemWarpRowMax));  // row sum
  scratch.add(sizeof(ScratchBufs), chunks, sizeof(ScratchBufs));
#endif
  if (nb_sub_seq == 1) {
    return Workspace{0, 0};  // single-block mode: neither semaphores nor scratch are touched
  }
  if (scratch.end > UINT32_MAX) {
    throw std::overflow_error("XQA scratch of " + std::to_string(scratch.end) +
                              " bytes exceeds the kernel's 32-bit offsets");
  }
  return Workspace{heads, scratch.end};  // one semaphore per (request, KV head[, row block])
}

void init_current_device() {
  // The kernel's shared memory size is a device-side constant (its layout depends on
  // __CUDA_ARCH__). The source queries it once at dlopen into hostSmemSize, which every launch
  // uses; check that query against this device before raising the kernel's limit here.
  uint32_t device_smem = 0;
  checkCuda(cudaMemcpyFromSymbol(&device_smem, smemSize, sizeof(smemSize)));
  if (device_smem != hostSmemSize) {
    throw std::runtime_error("XQA's load-time shared-memory query gave " + std::to_string(hostSmemSize) +
                             " bytes, the device reports " + std::to_string(device_smem));
  }
  checkCuda(cudaFuncSetAttribute(kernel_mha, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 static_cast<int>(device_smem)));
}

void launch(LaunchArgs const& a) {
  uint32_t const max_seq_len = a.max_pages_per_seq * tokensPerPage;
  auto* const out = static_cast<OutputHead*>(a.out);
  auto const* const q = static_cast<InputHead const*>(a.q);
  auto* const k = const_cast<GMemCacheHead*>(static_cast<GMemCacheHead const*>(a.k_pages));
  auto* const v = const_cast<GMemCacheHead*>(static_cast<GMemCacheHead const*>(a.v_pages));
  // qScale/kvCacheScale are read from the device scalars; the host values are unused.
#if JAXATTN_XQA_HOPPER
  launchHopperF8MHAFlashInfer(a.sm_count, a.num_kv_heads, a.sliding_window, 1.f, a.q_scale, out,
                              q, a.sinks, k, v, a.page_table, max_seq_len, a.seq_lens, a.batch,
                              1.f, a.kv_scale, a.semaphores, a.scratch, a.enable_pdl, a.stride_page,
                              a.stride_token, a.stride_head, a.stream);
#else
  launchMHAFlashInfer(a.sm_count, a.num_kv_heads, a.sliding_window, 1.f, a.q_scale, out, q,
                      a.sinks, k, v, a.page_table, max_seq_len, a.seq_lens, a.batch, 1.f,
                      a.kv_scale,
#if SPEC_DEC
                      a.q_seq_len, a.q_cu_seq_lens, a.mask,
#endif
                      a.semaphores, a.scratch, a.enable_pdl, a.stride_page,
                      a.stride_token, a.stride_head, a.stream);
#endif
}

}  // namespace jaxattn::xqa

#if JAXATTN_XQA_HOPPER
// tensorMap.cpp calls the driver API directly. Resolve it through the runtime instead of linking
// libcuda, which build machines without a driver lack.
namespace {
void* driver_entry_point(char const* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult status{};
  if (cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &status) !=
          cudaSuccess ||
      status != cudaDriverEntryPointSuccess) {
    return nullptr;
  }
  return fn;
}
}  // namespace

extern "C" CUresult CUDAAPI cuTensorMapEncodeTiled(
    CUtensorMap* tensor_map, CUtensorMapDataType data_type, cuuint32_t rank, void* address,
    cuuint64_t const* dims, cuuint64_t const* strides, cuuint32_t const* box,
    cuuint32_t const* element_strides, CUtensorMapInterleave interleave,
    CUtensorMapSwizzle swizzle, CUtensorMapL2promotion l2_promotion,
    CUtensorMapFloatOOBfill oob_fill) {
  using Fn = CUresult(CUDAAPI*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                cuuint64_t const*, cuuint64_t const*, cuuint32_t const*,
                                cuuint32_t const*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
  static Fn const fn = reinterpret_cast<Fn>(driver_entry_point("cuTensorMapEncodeTiled"));
  if (fn == nullptr) return CUDA_ERROR_NOT_FOUND;
  return fn(tensor_map, data_type, rank, address, dims, strides, box, element_strides, interleave,
            swizzle, l2_promotion, oob_fill);
}

extern "C" CUresult CUDAAPI cuGetErrorName(CUresult error, char const** name) {
  using Fn = CUresult(CUDAAPI*)(CUresult, char const**);
  static Fn const fn = reinterpret_cast<Fn>(driver_entry_point("cuGetErrorName"));
  if (fn == nullptr) return CUDA_ERROR_NOT_FOUND;
  return fn(error, name);
}
#endif
