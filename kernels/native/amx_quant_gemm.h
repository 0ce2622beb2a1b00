// The int4-weight skinny GEMM of 6 to 8 activation rows on AMX-BF16 tiles (kAmxQuantMinRows in
// isa_kernels.h; included by isa_kernels.cpp in the amx namespace, after amx_gemm.h; int8 weights
// take AMX-INT8, amx_int8_gemm.h). Layouts as quant_gemm.h:
//
//   y[m, n] = sum_b scale[n, b] * S[n, b, m] (+ min[n, b] * X[b, m])
//   S[n, b, m] = sum over block b of q[n, k] * x[m, k],   X[b, m] = sum over block b of x[m, k]
//
// With 8 activation rows the vector kernel spends eight multiply-adds on every weight, and the
// arithmetic, not the memory, sets the step (quant_gemm.h). Here one tile product does a block's
// 16 weight rows x 32 k x every activation row. The q values (0..15) are exact in bf16; each
// fp32 activation is carried as two bf16 parts, x ~ hi + lo (hi = x rounded to bf16, lo = the
// rest rounded): 16 significant bits, each activation within 2^-17 of its fp32
// value (relative), where bf16 alone would be 2^-9. Every product of a q and a part is exact in
// fp32 and S is summed in fp32. Each block's S is then scaled and its min added in fp32 vectors.
//
// Tiles: A is a block of 16 weight rows' q as bf16, written into L1 from the packed bytes; B the
// block's activation parts, [16 pairs of k][2M columns: the hi parts of rows 0..M-1, then the lo
// parts], packed once a call (amx_pack_parts); C the block's S for the 16 weight rows and both
// parts, stored to L1 and folded into 16 fp32 accumulators (one per weight row: lanes 0..M-1
// the hi parts' sums, M..2M-1 the lo parts'; added together at the end).
//
// The k order inside a block is the one the int4 bytes unpack into cheapest (unpack_block); the
// activations are packed in the same order, so the products pair up as in GGUF's order.

using graphrt_native::QuantRows;

constexpr int64_t kAmxQRows = 16;  // weight rows a tile block
constexpr int kParts = graphrt_native::kAmxQuantParts;
constexpr int64_t kAmxQLag = graphrt_native::kAmxQuantLag, kAmxQRing = kAmxQLag + 1;
// The next group of 16 weight rows is prefetched while this one runs: its bytes are contiguous
// (rows are K / 2 bytes apart), so 4 lines a block, in address order, cover them in the
// group's blocks, with the group's scales (and mins) in the first blocks. In address order, not
// row by row 8 KiB ahead as before: 3-5% faster cold (`graphrt bench kernels --rows 8`).

// Tiles, two sets used by alternate blocks (a block's B and C are never rewritten while the
// previous block's product still reads them): A 0 and 3 (16 x 32 bf16), B 1 and 4 (16 pairs x 2M),
// C 2 and 5 (16 x 2M fp32).
static inline void configure_quant_tiles(int64_t M) {
  TileConfig cfg;
  for (int t : {0, 3}) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  for (int t : {1, 2, 4, 5}) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = uint16_t(kParts * M * 4);
  }
  _tile_loadconfig(&cfg);
}

// Position p of a block's A row holds k = kBlockOrder[p]: 16 bytes broadcast to four 128-bit lanes,
// lane L shifted right by 4L bits per 16-bit word (word j: bytes 2j, 2j + 1), low nibble kept: lane
// 0 the low nibbles of the even bytes (k = 2j), 1 their high nibbles (2j + 16), 2 and 3 the odd
// bytes' (2j + 1, 2j + 17).
alignas(64) static const int32_t kBlockOrder[32] = {0,  2,  4,  6,  8,  10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30,
                                                    1,  3,  5,  7,  9,  11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};

static inline __m512 bf16_to_fp32(__m256i bits) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// n float16 values (a multiple of 16) as fp32.
static inline void halves_to_fp32(const uint16_t* h, float* out, int64_t n) {
  for (int64_t i = 0; i < n; i += 16)
    _mm512_storeu_ps(out + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + i))));
}

