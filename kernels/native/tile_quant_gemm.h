// Quantized tiles (kernels/quant_tiles.py: int4 and int8) on AVX512-VNNI's integer dot product.
// Included by isa_kernels.cpp in the vnni namespace, after vnni_quant_gemm.h (whose activation
// digits and constants it shares) and tile_fold.h (a block's scales and its fold, shared with the
// AMX kernel).
//
// A tile's 64 bytes of values hold 16 weight rows' four bytes each, one row a lane; a 4-byte
// group of one activation row's int8 digits, broadcast to every lane, meets them in one vpdpbusd
// (int4: each byte's two nibbles, two products; int8: the byte, stored as q + 128),
// so each lane accumulates its own output column and a block ends in 16 outputs at once: no
// horizontal sum, no spreading of scales over lanes, one stream of weights a thread. The
// plain layout's one-row product (vnni_quant_gemm.h) spends about 16 instructions on 64 bytes of
// weights, and hot, on one core, it stops at 22-33 GB/s; this one spends about 10 and reads 51-63
// (an AMD EPYC, family 1Ah: one 1536 x 576 matrix in a loop). Cold, two threads, over 30 layers
// of SmolLM2's four int4 projections: 40.5 against 26.9 GB/s.
//
// The activations are split into two int8 digits per value under each block's scale, exactly as
// vnni_quant_gemm.h does (x = s * (p0 + p1 / 256) + e); a row's record here is, per block, its 32
// first digits then its 32 second digits (64 bytes), then the blocks' lane scales s / 256, their
// sums of x (int4's minimums' term) and int8's corrections 128 * (256 * sum p0 + sum p1) (the
// q + 128 offset's share), K / 32 of each. Per lane and block, int4's integer sum
// 256 * (q . p0) + q . p1 stays below 2^24 (32 products of 15 * 127, times 256, plus 32 of
// 15 * 128), so its conversion to fp32 is exact; int8's reaches 2^27 (32 * 127 * 127 * 256), so
// it is rounded once, to fp32's 2^-24 of itself, as a sum of fp32 products would be.

// One block of a record: its 64 digits at `digits`, its lane scale, sum and correction.
static inline void tiles_pack_block(const float* xb, uint8_t* digits, float& lane_scale, float& sum,
                                    int32_t& correction) {
  const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
  __m128i p[4];
  lane_scale = vnni_block_digits(x0, x1, p);
  sum = _mm512_reduce_add_ps(_mm512_add_ps(x0, x1));
  for (int i = 0; i < 4; ++i) _mm_storeu_si128(reinterpret_cast<__m128i*>(digits + 16 * i), p[i]);
  // the stored (saturated) digits' sums
  const __m512i first = _mm512_add_epi32(_mm512_cvtepi8_epi32(p[0]), _mm512_cvtepi8_epi32(p[1]));
  const __m512i second = _mm512_add_epi32(_mm512_cvtepi8_epi32(p[2]), _mm512_cvtepi8_epi32(p[3]));
  correction = 128 * (256 * _mm512_reduce_add_epi32(first) + _mm512_reduce_add_epi32(second));
}

// Fewer blocks than this at a row's end are packed one at a time (a batch's three lane trees cost
// as much as about four blocks).
constexpr int kTilesPackMinBatch = 4;

