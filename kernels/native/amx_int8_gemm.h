// The int8-weight skinny GEMM of 6 to 8 activation rows on AMX-INT8 tiles (taken for
// kAmxQuantMinRows..kAmxQuantMaxRows; included by isa_kernels.cpp in the amx namespace, after
// amx_gemm.h and amx_quant_gemm.h). Layouts as quant_gemm.h:
//
//   y[m, n] = sum_b scale[n, b] * sum over block b of q[n, k] * x[m, k]      q: int8 [N, K]
//
// The weights go into the tiles as they are stored: an A tile is a block of 16 weight rows x 32
// int8s, loaded in place with the rows' stride, so no vector instruction touches a weight byte.
// (Converting them to bf16 for AMX-BF16 took eight vector instructions for every 32, and the tile
// loads then waited on those stores: this path is 1.3-1.7x faster, `graphrt bench kernels --rows 8
// --dtypes int8`.) The activations become int8 too: each block of 32 activations of a row is
// split into two int8 slices under the block's scale s = max|x| / 127,
//
//   x = s * (p0 + p1 / 254) + e,   p0, p1 in [-127, 127],   |e| <= 2^-15.9 * max|x over the block|
//
// an absolute error a bf16 rounding of the block's largest activation alone exceeds 2^7-fold
// (2^-9 of it); llama.cpp's int8 activations keep the first slice only. Each slice's products are
// exact in the tile's int32 sums (|sum| <= 32 * 127 * 127); the block is then scaled in fp32.
// A third slice (2^-23) takes a second tile product a block and gave back most of the gain.
//
// Tiles: A 0 and 3 (16 x 32 int8), B 1 and 4 (8 quads of k x 2M int32 columns: slice 0 of rows
// 0..M-1, then slice 1), C 2 and 5 (16 x 2M int32), two sets used by alternate blocks as in
// amx_quant_gemm.h. A block's C folds into fp32 accumulators with its column scales (s_m in lane
// m, s_m / 254 in lane M + m, 0 beyond 2M) times the weight row's scale.

static inline void configure_int8_tiles(int64_t M) {
  TileConfig cfg;
  for (int t : {0, 3}) {  // A
    cfg.rows[t] = 16;
    cfg.colsb[t] = 32;
  }
  for (int t : {1, 4}) {  // B
    cfg.rows[t] = 8;
    cfg.colsb[t] = uint16_t(2 * M * 4);
  }
  for (int t : {2, 5}) {  // C
    cfg.rows[t] = 16;
    cfg.colsb[t] = uint16_t(2 * M * 4);
  }
  _tile_loadconfig(&cfg);
}

// x fp32 [M, K] → per block of 32 k: B ([8 quads][2M] int32, amx_parts_size) and 16 column scales
// (amx_sums_size). A block whose largest magnitude is not finite gets NaN scales (that row's
// outputs are NaN, as in fp32); one of zeros gets zero; one below 2^-120 is scaled as if it were
// 2^-120 (its slices round toward zero: an error below 2^-127).
static void amx_pack_slices(const float* x, int32_t* slices, float* col_scales, int64_t M, int64_t K) {
  const int64_t blocks = K / 32, cols = 2 * M;
  std::memset(col_scales, 0, size_t(blocks * 16) * sizeof(float));
  const __m512 step = _mm512_set1_ps(254.0f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < blocks; ++b) {
      const float* xb = x + m * K + b * 32;
      __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
      float* cs = col_scales + b * 16;
      constexpr int kNonFinite = 0x01 | 0x08 | 0x10 | 0x80;  // NaNs and infinities (max drops NaNs)
      const bool finite = (_mm512_fpclass_ps_mask(v0, kNonFinite) | _mm512_fpclass_ps_mask(v1, kNonFinite)) == 0;
      const float s = finite ? std::max(amax, 0x1p-120f) / 127.0f : 0.0f;
      cs[m] = finite ? (amax == 0.0f ? 0.0f : s) : std::numeric_limits<float>::quiet_NaN();
      cs[M + m] = cs[m] / 254.0f;
      const __m512 inv = _mm512_set1_ps(finite ? 1.0f / s : 0.0f);
      v0 = _mm512_mul_ps(v0, inv);  // within [-127, 127] up to a rounding: p0 never passes 127
      v1 = _mm512_mul_ps(v1, inv);
      int32_t* block = slices + b * 8 * cols;
      for (int slice = 0; slice < 2; ++slice) {
        const __m512i p0 = _mm512_cvtps_epi32(v0), p1 = _mm512_cvtps_epi32(v1);  // nearest
        alignas(16) int32_t quads[8];  // quad i: k = 4i..4i+3 as four int8s
        _mm_store_si128(reinterpret_cast<__m128i*>(quads), _mm512_cvtsepi32_epi8(p0));
        _mm_store_si128(reinterpret_cast<__m128i*>(quads + 4), _mm512_cvtsepi32_epi8(p1));
        for (int i = 0; i < 8; ++i) block[i * cols + slice * M + m] = quads[i];
        // what the first slice left, in [-0.5, 0.5] (exact), to 254ths
        v0 = _mm512_mul_ps(_mm512_sub_ps(v0, _mm512_cvtepi32_ps(p0)), step);
        v1 = _mm512_mul_ps(_mm512_sub_ps(v1, _mm512_cvtepi32_ps(p1)), step);
      }
    }
}

