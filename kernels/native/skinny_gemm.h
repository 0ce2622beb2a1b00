// The skinny GEMM of decode steps, for one instruction set (included per set by isa_kernels.cpp).
//
//   y[m, n] = sum_k x[m, k] * w[n, k]      x: [M, K]; w: [N, K] rows; y: fp32 [M, N]
//
// A decode step multiplies a handful of rows by a large weight matrix, so the weights' bytes are
// the cost: each weight row is read from memory exactly once. The multiply-add is a policy P:
//   FmaPolicy<W>  x fp32, w fp32 or bf16 (widened by a shift), fp32 fused multiply-adds;
//   the bf16-dot policy (isa_kernels.cpp, CPUs with AVX512-BF16): x and w bf16, vdpbf16ps.
// A policy names X (x's element type), XV/WV/Acc (vector types), kStep (k per vector), loadx,
// loadw, madd and reduce. Accumulation is fp32; the K tail is a scalar loop.

template <typename W>
struct FmaPolicy {
  using X = float;
  using XV = vf;
  using WV = vf;
  using Acc = vf;
  static constexpr int kStep = kLanes;
  static XV loadx(const X* p) { return load(p); }
  static WV loadw(const W* p) { return load(p); }
  static Acc madd(Acc a, XV x, WV w) { return a + x * w; }
  static float reduce(Acc a) { return hsum(a); }
};

// How a tile's first pass over its weight rows requests them (later passes, for more activation
// rows, find the rows in L1): hardware prefetchers alone leave the memory idle between row blocks
// once several activation rows lengthen each block's arithmetic.
//   kPair   the rows kBlocksAhead blocks ahead while a block streams: with one activation row
//           into L1, with two or more the pair prefetch_l2 / prefetch_near (isa_kernels.h);
//   kAhead  each weight row's line kAheadBytes further on into L1 as the row is read
//           (prefetch_ahead, isa_kernels.h; where, below);
//   kNone   a later pass.
enum class Prefetch { kNone, kPair, kAhead };

// Cold fp32 weights on an Intel Xeon, both threads: 8 rows 24.2 -> 29.3 GB/s on the gate/up shape
// and 24.2 -> 25.8 on down, 4 rows 28.8 -> 31.4 and 25.9 -> 30.8, 2 rows 34.3 -> 35.4 and 28.0 ->
// 32.9 (a plain read: 30-32). On an AMD EPYC of family 19h (a 32 KiB L1) the far prefetch into L1
// also evicted the activation rows: 8 rows 13-17 -> 17-23 GB/s on SmolLM2's four layer shapes, 4
// rows 13-20 -> 18-26, 2 rows 19-27 -> 25-29. One row keeps the far prefetch into L1, which
// measured 37.2 against 36.2 GB/s on the Xeon.
constexpr int kBlocksAhead = 4;

// fp32 weights on AMD with AVX-512, two to kAheadMaxRows activation rows over the whole of K,
// where the requests fit L1 beside the rows' activations (ahead_fits, isa_kernels.h): kAhead.
// There the pair left the stream short, where each weight row is one front-to-back stream that a
// request 8 KiB ahead keeps in flight (as for the packed bf16 product, dot_packed_gemm.h). On a
// family-1Ah EPYC, SmolLM2's shapes, 192 MiB of cold matrices a shape, alternated in one process
// (the log's "A twelfth day"): two rows 55.7-68.7 -> 66.4-87.7 GB/s, four 56.0-77.6 ->
// 64.8-84.8, eight (3 x 8 tiles) 42.7 -> 45.0 on qkv and 48.8 -> 51.3 on the LM head, and in a
// fast phase (a `sum` at 75-79 GB/s) 40.5-69.1 -> 43.5-73.3 on the five shapes (down, K in
// chunks, unchanged at 47.6); an fp32 engine, alternated step by step: batch 2 11.92 -> 11.30 ms
// a step, 4 9.85 -> 8.77, 8 12.24 -> 11.75. Sixteen rows lost with it (two passes of eight, their
// activations and the requests overflowing L1: batch 16 21.01 -> 22.88 ms), as did K in chunks
// (the down projection at eight rows, kWideChunkK: its rows' next bytes are another chunk's), so
// those keep the pair.
constexpr int64_t kAheadMaxRows = 8;

// The far prefetch of one weight row's line, and (with two or more rows) the near one.
template <int MB>
static inline void far_prefetch(const void* p) {
  if (MB == 1)
    __builtin_prefetch(p);
  else
    prefetch_l2(p);
}

