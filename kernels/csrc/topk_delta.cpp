// The routed LoRA delta of T tokens over each token's own slots, grouped by slot, in one call:
// y[t, cols of member m] += sum_j w[t, j] * (x[t] A_m[s]^T) Bt_m[s],  s = slot_ids[t, j].
//
// The stacked CPU delta multiplies every token by every slot of the step's range and masks what
// it does not use; a learned top-2 over four adapters then does twice the work it needs. Here
// the (token, slot) pairs are sorted by slot once, each used slot's A block is read once for all
// its tokens (the shrink, one weighted rank vector per pair), and each output column chunk sums
// its tokens' pairs in slot order in fp32 before it is added to y once. A token's sums do not
// depend on which tokens share its step. Tiles are AVX2/FMA, or AVX-512F where the CPU has it;
// x, A, Bt and y are fp32 or bf16 (raw 16-bit patterns), sums fp32.
// Built as a PyTorch C++ extension by kernels/cpu_topk_delta.py and called as a torch op
// (`register_ops`) on tensors it checks itself; `topk_delta_reference` there is its twin.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <immintrin.h>
#include <pybind11/pybind11.h>
#include <stdint.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t ROW_BLOCK = 16;  // A rows per shrink work item
constexpr int64_t PAIR_BLOCK = 8;  // (token, slot) pairs per shrink work item

// One member of a fused group: its Bt rows ([rank, width] per slot, `slot_stride` elements
// apart), its first output column and its first row in A.
struct Member {
  const void* bt;
  int64_t slot_stride, width, col, a_row;
};

inline float widen(float v) { return v; }
inline float widen(uint16_t v) {
  const uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline void narrow(float v, float* out) { *out = v; }
inline void narrow(float v, uint16_t* out) {  // round to nearest even, NaN kept quiet
  uint32_t u;
  std::memcpy(&u, &v, 4);
  const bool nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
  u += 0x7FFFu + ((u >> 16) & 1u);
  *out = nan ? static_cast<uint16_t>(0x7FC0u) : static_cast<uint16_t>(u >> 16);
}

// ---- AVX2/FMA tiles ------------------------------------------------------------------------

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
inline float sum8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 h = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps(h, h, 1)));
}

// Copies the d - i tail of a row, widened and zero padded to `lanes` floats.
template <typename T>
inline void tail(const T* row, int64_t i, int64_t d, float* out, int64_t lanes) {
  for (int64_t l = 0; l < lanes; ++l) out[l] = i + l < d ? widen(row[i + l]) : 0.0f;
}

// h[t][r] = w[t] * <x_t, a_r> for TB token rows and RB A rows.
template <int TB, int RB, typename X, typename A>
void shrink8(const X* const* xs, const A* a, int64_t d, const float* w, float* const* h) {
  __m256 acc[TB][RB];
  for (int t = 0; t < TB; ++t)
    for (int r = 0; r < RB; ++r) acc[t][r] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= d; i += 8) {
    __m256 av[RB];
    for (int r = 0; r < RB; ++r) av[r] = load8(a + r * d + i);
    for (int t = 0; t < TB; ++t) {
      const __m256 xv = load8(xs[t] + i);
      for (int r = 0; r < RB; ++r) acc[t][r] = _mm256_fmadd_ps(xv, av[r], acc[t][r]);
    }
  }
  if (i < d) {
    alignas(32) float buf[8];
    __m256 av[RB];
    for (int r = 0; r < RB; ++r) tail(a + r * d, i, d, buf, 8), av[r] = _mm256_load_ps(buf);
    for (int t = 0; t < TB; ++t) {
      tail(xs[t], i, d, buf, 8);
      const __m256 xv = _mm256_load_ps(buf);
      for (int r = 0; r < RB; ++r) acc[t][r] = _mm256_fmadd_ps(xv, av[r], acc[t][r]);
    }
  }
  for (int t = 0; t < TB; ++t)
    for (int r = 0; r < RB; ++r) h[t][r] = w[t] * sum8(acc[t][r]);
}