// x fp32 [M, K] → parts [K/32 blocks][16 pairs][2M] and block sums [K/32][M], in int4's k order
// (kBlockOrder).
static void amx_pack_parts(const float* x, uint32_t* parts, float* sums, int64_t M, int64_t K) {
  const int64_t blocks = K / 32, cols = kParts * M;
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i pair_rows = _mm512_mullo_epi32(iota, _mm512_set1_epi32(int(cols)));
  const __m512i first = _mm512_load_si512(kBlockOrder), second = _mm512_load_si512(kBlockOrder + 16);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < blocks; ++b) {
      const float* xb = x + m * K + b * 32;
      __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
      sums[b * M + m] = _mm512_reduce_add_ps(_mm512_add_ps(x0, x1));
      const __m512 p0 = _mm512_permutex2var_ps(x0, first, x1), p1 = _mm512_permutex2var_ps(x0, second, x1);
      x0 = p0;
      x1 = p1;
      uint32_t* block = parts + b * 16 * cols;
      for (int p = 0; p < kParts; ++p) {
        const __m512i part = (__m512i)_mm512_cvtne2ps_pbh(x1, x0);  // positions 0-15 low: pairs in order
        _mm512_i32scatter_epi32(block + p * M + m, pair_rows, part, 4);
        // what the part left, exact in fp32 (the value's low bits), for the next part
        x0 = _mm512_sub_ps(x0, bf16_to_fp32(_mm512_castsi512_si256(part)));
        x1 = _mm512_sub_ps(x1, bf16_to_fp32(_mm512_extracti64x4_epi64(part, 1)));
      }
    }
}

// Block b of 16 weight rows from n as bf16 [16][32] into a, in kBlockOrder.
static inline void unpack_block(const QuantRows& w, int64_t n, int64_t b, uint16_t* a) {
  const int64_t K = w.K;
  alignas(64) static const uint16_t kNibbles[32] = {0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0,
                                                    0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};
  const __m512i table = _mm512_load_si512(kNibbles);  // bf16 of 0..15
  const __m512i shifts = _mm512_setr_epi64(0, 0, 0x0004000400040004, 0x0004000400040004, 0x0008000800080008,
                                           0x0008000800080008, 0x000c000c000c000c, 0x000c000c000c000c);
  const __m512i nibble = _mm512_set1_epi16(15);
  const uint8_t* q = static_cast<const uint8_t*>(w.q) + n * (K / 2) + b * 16;
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r) {
    const __m512i bytes = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + r * (K / 2))));
    const __m512i words = _mm512_and_si512(_mm512_srlv_epi16(bytes, shifts), nibble);
    _mm512_storeu_si512(a + r * 32, _mm512_permutexvar_epi16(words, table));
  }
}

// One block's tile product into c ([16][2M] fp32, rows 64 bytes apart). A macro: the tile
// intrinsics take their register numbers as literals.
#define GRT_TILE_BLOCK(TA, TB, TC, a, pb, c, cols) \
  do {                                             \
    _tile_loadd(TA, (a), 64);                      \
    _tile_loadd(TB, (pb), (cols) * 4);             \
    _tile_zero(TC);                                \
    _tile_dpbf16ps(TC, TA, TB);                    \
    _tile_stored(TC, (c), 64);                     \
  } while (0)

// 16 weight rows' accumulators into y[:, n .. n + 16): acc[r] lanes m and M + m are y[m, n + r]'s
// two parts (int4's bf16 parts, int8's slices), summed through L1 a column at a time.
static inline void store_two_parts(const __m512* acc, float* y, int64_t M, int64_t N, int64_t n) {
  const __m512i column = lane_times(16);
  alignas(64) float t[16 * 16];
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r) _mm512_store_ps(t + r * 16, acc[r]);
  for (int64_t m = 0; m < M; ++m)
    _mm512_storeu_ps(y + m * N + n,
                     _mm512_add_ps(_mm512_i32gather_ps(column, t + m, 4), _mm512_i32gather_ps(column, t + M + m, 4)));
}