template <int MB>
static inline void near_prefetch(const void* p) {
  if (MB > 1) prefetch_near(p);
}

// NB weight rows against MB activation rows held in registers (NB x MB accumulators), over K's
// values [k_begin, k_end), their sums written to y (added to it with `add`); when
// M > MB, the next MB rows re-read the same NB weight rows from L1 (NB rows of K <= 2048 fit).
template <typename P, typename W, int NB, int MB, Prefetch PF>
static inline void tile(const typename P::X* x, const W* w, float* y, int64_t N, int64_t K, int64_t n0, int64_t m0,
                        int64_t n_end, int64_t k_begin, int64_t k_end, bool add) {
  typename P::Acc acc[MB][NB];
#pragma GCC unroll 8
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) acc[i][j] = typename P::Acc{};
  const W* wr = w + n0 * K;
  const typename P::X* xr = x + m0 * K;
  int64_t k = k_begin;
  for (; k + P::kStep <= k_end; k += P::kStep) {
    typename P::WV wv[NB];
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) wv[j] = P::loadw(wr + j * K + k);
    if constexpr (PF == Prefetch::kPair) {
      if (n0 + (kBlocksAhead + 1) * NB <= n_end) {
#pragma GCC unroll 8
        for (int j = 0; j < NB; ++j) far_prefetch<MB>(wr + (kBlocksAhead * NB + j) * K + k);
      }
#pragma GCC unroll 8
      for (int j = 0; j < NB; ++j) near_prefetch<MB>(wr + j * K + k);
    }
    if constexpr (PF == Prefetch::kAhead) {
#pragma GCC unroll 8
      for (int j = 0; j < NB; ++j) prefetch_ahead(wr + j * K + k);
    }
#pragma GCC unroll 8
    for (int i = 0; i < MB; ++i) {
      typename P::XV xv = P::loadx(xr + i * K + k);
      // One load for the NB multiply-adds: left to itself GCC folds the load into each of them
      // (NB loads of the same vector), and the 2 x 8 tile ran 30% slower on an Intel Xeon
      // (fp32, 8 rows, weights in L2: 33 against 48 G multiply-adds/s on one core). One weight
      // row per tile keeps the folded load: it is then the only one.
      if constexpr (NB > 1) __asm__("" : "+v"(xv));
#pragma GCC unroll 8
      for (int j = 0; j < NB; ++j) acc[i][j] = P::madd(acc[i][j], xv, wv[j]);
    }
  }
  for (int i = 0; i < MB; ++i) {
    for (int j = 0; j < NB; ++j) {
      float s = P::reduce(acc[i][j]);
      for (int64_t kk = k; kk < k_end; ++kk) s += to_float(xr[i * K + kk]) * to_float(wr[j * K + kk]);
      if (add) y[(m0 + i) * N + n0 + j] += s; else y[(m0 + i) * N + n0 + j] = s;
    }
  }
}

// A tile of exactly `rows` (<= MB) activation rows, so accumulators stay in registers; the first
// pass over a row block requests the weights ahead as PF says.
template <typename P, typename W, int NB, int MB, Prefetch PF>
static inline void tile_rows(const typename P::X* x, const W* w, float* y, int64_t N, int64_t K, int64_t n0,
                             int64_t m0, int64_t n_end, int64_t rows, int64_t k0, int64_t k1, bool add) {
  if constexpr (MB > 0) {
    if (rows != MB) return tile_rows<P, W, NB, MB - 1, PF>(x, w, y, N, K, n0, m0, n_end, rows, k0, k1, add);
    if (m0 == 0) return tile<P, W, NB, MB, PF>(x, w, y, N, K, n0, m0, n_end, k0, k1, add);
    tile<P, W, NB, MB, Prefetch::kNone>(x, w, y, N, K, n0, m0, n_end, k0, k1, add);
  }
}

template <typename P, typename W, int NB, int MB, Prefetch PF>
static inline void row_block(const typename P::X* x, const W* w, float* y, int64_t M, int64_t N, int64_t K, int64_t n0,
                             int64_t n_end, int64_t k0, int64_t k1, bool add) {
  for (int64_t m0 = 0; m0 < M; m0 += MB)
    tile_rows<P, W, NB, MB, PF>(x, w, y, N, K, n0, m0, n_end, std::min<int64_t>(MB, M - m0), k0, k1, add);
}