#if defined(GRT_LANE_TREE)
// Sixteen blocks of one row from xb (the first nb real, nb >= kTilesPackMinBatch), the same bytes
// as tiles_pack_block's: their digits at `digits` (64 bytes a block), their lane scales, sums and
// corrections at the three pointers. Each block's maximum magnitude, sum and digit sums are reduced
// across its lanes together with the 15 others' (lane_tree: one vector of 16 results, where a block
// alone took three horizontal reductions), and the scales are computed 16 to a vector.
static inline void tiles_pack_sixteen(const float* xb, int nb, uint8_t* digits, float* lane_scales, float* sums,
                                      int32_t* corrections) {
  typedef float v16f __attribute__((vector_size(64)));
  constexpr int kNonFinite = 0x01 | 0x08 | 0x10 | 0x80;  // NaNs and infinities (max drops NaNs)
  const __m512 sign = _mm512_set1_ps(-0.0f), step = _mm512_set1_ps(256.0f);
  // 128-bit lane k of the bytes packed from four vectors holds each one's lanes 4k..4k+3
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  // a block's digit sums in fours: the first digits' (lanes 0-7) times 256
  const __m512i ones = _mm512_set1_epi8(1), times = _mm512_setr_epi32(8, 8, 8, 8, 8, 8, 8, 8, 0, 0, 0, 0, 0, 0, 0, 0);
  auto add = [](v16f a, v16f b) { return a + b; };
  auto max = [](v16f a, v16f b) { return (v16f)_mm512_max_ps((__m512)a, (__m512)b); };
  v16f mags[16], totals[16], digit_sums[16];
  uint32_t bad = 0;  // the blocks holding a NaN or an infinity
  for (int j = 0; j < 16; ++j) {
    if (j >= nb) {
      mags[j] = totals[j] = v16f{};
      continue;
    }
    const __m512 x0 = _mm512_loadu_ps(xb + 32 * j), x1 = _mm512_loadu_ps(xb + 32 * j + 16);
    mags[j] = (v16f)_mm512_max_ps(_mm512_andnot_ps(sign, x0), _mm512_andnot_ps(sign, x1));
    totals[j] = (v16f)_mm512_add_ps(x0, x1);
    bad |= uint32_t((_mm512_fpclass_ps_mask(x0, kNonFinite) | _mm512_fpclass_ps_mask(x1, kNonFinite)) != 0) << j;
  }
  // vnni_block_digits' scales, a lane a block
  const __m512 amax = (__m512)lane_tree(mags, max);
  const __m512 s = _mm512_div_ps(_mm512_max_ps(amax, _mm512_set1_ps(kVnniTiny)), _mm512_set1_ps(127.0f));
  const __m512 inv = _mm512_maskz_div_ps(__mmask16(~bad), _mm512_set1_ps(1.0f), s);
  __m512 lane = _mm512_maskz_div_ps(_mm512_cmp_ps_mask(amax, _mm512_setzero_ps(), _CMP_NEQ_UQ), s, step);
  lane = _mm512_mask_mov_ps(lane, __mmask16(bad), _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN()));
  const __mmask16 valid = __mmask16((1u << nb) - 1);
  _mm512_mask_storeu_ps(lane_scales, valid, lane);
  _mm512_mask_storeu_ps(sums, valid, (__m512)lane_tree(totals, add));
  for (int j = 0; j < 16; ++j) {
    if (j >= nb) {
      digit_sums[j] = v16f{};
      continue;
    }
    const __m512 x0 = _mm512_loadu_ps(xb + 32 * j), x1 = _mm512_loadu_ps(xb + 32 * j + 16);
    __m512i d[4];
    vnni_digit_lanes(x0, x1, _mm512_permutexvar_ps(_mm512_set1_epi32(j), inv), d);
    // saturated to bytes twice (to int16, then int8): the saturation to int8 of vnni_block_digits
    const __m512i bytes = _mm512_packs_epi16(_mm512_packs_epi32(d[0], d[1]), _mm512_packs_epi32(d[2], d[3]));
    const __m512i block = _mm512_permutexvar_epi32(order, bytes);
    _mm512_storeu_si512(digits + 64 * j, block);
    // below 2^24 in every lane and after the tree's sums, so exact in fp32
    const __m512i fours = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, block);
    digit_sums[j] = (v16f)_mm512_cvtepi32_ps(_mm512_sllv_epi32(fours, times));
  }
  const __m512i total = _mm512_cvtps_epi32((__m512)lane_tree(digit_sums, add));
  _mm512_mask_storeu_epi32(corrections, valid, _mm512_slli_epi32(total, 7));  // 128 *
}
#endif

