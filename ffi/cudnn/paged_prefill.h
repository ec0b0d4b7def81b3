// cuDNN paged prefill: the static configuration of one call site, the cuDNN graph built for it
// (once per configuration and device), and the launch. Nothing here knows about XLA.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <string>

namespace jaxattn::cudnn {

enum class DType : int64_t { kBFloat16 = 0, kFloat16 = 1 };
enum class Layout : int64_t { kHND = 0, kNHD = 1 };

// Everything that shapes the graph. Strides follow from the shapes and the layout:
//   q, out:        [num_tokens, num_q_heads, head_dim] packed, ragged by sequence
//   k/v pages:     HND [num_pages, num_kv_heads, page_size, head_dim]
//                  NHD [num_pages, page_size, num_kv_heads, head_dim]
//   block_tables:  int32 [batch, pages_per_seq]
//   lse:           float32 [batch, num_q_heads, max_q_len] (when return_lse)
struct Config {
  DType dtype = DType::kBFloat16;
  int64_t batch = 0;
  int64_t num_tokens = 0;
  int64_t num_q_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t num_pages = 0;
  int64_t page_size = 0;
  int64_t pages_per_seq = 0;
  Layout layout = Layout::kHND;
  int64_t max_q_len = 0;  // static bound on any sequence's query length
  float scale = 0.f;
  bool causal = true;            // bottom-right aligned
  int64_t sliding_window = 0;    // W > 0: keys i-W+1 .. i; 0: no window
  bool has_sinks = false;        // float32 [num_q_heads] sink logits
  bool return_lse = false;

  // Empty when the configuration is well formed, else what is wrong with it.
  std::string Check() const;
  // A unique text key of the configuration (graph cache key, with the device).
  std::string Key() const;
};

// Reads the configuration through `get(name)` (int64) and `get_float(name)`, `get_bool(name)`:
// shared by the FFI attribute dictionary and the Python workspace query.
template <typename GetInt, typename GetFloat, typename GetBool>
Config MakeConfig(GetInt get, GetFloat get_float, GetBool get_bool) {
  Config c;
  c.dtype = static_cast<DType>(get("dtype"));
  c.batch = get("batch");
  c.num_tokens = get("num_tokens");
  c.num_q_heads = get("num_q_heads");
  c.num_kv_heads = get("num_kv_heads");
  c.head_dim = get("head_dim");
  c.num_pages = get("num_pages");
  c.page_size = get("page_size");
  c.pages_per_seq = get("pages_per_seq");
  c.layout = static_cast<Layout>(get("layout"));
  c.max_q_len = get("max_q_len");
  c.scale = get_float("scale");
  c.causal = get_bool("causal");
  c.sliding_window = get("sliding_window");
  c.has_sinks = get_bool("has_sinks");
  c.return_lse = get_bool("return_lse");
  return c;
}

// Device pointers of one call. `sinks` and `lse` are null unless the config asks for them.
struct Buffers {
  const void* q = nullptr;
  const void* k_pages = nullptr;
  const void* v_pages = nullptr;
  const int32_t* seq_len_q = nullptr;       // [batch], clamped to max_q_len, 0 where seq_len_kv is 0
  const int32_t* seq_len_kv = nullptr;      // [batch], already clamped to pages_per_seq * page_size
  const int32_t* ragged_offsets = nullptr;  // [batch + 1], token offsets * num_q_heads * head_dim
  const int32_t* block_tables = nullptr;    // [batch, pages_per_seq]
  const float* sinks = nullptr;             // [num_q_heads]
  void* out = nullptr;
  float* lse = nullptr;
  void* workspace = nullptr;
};

class Plan;

// The plan for `config` on CUDA device `device` (-1: the calling thread's current device), built
// on first use and cached for the process. Thread-safe. Throws std::runtime_error with cuDNN's
// reason when the configuration cannot be built.
std::shared_ptr<const Plan> GetPlan(const Config& config, int device);

// Bytes of workspace the plan needs (the size of the workspace buffer passed to Run).
int64_t WorkspaceSize(const Plan& plan);

// Enqueues the attention on `stream`: cuDNN writes the rows sequences own (seq_len_q[b] rows from
// ragged_offsets[b]), and the other output rows (padding tokens, rows past a sequence's clamped
// query length, sequences with no keys) are zeroed concurrently on a side stream that rejoins
// `stream`. No allocation, no synchronization, no host reads of device data: safe under CUDA graph
// capture. Throws std::runtime_error on a launch error.
void Run(const Plan& plan, const Buffers& buffers, cudaStream_t stream);

// Zeroes each row t of out [num_tokens, row_elems] (2-byte elements) that no sequence owns:
// launched by Run; defined in zero_rows.cu.
cudaError_t LaunchZeroUnownedRows(void* out, int64_t num_tokens, int64_t row_elems,
                                  const int32_t* ragged_offsets, const int32_t* seq_len_q, int64_t batch,
                                  cudaStream_t stream);

// Versions: of the loaded cuDNN library, of the cuDNN headers and of cudnn-frontend built against.
int64_t BackendVersion();
int64_t CompiledVersion();
int64_t FrontendVersion();

}  // namespace jaxattn::cudnn
