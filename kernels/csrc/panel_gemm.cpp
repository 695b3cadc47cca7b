// y[M, N] = x[M, K] @ W[N, K]^T on AVX2/FMA (or AVX-512F) CPUs, W pre-packed into 16-column
// panels of fp32 or bf16, x and y fp32, accumulation in fp32.
//
// Decode GEMMs have a handful of rows (tokens) against a weight that streams from DRAM once per
// step. A plain register-blocked micro-kernel over panels laid out [panel][k][16] keeps the FMA
// ports fed and reads each weight byte once per call.
// bf16 panels halve the bytes a step streams: each 16-column row of a panel is widened to fp32
// in registers (a bf16 is the top half of an fp32): one shift and one mask per 16 weights.
// Built as a PyTorch C++ extension by kernels/cpu_panel_gemm.py (at `make models`, at image build,
// else at first use) and called as a torch op (`register_ops`) on tensors it checks itself;
// threads come from the OpenMP runtime torch already loaded (same soname), so the GEMM runs on
// torch's intra-op team.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <immintrin.h>
#include <pybind11/pybind11.h>
#include <stdint.h>
#include <torch/library.h>

#include <string>
#include <type_traits>

namespace {

constexpr int64_t NR = 16;  // output columns per panel: two 8-float AVX registers
constexpr int MR = 6;       // rows per micro-tile: 12 accumulators + 2 weights + 1 broadcast

// One 16-wide row of a panel as two 8-float registers.
inline void load_row(const float* row, __m256& w0, __m256& w1) {
  w0 = _mm256_loadu_ps(row);
  w1 = _mm256_loadu_ps(row + 8);
}

// A bf16 row is packed interleaved (column j at position 2j, column 8 + j at 2j + 1), so each
// 32-bit lane holds column j in its low half and column 8 + j in its high half: a shift and a
// mask widen all 16 to fp32, with no cross-lane shuffle.
inline void load_row(const uint16_t* row, __m256& w0, __m256& w1) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row));
  w0 = _mm256_castsi256_ps(_mm256_slli_epi32(bits, 16));
  w1 = _mm256_castsi256_ps(_mm256_and_si256(bits, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

template <int R, typename W>
inline void micro_tile(const float* x, int64_t ldx, const W* panel, int64_t k, float* y,
                       int64_t ldy, int64_t ncols) {
  __m256 acc[R][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    acc[r][0] = _mm256_setzero_ps();
    acc[r][1] = _mm256_setzero_ps();
  }
  for (int64_t i = 0; i < k; ++i) {
    __m256 w0, w1;
    load_row(panel + i * NR, w0, w1);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 xb = _mm256_broadcast_ss(x + r * ldx + i);
      acc[r][0] = _mm256_fmadd_ps(xb, w0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(xb, w1, acc[r][1]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    if (ncols == NR) {
      _mm256_storeu_ps(y + r * ldy, acc[r][0]);
      _mm256_storeu_ps(y + r * ldy + 8, acc[r][1]);
    } else {  // the last panel of an N that is not a multiple of 16
      alignas(32) float tmp[NR];
      _mm256_store_ps(tmp, acc[r][0]);
      _mm256_store_ps(tmp + 8, acc[r][1]);
      for (int64_t j = 0; j < ncols; ++j) y[r * ldy + j] = tmp[j];
    }
  }
}

// Calls tile(Rows<R>{}, row) over every row tile of an m-row x: full tiles of MaxR rows, then one
// tile of the m % MaxR rows left. R is a compile-time constant in each call, so every tile height
// is its own unrolled micro-kernel; the panel (k * 64 bytes) stays in L1/L2 across the row tiles,
// so DRAM sees it once.
template <int R>
using Rows = std::integral_constant<int, R>;

template <int R, typename Tile>
inline void last_tile(int64_t rows, int64_t row, const Tile& tile) {
  if constexpr (R > 0) {
    if (rows == R) {
      tile(Rows<R>{}, row);
    } else {
      last_tile<R - 1>(rows, row, tile);
    }
  }
}

template <int MaxR, typename Tile>
inline void row_tiles(int64_t m, const Tile& tile) {
  int64_t r = 0;
  for (; r + MaxR <= m; r += MaxR) tile(Rows<MaxR>{}, r);
  last_tile<MaxR - 1>(m - r, r, tile);
}

// The same on AVX-512 CPUs: a 16-column panel row is one 16-float register, so a tile holds
// twice the rows in the same registers and each FMA does twice the work. Compiled for
// AVX-512F by attribute (the library is built without -march, so it runs on AVX2-only CPUs) and
// taken only where the CPU reports AVX-512F.
constexpr int MR512 = 12;  // 12 accumulators + 1 weight row + 1 broadcast of 32 registers

__attribute__((target("avx512f"))) inline __m512 load_row512(const float* row) {
  return _mm512_loadu_ps(row);
}

// A bf16 row's 32-bit lanes hold column j low and column 8 + j high (see load_row): widen both
// halves as on AVX2 and join them into one register in column order.
__attribute__((target("avx512f"))) inline __m512 load_row512(const uint16_t* row) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row));
  const __m256i lo = _mm256_slli_epi32(bits, 16);
  const __m256i hi = _mm256_and_si256(bits, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u)));
  return _mm512_castsi512_ps(_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1));
}