// x fp32 [M, K] → M records of graphrt_native::tile_row_bytes(K) bytes (64-byte aligned), sixteen
// blocks at a time (tiles_pack_sixteen) where the compiler has lane_tree. Eight rows, hot, one
// core: 0.63 against 1.28 us one block at a time at K = 576, 1.69 against 3.39 at K = 1,536 (each
// thread packs every row of every call).
static void tiles_pack(const float* x, uint8_t* out, int64_t M, int64_t K) {
  const int64_t blocks = K / 32, row_bytes = graphrt_native::tile_row_bytes(K);
  for (int64_t m = 0; m < M; ++m) {
    uint8_t* row = out + m * row_bytes;
    float* lane_scales = reinterpret_cast<float*>(row + blocks * 64);
    float* sums = lane_scales + blocks;
    int32_t* corrections = reinterpret_cast<int32_t*>(sums + blocks);
    for (int64_t b0 = 0; b0 < blocks; b0 += 16) {
      const int nb = static_cast<int>(std::min<int64_t>(16, blocks - b0));
      const float* xb = x + m * K + b0 * 32;
#if defined(GRT_LANE_TREE)
      if (nb >= kTilesPackMinBatch) {
        tiles_pack_sixteen(xb, nb, row + b0 * 64, lane_scales + b0, sums + b0, corrections + b0);
        continue;
      }
#endif
      for (int j = 0; j < nb; ++j)
        tiles_pack_block(xb + 32 * j, row + (b0 + j) * 64, lane_scales[b0 + j], sums[b0 + j], corrections[b0 + j]);
    }
  }
}

// Four digits of an activation record, broadcast to every lane (folded into vpdpbusd's operand).
static inline __m512i four_digits(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return _mm512_set1_epi32(v);
}

// A tile line's prefetch, kVnniAhead on. int8 tiles with two or more activation rows, off AMD: the
// pair prefetch_l2 / prefetch_near (isa_kernels.h), as the skinny GEMM's tiles. int8 at batch 4 on
// an Intel Xeon, three alternated pairs of `graphrt bench decode --batch-sizes 4 --quantization
// int4,int8`: 512-527 tok/s against 487-498; int4, whose unpacking makes it arithmetic-bound,
// 563-597 against 575-612.
// One activation row on AMD: none, the stream is left to the hardware. On the family-19h EPYC
// (SmolLM2, batch 1, alternated in one process, the same outputs), int4 3.22 against 3.27 ms a
// step (faster in 8 of 8), int8 3.23 against 3.32 (6 of 6); at two and four rows the prefetch
// pays (its step 13% and 32% shorter), as at eight.
template <int BITS, int MB>
static inline void tile_prefetch(const uint8_t* p) {
  if (MB == 1 && graphrt_native::kAmdStreams) return;
  if (BITS == 8 && MB > 1 && !graphrt_native::kAmdStreams) {
    prefetch_l2(p + kVnniAhead);
    prefetch_near(p);
  } else {
    stream_prefetch(p + kVnniAhead);
  }
}

// NG groups of 16 weight rows (each its K / 32 tiles, from tiles[g]) against MB activation records
// from `rec`: 16 outputs each per group, stored at y[g] (rows `ldy` floats apart). NG = 2 reads two
// groups' streams at once (tiles_columns, up to kTilePairMaxRows activation rows).
template <int BITS, int MB, int NG = 1>
static inline void tiles_group(const uint8_t* const* tiles, int64_t blocks, const uint8_t* rec, int64_t row_bytes,
                               float* const* y, int64_t ldy) {
  constexpr int64_t kBytes = graphrt_native::tile_bytes(BITS), kValues = graphrt_native::tile_value_bytes(BITS);
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m512 acc[NG][MB];
#pragma GCC unroll 8
  for (int g = 0; g < NG; ++g)
#pragma GCC unroll 8
    for (int i = 0; i < MB; ++i) acc[g][i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
#pragma GCC unroll 2
    for (int g = 0; g < NG; ++g) {
      const uint8_t* tile = tiles[g] + b * kBytes;
      for (int64_t l = 0; l < kBytes; l += 64) tile_prefetch<BITS, MB>(tile + l);
      __m512i first[MB], second[MB];
#pragma GCC unroll 8
      for (int i = 0; i < MB; ++i) first[i] = second[i] = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int c = 0; c < kValues / 64; ++c) {
        const __m512i bytes = _mm512_loadu_si512(tile + 64 * c);
        if constexpr (BITS == 4) {
          const __m512i lo = _mm512_and_si512(bytes, nibble);
          const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble);
#pragma GCC unroll 8
          for (int i = 0; i < MB; ++i) {
            const uint8_t* d = rec + i * row_bytes + b * 64 + 4 * c;
            first[i] = _mm512_dpbusd_epi32(first[i], lo, four_digits(d));
            first[i] = _mm512_dpbusd_epi32(first[i], hi, four_digits(d + 16));
            second[i] = _mm512_dpbusd_epi32(second[i], lo, four_digits(d + 32));
            second[i] = _mm512_dpbusd_epi32(second[i], hi, four_digits(d + 48));
          }
        } else {
#pragma GCC unroll 8
          for (int i = 0; i < MB; ++i) {
            const uint8_t* d = rec + i * row_bytes + b * 64 + 4 * c;
            first[i] = _mm512_dpbusd_epi32(first[i], bytes, four_digits(d));
            second[i] = _mm512_dpbusd_epi32(second[i], bytes, four_digits(d + 32));
          }
        }
      }
      __m512 scales, mins;
      tile_scales<BITS>(tile, &scales, &mins);
#pragma GCC unroll 8
      for (int i = 0; i < MB; ++i) {
        const float* lane_scales = reinterpret_cast<const float*>(rec + i * row_bytes + blocks * 64);
        acc[g][i] = fold_block<BITS>(acc[g][i], first[i], second[i], scales, mins, lane_scales, blocks, b);
      }
    }
  }
