// One layer's learned top-k routing on CPU in one call: the gate logits of T tokens over n
// experts (x W^T + b), each token's top-k experts, their softmax weights and its [T, W] slot
// table (what the grouped LoRA delta, csrc/topk_delta.cpp, reads).
//
// In PyTorch this is an addmm, a top-k, a softmax, an index and two pads per decoder layer: at
// decode sizes ([32, 576] x [576, 4]) each op's dispatch costs more than its arithmetic, so one
// loop over the tokens replaces them.
// With a statistics row per layer it also folds, in the same loop, what gate telemetry reads:
// tokens, the sums and cumulative histograms of routing entropy and top-1 weight, and per expert
// the tokens that rank it first and that select it (the Python side otherwise spends ~30 small
// ops per step on them).
// Built as a PyTorch C++ extension by kernels/cpu_topk_route.py and called as a torch op
// (`register_ops`) on tensors it checks itself; `topk_route_reference` and
// `route_stats_reference` there are its twins.
#include <ATen/core/Tensor.h>
#include <pybind11/pybind11.h>
#include <stdint.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <string>

namespace {

// Where one layer's statistics go (see `route_stats_reference` for the column order).
struct Stats {
  double* row;  // [3 + n_ent + n_w + 2n] float64, added into; null: no statistics
  const float* ent_edges;
  int64_t n_ent;
  const float* w_edges;
  int64_t n_w;
};

// Normalized entropy (0: one-hot, 1: uniform; 0 with one expert) of softmax(row / temperature).
inline float entropy(const float* row, int64_t n, float temperature) {
  if (n < 2) return 0.0f;
  float m = row[0] / temperature;
  for (int64_t e = 1; e < n; ++e) m = std::fmax(m, row[e] / temperature);
  float total = 0.0f;
  for (int64_t e = 0; e < n; ++e) total += std::exp(row[e] / temperature - m);
  const float log_total = std::log(total);
  float h = 0.0f;
  for (int64_t e = 0; e < n; ++e) {
    const float logp = row[e] / temperature - m - log_total;
    const float p = std::exp(logp);
    if (p > 0.0f) h -= p * logp;
  }
  return h / std::log(static_cast<float>(n));
}

void add_stats(const Stats& s, const float* row, int64_t n, float temperature,
               const int64_t* idx, const float* w, int64_t k) {
  double* out = s.row;
  const float h = entropy(row, n, temperature);
  out[0] += 1.0;
  out[1] += h;
  out[2] += w[0];
  double* ent = out + 3;
  for (int64_t b = 0; b < s.n_ent; ++b) ent[b] += h <= s.ent_edges[b] ? 1.0 : 0.0;
  double* top1 = ent + s.n_ent;
  for (int64_t b = 0; b < s.n_w; ++b) top1[b] += w[0] <= s.w_edges[b] ? 1.0 : 0.0;
  double* first = top1 + s.n_w;
  first[idx[0]] += 1.0;
  double* selected = first + n;
  for (int64_t j = 0; j < k; ++j) selected[idx[j]] += w[j] > 0.0f ? 1.0 : 0.0;
}

constexpr int64_t MAX_K = 64;
constexpr int64_t LANES = 16;  // partial sums per dot product: the compiler keeps them in SIMD

// b + <x, w> over d, accumulated in LANES fp32 partial sums.
inline float dot(const float* x, const float* w, int64_t d, float b) {
  float part[LANES] = {0.0f};
  int64_t i = 0;
  for (; i + LANES <= d; i += LANES)
    for (int64_t l = 0; l < LANES; ++l) part[l] += x[i + l] * w[i + l];
  float total = 0.0f;
  for (int64_t l = 0; l < LANES; ++l) total += part[l];
  for (; i < d; ++i) total += x[i] * w[i];
  return total + b;
}

void route(const float* x, int64_t d, const float* gate_w, const float* gate_b, float* logits,
           int64_t T, int64_t n, int64_t k, float temperature, const int64_t* expert_slots,
           int64_t* slot_ids, float* weights, int64_t W, int64_t* experts, const Stats& stats,
           const uint8_t* learned, const int64_t* static_ids, const float* static_w) {
  for (int64_t t = 0; t < T; ++t) {
    float* row = logits + t * n;
    for (int64_t e = 0; e < n; ++e) row[e] = dot(x + t * d, gate_w + e * d, d, gate_b[e]);
    float vals[MAX_K];
    int64_t idx[MAX_K];
    // selection by repeated arg-max: the first index wins a tie, as torch.argmax does
    for (int64_t j = 0; j < k; ++j) {
      int64_t best = -1;
      float best_v = 0.0f;
      for (int64_t e = 0; e < n; ++e) {
        bool taken = false;
        for (int64_t i = 0; i < j; ++i) taken |= idx[i] == e;
        const float v = temperature == 1.0f ? row[e] : row[e] / temperature;
        if (!taken && (best < 0 || v > best_v)) best = e, best_v = v;
      }
      idx[j] = best;
      vals[j] = best_v;
    }
    float w[MAX_K];
    float total = 0.0f;
    for (int64_t j = 0; j < k; ++j) total += (w[j] = std::exp(vals[j] - vals[0]));
    for (int64_t j = 0; j < k; ++j) w[j] = k == 1 ? 1.0f : w[j] / total;
    int64_t* ids = slot_ids + t * W;
    float* tw = weights + t * W;
    const bool routed = learned == nullptr || learned[t] != 0;
    for (int64_t j = 0; j < W; ++j) {  // a static token keeps its own route's row
      ids[j] = routed ? (j < k ? expert_slots[idx[j]] : 0) : static_ids[t * W + j];
      tw[j] = routed ? (j < k ? w[j] : 0.0f) : static_w[t * W + j];
    }
    for (int64_t j = 0; j < k; ++j) experts[t * k + j] = idx[j];
    if (stats.row != nullptr && routed) add_stats(stats, row, n, temperature, idx, w, k);
  }
}

// Whether `t` is a contiguous CPU tensor of `dtype` shaped `sizes`.
bool is(const at::Tensor& t, at::ScalarType dtype, at::IntArrayRef sizes) {
  return t.scalar_type() == dtype && t.sizes() == sizes && t.is_contiguous() && t.device().is_cpu();
}

// One layer's route of T tokens, written into row `layer` of a step's tables: logits [L, T, n]
// fp32, experts [L, T, k] int64, slot_ids [L, T, W] int64 and slot_weights [L, T, W] fp32,
// from x [T, d] fp32, the layer's gate_w [n, d] / gate_b [n] fp32 and expert_slots [n] int64.
// With stats [L, 3 + n_ent + n_w + 2n] float64 (and the histograms' fp32 upper bounds
// ent_edges [n_ent] / w_edges [n_w], given exactly when stats is), the layer's route statistics
// are added into its row; with learned [T] uint8 (and static_ids [T, W] int64 / static_w [T, W]
// fp32, all three or none), a token whose flag is 0 keeps its static rows and is left out of the
// statistics. Every tensor is a contiguous CPU one, all checked here, and
// 1 <= k <= min(n, W, 64).
void route_into(const at::Tensor& x, const at::Tensor& gate_w, const at::Tensor& gate_b,
                int64_t k, double temperature, const at::Tensor& expert_slots, int64_t layer,
                const at::Tensor& logits, const at::Tensor& experts, const at::Tensor& slot_ids,
                const at::Tensor& slot_weights, const std::optional<at::Tensor>& stats,
                const std::optional<at::Tensor>& ent_edges,
                const std::optional<at::Tensor>& w_edges, const std::optional<at::Tensor>& learned,
                const std::optional<at::Tensor>& static_ids,
                const std::optional<at::Tensor>& static_w) {
  TORCH_CHECK_VALUE(gate_w.dim() == 2, "the gate weight must be [n, d], got ", gate_w.sizes());
  const int64_t n = gate_w.size(0), d = gate_w.size(1);
  TORCH_CHECK_VALUE(is(gate_w, at::kFloat, {n, d}) && is(gate_b, at::kFloat, {n}) &&
                        is(expert_slots, at::kLong, {n}),
                    "the gate must be contiguous fp32 CPU [", n, ", ", d, "] and [", n,
                    "] with int64 expert_slots [", n, "]");
  TORCH_CHECK_VALUE(x.dim() == 2 && is(x, at::kFloat, {x.size(0), d}),
                    "route_into takes a contiguous fp32 CPU [T, ", d, "] input, got ",
                    x.scalar_type(), " ", x.sizes());
  TORCH_CHECK_VALUE(logits.dim() == 3 && slot_ids.dim() == 3,
                    "route_into takes this router's `tables(T)`");
  const int64_t L = logits.size(0), T = x.size(0), W = slot_ids.size(2);
  TORCH_CHECK_VALUE(k >= 1 && k <= n && k <= W && k <= MAX_K, "top_k=", k,
                    " must lie in 1..min(experts=", n, ", width=", W, ", ", MAX_K, ")");
  TORCH_CHECK_VALUE(layer >= 0 && layer < L && is(logits, at::kFloat, {L, T, n}) &&
                        is(experts, at::kLong, {L, T, k}) && is(slot_ids, at::kLong, {L, T, W}) &&
                        is(slot_weights, at::kFloat, {L, T, W}),
                    "route_into takes a layer < ", L, " and this router's `tables(", T, ")`");
  Stats st{nullptr, nullptr, 0, nullptr, 0};
  TORCH_CHECK_VALUE(stats.has_value() == ent_edges.has_value() &&
                        stats.has_value() == w_edges.has_value(),
                    "route_into takes this router's `tables(T)`: statistics exactly where the "
                    "router has histogram edges");
  if (stats.has_value()) {
    const int64_t n_ent = ent_edges->numel(), n_w = w_edges->numel();
    TORCH_CHECK_VALUE(is(*ent_edges, at::kFloat, {n_ent}) && is(*w_edges, at::kFloat, {n_w}) &&
                          is(*stats, at::kDouble, {L, 3 + n_ent + n_w + 2 * n}),
                      "route_into takes this router's `tables(T)`: statistics [", L, ", ",
                      3 + n_ent + n_w + 2 * n, "] float64 for fp32 edges");
    st = {stats->data_ptr<double>() + layer * stats->size(1), ent_edges->data_ptr<float>(), n_ent,
          w_edges->data_ptr<float>(), n_w};
  }
  const bool keep = learned.has_value();
  TORCH_CHECK_VALUE(keep == static_ids.has_value() && keep == static_w.has_value(),
                    "static rows come as learned, ids and weights together");
  TORCH_CHECK_VALUE(!keep || (is(*learned, at::kByte, {T}) && is(*static_ids, at::kLong, {T, W}) &&
                              is(*static_w, at::kFloat, {T, W})),
                    "static rows must be [", T, "] uint8 and [", T, ", ", W, "] int64 / fp32");
  route(x.data_ptr<float>(), d, gate_w.data_ptr<float>(), gate_b.data_ptr<float>(),
        logits.data_ptr<float>() + layer * T * n, T, n, k, static_cast<float>(temperature),
        expert_slots.data_ptr<int64_t>(), slot_ids.data_ptr<int64_t>() + layer * T * W,
        slot_weights.data_ptr<float>() + layer * T * W, W,
        experts.data_ptr<int64_t>() + layer * T * k, st,
        keep ? learned->data_ptr<uint8_t>() : nullptr,
        keep ? static_ids->data_ptr<int64_t>() : nullptr,
        keep ? static_w->data_ptr<float>() : nullptr);
}

std::string registered;  // this library's ops namespace, once registered

}  // namespace

// Registers the ops under namespace `ns` (a name no other library loaded in this process has:
// the same source built twice must not register twice) and returns the namespace they live in,
// the first one asked for when called again.
static std::string register_ops(const std::string& ns) {
  if (!registered.empty()) return registered;
  // never freed: the registration lives as long as the process
  auto* lib = new torch::Library(torch::Library::DEF, ns, std::nullopt, __FILE__, __LINE__);
  lib->def("route_into(Tensor x, Tensor gate_w, Tensor gate_b, int k, float temperature, "
           "Tensor expert_slots, int layer, Tensor(a!) logits, Tensor(b!) experts, "
           "Tensor(c!) slot_ids, Tensor(d!) slot_weights, Tensor(e!)? stats, Tensor? ent_edges, "
           "Tensor? w_edges, Tensor? learned, Tensor? static_ids, Tensor? static_w) -> ()");
  lib->impl("route_into", torch::dispatch(c10::DispatchKey::CPU, TORCH_FN(route_into)));
  registered = ns;
  return registered;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("register_ops", &register_ops); }
