// The product over bf16 weights packed for the tiles (kernels/packed_bf16.py) on AVX512-BF16's dot
// product, for CPUs without AMX (included by isa_kernels.cpp in the avx512bf16 namespace).
//
//   out[m, n] = bf16(sum_k x[m, k] * w[n, k] + bias[n])     x: bf16 [M, K]; out: bf16 [M, N]
//
// Packed, k-step s of the block of output columns n.. n + 31 is 2 KiB: for each half h and pair
// p, one vector whose lane c holds w[n + 16 h + c, 32 s + 2 p], w[n + 16 h + c, 32 s + 2 p + 1].
// vdpbf16ps of that vector and the pair x[m, 32 s + 2 p .. + 1] broadcast to every lane adds both
// products into the 16 columns' own lanes, so a block's sums end in the output's order, with no
// sum across lanes: the row-major kernel (skinny_gemm.h) ends each output with one, a reduction
// for every 18 dot products at SmolLM2's width, which at eight rows made its arithmetic as long as
// the memory's time. Up to kDotPackedRows activation rows at a time: 16 accumulators and one
// weight vector in registers, each pair the instruction's embedded broadcast; more rows take
// further passes over the block, which the first pass left in cache. A k-step is read in memory
// order (the first half's 16 vectors, then the second's) and a block is one stream read front to
// back. At four or more rows on AMD its lines are requested 8 KiB ahead (kDotAheadRows, below);
// 1 or 2 KiB ahead had measured the same or slower on an AMD EPYC of family 19h.
// Below four rows two accumulators a row and half take turns, so that one row's dot products do
// not wait on each other.

constexpr int kDotPackedRows = 8;

// With four or more activation rows on AMD (where the requests fit L1 beside the pass's
// activations: ahead_fits, isa_kernels.h), the first pass over a block requests each weight
// vector's line kAheadBytes further on into L1 as it reads the vector: with four to eight dot
// products a vector the core did not keep enough of the stream in flight, and the hardware
// prefetchers alone left the memory partly idle. On a family-1Ah EPYC, SmolLM2's shapes, 256 MiB
// of cold matrices a shape, alternated in one process: eight rows 33.4-53.6 -> 46.2-66.1 GB/s on
// the four layer shapes and 52.8 -> 74.9 on the LM head, four rows 43.7-60.8 -> 50.1-70.5; with
// the weights in cache 0-8% slower. A bf16 engine, alternated step by step: batch 8 8.12 -> 6.08
// ms a step, 4 6.29 -> 5.66, 16 11.07 -> 9.94; at batch 2 it was 3% slower (4.94 -> 5.09), and
// one row's three streams (dot_packed_row_streams) read 1-6% slower with it: neither takes it.
// 6 KiB ahead and 12-16 KiB measured about the same as 8, and into L2 a little slower than into
// L1 (the log's "A twelfth day").
constexpr int kDotAheadRows = 4;

// acc + the pairwise products of w and the pair at `pair` in every lane: one instruction, the pair
// an embedded broadcast from memory. (Spelled with intrinsics, GCC broadcast each pair once for
// both halves of a block and kept the 128 broadcasts of a k-step on the stack.)
static inline __m512 dot_broadcast(__m512 acc, __m512bh w, const uint32_t* pair) {
  __asm__("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*pair));
  return acc;
}

template <int MB, bool PREFETCH>
static inline void dot_packed_tile(const uint16_t* x, const uint16_t* block, const float* bias, uint16_t* out,
                                   int64_t N, int64_t K, int64_t m0, int64_t n,
                                   bool aligned) {
  constexpr int C = MB < 4 ? 2 : 1;
  __m512 acc[C][MB][2];
#pragma GCC unroll 2
  for (int c = 0; c < C; ++c)
#pragma GCC unroll 8
    for (int i = 0; i < MB; ++i) acc[c][i][0] = acc[c][i][1] = _mm512_setzero_ps();
  const int64_t P = K / 2;  // activation pairs a row
  const uint32_t* xr[MB];
#pragma GCC unroll 8
  for (int i = 0; i < MB; ++i) xr[i] = reinterpret_cast<const uint32_t*>(x) + (m0 + i) * P;
  for (int64_t s = 0; s < K / 32; ++s) {
    const uint16_t* step = block + s * 1024;
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
#pragma GCC unroll 16
      for (int p = 0; p < 16; ++p) {
        const uint16_t* at = step + h * 512 + p * 32;
        if constexpr (PREFETCH) prefetch_ahead(at);
        const __m512bh w = (__m512bh)_mm512_loadu_si512(at);
#pragma GCC unroll 8
        for (int i = 0; i < MB; ++i) acc[p % C][i][h] = dot_broadcast(acc[p % C][i][h], w, xr[i] + s * 16 + p);
      }
    }
  }
  const __m512 b0 = bias != nullptr ? _mm512_loadu_ps(bias + n) : _mm512_setzero_ps();
  const __m512 b1 = bias != nullptr ? _mm512_loadu_ps(bias + n + 16) : _mm512_setzero_ps();
#pragma GCC unroll 8
  for (int i = 0; i < MB; ++i) {
    __m512 lo = acc[0][i][0], hi = acc[0][i][1];
    if constexpr (C == 2) lo = _mm512_add_ps(lo, acc[1][i][0]), hi = _mm512_add_ps(hi, acc[1][i][1]);
    store_packed_row(lo, hi, b0, b1, out + (m0 + i) * N + n, aligned);
  }
}

