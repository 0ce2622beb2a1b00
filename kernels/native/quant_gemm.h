// The weight-only quantized skinny GEMM, for one instruction set (included per set by
// isa_kernels.cpp, after simd.h). Layouts (kernels/quantized.py): blocks of 32 values along K,
//   int4: q uint8 [N, K/2] (values 0-15 of a block in the low nibbles of its 16 bytes, 16-31 in
//         the high ones), w = q * scale + min;     int8: q int8 [N, K], w = q * scale;
//   scales (and mins) float16 [N, K/32].
//
//   y[m, n] = sum_k x[m, k] * w[n, k]      x: fp32 [M, K]; y: fp32 [M, N]
//
// Each weight row is read once: a block's bytes are widened to fp32 vectors in registers
// (kVecs of them), one multiply-add per vector turns them into weights, and every activation row
// of the tile multiplies them. The row's scales (and mins) are widened to fp32 first, K/32 of
// them, a vector at a time. More rows than a tile holds: the weight row is dequantised once into
// an L1 buffer and the fp32 tile runs over it for each group of rows.

using graphrt_native::QuantRows;

constexpr int kQBlock = 32;
// How far ahead of each weight row's position its bytes are prefetched: 512 bytes on AMD (with
// the non-temporal hint), 8 KiB elsewhere (Intel: `graphrt bench kernels --dtypes int4,int8`
// read one row's int4 at 49% of the memory's speed against 37% at 512, int8 58% against 55%;
// 2 KiB and 32 KiB were slower, 16 KiB the same).
constexpr int64_t kQAheadAmd = 512, kQAheadOther = 8192;
constexpr int kVecs = kQBlock / kLanes;  // fp32 vectors per block: 2 (AVX-512), 4 (AVX2), 8
constexpr int kQMaxRows = GRT_WIDE_MB;   // activation rows whose accumulators live in registers

typedef uint8_t vb_unaligned __attribute__((vector_size(kLanes), aligned(1)));
typedef int8_t vsb_unaligned __attribute__((vector_size(kLanes), aligned(1)));
typedef _Float16 vhalf_unaligned __attribute__((vector_size(kLanes * 2), aligned(2)));

// kLanes bytes widened to 32-bit lanes (zero- or sign-extended), and kLanes float16 to fp32:
// one instruction each on AVX-512 and AVX2 (GCC's generic vector conversions scalarise these).
static inline vu widen_u8(const uint8_t* p) {
#if GRT_VEC_BYTES == 64
  return (vu)_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#elif GRT_VEC_BYTES == 32 && (defined(__x86_64__) || defined(__i386__))
  return (vu)_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#else
  return __builtin_convertvector(*reinterpret_cast<const vb_unaligned*>(p), vu);
#endif
}

static inline vi widen_s8(const int8_t* p) {
#if GRT_VEC_BYTES == 64
  return (vi)_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#elif GRT_VEC_BYTES == 32 && (defined(__x86_64__) || defined(__i386__))
  return (vi)_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#else
  return __builtin_convertvector(*reinterpret_cast<const vsb_unaligned*>(p), vi);
#endif
}

static inline vf widen_half(const uint16_t* p) {
#if GRT_VEC_BYTES == 64
  return (vf)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif GRT_VEC_BYTES == 32 && (defined(__x86_64__) || defined(__i386__))
  return (vf)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  return __builtin_convertvector(*reinterpret_cast<const vhalf_unaligned*>(p), vf);
#endif
}

// A float from memory in every lane: one broadcast load (splat's add-and-shuffle costs two uops).
static inline vf bcast(const float* p) {
#if GRT_VEC_BYTES == 64
  return (vf)_mm512_set1_ps(*p);
#elif GRT_VEC_BYTES == 32 && (defined(__x86_64__) || defined(__i386__))
  return (vf)_mm256_broadcast_ss(p);
#else
  return splat(*p);
#endif
}

static inline void half_row(const uint16_t* h, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store(out + i, widen_half(h + i));
  for (; i < n; ++i) {
    _Float16 v;
    __builtin_memcpy(&v, h + i, 2);
    out[i] = float(v);
  }
}

