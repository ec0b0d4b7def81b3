// cuDNN paged prefill graph (cudnn-frontend graph API): build once per (configuration, device),
// execute by binding pointers only.
#include "paged_prefill.h"

#include <cudnn_frontend.h>

#include <cinttypes>
#include <cstdio>
#include <map>
#include <mutex>
#include <stdexcept>
#include <unordered_map>
#include <utility>

namespace jaxattn::cudnn {
namespace {

namespace fe = cudnn_frontend;


// Tensor uids of the variant pack.
enum Uid : int64_t {
  kQ = 1,
  kK,
  kV,
  kO,
  kStats,
  kSeqLenQ,
  kSeqLenKV,
  kRaggedQ,
  kRaggedO,
  kTableK,
  kTableV,
  kSinks,
};

[[noreturn]] void Fail(const std::string& what) { throw std::runtime_error(what); }

void Check(const fe::error_t& status, const char* stage) {
  if (!status.is_good()) {
    Fail(std::string("cuDNN ") + stage + " failed: " + const_cast<fe::error_t&>(status).get_message());
  }
}

void CheckCuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess) Fail(std::string(what) + ": " + cudaGetErrorString(status));
}

// Makes `device` current on this thread for the guard's lifetime.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    CheckCuda(cudaGetDevice(&previous_), "cudaGetDevice");
    if (device >= 0 && device != previous_) CheckCuda(cudaSetDevice(device), "cudaSetDevice");
    device_ = device >= 0 ? device : previous_;
  }
  ~DeviceGuard() {
    if (device_ != previous_) cudaSetDevice(previous_);
  }
  int device() const { return device_; }

 private:
  int previous_ = 0;
  int device_ = 0;
};

// Per device: one cuDNN handle, whose stream is set under `mu` right before each execute, and
// the side stream and fork/join events of the zeroing pass (see Run), also used under `mu`.
struct DeviceHandle {
  cudnnHandle_t handle = nullptr;
  cudaStream_t side = nullptr;
  cudaEvent_t fork = nullptr;
  cudaEvent_t join = nullptr;
  std::mutex mu;
};

