// The weight-only quantized skinny GEMM of decode row counts on AVX512-VNNI's
// integer dot product (vpdpbusd: 64 unsigned bytes times 64 signed bytes, summed in fours into 16
// int32 lanes). Included by isa_kernels.cpp in the vnni namespace. Layouts as quant_gemm.h:
//
//   y[m, n] = sum_b scale[n, b] * sum over block b of q[n, k] * x[m, k]  (+ min[n, b] * X[m, b])
//
// quant_gemm.h widens every weight to fp32 before its multiply-add. Here the weight bytes go into
// the dot product as they are stored, a third of the instructions or fewer: one row of hot int8
// weights (one 49152x576 matrix called in a loop, two threads) 54-55 GB/s against 32-35, and
// cold ones (`graphrt bench kernels --rows 1`) int4 19.4-19.5 GB/s against 16.6-16.7; cold int8
// stays at 21-22 GB/s either way, so the memory stream, not the arithmetic, sets it. On an AMD
// EPYC without AMX the dot product also takes 6-16 rows (isa_kernels.h): hot, on one core, int4 at
// 8 rows 110-123 ns a weight row of K = 1536 against the widening kernel's 181-200, int8 the same
// as it (160-210 either way). The bytes: an int4 row's 64 bytes (four blocks)
// take two ANDs and a shift to become two vectors of nibbles (0..15, unsigned bytes); an int8 row's
// 64 bytes (two blocks) one XOR with 0x80 (q + 128, unsigned; the 128 * sum of the activations is
// taken back below). The activations become int8, as in amx_int8_gemm.h: each block of 32 of a
// row is split into two int8 digits under the block's scale s = max|x| / 127,
//
//   x = s * (p0 + p1 / 256) + e,   p0 in [-127, 127], p1 in [-128, 127],   |e| <= 2^-15 * max|x over the block|
//
// (p1 = round(256 * (x / s - p0)) saturates at 127 only when that rest is within 1/512 of +1/2;
// otherwise |e| <= 2^-16 of the block's largest). Each block's products are exact in int32: per lane
// 256 * (q . p0) + q . p1 over four (int8) or eight (int4) products, below 2^24, so its conversion to
// fp32 is exact too. Each block is then scaled in fp32 by the weight's scale times s / 256.
//
// The activations are packed once a call (vnni_pack), per row and per group of blocks (four for
// int4, two for int8; the last group padded with zero digits) as one record the kernel reads in
// order:
//   int4: [p0 of k 0..15 of each block][p0 of k 16..31][p1 of k 0..15][p1 of k 16..31] (64 bytes
//         each, matching the nibbles' order), then 16 lane scales (s / 256 of lane l's block l / 4);
//         after the groups, the blocks' sums of x (for the mins), padded to 16 with zeros;
//   int8: [p0 of the two blocks][p1] (64 bytes each), 16 lane scales (block l / 8), and 16 int32
//         corrections, 128 * (256 * the lane's four p0 + its four p1), which the XOR's 128 added.

using graphrt_native::QuantRows;

// A block whose largest magnitude is below 2^-100 is scaled as if it were 2^-100, so that s / 256
// stays a normal float: its digits round toward zero, an error below 2^-116.
constexpr float kVnniTiny = 0x1p-100f;

template <int BITS>
struct VnniLayout {
  static constexpr int64_t kBlocks = graphrt_native::vnni_group_blocks(BITS);  // blocks a group
  static constexpr int64_t kRecord = graphrt_native::vnni_record_bytes(BITS);  // bytes of a row's group record
};

// The digits of a block's values as int32 lanes, before their saturation to bytes, under the
// scale's inverse `inv` (0 for a block that is not finite): d[0], d[1] the first digits of values
// 0..15 and 16..31 (nearest), d[2], d[3] the second.
static inline void vnni_digit_lanes(__m512 x0, __m512 x1, __m512 inv, __m512i (&d)[4]) {
  const __m512 step = _mm512_set1_ps(256.0f);
  const __m512 v0 = _mm512_mul_ps(x0, inv), v1 = _mm512_mul_ps(x1, inv);  // within [-127, 127]
  d[0] = _mm512_cvtps_epi32(v0);
  d[1] = _mm512_cvtps_epi32(v1);
  d[2] = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(v0, _mm512_cvtepi32_ps(d[0])), step));
  d[3] = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(v1, _mm512_cvtepi32_ps(d[1])), step));
}