template <int MB>
static inline void dot_packed_pass(const uint16_t* x, const uint16_t* block, const float* bias, uint16_t* out,
                                   int64_t N, int64_t K, int64_t m0, int64_t n, bool aligned, int64_t rows) {
  if constexpr (MB > 1) {
    if (rows != MB)
      return dot_packed_pass<MB - 1>(x, block, bias, out, N, K, m0, n, aligned, rows);
  }
  if (m0 == 0 && MB >= kDotAheadRows && graphrt_native::kAmdStreams &&
      graphrt_native::ahead_fits(1, MB * K * int64_t(sizeof(uint16_t))))
    dot_packed_tile<MB, true>(x, block, bias, out, N, K, m0, n, aligned);
  else
    dot_packed_tile<MB, false>(x, block, bias, out, N, K, m0, n, aligned);
}

// out [M, N] bf16 over output columns [n0, n1) (multiples of 32); x bf16 [M, K], any M, K a
// multiple of 32; bias fp32 [N] or null.
static void dot_packed_rows(const uint16_t* x, const uint16_t* w, const float* bias, uint16_t* out, int64_t M,
                            int64_t N, int64_t K, int64_t n0, int64_t n1) {
  const bool aligned = reinterpret_cast<uintptr_t>(out) % 64 == 0 && N % 32 == 0;
  for (int64_t n = n0; n < n1; n += 32) {
    const uint16_t* block = w + n * K;
    for (int64_t m0 = 0; m0 < M; m0 += kDotPackedRows)
      dot_packed_pass<kDotPackedRows>(x, block, bias, out, N, K, m0, n, aligned,
                                      std::min<int64_t>(kDotPackedRows, M - m0));
  }
  _mm_sfence();  // the streaming stores, visible before the caller's threads join
}

// One activation row against S blocks of 32 columns at once, each read front to back: S streams
// together, the pair of activations broadcast from memory for each. Each block's sums are added
// as dot_packed_tile<1, false> adds them, so the result is the same bits.
template <int S>
static inline void dot_packed_streams(const uint16_t* x, const uint16_t* w, const float* bias, uint16_t* out,
                                      int64_t K, const int64_t (&n)[S], bool aligned) {
  __m512 acc[S][2][2];  // [block][accumulator][half]
#pragma GCC unroll 4
  for (int b = 0; b < S; ++b) acc[b][0][0] = acc[b][0][1] = acc[b][1][0] = acc[b][1][1] = _mm512_setzero_ps();
  const uint32_t* xr = reinterpret_cast<const uint32_t*>(x);
  const uint16_t* block[S];
#pragma GCC unroll 4
  for (int b = 0; b < S; ++b) block[b] = w + n[b] * K;
  for (int64_t s = 0; s < K / 32; ++s) {
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
#pragma GCC unroll 16
      for (int p = 0; p < 16; ++p) {
#pragma GCC unroll 4
        for (int b = 0; b < S; ++b) {
          const __m512bh wv = (__m512bh)_mm512_loadu_si512(block[b] + s * 1024 + h * 512 + p * 32);
          acc[b][p % 2][h] = dot_broadcast(acc[b][p % 2][h], wv, xr + s * 16 + p);
        }
      }
    }
  }
#pragma GCC unroll 4
  for (int b = 0; b < S; ++b) {
    const __m512 b0 = bias != nullptr ? _mm512_loadu_ps(bias + n[b]) : _mm512_setzero_ps();
    const __m512 b1 = bias != nullptr ? _mm512_loadu_ps(bias + n[b] + 16) : _mm512_setzero_ps();
    store_packed_row(_mm512_add_ps(acc[b][0][0], acc[b][1][0]), _mm512_add_ps(acc[b][0][1], acc[b][1][1]), b0, b1,
                     out + n[b], aligned);
  }
}

// One activation row over [n0, n1) on AMD: the blocks in three equal parts, read together as
// three streams (a block of each at a time); the blocks past them as dot_packed_rows reads them.
// As in the skinny GEMM (skinny_gemm.h, kGemvStreams), one stream a thread leaves an AMD EPYC of
// family 19h's memory partly idle in its fast phases: SmolLM2's shapes cold, one row, 47.7-50.5
// GB/s against 51.0-52.4 (`graphrt bench kernels --rows 1 --dtypes bfloat16`, alternated, a
// streaming sum 67-70), the o projection 36-40 against 40-41 and the LM head 62-68 against
// 67-70; a bf16 engine at one row, alternated in one process: 6.03-6.26 ms a step against
// 6.06-6.52, faster in nine pairs of ten (the log's "Three weight streams at one row").
static void dot_packed_row_streams(const uint16_t* x, const uint16_t* w, const float* bias, uint16_t* out, int64_t N,
                                   int64_t K, int64_t n0, int64_t n1) {
  const bool aligned = reinterpret_cast<uintptr_t>(out) % 64 == 0 && N % 32 == 0;
  const int64_t part = (n1 - n0) / 32 / 3;
  for (int64_t i = 0; i < part; ++i) {
    const int64_t n[3] = {n0 + 32 * i, n0 + 32 * (part + i), n0 + 32 * (2 * part + i)};
    dot_packed_streams<3>(x, w, bias, out, K, n, aligned);
  }
  dot_packed_rows(x, w, bias, out, 1, N, K, n0 + 3 * 32 * part, n1);
}