// acc[t][0:8*CB] += sum_r h[t][r] * bt[r][0:8*CB] for TB tokens.
template <int TB, int CB, typename B>
void expand8(const float* const* h, const B* bt, int64_t ldb, int64_t rank, float* const* acc) {
  __m256 c[TB][CB];
  for (int t = 0; t < TB; ++t)
    for (int j = 0; j < CB; ++j) c[t][j] = _mm256_loadu_ps(acc[t] + 8 * j);
  for (int64_t r = 0; r < rank; ++r) {
    __m256 bv[CB];
    for (int j = 0; j < CB; ++j) bv[j] = load8(bt + r * ldb + 8 * j);
    for (int t = 0; t < TB; ++t) {
      const __m256 hb = _mm256_set1_ps(h[t][r]);
      for (int j = 0; j < CB; ++j) c[t][j] = _mm256_fmadd_ps(hb, bv[j], c[t][j]);
    }
  }
  for (int t = 0; t < TB; ++t)
    for (int j = 0; j < CB; ++j) _mm256_storeu_ps(acc[t] + 8 * j, c[t][j]);
}

// ---- AVX-512F tiles (compiled by attribute, taken only where the CPU reports AVX-512F) ------

__attribute__((target("avx512f"))) inline __m512 load16(const float* p) {
  return _mm512_loadu_ps(p);
}
__attribute__((target("avx512f"))) inline __m512 load16(const uint16_t* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

template <int TB, int RB, typename X, typename A>
__attribute__((target("avx512f"))) void shrink16(const X* const* xs, const A* a, int64_t d,
                                                 const float* w, float* const* h) {
  __m512 acc[TB][RB];
  for (int t = 0; t < TB; ++t)
    for (int r = 0; r < RB; ++r) acc[t][r] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) {
    __m512 av[RB];
    for (int r = 0; r < RB; ++r) av[r] = load16(a + r * d + i);
    for (int t = 0; t < TB; ++t) {
      const __m512 xv = load16(xs[t] + i);
      for (int r = 0; r < RB; ++r) acc[t][r] = _mm512_fmadd_ps(xv, av[r], acc[t][r]);
    }
  }
  if (i < d) {
    alignas(64) float buf[16];
    __m512 av[RB];
    for (int r = 0; r < RB; ++r) tail(a + r * d, i, d, buf, 16), av[r] = _mm512_load_ps(buf);
    for (int t = 0; t < TB; ++t) {
      tail(xs[t], i, d, buf, 16);
      const __m512 xv = _mm512_load_ps(buf);
      for (int r = 0; r < RB; ++r) acc[t][r] = _mm512_fmadd_ps(xv, av[r], acc[t][r]);
    }
  }
  for (int t = 0; t < TB; ++t)
    for (int r = 0; r < RB; ++r) h[t][r] = w[t] * _mm512_reduce_add_ps(acc[t][r]);
}

template <int TB, int CB, typename B>
__attribute__((target("avx512f"))) void expand16(const float* const* h, const B* bt,
                                                 int64_t ldb, int64_t rank, float* const* acc) {
  __m512 c[TB][CB];
  for (int t = 0; t < TB; ++t)
    for (int j = 0; j < CB; ++j) c[t][j] = _mm512_loadu_ps(acc[t] + 16 * j);
  for (int64_t r = 0; r < rank; ++r) {
    __m512 bv[CB];
    for (int j = 0; j < CB; ++j) bv[j] = load16(bt + r * ldb + 16 * j);
    for (int t = 0; t < TB; ++t) {
      const __m512 hb = _mm512_set1_ps(h[t][r]);
      for (int j = 0; j < CB; ++j) c[t][j] = _mm512_fmadd_ps(hb, bv[j], c[t][j]);
    }
  }
  for (int t = 0; t < TB; ++t)
    for (int j = 0; j < CB; ++j) _mm512_storeu_ps(acc[t] + 16 * j, c[t][j]);
}

// Runs f(Int<n>) for the compile-time n equal to the runtime `n` in 1..Max.
template <int N>
using Int = std::integral_constant<int, N>;
template <int Max, typename F>
inline void dispatch(int n, const F& f) {
  if constexpr (Max > 0) {
    if (n == Max) return f(Int<Max>{});
    dispatch<Max - 1>(n, f);
  }
}

// Column chunk of the expand: CB vectors of the ISA's lanes.
constexpr int CB = 4;
constexpr int TB512 = 4, RB512 = 4, TB256 = 2, RB256 = 4;

struct Chunk {
  int64_t member, col, cols;  // member index, first column within the member, columns
};