// One block of 32 activations (x0: values 0..15, x1: 16..31) as two int8 digits under the block's
// scale s = max|x| / 127: digits[0], [1] the first digit of values 0..15 and 16..31, digits[2],
// [3] the second, as saturated bytes. Returns the lane scale s / 256: 0 for a block of zeros, NaN
// for one whose largest magnitude is not finite (that row's outputs are NaN, as in fp32).
static inline float vnni_block_digits(__m512 x0, __m512 x1, __m128i (&digits)[4]) {
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
  constexpr int kNonFinite = 0x01 | 0x08 | 0x10 | 0x80;  // NaNs and infinities (max drops NaNs)
  const bool finite = (_mm512_fpclass_ps_mask(x0, kNonFinite) | _mm512_fpclass_ps_mask(x1, kNonFinite)) == 0;
  const float s = std::max(amax, kVnniTiny) / 127.0f;
  const __m512 inv = _mm512_set1_ps(finite ? 1.0f / s : 0.0f);
  __m512i d[4];
  vnni_digit_lanes(x0, x1, inv, d);
  for (int i = 0; i < 4; ++i) digits[i] = _mm512_cvtsepi32_epi8(d[i]);
  return finite ? (amax == 0.0f ? 0.0f : s / 256.0f) : std::numeric_limits<float>::quiet_NaN();
}

// x fp32 [M, K] → M rows of graphrt_native::vnni_row_bytes(K, BITS) bytes each (64-byte aligned).
template <int BITS>
static void vnni_pack_rows(const float* x, uint8_t* out, int64_t M, int64_t K) {
  using L = VnniLayout<BITS>;
  const int64_t blocks = K / 32, row_bytes = graphrt_native::vnni_row_bytes(K, BITS);
  const int64_t groups = (blocks + L::kBlocks - 1) / L::kBlocks;
  std::memset(out, 0, size_t(M * row_bytes));
  for (int64_t m = 0; m < M; ++m) {
    uint8_t* row = out + m * row_bytes;
    for (int64_t b = 0; b < blocks; ++b) {
      const float* xb = x + m * K + b * 32;
      const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
      __m128i digits[4];
      const float lane_scale = vnni_block_digits(x0, x1, digits);
      const __m128i p0a = digits[0], p0b = digits[1], p1a = digits[2], p1b = digits[3];
      const int64_t c = b % L::kBlocks;
      uint8_t* rec = row + b / L::kBlocks * L::kRecord;
      float* lanes = reinterpret_cast<float*>(rec + (BITS == 4 ? 256 : 128));
      if constexpr (BITS == 4) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(rec + c * 16), p0a);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(rec + 64 + c * 16), p0b);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(rec + 128 + c * 16), p1a);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(rec + 192 + c * 16), p1b);
        for (int l = 0; l < 4; ++l) lanes[c * 4 + l] = lane_scale;
        float* sums = reinterpret_cast<float*>(row + groups * L::kRecord);
        sums[b] = _mm512_reduce_add_ps(_mm512_add_ps(x0, x1));
      } else {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(rec + c * 32), p0a);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(rec + c * 32 + 16), p0b);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(rec + 64 + c * 32), p1a);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(rec + 64 + c * 32 + 16), p1b);
        const int8_t* p0 = reinterpret_cast<const int8_t*>(rec + c * 32);
        const int8_t* p1 = reinterpret_cast<const int8_t*>(rec + 64 + c * 32);
        int32_t* corrections = reinterpret_cast<int32_t*>(rec + 192);
        for (int l = 0; l < 8; ++l) {
          int32_t s0 = 0, s1 = 0;
          for (int j = 0; j < 4; ++j) {
            s0 += p0[4 * l + j];
            s1 += p1[4 * l + j];
          }
          lanes[c * 8 + l] = lane_scale;
          corrections[c * 8 + l] = 128 * (256 * s0 + s1);
        }
      }
    }
  }
}

static void vnni_pack(const float* x, uint8_t* out, int64_t M, int64_t K, int bits) {
  if (bits == 4) return vnni_pack_rows<4>(x, out, M, K);
  vnni_pack_rows<8>(x, out, M, K);
}

// acc + min[b] * X[b] over a weight row's blocks, lane-wise (sums padded with zeros to a
// multiple of 16): the row's one horizontal sum then takes the mins with the products.
static inline __m512 add_mins(__m512 acc, const uint16_t* mins, const float* sums, int64_t blocks) {
  for (int64_t b = 0; b < blocks; b += 16) {
    const int64_t left = blocks - b;
    const __m256i h = left >= 16 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(mins + b))
                                 : _mm256_maskz_loadu_epi16(__mmask16((1u << left) - 1), mins + b);
    acc = _mm512_fmadd_ps(_mm512_cvtph_ps(h), _mm512_loadu_ps(sums + b), acc);
  }
  return acc;
}

