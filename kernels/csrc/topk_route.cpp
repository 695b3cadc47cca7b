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
// Built as a PyTorch C++ extension by kernels/cpu_topk_route.py; `topk_route_reference` and
// `route_stats_reference` there are its twins.
#include <pybind11/pybind11.h>
#include <stdint.h>

#include <cmath>

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

}  // namespace

// x: [T, d] fp32; gate_w: [n, d] fp32; gate_b: [n] fp32; expert_slots: [n] int64; outputs
// logits [T, n] fp32, slot_ids [T, W] int64, weights [T, W] fp32 and experts [T, k] int64, all
// contiguous; stats (0: none): one layer's [3 + n_ent + n_w + 2n] float64 row, added into, with
// the histograms' fp32 upper bounds ent_edges [n_ent] and w_edges [n_w]; learned (0: every
// token): [T] uint8, where 0 the token's slot_ids/weights rows are copied from static_ids [T, W]
// int64 / static_w [T, W] fp32 and it is left out of stats. Addresses come as
// integers: the caller (cpu_topk_route.TopKRouter) checks shapes, dtypes and
// 1 <= k <= min(n, W, 64); returns 2 where k lies outside that, else 0.
static int64_t route_fp32(uintptr_t x, int64_t d, uintptr_t gate_w, uintptr_t gate_b,
                          uintptr_t logits, int64_t T, int64_t n, int64_t k, double temperature,
                          uintptr_t expert_slots, uintptr_t slot_ids, uintptr_t weights,
                          int64_t W, uintptr_t experts, uintptr_t stats, uintptr_t ent_edges,
                          int64_t n_ent, uintptr_t w_edges, int64_t n_w, uintptr_t learned,
                          uintptr_t static_ids, uintptr_t static_w) {
  if (k < 1 || k > n || k > W || k > MAX_K) return 2;
  const Stats s{reinterpret_cast<double*>(stats), reinterpret_cast<const float*>(ent_edges),
                n_ent, reinterpret_cast<const float*>(w_edges), n_w};
  route(reinterpret_cast<const float*>(x), d, reinterpret_cast<const float*>(gate_w),
        reinterpret_cast<const float*>(gate_b), reinterpret_cast<float*>(logits), T, n, k,
        static_cast<float>(temperature), reinterpret_cast<const int64_t*>(expert_slots),
        reinterpret_cast<int64_t*>(slot_ids), reinterpret_cast<float*>(weights), W,
        reinterpret_cast<int64_t*>(experts), s, reinterpret_cast<const uint8_t*>(learned),
        reinterpret_cast<const int64_t*>(static_ids), reinterpret_cast<const float*>(static_w));
  return 0;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.def("route_fp32", &route_fp32, py::call_guard<py::gil_scoped_release>());
}