template <int R, typename W>
__attribute__((target("avx512f"))) void micro_tile512(const float* x, int64_t ldx,
                                                      const W* panel, int64_t k, float* y,
                                                      int64_t ldy, int64_t ncols) {
  __m512 acc[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; ++i) {
    const __m512 w = load_row512(panel + i * NR);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + i]), w, acc[r]);
    }
  }
  const __mmask16 keep = ncols == NR ? static_cast<__mmask16>(0xFFFF)
                                     : static_cast<__mmask16>((1u << ncols) - 1u);
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * ldy, keep, acc[r]);
}

const bool kHasAvx512 = __builtin_cpu_supports("avx512f");

template <typename W>
void panel_gemm(const float* x, int64_t ldx, const W* panels, float* y, int64_t ldy, int64_t m,
                int64_t n, int64_t k, int threads, bool allow_avx512) {
  const int64_t npanels = (n + NR - 1) / NR;
  const bool wide = allow_avx512 && kHasAvx512;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t p = 0; p < npanels; ++p) {
    const int64_t ncols = (n - p * NR) < NR ? (n - p * NR) : NR;
    const W* panel = panels + p * k * NR;
    float* yp = y + p * NR;
    if (wide) {
      row_tiles<MR512>(m, [&](auto rows, int64_t r) {
        micro_tile512<decltype(rows)::value, W>(x + r * ldx, ldx, panel, k, yp + r * ldy, ldy,
                                                ncols);
      });
    } else {
      row_tiles<MR>(m, [&](auto rows, int64_t r) {
        micro_tile<decltype(rows)::value, W>(x + r * ldx, ldx, panel, k, yp + r * ldy, ldy,
                                             ncols);
      });
    }
  }
}

// y [m, n] fp32 contiguous (written) = x [m, k] fp32 (rows `x.stride(0)` apart, unit stride
// along k) @ W^T, W packed as `panels` [ceil(n / 16), k, 16] contiguous, zero padded, fp32 or
// bf16 (the raw 16-bit patterns, as torch stores bfloat16), n = `out_features`; every one a CPU
// tensor, all checked here. Threads are torch's intra-op count (OpenMP's own default is per
// calling thread, and the engine steps on a thread of its own); `allow_avx512` false keeps the
// AVX2 tiles on an AVX-512 CPU (tests check both against their twin).
void gemm(const at::Tensor& x, const at::Tensor& panels, int64_t out_features, const at::Tensor& y,
          bool allow_avx512) {
  TORCH_CHECK_VALUE(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
                    "panel_linear needs 2-D fp32 or bf16 CPU input, got ", x.scalar_type(), " ",
                    x.sizes(), " on ", x.device());
  TORCH_CHECK_VALUE(x.size(1) == 0 || x.stride(1) == 1, "x needs unit stride along features");
  const int64_t m = x.size(0), k = x.size(1), n = out_features;
  const auto dtype = panels.scalar_type();
  TORCH_CHECK_VALUE(panels.dim() == 3 && panels.size(2) == NR &&
                        (dtype == at::kFloat || dtype == at::kBFloat16) &&
                        panels.is_contiguous() && panels.device().is_cpu(),
                    "panels must be contiguous fp32 or bf16 CPU [blocks, in, ", NR, "], got ",
                    dtype, " ", panels.sizes());
  TORCH_CHECK_VALUE(panels.size(1) == k, "input has ", k, " features, the weight takes ",
                    panels.size(1));
  TORCH_CHECK_VALUE(n >= 0 && panels.size(0) == (n + NR - 1) / NR, "panels of ",
                    panels.size(0), " blocks cannot hold ", n, " output columns");
  TORCH_CHECK_VALUE(y.dim() == 2 && y.size(0) == m && y.size(1) == n &&
                        y.scalar_type() == at::kFloat && y.is_contiguous() && y.device().is_cpu(),
                    "y must be a contiguous fp32 CPU [", m, ", ", n, "]");
  if (m == 0 || n == 0) return;
  const int threads = at::get_num_threads();
  float* yp = y.data_ptr<float>();
  if (dtype == at::kBFloat16) {
    panel_gemm(x.data_ptr<float>(), x.stride(0), static_cast<const uint16_t*>(panels.data_ptr()),
               yp, n, m, n, k, threads, allow_avx512);
  } else {
    panel_gemm(x.data_ptr<float>(), x.stride(0), panels.data_ptr<float>(), yp, n, m, n, k,
               threads, allow_avx512);
  }
}

std::string registered;  // this library's ops namespace, once registered

}  // namespace

// Columns per panel, so the Python side packs with the same width the kernel reads.
static int64_t panel_width() { return NR; }

// Whether the GEMMs run their AVX-512 tiles here (else the AVX2/FMA ones).
static bool has_avx512() { return kHasAvx512; }

// Registers the ops under namespace `ns` (a name no other library loaded in this process has:
// the same source built twice must not register twice) and returns the namespace they live in,
// the first one asked for when called again.
static std::string register_ops(const std::string& ns) {
  if (!registered.empty()) return registered;
  // never freed: the registration lives as long as the process
  auto* lib = new torch::Library(torch::Library::DEF, ns, std::nullopt, __FILE__, __LINE__);
  lib->def("gemm(Tensor x, Tensor panels, int out_features, Tensor(a!) y, "
           "bool allow_avx512) -> ()");
  lib->impl("gemm", torch::dispatch(c10::DispatchKey::CPU, TORCH_FN(gemm)));
  registered = ns;
  return registered;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("panel_width", &panel_width);
  m.def("has_avx512", &has_avx512);
  m.def("register_ops", &register_ops);
}