// Output columns [n0, n1), a multiple of 16 of them; parts and sums from amx_pack_parts.
// scratch: amx_quant_scratch(K) floats (isa_kernels.h).
//
// The blocks are software-pipelined: while the tile unit multiplies block b, the vectors unpack
// block b + kAmxQLag's weights and fold block b - kAmxQLag's products into the accumulators. A
// tile load waits until the vector stores it reads have left the core, and vector loads of a
// tile store the same; kAmxQLag blocks apart, neither waits. Buffers: rings of kAmxQRing blocks.
static void amx_quant_rows(const uint32_t* parts, const float* sums, const QuantRows& w, float* y, int64_t M, int64_t N,
                           int64_t n0, int64_t n1, float* scratch) {
  const int64_t K = w.K, blocks = K / 32, cols = kParts * M;
  float* sc = scratch;                                                  // 16 rows' scales, [row][block]
  float* mn = sc + kAmxQRows * blocks;                                  // and mins
  uint16_t* a = reinterpret_cast<uint16_t*>(mn + kAmxQRows * blocks);  // ring of A blocks, [16][32] bf16
  float* c = mn + kAmxQRows * blocks + kAmxQRing * 256;                 // ring of C blocks, [16][16] fp32
  configure_quant_tiles(M);
  const __mmask16 first = __mmask16((1u << M) - 1);
  const char* bytes = static_cast<const char*>(w.q);
  const int64_t row_bytes = K / 2;
  auto a_block = [&](int64_t b) { return a + b % kAmxQRing * 512; };  // the rings' slots of block b
  auto c_block = [&](int64_t b) { return c + b % kAmxQRing * 256; };
  for (int64_t n = n0; n < n1; n += kAmxQRows) {
    halves_to_fp32(w.scales + n * blocks, sc, kAmxQRows * blocks);
    halves_to_fp32(w.mins + n * blocks, mn, kAmxQRows * blocks);
    __m512 acc[kAmxQRows];
#pragma GCC unroll 16
    for (int r = 0; r < kAmxQRows; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < std::min<int64_t>(kAmxQLag, blocks); ++b)
      unpack_block(w, n, b, a_block(b));
    for (int64_t b = 0; b < blocks + kAmxQLag; ++b) {
      if (b < blocks) {
        const uint32_t* pb = parts + b * 16 * cols;
        if (b & 1)
          GRT_TILE_BLOCK(3, 4, 5, a_block(b), pb, c_block(b), cols);
        else
          GRT_TILE_BLOCK(0, 1, 2, a_block(b), pb, c_block(b), cols);
        const int64_t next = b + kAmxQLag;
        if (next < blocks) unpack_block(w, n, next, a_block(next));
        const int64_t ahead = n + kAmxQRows;  // past n1 or N: a prefetch never faults
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) __builtin_prefetch(bytes + ahead * row_bytes + (b * 4 + i) * 64);
        if (b <= kAmxQRows * blocks * 2 / 64) {  // a group's scales: 16 rows x blocks float16s
          __builtin_prefetch(reinterpret_cast<const char*>(w.scales + ahead * blocks) + b * 64);
          __builtin_prefetch(reinterpret_cast<const char*>(w.mins + ahead * blocks) + b * 64);
        }
      }
      if (b >= kAmxQLag) {  // fold block f: lanes past 2M hold what they hold and are never read
        const int64_t f = b - kAmxQLag;
        const float* cf = c_block(f);
        const __m512 xs = _mm512_maskz_loadu_ps(first, sums + f * M);
#pragma GCC unroll 16
        for (int r = 0; r < kAmxQRows; ++r) {
          acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(cf + r * 16), _mm512_set1_ps(sc[r * blocks + f]), acc[r]);
          acc[r] = _mm512_fmadd_ps(xs, _mm512_set1_ps(mn[r * blocks + f]), acc[r]);
        }
      }
    }
    store_two_parts(acc, y, M, N, n);
  }
  _tile_release();
}

#undef GRT_TILE_BLOCK
