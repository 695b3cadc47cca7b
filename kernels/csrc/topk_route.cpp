// One layer's learned top-k routing on CPU in one call: the gate logits of T tokens over n
// experts (x W^T + b), each token's top-k experts, their softmax weights, its [T, W] slot table
// and the rank-expanded slot weights the stacked LoRA delta reads.
//
// In PyTorch this is an addmm, a top-k, a softmax, an index, two concatenations, an
// embedding_bag and a comparison per decoder layer: at decode sizes ([32, 576] x [576, 4]) each
// op's dispatch costs more than its arithmetic, so one loop over the tokens replaces them.
// Built as a PyTorch C++ extension by kernels/cpu_topk_route.py; `topk_route_reference` there
// is its twin.
#include <pybind11/pybind11.h>
#include <stdint.h>

#include <cmath>
#include <cstring>

namespace {

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

// Returns 0, or 1 where an expert's column lies outside the stacked slot range (nothing is
// written past a buffer then; the caller raises).
int64_t route(const float* x, int64_t d, const float* gate_w, const float* gate_b, float* logits,
              int64_t T, int64_t n, int64_t k, float temperature,
              const int64_t* expert_slots, const int64_t* local_slots, int64_t count,
              const int64_t* ranks, int64_t num_ranks, int64_t* slot_ids, float* weights,
              int64_t W, int64_t* experts, float* rows, bool* inactive) {
  int64_t width = 0;
  for (int64_t b = 0; b < num_ranks; ++b) width += count * ranks[b];
  for (int64_t e = 0; e < n && num_ranks > 0; ++e)
    if (local_slots[e] < 0 || local_slots[e] >= count) return 1;
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
    for (int64_t j = 0; j < W; ++j) {
      ids[j] = j < k ? expert_slots[idx[j]] : 0;
      tw[j] = j < k ? w[j] : 0.0f;
    }
    for (int64_t j = 0; j < k; ++j) experts[t * k + j] = idx[j];
    if (width == 0) continue;
    float* r = rows + t * width;
    std::memset(r, 0, width * sizeof(float));
    int64_t col = 0;
    for (int64_t b = 0; b < num_ranks; ++b) {
      for (int64_t j = 0; j < k; ++j) {
        float* dst = r + col + local_slots[idx[j]] * ranks[b];
        for (int64_t c = 0; c < ranks[b]; ++c) dst[c] += w[j];
      }
      col += count * ranks[b];
    }
    bool* off = inactive + t * width;
    for (int64_t c = 0; c < width; ++c) off[c] = r[c] == 0.0f;
  }
  return 0;
}

}  // namespace

// x: [T, d] fp32; gate_w: [n, d] fp32; gate_b: [n] fp32; expert_slots, local_slots: [n] int64; ranks: [num_ranks] int64; outputs
// logits [T, n] fp32, slot_ids [T, W] int64, weights [T, W] fp32, experts [T, k] int64, rows [T, width] fp32 and
// inactive [T, width] bool, all contiguous. Addresses come as integers: the caller
// (cpu_topk_route.topk_route) checks shapes, dtypes and 1 <= k <= min(n, W, 64).
static int64_t route_fp32(uintptr_t x, int64_t d, uintptr_t gate_w, uintptr_t gate_b,
                          uintptr_t logits, int64_t T, int64_t n, int64_t k, double temperature,
                          uintptr_t expert_slots, uintptr_t local_slots, int64_t count,
                          uintptr_t ranks, int64_t num_ranks, uintptr_t slot_ids,
                          uintptr_t weights, int64_t W, uintptr_t experts, uintptr_t rows,
                          uintptr_t inactive) {
  if (k < 1 || k > n || k > W || k > MAX_K) return 2;
  return route(reinterpret_cast<const float*>(x), d, reinterpret_cast<const float*>(gate_w),
               reinterpret_cast<const float*>(gate_b), reinterpret_cast<float*>(logits), T, n, k,
               static_cast<float>(temperature),
               reinterpret_cast<const int64_t*>(expert_slots),
               reinterpret_cast<const int64_t*>(local_slots), count,
               reinterpret_cast<const int64_t*>(ranks), num_ranks,
               reinterpret_cast<int64_t*>(slot_ids), reinterpret_cast<float*>(weights), W,
               reinterpret_cast<int64_t*>(experts), reinterpret_cast<float*>(rows),
               reinterpret_cast<bool*>(inactive));
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.def("route_fp32", &route_fp32, py::call_guard<py::gil_scoped_release>());
}