// How far ahead each weight row's bytes are prefetched: 8 KiB on every CPU (an AMD EPYC, the
// products of a 30-layer int4 step on cold weights: 4.1-4.3 ms against 4.9-5.2 at quant_gemm.h's
// 512 bytes there, int8 6.4 against 8.4).
constexpr int64_t kVnniAhead = 8192;

// One group of blocks (64 bytes of each weight row) of NB weight rows against MB activation rows:
// q and h at the group's bytes and scales in the first weight row, rec at its record in the first
// activation row. FULL: all of the group's blocks; otherwise the first `rem` (the ragged last group).
template <int BITS, int NB, int MB, bool FULL>
__attribute__((always_inline)) static inline void vnni_group(const uint8_t* q, int64_t row_q, const uint16_t* h,
                                                             int64_t blocks, const uint8_t* rec, int64_t row_bytes,
                                                             int64_t rem, __m512 (&acc)[MB][NB]) {
  // lane l's block within the group: l / 4 (int4) or l / 8 (int8)
  const __m512i spread = BITS == 4 ? _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3)
                                   : _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  const __m512i nibble = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(char(0x80));
  __m512i lo[NB], hi[NB];
  __m512 ws[NB];
#pragma GCC unroll 4
  for (int r = 0; r < NB; ++r) {
    const uint8_t* p = q + r * row_q;
    __m512i bytes;
    __m128i halves;
    if constexpr (FULL) {
      bytes = _mm512_loadu_si512(p);
      if constexpr (BITS == 4) {
        halves = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(h + r * blocks));
      } else {
        int32_t two;  // the two blocks' float16 scales
        std::memcpy(&two, h + r * blocks, sizeof two);
        halves = _mm_cvtsi32_si128(two);
      }
    } else {
      bytes = _mm512_maskz_loadu_epi8((__mmask64(1) << (rem * 32 * BITS / 8)) - 1, p);
      halves = _mm_maskz_loadu_epi16(__mmask8((1u << rem) - 1), h + r * blocks);
    }
    stream_prefetch(p + kVnniAhead);
    ws[r] = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_cvtph_ps(halves)));
    if constexpr (BITS == 4) {
      lo[r] = _mm512_and_si512(bytes, nibble);
      hi[r] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble);
    } else {
      lo[r] = _mm512_xor_si512(bytes, flip);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MB; ++i) {
    const uint8_t* ri = rec + i * row_bytes;
    const __m512i d0 = _mm512_load_si512(ri), d1 = _mm512_load_si512(ri + 64);
    if constexpr (BITS == 4) {
      const __m512i d2 = _mm512_load_si512(ri + 128), d3 = _mm512_load_si512(ri + 192);
      const __m512 lanes = _mm512_load_ps(reinterpret_cast<const float*>(ri + 256));
#pragma GCC unroll 4
      for (int r = 0; r < NB; ++r) {
        __m512i a = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[r], d0), hi[r], d1);
        a = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_slli_epi32(a, 8), lo[r], d2), hi[r], d3);
        acc[i][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_mul_ps(ws[r], lanes), acc[i][r]);
      }
    } else {
      const __m512 lanes = _mm512_load_ps(reinterpret_cast<const float*>(ri + 128));
      const __m512i corrections = _mm512_load_si512(ri + 192);
#pragma GCC unroll 4
      for (int r = 0; r < NB; ++r) {
        __m512i a = _mm512_slli_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[r], d0), 8);
        a = _mm512_sub_epi32(_mm512_dpbusd_epi32(a, lo[r], d1), corrections);
        acc[i][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_mul_ps(ws[r], lanes), acc[i][r]);
      }
    }
  }
}