#pragma GCC unroll 2
  for (int g = 0; g < NG; ++g)
#pragma GCC unroll 8
    for (int i = 0; i < MB; ++i) _mm512_storeu_ps(y[g] + i * ldy, acc[g][i]);
}

// The widening product, for more activation rows than the digits' kernel takes (as the plain
// layout's quant_gemm.h beyond kVnniMaxRowsNoAmx rows): each value of a tile becomes fp32
// (q * scale + min, 16 rows a vector) and meets every activation row in fp32, so the sums are
// fp32's, as in a dequantised matrix times x. MB activation rows from x, 16 outputs each at y.
template <int BITS, int MB>
static inline void tiles_wide_group(const uint8_t* tile, int64_t blocks, const float* x, int64_t K, float* y,
                                    int64_t ldy) {
  constexpr int64_t kBytes = graphrt_native::tile_bytes(BITS), kValues = graphrt_native::tile_value_bytes(BITS);
  const __m512i nibble = _mm512_set1_epi32(0x0F), byte = _mm512_set1_epi32(0xFF), offset = _mm512_set1_epi32(128);
  __m512 acc[MB];
#pragma GCC unroll 8
  for (int i = 0; i < MB; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b, tile += kBytes) {
    __m512 scales, mins;
    tile_scales<BITS>(tile, &scales, &mins);
    for (int c = 0; c < kValues / 64; ++c) {
      const __m512i bytes = _mm512_loadu_si512(tile + 64 * c);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {  // int4: values 4c + j (low nibble of byte j) and 16 + 4c + j; int8: 4c + j
        const __m512i shifted = _mm512_srli_epi32(bytes, 8 * j);
        const int64_t k = b * 32 + 4 * c + j;
        if constexpr (BITS == 4) {
          const __m512 lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(shifted, nibble)), scales, mins);
          const __m512i high = _mm512_and_si512(_mm512_srli_epi32(shifted, 4), nibble);
          const __m512 hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(high), scales, mins);
#pragma GCC unroll 8
          for (int i = 0; i < MB; ++i) {
            acc[i] = _mm512_fmadd_ps(lo, _mm512_set1_ps(x[i * K + k]), acc[i]);
            acc[i] = _mm512_fmadd_ps(hi, _mm512_set1_ps(x[i * K + k + 16]), acc[i]);
          }
        } else {
          const __m512i q = _mm512_sub_epi32(_mm512_and_si512(shifted, byte), offset);
          const __m512 w = _mm512_mul_ps(_mm512_cvtepi32_ps(q), scales);
#pragma GCC unroll 8
          for (int i = 0; i < MB; ++i) acc[i] = _mm512_fmadd_ps(w, _mm512_set1_ps(x[i * K + k]), acc[i]);
        }
      }
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MB; ++i) _mm512_storeu_ps(y + i * ldy, acc[i]);
}

// `rows` activation rows (at most MB) against one group of weight rows: records of the digits'
// product, or fp32 rows of x for the widening one (WIDE), `stride` bytes apart.
template <int BITS, bool WIDE, int MB>
static inline void tiles_rows(const uint8_t* tile, int64_t blocks, const uint8_t* act, int64_t stride, int64_t K,
                              float* y, int64_t ldy, int64_t rows) {
  if constexpr (MB > 1) {
    if (rows < MB) return tiles_rows<BITS, WIDE, MB - 1>(tile, blocks, act, stride, K, y, ldy, rows);
  }
  if constexpr (WIDE)
    tiles_wide_group<BITS, MB>(tile, blocks, reinterpret_cast<const float*>(act), K, y, ldy);
  else
    tiles_group<BITS, MB>(&tile, blocks, act, stride, &y, ldy);
}