// Output columns [n_begin, n_end) in row blocks of NB weight rows; with k_chunk > 0, the blocks
// are walked once a chunk of k_chunk values of K (a multiple of the vector width), each chunk's
// sums added to the last one's.
template <typename P, typename W, int NB, int MB, Prefetch PF>
static inline void row_blocks(const typename P::X* x, const W* w, float* y, int64_t M, int64_t N, int64_t K,
                              int64_t n_begin, int64_t n_end, int64_t k_chunk = 0) {
  int64_t k0 = 0;
  do {
    const int64_t k1 = k_chunk > 0 ? std::min(K, k0 + k_chunk) : K;
    int64_t n = n_begin;
    for (; n + NB <= n_end; n += NB) row_block<P, W, NB, MB, PF>(x, w, y, M, N, K, n, n_end, k0, k1, k0 > 0);
    for (; n < n_end; ++n) row_block<P, W, 1, MB, PF>(x, w, y, M, N, K, n, n_end, k0, k1, k0 > 0);
    k0 = k1;
  } while (k0 < K);
}

// One activation row (on AMD): S weight rows at a time, one from each of S equal parts of the
// thread's rows, so that each part is one stream read front to back and the S streams run
// together, the activation vectors loaded once for all S. Four accumulators a row so the adds do
// not wait on each other; a row's sums are added in the same order whatever S, so the result
// does not depend on it. On an AMD EPYC of family 19h, 1 GiB of rows of 576 in a fast phase (a
// streaming sum 60-69 GB/s): one stream read fp32 rows at 51-59 GB/s, three at 60-68 (two and
// four less than three), bf16 rows 61-63 against 66-67; in slow phases (about 36 GB/s) all read
// the same. An fp32 engine at one row, alternated in one process: 10.4-11.2 ms a step against
// 10.9-12.5, faster in ten pairs of ten (the log's "Three weight streams at one row"). Software
// prefetch made no difference to a single stream and is not used.
constexpr int kGemvStreams = 3;

template <typename P, typename W, int S>
static inline void dot_rows(const typename P::X* x, const W* w, float* y, int64_t K, const int64_t (&rows)[S]) {
  const W* wr[S];
  typename P::Acc a[S][4];
#pragma GCC unroll 4
  for (int q = 0; q < S; ++q) {
    wr[q] = w + rows[q] * K;
    a[q][0] = a[q][1] = a[q][2] = a[q][3] = typename P::Acc{};
  }
  int64_t k = 0;
  for (; k + 4 * P::kStep <= K; k += 4 * P::kStep) {
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const typename P::XV xv = P::loadx(x + k + j * P::kStep);
#pragma GCC unroll 4
      for (int q = 0; q < S; ++q) a[q][j] = P::madd(a[q][j], xv, P::loadw(wr[q] + k + j * P::kStep));
    }
  }
  for (; k + P::kStep <= K; k += P::kStep) {
    const typename P::XV xv = P::loadx(x + k);
#pragma GCC unroll 4
    for (int q = 0; q < S; ++q) a[q][0] = P::madd(a[q][0], xv, P::loadw(wr[q] + k));
  }
#pragma GCC unroll 4
  for (int q = 0; q < S; ++q) {
    float s = P::reduce((a[q][0] + a[q][1]) + (a[q][2] + a[q][3]));
    for (int64_t kk = k; kk < K; ++kk) s += to_float(x[kk]) * to_float(wr[q][kk]);
    y[rows[q]] = s;
  }
}

template <typename P, typename W>
static void gemv(const typename P::X* x, const W* w, float* y, int64_t K, int64_t n_begin, int64_t n_end) {
  constexpr int S = kGemvStreams;
  const int64_t part = (n_end - n_begin) / S;
  for (int64_t i = 0; i < part; ++i) {
    int64_t rows[S];
#pragma GCC unroll 4
    for (int q = 0; q < S; ++q) rows[q] = n_begin + q * part + i;
    dot_rows<P, W, S>(x, w, y, K, rows);
  }
  for (int64_t n = n_begin + S * part; n < n_end; ++n) dot_rows<P, W, 1>(x, w, y, K, {n});
}

// fp32 weights on AMD with 32 vector registers: three weight rows a wide tile (24 accumulators).
// At eight rows the 2 x 8 tile loads ten vectors for 16 multiply-adds (3 x 8: 11 for 24), and on
// an AMD EPYC of family 19h it ran at about half the FMA units' peak even with the weights in L2
// (27.9-29.6 GB/s on the o projection's shape, 27.8-28.7 on down's; 3 x 8: 31.3 and 34.8-36.6).
// Cold, down gained 15-18% and the other shapes moved within the noise; an engine at batch 8,
// alternated in one process, either first: 342.5-377.4 against 338.8-366.5 tok/s, faster in nine
// pairs of nine (the log's "fp32 at eight rows: three weight rows a tile"). An earlier Intel Xeon
// measured 3 x 8 as 2 x 8 cold: elsewhere the tile stays.
#if GRT_VEC_BYTES == 64
constexpr int kWideNbAmdF32 = 3;
#else
constexpr int kWideNbAmdF32 = GRT_WIDE_NB;
#endif

