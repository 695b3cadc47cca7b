// y[M, N] = x[M, K] @ W[N, K]^T on AVX2/FMA CPUs, W pre-packed into 16-column panels of fp32 or
// bf16, x and y fp32, accumulation in fp32.
//
// Decode GEMMs have a handful of rows (tokens) against a weight that streams from DRAM once per
// step. oneDNN's small-M fp32 kernel reaches ~16 GB/s of this box's ~34 GB/s at 8 rows; a plain
// register-blocked micro-kernel over panels laid out [panel][k][16] keeps both FMA ports fed
// and reads each weight byte once per call (see kernels/cpu_panel_gemm.py for the numbers).
// bf16 panels halve the bytes a step streams: each 16-column row of a panel is widened to fp32
// in registers (a bf16 is the top half of an fp32): one shift and one mask per 16 weights.
// Built as a PyTorch C++ extension by kernels/cpu_panel_gemm.py (at `make models`, at image build,
// else at first use); threads come from the OpenMP runtime torch already loaded (same soname), so
// the GEMM runs on torch's intra-op team.
#include <immintrin.h>
#include <pybind11/pybind11.h>
#include <stdint.h>

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

// Every row of x against one panel: full tiles of MR rows, then one tile for the remainder.
// The panel (k * 64 bytes) stays in L1/L2 across the row tiles, so DRAM sees it once.
template <typename W>
void panel_rows(const float* x, int64_t ldx, const W* panel, int64_t k, float* y, int64_t ldy,
                int64_t ncols, int64_t m) {
  int64_t r = 0;
  for (; r + MR <= m; r += MR) {
    micro_tile<MR, W>(x + r * ldx, ldx, panel, k, y + r * ldy, ldy, ncols);
  }
  const float* xr = x + r * ldx;
  float* yr = y + r * ldy;
  switch (m - r) {
    case 1: micro_tile<1, W>(xr, ldx, panel, k, yr, ldy, ncols); break;
    case 2: micro_tile<2, W>(xr, ldx, panel, k, yr, ldy, ncols); break;
    case 3: micro_tile<3, W>(xr, ldx, panel, k, yr, ldy, ncols); break;
    case 4: micro_tile<4, W>(xr, ldx, panel, k, yr, ldy, ncols); break;
    case 5: micro_tile<5, W>(xr, ldx, panel, k, yr, ldy, ncols); break;
    default: break;
  }
}

template <typename W>
void panel_gemm(const float* x, int64_t ldx, const W* panels, float* y, int64_t ldy, int64_t m,
                int64_t n, int64_t k, int threads) {
  const int64_t npanels = (n + NR - 1) / NR;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t p = 0; p < npanels; ++p) {
    const int64_t ncols = (n - p * NR) < NR ? (n - p * NR) : NR;
    panel_rows(x, ldx, panels + p * k * NR, k, y + p * NR, ldy, ncols, m);
  }
}

}  // namespace

// Columns per panel, so the Python side packs with the same width the kernel reads.
static int64_t panel_width() { return NR; }

// x: m rows of k floats, row stride ldx; panels: [ceil(n / 16), k, 16] contiguous, zero padded,
// fp32 or bf16 (the raw 16-bit patterns, as torch stores bfloat16); y: m rows of n floats, row
// stride ldy. Addresses come as integers: the caller (cpu_panel_gemm.panel_linear) checks shapes,
// dtypes and strides and passes torch's intra-op thread count (OpenMP's own default is per
// calling thread, and the engine steps on a thread of its own).
static void gemm_fp32(uintptr_t x, int64_t ldx, uintptr_t panels, uintptr_t y, int64_t ldy,
                      int64_t m, int64_t n, int64_t k, int threads) {
  panel_gemm(reinterpret_cast<const float*>(x), ldx, reinterpret_cast<const float*>(panels),
             reinterpret_cast<float*>(y), ldy, m, n, k, threads);
}

static void gemm_bf16(uintptr_t x, int64_t ldx, uintptr_t panels, uintptr_t y, int64_t ldy,
                      int64_t m, int64_t n, int64_t k, int threads) {
  panel_gemm(reinterpret_cast<const float*>(x), ldx, reinterpret_cast<const uint16_t*>(panels),
             reinterpret_cast<float*>(y), ldy, m, n, k, threads);
}

// The GEMMs release the GIL: the engine's step thread and the server's event loop run beside them.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.def("panel_width", &panel_width);
  m.def("gemm_fp32", &gemm_fp32, py::call_guard<py::gil_scoped_release>());
  m.def("gemm_bf16", &gemm_bf16, py::call_guard<py::gil_scoped_release>());
}
