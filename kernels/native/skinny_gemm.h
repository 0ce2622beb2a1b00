#define GRT_PF 4
// The skinny GEMM of decode steps, for one instruction set (included per set by isa_kernels.cpp).
//
//   y[m, n] = sum_k x[m, k] * w[n, k]      x: fp32 [M, K]; w: [N, K] rows, fp32 or bf16; y: fp32 [M, N]
//
// A decode step multiplies a handful of rows by a large weight matrix, so the weights' bytes are
// the cost: each weight row is read from memory exactly once. NB weight rows are loaded a vector
// at a time and multiplied with MB activation rows held in registers (NB x MB accumulators); when
// M > MB, the next MB rows re-read the same NB weight rows from L1 (NB rows of K <= 2048 floats fit).
// Accumulation is fp32; the K tail (K not a multiple of the vector width) is a scalar loop.

// PREFETCH: ask for the next NB weight rows while these stream (the first pass over a row block
// only; later passes over it hit L1). Hardware prefetchers alone leave the memory idle between
// row blocks once several activation rows make each block's arithmetic longer.
template <typename W, int NB, int MB, bool PREFETCH>
static inline void tile(const float* x, const W* w, float* y, int64_t N, int64_t K, int64_t n0, int64_t m0,
                        int64_t n_end) {
  vf acc[MB][NB];
#pragma GCC unroll 8
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) acc[i][j] = vf{};
  const W* wr = w + n0 * K;
  const float* xr = x + m0 * K;
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    vf wv[NB];
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) wv[j] = load(wr + j * K + k);
    if constexpr (PREFETCH) {
      if (n0 + (GRT_PF + 1) * NB <= n_end) {
#pragma GCC unroll 8
        for (int j = 0; j < NB; ++j) __builtin_prefetch(wr + (GRT_PF * NB + j) * K + k);
      }
    }
#pragma GCC unroll 8
    for (int i = 0; i < MB; ++i) {
      const vf xv = load(xr + i * K + k);
#pragma GCC unroll 8
      for (int j = 0; j < NB; ++j) acc[i][j] += xv * wv[j];
    }
  }
  for (int i = 0; i < MB; ++i) {
    for (int j = 0; j < NB; ++j) {
      float s = hsum(acc[i][j]);
      for (int64_t kk = k; kk < K; ++kk) s += xr[i * K + kk] * to_float(wr[j * K + kk]);
      y[(m0 + i) * N + n0 + j] = s;
    }
  }
}

// The last M % MB rows: a tile of exactly that many rows, so accumulators stay in registers.
template <typename W, int NB, int MB>
static inline void tail_tile(const float* x, const W* w, float* y, int64_t N, int64_t K, int64_t n0, int64_t m0,
                             int64_t rows) {
  if constexpr (MB > 0) {
    if (rows == MB) {
      tile<W, NB, MB, false>(x, w, y, N, K, n0, m0, 0);
    } else {
      tail_tile<W, NB, MB - 1>(x, w, y, N, K, n0, m0, rows);
    }
  }
}

template <typename W, int NB>
static inline void row_block(const float* x, const W* w, float* y, int64_t M, int64_t N, int64_t K, int64_t n0,
                             int64_t n_end) {
  int64_t m0 = 0;
  if (M >= GRT_MB) {
    tile<W, NB, GRT_MB, true>(x, w, y, N, K, n0, 0, n_end);
    m0 = GRT_MB;
  } else {
    switch (M) {  // fewer rows than a tile: one pass, prefetching
      case 1: tile<W, NB, 1, true>(x, w, y, N, K, n0, 0, n_end); return;
      case 2: tile<W, NB, (GRT_MB > 2 ? 2 : 1), true>(x, w, y, N, K, n0, 0, n_end); m0 = (GRT_MB > 2 ? 2 : 1); break;
      default: tile<W, NB, (GRT_MB > 3 ? 3 : 1), true>(x, w, y, N, K, n0, 0, n_end); m0 = (GRT_MB > 3 ? 3 : 1); break;
    }
  }
  for (; m0 + GRT_MB <= M; m0 += GRT_MB) tile<W, NB, GRT_MB, false>(x, w, y, N, K, n0, m0, 0);
  if (m0 < M) tail_tile<W, NB, GRT_MB - 1>(x, w, y, N, K, n0, m0, M - m0);
}

// Output columns [n_begin, n_end): one thread's share.
template <typename W>
static void skinny_gemm(const float* x, const W* w, float* y, int64_t M, int64_t N, int64_t K, int64_t n_begin,
                        int64_t n_end) {
  int64_t n = n_begin;
  for (; n + 4 <= n_end; n += 4) row_block<W, 4>(x, w, y, M, N, K, n, n_end);
  for (; n < n_end; ++n) row_block<W, 1>(x, w, y, M, N, K, n, n_end);
}
