// Decode attention over a paged KV cache on CPU, read in place: out[b, h] = softmax(q·Kᵀ·scale)·V
// over sequence b's first context_lens[b] positions, K/V rows found through its block table.
//
// The PyTorch path gathers every sequence's blocks into a contiguous copy (and widens a bf16
// cache to fp32) before two batched GEMMs; at decode sizes that copy is most of the layer's
// attention time. Here each (sequence, KV head) task widens one K or V row at a time into
// registers and serves every query head of its GQA group from it, with fp32 scores, softmax and
// accumulation. Rows of the cache are fp32 or bf16 (the raw 16-bit patterns, as torch stores
// bfloat16). Built as a PyTorch C++ extension by kernels/cpu_paged_attention.py and called as a
// torch op (`register_ops`) on tensors it checks itself; threads come from the OpenMP runtime
// torch already loaded, so tasks run on torch's intra-op team.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <pybind11/pybind11.h>
#include <stdint.h>
#include <string.h>
#include <torch/library.h>

#include <cmath>
#include <initializer_list>
#include <string>
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

// Every table entry a length reaches has passed `check_tables`.
template <typename T>
void paged_decode(const float* q, const T* kc, const T* vc, const int32_t* tables,
                  int64_t table_stride, const int32_t* lens, float* out, int64_t batch,
                  int64_t heads, int64_t kv_heads, int64_t bs, int64_t hd, float scale,
                  int threads) {
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
}

// One layer's decode, out [B, H, hd] fp32 (written) from q [B, H, hd] fp32, caches
// [blocks, kv_heads, bs, hd] fp32 or bf16 (both the same), block tables [B, W] int32 and context
// lengths [B] int32, every one a contiguous CPU tensor; scale multiplies q·kᵀ. Everything the
// loops read through is checked here, tables included (a length past its table, a block outside
// the cache), before anything is computed; threads are torch's intra-op count.
void decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& block_tables, const at::Tensor& context_lens, at::Tensor& out,
            double scale) {
  TORCH_CHECK_VALUE(q.dim() == 3 && k_cache.dim() == 4 && block_tables.dim() == 2 &&
                        context_lens.dim() == 1,
                    "expected q [B, H, D], k_cache/v_cache [num_blocks, KVH, block_size, D], "
                    "block_tables [B, max_blocks], context_lens [B]");
  TORCH_CHECK_VALUE(k_cache.sizes() == v_cache.sizes(), "k_cache ", k_cache.sizes(),
                    " != v_cache ", v_cache.sizes());
  const int64_t batch = q.size(0), heads = q.size(1), hd = q.size(2);
  const int64_t num_blocks = k_cache.size(0), kv_heads = k_cache.size(1), bs = k_cache.size(2);
  TORCH_CHECK_VALUE(k_cache.size(3) == hd, "head dim mismatch: q ", hd, ", cache ",
                    k_cache.size(3));
  TORCH_CHECK_VALUE(kv_heads > 0 && heads % kv_heads == 0, heads,
                    " query heads are not a multiple of ", kv_heads, " KV heads");
  TORCH_CHECK_VALUE(block_tables.size(0) == batch && context_lens.size(0) == batch,
                    "batch mismatch: q ", batch, ", block_tables ", block_tables.size(0),
                    ", context_lens ", context_lens.size(0));
  const auto dtype = k_cache.scalar_type();
  TORCH_CHECK_VALUE((dtype == at::kFloat || dtype == at::kBFloat16) &&
                        v_cache.scalar_type() == dtype,
                    "caches must both be fp32 or bf16, got ", dtype, "/", v_cache.scalar_type());
  TORCH_CHECK_VALUE(q.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat &&
                        block_tables.scalar_type() == at::kInt &&
                        context_lens.scalar_type() == at::kInt,
                    "q and out must be fp32, block_tables and context_lens int32");
  TORCH_CHECK_VALUE(out.sizes() == q.sizes(), "out must be shaped like q");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{
           &q, &k_cache, &v_cache, &block_tables, &context_lens, &out}) {
    TORCH_CHECK_VALUE(t->device().is_cpu(), "every input must be on the CPU");
  }
  TORCH_CHECK_VALUE(k_cache.is_contiguous() && v_cache.is_contiguous(),
                    "the caches must be contiguous");
  TORCH_CHECK_VALUE(q.is_contiguous() && out.is_contiguous() && block_tables.is_contiguous() &&
                        context_lens.is_contiguous(),
                    "q, out, block_tables and context_lens must be contiguous");
  const int64_t width = block_tables.size(1);
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  const int64_t bad = check_tables(tables, width, lens, batch, bs, num_blocks);
  TORCH_CHECK_VALUE(bad != 1, "a context length exceeds its block table (", width, " blocks)");
  TORCH_CHECK_VALUE(bad != 2, "a block table names a block outside the cache (0..",
                    num_blocks - 1, ")");
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int threads = at::get_num_threads();
  const float sc = static_cast<float>(scale);
  if (dtype == at::kBFloat16) {  // bf16 as its raw 16-bit patterns
    paged_decode(qp, static_cast<const uint16_t*>(k_cache.data_ptr()),
                 static_cast<const uint16_t*>(v_cache.data_ptr()), tables, width, lens, op, batch,
                 heads, kv_heads, bs, hd, sc, threads);
  } else {
    paged_decode(qp, k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), tables, width, lens,
                 op, batch, heads, kv_heads, bs, hd, sc, threads);
  }
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
  lib->def("decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
           "Tensor context_lens, Tensor(a!) out, float scale) -> ()");
  lib->impl("decode", torch::dispatch(c10::DispatchKey::CPU, TORCH_FN(decode)));
  registered = ns;
  return registered;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("register_ops", &register_ops); }