// NB weight rows from n against MB activation rows from m0: the full groups in a loop without a
// branch, then the ragged last group if there is one. (With the ragged test inside the loop GCC
// kept the accumulators on the stack, a store and a load each a group: int4 at 8 rows took 171 ns
// a weight row of K = 1536, hot on one core, against 110-123 now.)
template <int BITS, int NB, int MB>
static inline void vnni_tile(const uint8_t* packed, const QuantRows& w, float* y, int64_t N, int64_t n, int64_t m0) {
  using L = VnniLayout<BITS>;
  const int64_t K = w.K, blocks = K / 32, row_q = K * BITS / 8;
  const int64_t groups = (blocks + L::kBlocks - 1) / L::kBlocks, full = blocks / L::kBlocks;
  const int64_t row_bytes = graphrt_native::vnni_row_bytes(K, BITS);
  const uint8_t* q = static_cast<const uint8_t*>(w.q) + n * row_q;
  const uint16_t* scales = w.scales + n * blocks;
  const uint8_t* rec = packed + m0 * row_bytes;
  __m512 acc[MB][NB];
#pragma GCC unroll 8
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 4
    for (int r = 0; r < NB; ++r) acc[i][r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < full; ++g)
    vnni_group<BITS, NB, MB, true>(q + g * 64, row_q, scales + g * L::kBlocks, blocks, rec + g * L::kRecord,
                                   row_bytes, L::kBlocks, acc);
  if (full < groups)
    vnni_group<BITS, NB, MB, false>(q + full * 64, row_q, scales + full * L::kBlocks, blocks,
                                    rec + full * L::kRecord, row_bytes, blocks - full * L::kBlocks, acc);
  for (int i = 0; i < MB; ++i) {
    const float* sums = reinterpret_cast<const float*>(rec + i * row_bytes + groups * L::kRecord);
    for (int r = 0; r < NB; ++r) {
      __m512 a = acc[i][r];
      if constexpr (BITS == 4) a = add_mins(a, w.mins + (n + r) * blocks, sums, blocks);
      y[(m0 + i) * N + n + r] = _mm512_reduce_add_ps(a);
    }
  }
}

// NB weight rows from n against `rows` (at most MB) activation rows from m0, their accumulators in
// registers.
template <int BITS, int NB, int MB>
static inline void vnni_rows(const uint8_t* packed, const QuantRows& w, float* y, int64_t N, int64_t n, int64_t m0,
                             int64_t rows) {
  if constexpr (MB > 1) {
    if (rows < MB) return vnni_rows<BITS, NB, MB - 1>(packed, w, y, N, n, m0, rows);
  }
  vnni_tile<BITS, NB, MB>(packed, w, y, N, n, m0);
}

// Output columns [n0, n1): weight rows four at a time for one or two activation rows; two for
// more, against up to kVnniTileRows activation rows at a time (the next ones read the same two
// weight rows again from L1). One activation row against int8 weights on AMD takes one weight row
// at a time, so that each thread reads its weights front to back in one stream: on an AMD EPYC
// (family 1Ah; 30 layers of SmolLM2's int8 projections and its int8 LM head, cold, two threads)
// 3.5-3.6 ms against 4.0-4.1 for the layers and 0.65 against 0.82-0.85 ms for the head, and
// alternating step by step in the engine, batch-1 decode 4% faster (int8) and 3% (int4, whose LM
// head is int8). int4 rows (288 bytes at K = 576) read the same either way, as do two activation
// rows; on Intel the four-row tile stays (not measured there).
template <int BITS>
static void vnni_columns(const uint8_t* packed, const QuantRows& w, float* y, int64_t M, int64_t N, int64_t n0,
                         int64_t n1) {
  constexpr int kTile = int(graphrt_native::kVnniTileRows);
  int64_t n = n0;
  const bool one_stream = BITS == 8 && M == 1 && graphrt_native::kAmdStreams;  // the loop after takes it
  if (M <= 2 && !one_stream) {
    for (; n + 4 <= n1; n += 4) vnni_rows<BITS, 4, 2>(packed, w, y, N, n, 0, M);
  } else if (M > 2) {
    for (; n + 2 <= n1; n += 2)
      for (int64_t m0 = 0; m0 < M; m0 += kTile)
        vnni_rows<BITS, 2, kTile>(packed, w, y, N, n, m0, std::min<int64_t>(kTile, M - m0));
  }
  for (; n < n1; ++n)
    for (int64_t m0 = 0; m0 < M; m0 += kTile)
      vnni_rows<BITS, 1, kTile>(packed, w, y, N, n, m0, std::min<int64_t>(kTile, M - m0));
}

// y over output columns [n0, n1); packed from vnni_pack.
static void vnni_quant_gemm(const uint8_t* packed, const QuantRows& w, float* y, int64_t M, int64_t N, int64_t n0,
                            int64_t n1) {
  if (w.bits == 4) return vnni_columns<4>(packed, w, y, M, N, n0, n1);
  vnni_columns<8>(packed, w, y, M, N, n0, n1);
}