// ... and K in chunks of kWideChunkK values where the rows' activations fill an L1 of 48 KiB (eight
// rows of 1,536: SmolLM2's down projection). Each tile re-reads every activation row, and when they
// no longer fit L1 beside the weights streaming through it they came from L2 for every tile: down
// read 65-68 GB/s hot at eight rows where the other shapes read 76-94. A chunk's activations (12
// KiB at eight rows) stay in L1 across the tiles; each weight row is still read once, a chunk at a
// time. On a family-1Ah EPYC, alternated in one process (the log's "An eleventh day"): down at
// eight rows 45.2-48.3 against 41.3-42.0 GB/s cold, at sixteen 28.7-31.3 against 27.5-27.7; an
// fp32 engine at batch 8 12.42-12.74 against 12.78-13.01 ms a step in three runs. Smaller
// activations lost from it (six rows of 1,536: 47.4 against 53.0 GB/s; sixteen of 576: 33.6
// against 34.8), as did chunks of 256, 512 and 768 values (cold).
constexpr int64_t kWideChunkK = 384;
constexpr int64_t kWideChunkAbove = 48 << 10;

// Output columns [n_begin, n_end): one thread's share. One row: the three streams above on AMD,
// weight rows in pairs elsewhere (kAmdStreams). Up to GRT_SMALL_MB rows: tiles of GRT_SMALL_NB
// weight rows (one: a single front-to-back stream, which measured fastest for 2-4 rows); more
// rows: GRT_WIDE_NB weight rows x GRT_WIDE_MB activation rows, so each weight vector, once in a
// register, serves that many rows (kWideNbAmdF32 of them for fp32 weights on AMD). The weights
// are requested ahead as `Prefetch` says: kAhead for fp32 on AMD from two to kAheadMaxRows rows
// over the whole of K, kPair otherwise.
template <typename P, typename W>
static void skinny_gemm(const typename P::X* x, const W* w, float* y, int64_t M, int64_t N, int64_t K,
                        int64_t n_begin, int64_t n_end) {
  constexpr bool kF32 = std::is_same_v<P, FmaPolicy<float>>;
  constexpr Prefetch kPair = Prefetch::kPair, kAhead = Prefetch::kAhead;
  if (M == 1 && graphrt_native::kAmdStreams) return gemv<P, W>(x, w, y, K, n_begin, n_end);
  if (M == 1) return row_blocks<P, W, 2, 1, kPair>(x, w, y, M, N, K, n_begin, n_end);
  // each of a tile's weight rows is a stream, and a row block reads every activation row
  const auto ahead = [&](int64_t streams) {
    return kF32 && GRT_VEC_BYTES == 64 && graphrt_native::kAmdStreams && M <= kAheadMaxRows &&
           graphrt_native::ahead_fits(streams, M * K * int64_t(sizeof(float)));
  };
  if (M <= GRT_SMALL_MB) {
    if (ahead(GRT_SMALL_NB))
      return row_blocks<P, W, GRT_SMALL_NB, GRT_SMALL_MB, kAhead>(x, w, y, M, N, K, n_begin, n_end);
    return row_blocks<P, W, GRT_SMALL_NB, GRT_SMALL_MB, kPair>(x, w, y, M, N, K, n_begin, n_end);
  }
  if constexpr (kF32)
    if (graphrt_native::kAmdStreams) {
      constexpr int NB = kWideNbAmdF32, MB = GRT_WIDE_MB;
      if (M * K * int64_t(sizeof(float)) >= kWideChunkAbove)
        return row_blocks<P, W, NB, MB, kPair>(x, w, y, M, N, K, n_begin, n_end, kWideChunkK);
      if (ahead(NB)) return row_blocks<P, W, NB, MB, kAhead>(x, w, y, M, N, K, n_begin, n_end);
      return row_blocks<P, W, NB, MB, kPair>(x, w, y, M, N, K, n_begin, n_end);
    }
  row_blocks<P, W, GRT_WIDE_NB, GRT_WIDE_MB, kPair>(x, w, y, M, N, K, n_begin, n_end);
}
