// Decode attention over a paged KV cache on CPU, read in place: out[b, h] = softmax(q·Kᵀ·scale)·V
// over sequence b's first context_lens[b] positions, K/V rows found through its block table.
//
// The PyTorch path gathers every sequence's blocks into a contiguous copy (and widens a bf16
// cache to fp32) before two batched GEMMs; at decode sizes that copy is most of the layer's
// attention time. Here each (sequence, KV head) task widens one K or V row at a time into
// registers and serves every query head of its GQA group from it, with fp32 scores, softmax and
// accumulation. Rows of the cache are fp32 or bf16 (the raw 16-bit patterns, as torch stores
// bfloat16). Built as a PyTorch C++ extension by kernels/cpu_paged_attention.py; threads come
// from the OpenMP runtime torch already loaded, so tasks run on torch's intra-op team.
#include <pybind11/pybind11.h>
#include <stdint.h>
#include <string.h>

#include <cmath>
#include <vector>

namespace {

inline void widen(const float* src, float* dst, int64_t n) { memcpy(dst, src, n * sizeof(float)); }

inline void widen(const uint16_t* src, float* dst, int64_t n) {
  uint32_t* bits = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) bits[d] = static_cast<uint32_t>(src[d]) << 16;
}

template <typename T>
void attend_one(const float* q, const T* kc, const T* vc, const int32_t* table, int64_t len,
                int64_t kv_head, int64_t kv_heads, int64_t bs, int64_t hd, int64_t group,
                float scale, float* out, std::vector<float>& scores, std::vector<float>& row) {
  scores.resize(group * len);
  row.resize(hd);
  float* r = row.data();
  for (int64_t p = 0; p < len; ++p) {
    const int64_t slot = (static_cast<int64_t>(table[p / bs]) * kv_heads + kv_head) * bs + p % bs;
    widen(kc + slot * hd, r, hd);
    for (int64_t j = 0; j < group; ++j) {
      const float* qj = q + j * hd;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < hd; ++d) dot += qj[d] * r[d];
      scores[j * len + p] = dot * scale;
    }
  }
  std::vector<float> inv(group);
  for (int64_t j = 0; j < group; ++j) {
    float* s = scores.data() + j * len;
    float top = s[0];
    for (int64_t p = 1; p < len; ++p) top = s[p] > top ? s[p] : top;
    float sum = 0.f;
    for (int64_t p = 0; p < len; ++p) {
      s[p] = std::exp(s[p] - top);
      sum += s[p];
    }
    inv[j] = 1.f / sum;
  }
  memset(out, 0, group * hd * sizeof(float));
  for (int64_t p = 0; p < len; ++p) {
    const int64_t slot = (static_cast<int64_t>(table[p / bs]) * kv_heads + kv_head) * bs + p % bs;
    widen(vc + slot * hd, r, hd);
    for (int64_t j = 0; j < group; ++j) {
      const float w = scores[j * len + p];
      float* oj = out + j * hd;
#pragma omp simd
      for (int64_t d = 0; d < hd; ++d) oj[d] += w * r[d];
    }
  }
  for (int64_t j = 0; j < group; ++j) {
    float* oj = out + j * hd;
#pragma omp simd
    for (int64_t d = 0; d < hd; ++d) oj[d] *= inv[j];
  }
}

// 0 when every block a length reaches is in the table and in the cache, else which check failed:
// the kernel reads raw memory, so nothing is read before this passes.
int64_t check_tables(const int32_t* tables, int64_t table_stride, const int32_t* lens,
                     int64_t batch, int64_t bs, int64_t num_blocks) {
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t used = (static_cast<int64_t>(lens[b]) + bs - 1) / bs;
    if (used > table_stride) return 1;
    for (int64_t i = 0; i < used; ++i) {
      const int32_t block = tables[b * table_stride + i];
      if (block < 0 || block >= num_blocks) return 2;
    }
  }
  return 0;
}

template <typename T>
int64_t paged_decode(const float* q, const T* kc, const T* vc, const int32_t* tables,
                     int64_t table_stride, const int32_t* lens, float* out, int64_t batch,
                     int64_t heads, int64_t kv_heads, int64_t bs, int64_t hd, int64_t num_blocks,
                     float scale, int threads) {
  const int64_t bad = check_tables(tables, table_stride, lens, batch, bs, num_blocks);
  if (bad) return bad;
  const int64_t group = heads / kv_heads;
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    std::vector<float> scores, row;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < batch * kv_heads; ++t) {
      const int64_t b = t / kv_heads, h = t % kv_heads;
      const int64_t offset = (b * heads + h * group) * hd;
      if (lens[b] <= 0) {  // batch padding: its output is 0
        memset(out + offset, 0, group * hd * sizeof(float));
        continue;
      }
      attend_one(q + offset, kc, vc, tables + b * table_stride, lens[b], h, kv_heads, bs, hd,
                 group, scale, out + offset, scores, row);
    }
  }
  return 0;
}

}  // namespace

// q, out: [batch, heads, hd] fp32 contiguous; caches: [blocks, kv_heads, bs, hd] contiguous,
// fp32 or bf16; tables: [batch, table_stride] int32; lens: [batch] int32. Addresses come as
// integers: the caller (cpu_paged_attention.paged_decode) checks shapes and dtypes and passes
// torch's intra-op thread count; the tables are checked here (returns 1: a length runs past its
// table, 2: a block outside the cache; nothing is computed then). Bound once per cache dtype:
// fp32, and bf16 as its raw 16-bit patterns.
template <typename T>
int64_t decode(uintptr_t q, uintptr_t kc, uintptr_t vc, uintptr_t tables, int64_t table_stride,
               uintptr_t lens, uintptr_t out, int64_t batch, int64_t heads, int64_t kv_heads,
               int64_t bs, int64_t hd, int64_t num_blocks, double scale, int threads) {
  return paged_decode(reinterpret_cast<const float*>(q), reinterpret_cast<const T*>(kc),
                      reinterpret_cast<const T*>(vc), reinterpret_cast<const int32_t*>(tables),
                      table_stride, reinterpret_cast<const int32_t*>(lens),
                      reinterpret_cast<float*>(out), batch, heads, kv_heads, bs, hd, num_blocks,
                      static_cast<float>(scale), threads);
}

// The kernels release the GIL: the engine's step thread and the server's event loop run beside them.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.def("decode_fp32", &decode<float>, py::call_guard<py::gil_scoped_release>());
  m.def("decode_bf16", &decode<uint16_t>, py::call_guard<py::gil_scoped_release>());
}