template <typename X, typename W, typename Y>
int64_t delta(const X* x, int64_t ldx, int64_t d, int64_t T, const int64_t* ids,
              const float* weights, int64_t width, const W* a, int64_t a_slot_stride,
              int64_t R, int64_t rows, int64_t slot_base, const Member* members,
              int64_t n_members, int64_t rank, Y* y, int64_t ldy, int threads, bool wide) {
  // the (token, weight) pairs of each slot row, in token order, slots ascending
  std::vector<int64_t> start(rows + 1, 0);
  for (int64_t p = 0; p < T * width; ++p) {
    if (ids[p] <= 0 || weights[p] == 0.0f) continue;
    const int64_t row = ids[p] - slot_base;
    if (row < 0 || row >= rows) return 1;
    ++start[row + 1];
  }
  for (int64_t s = 0; s < rows; ++s) start[s + 1] += start[s];
  const int64_t P = start[rows];
  if (P == 0) return 0;
  std::vector<int64_t> fill(start.begin(), start.end() - 1), tok(P);
  std::vector<float> pw(P);
  std::vector<char> active(T, 0);
  for (int64_t p = 0; p < T * width; ++p) {
    if (ids[p] <= 0 || weights[p] == 0.0f) continue;
    const int64_t q = fill[ids[p] - slot_base]++;
    tok[q] = p / width, pw[q] = weights[p], active[p / width] = 1;
  }
  std::vector<int64_t> used;
  struct Item {
    int64_t slot, p0, p1, r0;  // a slot's pairs p0..p1-1 against its A rows from r0
  };
  std::vector<Item> items;  // small and many, taken dynamically: slots hold unequal pair counts
  for (int64_t s = 0; s < rows; ++s) {
    if (start[s + 1] == start[s]) continue;
    used.push_back(s);
    for (int64_t p0 = start[s]; p0 < start[s + 1]; p0 += PAIR_BLOCK)
      for (int64_t r0 = 0; r0 < R; r0 += ROW_BLOCK)
        items.push_back({s, p0, std::min(start[s + 1], p0 + PAIR_BLOCK), r0});
  }
  const int64_t n_items = static_cast<int64_t>(items.size());
  const int64_t lanes = wide ? 16 : 8, chunk_cols = CB * lanes;
  std::vector<Chunk> chunks;
  int64_t D = 0;
  for (int64_t m = 0; m < n_members; ++m) {
    const int64_t w = members[m].width, col = members[m].col;
    for (int64_t c = 0; c < w; c += chunk_cols) chunks.push_back({m, c, std::min(chunk_cols, w - c)});
    D = std::max(D, col + w);
  }
  // scratch of the calling thread, grown, never shrunk: rank vectors per pair, per-token sums
  static thread_local std::vector<float> h_buf, acc_buf;
  if (h_buf.size() < static_cast<size_t>(P * R)) h_buf.resize(P * R);
  if (acc_buf.size() < static_cast<size_t>(T * D)) acc_buf.resize(T * D);
  float* const h = h_buf.data();
  float* const acc = acc_buf.data();
  const int64_t n_chunks = static_cast<int64_t>(chunks.size());

#pragma omp parallel num_threads(threads) if (threads > 1)
  {
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n_items; ++i) {
      const Item& item = items[i];
      const int64_t s = item.slot, r0 = item.r0, r1 = std::min(R, r0 + ROW_BLOCK);
      const W* a_slot = a + s * a_slot_stride;
      const int TBmax = wide ? TB512 : TB256, RBmax = wide ? RB512 : RB256;
      for (int64_t p0 = item.p0; p0 < item.p1; p0 += TBmax) {
        const int tb = static_cast<int>(std::min<int64_t>(TBmax, item.p1 - p0));
        const X* xs[TB512];
        float* hs[TB512];
        for (int t = 0; t < tb; ++t) xs[t] = x + tok[p0 + t] * ldx;
        for (int64_t r = r0; r < r1; r += RBmax) {
          const int rb = static_cast<int>(std::min<int64_t>(RBmax, r1 - r));
          for (int t = 0; t < tb; ++t) hs[t] = h + (p0 + t) * R + r;
          const W* ar = a_slot + r * d;
          const float* wt = pw.data() + p0;
          if (wide) {
            dispatch<TB512>(tb, [&](auto TBc) {
              dispatch<RB512>(rb, [&](auto RBc) {
                shrink16<decltype(TBc)::value, decltype(RBc)::value>(xs, ar, d, wt, hs);
              });
            });
          } else {
            dispatch<TB256>(tb, [&](auto TBc) {
              dispatch<RB256>(rb, [&](auto RBc) {
                shrink8<decltype(TBc)::value, decltype(RBc)::value>(xs, ar, d, wt, hs);
              });
            });
          }
        }
      }
    }
    // implicit barrier: every pair's rank vector is ready
#pragma omp for schedule(static)
    for (int64_t ci = 0; ci < n_chunks; ++ci) {
      const Chunk& c = chunks[ci];
      const Member& mem = members[c.member];
      const W* bt_base = static_cast<const W*>(mem.bt);
      const int64_t bt_slot_stride = mem.slot_stride, ldb = mem.width, out_col = mem.col + c.col;
      const int64_t a_row = mem.a_row;
      for (int64_t t = 0; t < T; ++t)
        if (active[t]) std::memset(acc + t * D + out_col, 0, c.cols * sizeof(float));
      for (const int64_t s : used) {
        const W* bt = bt_base + s * bt_slot_stride + c.col;
        const int TBmax = wide ? TB512 : TB256;
        for (int64_t p0 = start[s], tb = 0; p0 < start[s + 1]; p0 += tb) {
          // a block holds a token once: a token that lists one slot twice gets two blocks
          tb = 1;
          while (tb < TBmax && p0 + tb < start[s + 1] && tok[p0 + tb] != tok[p0 + tb - 1]) ++tb;
          const float* hs[TB512];
          float* accs[TB512];
          for (int t = 0; t < tb; ++t) {
            hs[t] = h + (p0 + t) * R + a_row;
            accs[t] = acc + tok[p0 + t] * D + out_col;
          }
          if (c.cols == chunk_cols && wide) {
            dispatch<TB512>(static_cast<int>(tb), [&](auto TBc) {
              expand16<decltype(TBc)::value, CB>(hs, bt, ldb, rank, accs);
            });
          } else if (c.cols == chunk_cols) {
            dispatch<TB256>(static_cast<int>(tb), [&](auto TBc) {
              expand8<decltype(TBc)::value, CB>(hs, bt, ldb, rank, accs);
            });
          } else {  // a member's last columns when its width is not a multiple of the chunk
            for (int t = 0; t < tb; ++t)
              for (int64_t r = 0; r < rank; ++r)
                for (int64_t j = 0; j < c.cols; ++j) accs[t][j] += hs[t][r] * widen(bt[r * ldb + j]);
          }
        }
      }
      for (int64_t t = 0; t < T; ++t) {
        if (!active[t]) continue;
        const float* src = acc + t * D + out_col;
        Y* dst = y + t * ldy + out_col;
        for (int64_t j = 0; j < c.cols; ++j) narrow(widen(dst[j]) + src[j], dst + j);
      }
    }
  }
  return 0;
}