DeviceHandle& HandleFor(int device) {
  // Leaked on purpose: handles must outlive every cached plan, also at process exit.
  static auto* mu = new std::mutex;
  static auto* handles = new std::map<int, std::unique_ptr<DeviceHandle>>;
  std::lock_guard<std::mutex> lock(*mu);
  auto& slot = (*handles)[device];
  if (!slot) {
    auto h = std::make_unique<DeviceHandle>();
    if (fe::detail::create_handle(&h->handle) != CUDNN_STATUS_SUCCESS) {
      Fail("cudnnCreate failed on device " + std::to_string(device));
    }
    CheckCuda(cudaStreamCreateWithFlags(&h->side, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    CheckCuda(cudaEventCreateWithFlags(&h->fork, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    CheckCuda(cudaEventCreateWithFlags(&h->join, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    slot = std::move(h);
  }
  return *slot;
}

fe::graph::Tensor_attributes Int32Tensor(const char* name, int64_t uid, std::vector<int64_t> dim,
                                         std::vector<int64_t> stride) {
  return fe::graph::Tensor_attributes()
      .set_name(name)
      .set_uid(uid)
      .set_dim(std::move(dim))
      .set_stride(std::move(stride))
      .set_data_type(fe::DataType_t::INT32);
}

std::shared_ptr<fe::graph::Graph> BuildGraph(const Config& c, cudnnHandle_t handle, int64_t* workspace) {
  const int64_t b = c.batch, hq = c.num_q_heads, hk = c.num_kv_heads, d = c.head_dim;
  const int64_t s = c.max_q_len, ps = c.page_size, p = c.pages_per_seq;
  const auto io = c.dtype == DType::kBFloat16 ? fe::DataType_t::BFLOAT16 : fe::DataType_t::HALF;

  auto graph = std::make_shared<fe::graph::Graph>();
  graph->set_io_data_type(io)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);

  // Packed ragged Q/O: logical [B, Hq, S, D], one token = Hq * D elements; each sequence starts
  // at its ragged offset (elements), so the batch stride is never used.
  const std::vector<int64_t> qo_dim = {b, hq, s, d};
  const std::vector<int64_t> qo_stride = {s * hq * d, d, hq * d, 1};
  const std::vector<int64_t> offsets_dim = {b + 1, 1, 1, 1}, scalar_stride = {1, 1, 1, 1};
  auto ragged_q = graph->tensor(Int32Tensor("ragged_q", kRaggedQ, offsets_dim, scalar_stride));
  auto ragged_o = graph->tensor(Int32Tensor("ragged_o", kRaggedO, offsets_dim, scalar_stride));
  auto q = graph->tensor(fe::graph::Tensor_attributes()
                             .set_name("q")
                             .set_uid(kQ)
                             .set_dim(qo_dim)
                             .set_stride(qo_stride)
                             .set_ragged_offset(ragged_q));

  // The page pools as they are, layout expressed by strides: logical [pages, Hkv, page, D].
  const std::vector<int64_t> kv_dim = {c.num_pages, hk, ps, d};
  const std::vector<int64_t> kv_stride = c.layout == Layout::kHND
                                             ? std::vector<int64_t>{hk * ps * d, ps * d, d, 1}
                                             : std::vector<int64_t>{ps * hk * d, d, hk * d, 1};
  auto k = graph->tensor(
      fe::graph::Tensor_attributes().set_name("k_pages").set_uid(kK).set_dim(kv_dim).set_stride(kv_stride));
  auto v = graph->tensor(
      fe::graph::Tensor_attributes().set_name("v_pages").set_uid(kV).set_dim(kv_dim).set_stride(kv_stride));

  const std::vector<int64_t> len_dim = {b, 1, 1, 1};
  auto seq_len_q = graph->tensor(Int32Tensor("seq_len_q", kSeqLenQ, len_dim, scalar_stride));
  auto seq_len_kv = graph->tensor(Int32Tensor("seq_len_kv", kSeqLenKV, len_dim, scalar_stride));
  const std::vector<int64_t> table_dim = {b, 1, p, 1}, table_stride = {p, p, 1, 1};
  auto table_k = graph->tensor(Int32Tensor("block_tables_k", kTableK, table_dim, table_stride));
  auto table_v = graph->tensor(Int32Tensor("block_tables_v", kTableV, table_dim, table_stride));

  auto attrs = fe::graph::SDPA_attributes()
                   .set_name("paged_prefill")
                   .set_generate_stats(c.return_lse)
                   .set_attn_scale(c.scale)
                   .set_padding_mask(true)
                   .set_seq_len_q(seq_len_q)
                   .set_seq_len_kv(seq_len_kv)
                   .set_paged_attention_k_table(table_k)
                   .set_paged_attention_v_table(table_v)
                   .set_paged_attention_max_seq_len_kv(static_cast<int>(p * ps));
  if (c.causal || c.sliding_window > 0) {
    // Query row r of a sequence sits at position seq_len_kv - seq_len_q + r (per sequence).
    attrs.set_diagonal_alignment(fe::DiagonalAlignment_t::BOTTOM_RIGHT).set_diagonal_band_right_bound(0);
  }
  if (c.sliding_window > 0) {
    attrs.set_diagonal_band_left_bound(static_cast<int>(c.sliding_window));
  }
  if (c.has_sinks) {
    attrs.set_sink_token(graph->tensor(fe::graph::Tensor_attributes()
                                           .set_name("sinks")
                                           .set_uid(kSinks)
                                           .set_dim({1, hq, 1, 1})
                                           .set_stride({hq, 1, 1, 1})
                                           .set_data_type(fe::DataType_t::FLOAT)));
  }

  auto [o, stats] = graph->sdpa(q, k, v, std::move(attrs));
  o->set_output(true).set_uid(kO).set_dim(qo_dim).set_stride(qo_stride).set_ragged_offset(ragged_o);
  if (c.return_lse) {
    stats->set_output(true)
        .set_uid(kStats)
        .set_data_type(fe::DataType_t::FLOAT)
        .set_dim({b, hq, s, 1})
        .set_stride({hq * s, s, 1, 1});
  }

  Check(graph->validate(), "graph validation");
  Check(graph->build_operation_graph(handle), "build_operation_graph");
  Check(graph->create_execution_plans({fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK}), "create_execution_plans");
  Check(graph->check_support(handle), "check_support");
  Check(graph->build_plans(handle, fe::BuildPlanPolicy_t::HEURISTICS_CHOICE), "build_plans");
  Check(graph->get_workspace_size(*workspace), "get_workspace_size");
  return graph;
}

}  // namespace

class Plan {
 public:
  Config config;
  int device = 0;
  std::shared_ptr<fe::graph::Graph> graph;
  int64_t workspace_size = 0;
  DeviceHandle* handle = nullptr;
};

std::string Config::Check() const {
  auto positive = [](int64_t x) { return x > 0; };
  if (dtype != DType::kBFloat16 && dtype != DType::kFloat16) return "dtype must be 0 (bfloat16) or 1 (float16)";
  if (layout != Layout::kHND && layout != Layout::kNHD) return "layout must be 0 (HND) or 1 (NHD)";
  if (!positive(batch) || !positive(num_tokens) || !positive(num_q_heads) || !positive(num_kv_heads) ||
      !positive(head_dim) || !positive(num_pages) || !positive(page_size) || !positive(pages_per_seq) ||
      !positive(max_q_len)) {
    return "all sizes must be positive";
  }
  if (num_q_heads % num_kv_heads) return "num_q_heads must be a multiple of num_kv_heads";
  if (head_dim % 8) return "head_dim must be a multiple of 8";
  if (page_size & (page_size - 1)) return "page_size must be a power of 2";
  if (max_q_len > num_tokens) return "max_q_len must be <= num_tokens";
  if (num_tokens * num_q_heads * head_dim >= (int64_t{1} << 31)) {
    return "num_tokens * num_q_heads * head_dim must be < 2**31 (int32 ragged offsets)";
  }
  if (pages_per_seq * page_size >= (int64_t{1} << 31)) return "pages_per_seq * page_size must be < 2**31";
  if (sliding_window < 0) return "sliding_window must be >= 0";
  if (!(scale > 0.f)) return "scale must be positive";
  return "";
}

std::string Config::Key() const {
  char buf[512];
  std::snprintf(buf, sizeof(buf),
                "dt%" PRId64 " b%" PRId64 " t%" PRId64 " hq%" PRId64 " hk%" PRId64 " d%" PRId64 " n%" PRId64
                " ps%" PRId64 " p%" PRId64 " l%" PRId64 " s%" PRId64 " sc%a c%d w%" PRId64 " sink%d lse%d",
                static_cast<int64_t>(dtype), batch, num_tokens, num_q_heads, num_kv_heads, head_dim, num_pages,
                page_size, pages_per_seq, static_cast<int64_t>(layout), max_q_len, static_cast<double>(scale),
                causal, sliding_window, has_sinks, return_lse);
  return buf;
}

std::shared_ptr<const Plan> GetPlan(const Config& config, int device) {
  if (std::string problem = config.Check(); !problem.empty()) Fail("invalid configuration: " + problem);
  DeviceGuard guard(device);
  const std::string key = std::to_string(guard.device()) + "|" + config.Key();

  // Builds are rare (once per configuration and device); one lock keeps them simple.
  static auto* mu = new std::mutex;
  static auto* plans = new std::unordered_map<std::string, std::shared_ptr<const Plan>>;
  std::lock_guard<std::mutex> lock(*mu);
  if (auto it = plans->find(key); it != plans->end()) return it->second;

  auto plan = std::make_shared<Plan>();
  plan->config = config;
  plan->device = guard.device();
  plan->handle = &HandleFor(plan->device);
  plan->graph = BuildGraph(config, plan->handle->handle, &plan->workspace_size);
  plans->emplace(key, plan);
  return plan;
}

int64_t WorkspaceSize(const Plan& plan) { return plan.workspace_size; }

void Run(const Plan& plan, const Buffers& x, cudaStream_t stream) {
  const Config& c = plan.config;
  std::unordered_map<int64_t, void*> pack = {
      {kQ, const_cast<void*>(x.q)},
      {kK, const_cast<void*>(x.k_pages)},
      {kV, const_cast<void*>(x.v_pages)},
      {kO, x.out},
      {kSeqLenQ, const_cast<int32_t*>(x.seq_len_q)},
      {kSeqLenKV, const_cast<int32_t*>(x.seq_len_kv)},
      {kRaggedQ, const_cast<int32_t*>(x.ragged_offsets)},
      {kRaggedO, const_cast<int32_t*>(x.ragged_offsets)},
      {kTableK, const_cast<int32_t*>(x.block_tables)},
      {kTableV, const_cast<int32_t*>(x.block_tables)},
  };
  if (c.has_sinks) pack.emplace(kSinks, const_cast<float*>(x.sinks));
  if (c.return_lse) pack.emplace(kStats, x.lse);
  DeviceHandle& h = *plan.handle;
  std::lock_guard<std::mutex> lock(h.mu);
  // cuDNN writes exactly the rows sequences own; the others are zeroed on the side stream at the
  // same time, so the zeroing adds no kernel to `stream`. Fork and join are event record/wait,
  // which stream capture turns into graph edges.
  CheckCuda(cudaEventRecord(h.fork, stream), "forking the zeroing stream");
  CheckCuda(cudaStreamWaitEvent(h.side, h.fork, 0), "forking the zeroing stream");
  CheckCuda(LaunchZeroUnownedRows(x.out, c.num_tokens, c.num_q_heads * c.head_dim, x.ragged_offsets, x.seq_len_q,
                                  c.batch, h.side),
            "zeroing unowned output rows");
  CheckCuda(cudaEventRecord(h.join, h.side), "joining the zeroing stream");
  if (fe::detail::set_stream(h.handle, stream) != CUDNN_STATUS_SUCCESS) Fail("cudnnSetStream failed");
  const fe::error_t status = plan.graph->execute(h.handle, pack, plan.workspace_size ? x.workspace : nullptr);
  CheckCuda(cudaStreamWaitEvent(stream, h.join, 0), "joining the zeroing stream");
  Check(status, "execute");
}

int64_t BackendVersion() { return static_cast<int64_t>(fe::detail::get_backend_version()); }
int64_t CompiledVersion() { return CUDNN_VERSION; }
int64_t FrontendVersion() { return CUDNN_FRONTEND_VERSION; }

}  // namespace jaxattn::cudnn
