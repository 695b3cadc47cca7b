// y[M, N] = x[M, K] @ W[N, K]^T for fp32 on AVX2/FMA CPUs, W pre-packed into 16-column panels.
//
// Decode GEMMs have a handful of rows (tokens) against a weight that streams from DRAM once per
// step. oneDNN's small-M fp32 kernel reaches ~16 GB/s of this box's ~34 GB/s at 8 rows; a plain
// register-blocked micro-kernel over panels laid out [panel][k][16] keeps both FMA ports fed
// and reads each weight byte once per call (see kernels/cpu_panel_gemm.py for the numbers).
// Built at first use by kernels/cpu_panel_gemm.py; threads come from the OpenMP runtime torch
// already loaded (same soname), so the GEMM runs on torch's intra-op team.
#include <immintrin.h>
#include <stdint.h>

namespace {

constexpr int64_t NR = 16;  // output columns per panel: two 8-float AVX registers
constexpr int MR = 6;       // rows per micro-tile: 12 accumulators + 2 weights + 1 broadcast

template <int R>
inline void micro_tile(const float* x, int64_t ldx, const float* panel, int64_t k, float* y,
                       int64_t ldy, int64_t ncols) {
  __m256 acc[R][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    acc[r][0] = _mm256_setzero_ps();
    acc[r][1] = _mm256_setzero_ps();
  }
  for (int64_t i = 0; i < k; ++i) {
    const __m256 w0 = _mm256_loadu_ps(panel + i * NR);
    const __m256 w1 = _mm256_loadu_ps(panel + i * NR + 8);
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
void panel_rows(const float* x, int64_t ldx, const float* panel, int64_t k, float* y,
                int64_t ldy, int64_t ncols, int64_t m) {
  int64_t r = 0;
  for (; r + MR <= m; r += MR) micro_tile<MR>(x + r * ldx, ldx, panel, k, y + r * ldy, ldy, ncols);
  const float* xr = x + r * ldx;
  float* yr = y + r * ldy;
  switch (m - r) {
    case 1: micro_tile<1>(xr, ldx, panel, k, yr, ldy, ncols); break;
    case 2: micro_tile<2>(xr, ldx, panel, k, yr, ldy, ncols); break;
    case 3: micro_tile<3>(xr, ldx, panel, k, yr, ldy, ncols); break;
    case 4: micro_tile<4>(xr, ldx, panel, k, yr, ldy, ncols); break;
    case 5: micro_tile<5>(xr, ldx, panel, k, yr, ldy, ncols); break;
    default: break;
  }
}

}  // namespace

extern "C" {

// Columns per panel, so the Python side packs with the same width the kernel reads.
int64_t molora_panel_width(void) { return NR; }

// x: m rows of k floats, row stride ldx; panels: [ceil(n / 16), k, 16] contiguous, zero padded;
// y: m rows of n floats, row stride ldy. The caller checks shapes, dtypes and strides and passes
// torch's intra-op thread count (OpenMP's own default is per calling thread, and the engine
// steps on a thread of its own).
void molora_panel_gemm(const float* x, int64_t ldx, const float* panels, float* y, int64_t ldy,
                       int64_t m, int64_t n, int64_t k, int threads) {
  const int64_t npanels = (n + NR - 1) / NR;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t p = 0; p < npanels; ++p) {
    const int64_t ncols = (n - p * NR) < NR ? (n - p * NR) : NR;
    panel_rows(x, ldx, panels + p * k * NR, k, y + p * NR, ldy, ncols, m);
  }
}

}  // extern "C"