// One block's 32 weights as kVecs fp32 vectors.
#if GRT_VEC_BYTES == 64
// AVX-512: the block's 16 possible weights (min + scale * 0..15) are one vector, and a
// permutation indexed by each lane's low 4 bits picks them: the low nibbles straight from the
// widened bytes, the high ones after a shift. 5 instructions for 32 weights, no conversions.
static inline void dequant4(const uint8_t* q, const float* scale, const float* mn, vf* w) {
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 table = _mm512_fmadd_ps(iota, _mm512_set1_ps(*scale), _mm512_set1_ps(*mn));
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
  w[0] = (vf)_mm512_permutexvar_ps(bytes, table);
  w[1] = (vf)_mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
}
#else
static inline void dequant4(const uint8_t* q, const float* scale, const float* mn, vf* w) {
  const vf s = bcast(scale), m = bcast(mn);
#pragma GCC unroll 8
  for (int j = 0; j < kVecs; ++j) {
    const int first = j * kLanes;  // values [first, first + kLanes) of the block
    const vu bytes = widen_u8(q + (first & 15));
    const vu nib = first < 16 ? (bytes & 15u) : (bytes >> 4);
    w[j] = __builtin_convertvector((vi)nib, vf) * s + m;
  }
}
#endif

static inline void dequant8(const int8_t* q, const float* scale, vf* w) {
  const vf s = bcast(scale);
#pragma GCC unroll 8
  for (int j = 0; j < kVecs; ++j) w[j] = __builtin_convertvector(widen_s8(q + j * kLanes), vf) * s;
}

template <int BITS>
static inline void dequant_block(const QuantRows& w, int64_t n, int64_t b, const float* sc, const float* mn, vf* out) {
  if constexpr (BITS == 4) {
    dequant4(static_cast<const uint8_t*>(w.q) + n * (w.K / 2) + b * 16, sc + b, mn + b, out);
  } else {
    dequant8(static_cast<const int8_t*>(w.q) + n * w.K + b * kQBlock, sc + b, out);
  }
}

// NB weight rows from n against MB activation rows from m0, dequantising each block in
// registers; sc/mn hold the rows' scales and mins (fp32), `blocks` apart. Few activation rows
// take two weight rows at a time: twice the independent accumulator chains, one x load for both.
template <int BITS, int NB, int MB>
static inline void qtile(const float* x, const QuantRows& w, float* y, int64_t N, int64_t n, int64_t m0,
                         const float* sc, const float* mn) {
  const int64_t K = w.K, blocks = K / kQBlock;
  vf acc[MB][NB][kVecs];
#pragma GCC unroll 8
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 4
    for (int r = 0; r < NB; ++r)
#pragma GCC unroll 8
      for (int j = 0; j < kVecs; ++j) acc[i][r][j] = vf{};
  const float* xr = x + m0 * K;
  // each row's bytes `ahead` on, a cache line per 64 bytes (the next rows' lines, near the end)
  const char* rows = static_cast<const char*>(w.q) + n * K * BITS / 8;
  const int64_t ahead = graphrt_native::kAmdStreams ? kQAheadAmd : kQAheadOther;
  constexpr int64_t kBlockBytes = kQBlock * BITS / 8;
  for (int64_t b = 0; b < blocks; ++b) {
    vf wv[NB][kVecs];
#pragma GCC unroll 4
    for (int r = 0; r < NB; ++r) dequant_block<BITS>(w, n + r, b, sc + r * blocks, mn + r * blocks, wv[r]);
    if ((b * kBlockBytes) % 64 == 0) {
#pragma GCC unroll 4
      for (int r = 0; r < NB; ++r) stream_prefetch(rows + r * K * BITS / 8 + b * kBlockBytes + ahead);
    }
#pragma GCC unroll 8
    for (int i = 0; i < MB; ++i)
#pragma GCC unroll 8
      for (int j = 0; j < kVecs; ++j) {
        const vf xv = load(xr + i * K + b * kQBlock + j * kLanes);
#pragma GCC unroll 4
        for (int r = 0; r < NB; ++r) acc[i][r][j] += xv * wv[r][j];
      }
  }
  for (int i = 0; i < MB; ++i)
    for (int r = 0; r < NB; ++r) {
      vf s = acc[i][r][0];
      for (int j = 1; j < kVecs; ++j) s += acc[i][r][j];
      y[(m0 + i) * N + n + r] = hsum(s);
    }
}

// `rows` (<= kQMaxRows) activation rows with the tile of exactly that many.
template <int BITS, int MB>
static inline void qtile_rows(const float* x, const QuantRows& w, float* y, int64_t N, int64_t n, int64_t m0,
                              int64_t rows, const float* sc, const float* mn) {
  if constexpr (MB > 0) {
    if (rows != MB) return qtile_rows<BITS, MB - 1>(x, w, y, N, n, m0, rows, sc, mn);
    qtile<BITS, 1, MB>(x, w, y, N, n, m0, sc, mn);
  }
}

