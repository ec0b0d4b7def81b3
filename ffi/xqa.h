// Interface between jaxattn's XQA FFI handler (xqa_ffi.cu) and one compiled XQA kernel variant
// (xqa_kernel.cu, which wraps TensorRT-LLM's XQA sources from the installed flashinfer-python).
// Each variant shared library links one handler object with one kernel object.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace jaxattn::xqa {

// Compile-time constants of the linked kernel variant.
struct VariantInfo {
  uint32_t head_dim;
  uint32_t group_size;  // query heads per KV head
  uint32_t page_size;   // tokens per page
  uint32_t input_fp16;  // q/out are float16 (1) or bfloat16 (0)
  uint32_t cache_fp8;   // KV pages are float8_e4m3fn (1) or the input dtype (0)
  uint32_t sliding_window;
  uint32_t hopper_kernel;  // mha_sm90.cu (TMA + GMMA) rather than mha.cu
  uint32_t spec_dec;       // SPEC_DEC=1 build of mha.cu: several query tokens per request
};

// What a launch needs beyond its operands when XQA splits each sequence over several CTAs
// (both zero otherwise). The uint32 semaphores must be zero when the kernel starts; the last
// CTA of each sequence returns its semaphore to zero (atom.inc wraps). Scratch is per launch.
struct Workspace {
  uint64_t semaphore_count;
  uint64_t scratch_bytes;
};

struct LaunchArgs {
  uint32_t sm_count;
  uint32_t num_kv_heads;
  uint32_t sliding_window;  // keys visible to the query, counting its own; ignored unless compiled in
  float const* q_scale;     // device scalar: scale * sqrt(head_dim) [* k_scale / v_scale for fp8]
  float const* kv_scale;    // device scalar: v_scale (fp8 pages only)
  void* out;                // [batch, Hq, D] input dtype ([T, Hq, D] for spec_dec)
  void const* q;            // [batch, Hq, D] input dtype ([T, Hq, D] for spec_dec)
  float const* sinks;       // [Hq] float32 or nullptr
  void const* k_pages;
  void const* v_pages;
  int32_t const* page_table;  // [batch, max_pages_per_seq]
  uint32_t max_pages_per_seq;
  uint32_t const* seq_lens;  // [batch]
  uint32_t batch;
  uint32_t* semaphores;  // semaphore_count zeros, or nullptr when the launch does not split
  void* scratch;
  uint64_t stride_page;  // in elements
  uint64_t stride_token;
  uint64_t stride_head;
  bool enable_pdl;  // programmatic dependent launch: overlap the kernel's prologue with its predecessor
  // Speculative decode (spec_dec variants only; ignored otherwise). Request i's query tokens are
  // rows q_cu_seq_lens[i] .. q_cu_seq_lens[i+1] of q/out (at most q_seq_len of them); mask row t
  // (ceil(q_seq_len / 32) words) holds token t's bits over its request's last q_len keys.
  uint32_t q_seq_len;
  uint32_t const* q_cu_seq_lens;  // [batch + 1]
  uint32_t const* mask;           // [T, ceil(q_seq_len / 32)]
  cudaStream_t stream;
};

VariantInfo variant_info();

// Workspace the kernel needs for this launch shape, mirroring the launch function's split
// count and the kernel's scratch segmentation (q_seq_len: the bound on query tokens per
// request, 1 unless spec_dec). Throws std::overflow_error past 32-bit offsets,
// std::invalid_argument for a q_seq_len the variant cannot take.
Workspace workspace_layout(uint32_t sm_count, uint32_t batch, uint32_t num_kv_heads,
                           uint32_t max_pages_per_seq, uint32_t q_seq_len);

// Sets the kernel's dynamic shared memory limit on the current device (the library's own
// load-time setup covers only the device current at dlopen). Throws std::runtime_error.
void init_current_device();

// Enqueues the kernel on args.stream. Throws std::runtime_error on a CUDA error.
void launch(LaunchArgs const& args);

}  // namespace jaxattn::xqa