// One block's tile product into c ([16][2M] int32, rows 64 bytes apart). A macro: the tile
// intrinsics take their register numbers as literals.
#define GRT_INT8_BLOCK(TA, TB, TC, a, stride, pb, c, cols) \
  do {                                                     \
    _tile_loadd(TA, (a), (stride));                        \
    _tile_loadd(TB, (pb), (cols) * 4);                     \
    _tile_zero(TC);                                        \
    _tile_dpbssd(TC, TA, TB);                              \
    _tile_stored(TC, (c), 64);                             \
  } while (0)

// Output columns [n0, n1), a multiple of 16 of them; slices and col_scales from amx_pack_slices.
// scratch: amx_quant_scratch(K) floats. The blocks are pipelined as in amx_quant_rows: a block's
// products are folded kAmxQLag blocks after their tile store (vector loads of a tile store wait
// until it has left the core).
static void amx_int8_rows(const int32_t* slices, const float* col_scales, const QuantRows& w, float* y, int64_t M,
                          int64_t N, int64_t n0, int64_t n1, float* scratch) {
  const int64_t K = w.K, blocks = K / 32, cols = 2 * M;
  float* sc = scratch;                                          // 16 rows' scales, [row][block]
  int32_t* c = reinterpret_cast<int32_t*>(sc + 16 * blocks);  // ring of C blocks, [16][16] int32
  configure_int8_tiles(M);
  const int8_t* q = static_cast<const int8_t*>(w.q);
  auto c_block = [&](int64_t b) { return c + b % kAmxQRing * 256; };
  for (int64_t n = n0; n < n1; n += 16) {
    halves_to_fp32(w.scales + n * blocks, sc, 16 * blocks);
    __m512 acc[16];
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks + kAmxQLag; ++b) {
      if (b < blocks) {
        const int8_t* a = q + n * K + b * 32;
        const int32_t* pb = slices + b * 8 * cols;
        if (b & 1)
          GRT_INT8_BLOCK(3, 4, 5, a, K, pb, c_block(b), cols);
        else
          GRT_INT8_BLOCK(0, 1, 2, a, K, pb, c_block(b), cols);
        // the next group of 16 rows in address order (K bytes a row: 8 lines a block), with its
        // scales; past n1 or N a prefetch never faults
        const int64_t ahead = n + 16;
#pragma GCC unroll 8
        for (int i = 0; i < 8; ++i) __builtin_prefetch(q + ahead * K + (b * 8 + i) * 64);
        if (b <= 16 * blocks * 2 / 64)
          __builtin_prefetch(reinterpret_cast<const char*>(w.scales + ahead * blocks) + b * 64);
      }
      if (b >= kAmxQLag) {  // fold block f
        const int64_t f = b - kAmxQLag;
        const int32_t* cf = c_block(f);
        const __m512 cs = _mm512_loadu_ps(col_scales + f * 16);
#pragma GCC unroll 16
        for (int r = 0; r < 16; ++r)
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(cf + r * 16)),
                                   _mm512_mul_ps(cs, _mm512_set1_ps(sc[r * blocks + f])), acc[r]);
      }
    }
    store_two_parts(acc, y, M, N, n);
  }
  _tile_release();
}

#undef GRT_INT8_BLOCK