const bool kHasAvx512 = __builtin_cpu_supports("avx512f");

bool fp32_or_bf16(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16;
}

// y [T, >= every member's columns] (added into) += the routed delta of x [T, d] over the table
// slot_ids [T, W] int64 / weights [T, W] fp32 (both contiguous; ids <= 0 and zero weights add
// nothing), the slot rows A [rows, R, d] (slot id `slot_base` is row 0; R = members x rank) and
// each member's Bt [rows, rank, width] with its first output column `cols[i]` (member i's A
// rows start at i x rank). x, A/Bt and y are each fp32 or bf16, CPU, unit stride along their
// last dimension, A's and each Bt's slot rows contiguous. Everything the loops read through is
// checked here, ids included (one outside 0..rows-1 writes nothing); threads are torch's
// intra-op count; `allow_avx512` false keeps the AVX2 tiles.
void topk_delta(const at::Tensor& x, const at::Tensor& slot_ids, const at::Tensor& weights,
                const at::Tensor& a, at::TensorList bts, at::IntArrayRef cols, int64_t slot_base,
                const at::Tensor& y, bool allow_avx512) {
  TORCH_CHECK_VALUE(a.dim() == 3 && fp32_or_bf16(a) && a.device().is_cpu() &&
                        (a.size(2) == 0 || a.stride(2) == 1) && a.stride(1) == a.size(2),
                    "A must be fp32 or bf16 CPU [S, n·r, d_in] with contiguous slot rows, got ",
                    a.scalar_type(), " ", a.sizes());
  const int64_t rows = a.size(0), R = a.size(1), d = a.size(2);
  const int64_t n_members = static_cast<int64_t>(bts.size());
  TORCH_CHECK_VALUE(n_members > 0 && static_cast<int64_t>(cols.size()) == n_members &&
                        R % n_members == 0,
                    "A has ", R, " rows per slot for ", n_members, " members and ", cols.size(),
                    " columns");
  const int64_t rank = R / n_members;
  TORCH_CHECK_VALUE(x.dim() == 2 && x.size(1) == d && fp32_or_bf16(x) && x.device().is_cpu() &&
                        (d == 0 || x.stride(1) == 1),
                    "x must be fp32 or bf16 CPU [T, ", d, "] with unit stride, got ",
                    x.scalar_type(), " ", x.sizes());
  const int64_t T = x.size(0);
  TORCH_CHECK_VALUE(y.dim() == 2 && y.size(0) == T && fp32_or_bf16(y) && y.device().is_cpu() &&
                        (y.size(1) == 0 || y.stride(1) == 1),
                    "y must be fp32 or bf16 CPU [", T, ", D] with unit stride, got ",
                    y.scalar_type(), " ", y.sizes());
  TORCH_CHECK_VALUE(slot_ids.dim() == 2 && slot_ids.size(0) == T &&
                        slot_ids.sizes() == weights.sizes() &&
                        slot_ids.scalar_type() == at::kLong &&
                        weights.scalar_type() == at::kFloat &&
                        slot_ids.is_contiguous() && weights.is_contiguous() &&
                        slot_ids.device().is_cpu() && weights.device().is_cpu(),
                    "slot_ids (int64) and weights (fp32) must both be contiguous CPU [", T,
                    ", W], got ", slot_ids.sizes(), " and ", weights.sizes());
  std::vector<Member> members(n_members);
  for (int64_t i = 0; i < n_members; ++i) {
    const at::Tensor& bt = bts[i];
    TORCH_CHECK_VALUE(bt.dim() == 3 && bt.size(0) == rows && bt.size(1) == rank &&
                          bt.scalar_type() == a.scalar_type() && bt.device().is_cpu() &&
                          (bt.size(2) == 0 || bt.stride(2) == 1) && bt.stride(1) == bt.size(2),
                      "Bt must be [", rows, ", ", rank, ", w] with contiguous slot rows and A's "
                      "dtype, got ", bt.scalar_type(), " ", bt.sizes());
    TORCH_CHECK_VALUE(cols[i] >= 0 && cols[i] + bt.size(2) <= y.size(1),
                      "a member's columns lie past y's ", y.size(1));
    members[i] = {bt.data_ptr(), bt.stride(0), bt.size(2), cols[i], i * rank};
  }
  const bool wide = allow_avx512 && kHasAvx512;
  const int threads = at::get_num_threads();
  const int64_t* id = slot_ids.data_ptr<int64_t>();
  const float* w = weights.data_ptr<float>();
  auto run = [&](auto xt, auto wt, auto yt) {
    using X = decltype(xt);
    using W = decltype(wt);
    using Y = decltype(yt);
    return delta(static_cast<const X*>(x.data_ptr()), x.stride(0), d, T, id, w, slot_ids.size(1),
                 static_cast<const W*>(a.data_ptr()), a.stride(0), R, rows, slot_base,
                 members.data(), n_members, rank, static_cast<Y*>(y.data_ptr()), y.stride(0),
                 threads, wide);
  };
  // bf16 as its raw 16-bit patterns
  auto by_y = [&](auto xt, auto wt) {
    return y.scalar_type() == at::kBFloat16 ? run(xt, wt, uint16_t{}) : run(xt, wt, float{});
  };
  auto by_w = [&](auto xt) {
    return a.scalar_type() == at::kBFloat16 ? by_y(xt, uint16_t{}) : by_y(xt, float{});
  };
  const int64_t bad =
      x.scalar_type() == at::kBFloat16 ? by_w(uint16_t{}) : by_w(float{});
  TORCH_CHECK_VALUE(bad == 0, "a slot id lies outside ", slot_base, "..", slot_base + rows - 1);
}

std::string registered;  // this library's ops namespace, once registered

}  // namespace

// Whether the tiles run AVX-512 here (else AVX2/FMA).
static bool has_avx512() { return kHasAvx512; }

// Registers the ops under namespace `ns` (a name no other library loaded in this process has:
// the same source built twice must not register twice) and returns the namespace they live in,
// the first one asked for when called again.
static std::string register_ops(const std::string& ns) {
  if (!registered.empty()) return registered;
  // never freed: the registration lives as long as the process
  auto* lib = new torch::Library(torch::Library::DEF, ns, std::nullopt, __FILE__, __LINE__);
  lib->def("topk_delta(Tensor x, Tensor slot_ids, Tensor weights, Tensor a, Tensor[] bts, "
           "int[] cols, int slot_base, Tensor(a!) y, bool allow_avx512) -> ()");
  lib->impl("topk_delta", torch::dispatch(c10::DispatchKey::CPU, TORCH_FN(topk_delta)));
  registered = ns;
  return registered;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("has_avx512", &has_avx512);
  m.def("register_ops", &register_ops);
}