constexpr int kTilePairMaxRows = 4;  // activation rows that read two groups at once (tiles_columns)

// Two groups of weight rows against `rows` activation rows (at most MB), as tiles_rows.
template <int BITS, int MB>
static inline void tiles_pair_rows(const uint8_t* const* pair, int64_t blocks, const uint8_t* act, int64_t stride,
                                   float* const* y, int64_t ldy, int64_t rows) {
  if constexpr (MB > 1) {
    if (rows < MB) return tiles_pair_rows<BITS, MB - 1>(pair, blocks, act, stride, y, ldy, rows);
  }
  tiles_group<BITS, MB, 2>(pair, blocks, act, stride, y, ldy);
}

// y [M, N] over row groups [g0, g1): each group's tiles are read from memory once, then from L1
// for the next kTileMaxRows activation rows.
//
// Up to kTilePairMaxRows activation rows on a CPU that does not take one stream a thread best
// (kAmdStreams: Intel's) read two groups at a time, one from each half of the thread's range, so
// that two streams are in flight. On an Intel Xeon with AMX, SmolLM2's shapes cold with two
// threads (`graphrt bench kernels` over tiles, two runs each), one stream against two: int4 at
// one row 17.3-17.5 GB/s against 23.2-24.5, two rows 16.2-16.4 against 22.4-22.6, four 16.9-17.0
// against 18.7-18.9; int8 22.0-22.1 against 25.8-28.0, 20.2-20.6 against 24.6-25.7, 19.3-19.4
// against 22.6-23.1. At eight rows two groups' accumulators spill (int4 12.4-13.4 against
// 10.4-10.9).
template <int BITS, bool WIDE>
static void tiles_columns(const uint8_t* act, const uint8_t* tiles, float* y, int64_t M, int64_t N, int64_t K,
                          int64_t g0, int64_t g1) {
  constexpr int kRows = int(graphrt_native::kTileMaxRows);
  const int64_t blocks = K / 32, stride = WIDE ? K * int64_t(sizeof(float)) : graphrt_native::tile_row_bytes(K);
  const int64_t group_bytes = blocks * graphrt_native::tile_bytes(BITS);
  if constexpr (!WIDE) {
    if (M <= kTilePairMaxRows && !graphrt_native::kAmdStreams) {
      const int64_t half = (g1 - g0) / 2;
      for (int64_t g = g0; g < g0 + half; ++g) {
        const uint8_t* pair[2] = {tiles + g * group_bytes, tiles + (g + half) * group_bytes};
        float* out[2] = {y + g * 16, y + (g + half) * 16};
        tiles_pair_rows<BITS, kTilePairMaxRows>(pair, blocks, act, stride, out, N, M);
      }
      g0 += 2 * half;  // an odd group left over: below
    }
  }
  for (int64_t g = g0; g < g1; ++g)
    for (int64_t m0 = 0; m0 < M; m0 += kRows)
      tiles_rows<BITS, WIDE, kRows>(tiles + g * group_bytes, blocks, act + m0 * stride, stride, K,
                                    y + m0 * N + g * 16, N, std::min<int64_t>(kRows, M - m0));
}

// The digits' product over records packed by tiles_pack.
static void tiles_gemm(const uint8_t* packed, const uint8_t* tiles, float* y, int64_t M, int64_t N, int64_t K,
                       int64_t g0, int64_t g1, int bits) {
  if (bits == 4) return tiles_columns<4, false>(packed, tiles, y, M, N, K, g0, g1);
  tiles_columns<8, false>(packed, tiles, y, M, N, K, g0, g1);
}

// The widening product over x fp32 [M, K].
static void tiles_gemm_wide(const float* x, const uint8_t* tiles, float* y, int64_t M, int64_t N, int64_t K,
                            int64_t g0, int64_t g1, int bits) {
  const uint8_t* act = reinterpret_cast<const uint8_t*>(x);
  if (bits == 4) return tiles_columns<4, true>(act, tiles, y, M, N, K, g0, g1);
  tiles_columns<8, true>(act, tiles, y, M, N, K, g0, g1);
}