// Weight row n as K floats into out (its bytes prefetched ahead); sc, mn: scratch, K/32 floats each.
template <int BITS>
static inline void dequantize_row(const QuantRows& w, int64_t n, float* out, float* sc, float* mn) {
  const int64_t K = w.K, blocks = K / kQBlock;
  half_row(w.scales + n * blocks, sc, blocks);
  if constexpr (BITS == 4) half_row(w.mins + n * blocks, mn, blocks);
  const char* bytes = static_cast<const char*>(w.q) + n * K * BITS / 8;
  const int64_t ahead = graphrt_native::kAmdStreams ? kQAheadAmd : kQAheadOther;
  constexpr int64_t kBlockBytes = kQBlock * BITS / 8;
  for (int64_t b = 0; b < blocks; ++b) {
    if ((b * kBlockBytes) % 64 == 0) stream_prefetch(bytes + b * kBlockBytes + ahead);
    vf wv[kVecs];
    dequant_block<BITS>(w, n, b, sc, mn, wv);
    for (int j = 0; j < kVecs; ++j) store(out + b * kQBlock + j * kLanes, wv[j]);
  }
}

// Output columns [n_begin, n_end): one thread's share. scratch: 4 * K / 32 + 2 * K floats.
template <int BITS>
static void quant_gemm(const float* x, const QuantRows& w, float* y, int64_t M, int64_t N, int64_t n_begin,
                       int64_t n_end, float* scratch) {
  const int64_t K = w.K, blocks = K / kQBlock;
  float* sc = scratch;               // two rows' scales
  float* mn = scratch + 2 * blocks;  // and mins
  float* wf = scratch + 4 * blocks;
  int64_t n = n_begin;
  // int4, 1-2 rows, off AMD: four weight rows at a time (Intel, `graphrt bench kernels --dtypes
  // int4`: 51-56% of the read bandwidth at one row against 39-47% with two; AMD keeps its two)
  if (BITS == 4 && M <= 2 && !graphrt_native::kAmdStreams) {
    float* sc4 = wf;  // 4 rows' scales and mins (the dequantised row is unused here)
    float* mn4 = wf + 4 * blocks;
    for (; n + 4 <= n_end; n += 4) {
      half_row(w.scales + n * blocks, sc4, 4 * blocks);
      half_row(w.mins + n * blocks, mn4, 4 * blocks);
      if (M == 1) qtile<BITS, 4, 1>(x, w, y, N, n, 0, sc4, mn4);
      else qtile<BITS, 4, 2>(x, w, y, N, n, 0, sc4, mn4);
    }
  }
  if (BITS == 4 && M <= 2) {  // (int8 measured slower this way)
    for (; n + 2 <= n_end; n += 2) {
      half_row(w.scales + n * blocks, sc, 2 * blocks);
      if constexpr (BITS == 4) half_row(w.mins + n * blocks, mn, 2 * blocks);
      if (M == 1) qtile<BITS, 2, 1>(x, w, y, N, n, 0, sc, mn);
      else qtile<BITS, 2, 2>(x, w, y, N, n, 0, sc, mn);
    }
  }
  // More rows than a tile holds: weight rows dequantised into L1 in pairs, then skinny_gemm.h's
  // fp32 register tile over them (Intel, one core, int4 at 16 rows: 1.5 → 3.0 G weights/s against
  // a row at a time; at 8 rows the register-dequantising tile below streams better with two threads)
  if (M > kQMaxRows) {
    for (; n + GRT_WIDE_NB <= n_end; n += GRT_WIDE_NB) {
      for (int r = 0; r < GRT_WIDE_NB; ++r) dequantize_row<BITS>(w, n + r, wf + r * K, sc, mn);
      row_block<FmaPolicy<float>, float, GRT_WIDE_NB, GRT_WIDE_MB, Prefetch::kPair>(x, wf, y + n, M, N, K, 0,
                                                                                    GRT_WIDE_NB, 0, K, false);
    }
  }
  for (; n < n_end; ++n) {
    if (M > kQMaxRows) {  // the last weight row of an odd count, through the same tile
      dequantize_row<BITS>(w, n, wf, sc, mn);
      row_block<FmaPolicy<float>, float, 1, GRT_WIDE_MB, Prefetch::kPair>(x, wf, y + n, M, N, K, 0, 1, 0, K, false);
      continue;
    }
    half_row(w.scales + n * blocks, sc, blocks);
    if constexpr (BITS == 4) half_row(w.mins + n * blocks, mn, blocks);
    qtile_rows<BITS, kQMaxRows>(x, w, y, N, n, 0, M, sc, mn);
  }
}

// The fp32 matrix of rows [r_begin, r_end) (leading dims flattened into rows).
template <int BITS>
static void dequantize_rows(const QuantRows& w, float* out, int64_t r_begin, int64_t r_end, float* scratch) {
  for (int64_t n = r_begin; n < r_end; ++n) dequantize_row<BITS>(w, n, out + n * w.K, scratch, scratch + w.K / kQBlock);
}
