// Zeroes the output rows that cuDNN's ragged paged prefill leaves unwritten.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "paged_prefill.h"

namespace jaxattn::cudnn {
namespace {

constexpr int kWarpsPerBlock = 8;
constexpr int kMaxBlocks = 1024;

// Row t (element offset t * row_elems) belongs to sequence b, the last with ragged_offsets[b] <=
// t * row_elems; cuDNN writes it iff b < batch and the row is within the sequence's clamped query
// length (0 for sequences without keys). Every other row is set to zero, 16 bytes per lane.
__global__ void ZeroUnownedRows(uint4* out, int64_t num_tokens, int64_t row_elems, int64_t row_vecs,
                                const int32_t* __restrict__ ragged_offsets, const int32_t* __restrict__ seq_len_q,
                                int64_t batch) {
  const int lane = threadIdx.x % 32;
  const int64_t warp = blockIdx.x * int64_t{kWarpsPerBlock} + threadIdx.x / 32;
  for (int64_t row = warp; row < num_tokens; row += int64_t{gridDim.x} * kWarpsPerBlock) {
    const int64_t elem = row * row_elems;
    int64_t lo = 0, hi = batch + 1;  // invariant: ragged_offsets[lo] <= elem or lo == 0
    while (hi - lo > 1) {
      const int64_t mid = (lo + hi) / 2;
      if (ragged_offsets[mid] <= elem) lo = mid; else hi = mid;
    }
    const bool owned = lo < batch && elem >= ragged_offsets[lo] &&
                       elem < ragged_offsets[lo] + int64_t{seq_len_q[lo]} * row_elems;
    if (owned) continue;
    uint4* dst = out + row * row_vecs;
    for (int64_t i = lane; i < row_vecs; i += 32) dst[i] = make_uint4(0, 0, 0, 0);
  }
}

}  // namespace

cudaError_t LaunchZeroUnownedRows(void* out, int64_t num_tokens, int64_t row_elems, const int32_t* ragged_offsets,
                                  const int32_t* seq_len_q, int64_t batch, cudaStream_t stream) {
  const int64_t row_vecs = row_elems * 2 / sizeof(uint4);  // 2-byte elements, row_elems % 8 == 0
  const int64_t blocks = std::min<int64_t>((num_tokens + kWarpsPerBlock - 1) / kWarpsPerBlock, kMaxBlocks);
  ZeroUnownedRows<<<static_cast<unsigned>(blocks), kWarpsPerBlock * 32, 0, stream>>>(
      static_cast<uint4*>(out), num_tokens, row_elems, row_vecs, ragged_offsets, seq_len_q, batch);
  return cudaGetLastError();
}

}  // namespace jaxattn::cudnn
