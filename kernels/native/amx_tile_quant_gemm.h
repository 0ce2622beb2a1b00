// Quantized tiles (kernels/quant_tiles.py: int4 and int8) times kTileAmxMinRows..kTileAmxMaxRows
// activation rows on AMX-INT8 (included by isa_kernels.cpp in the amx namespace, after
// amx_gemm.h, amx_quant_gemm.h and tile_fold.h).
//
// A tile's values are already an AMX B operand: for each of the block's 8 quads of k, 16 weight
// rows' 4 bytes side by side, [8][64] bytes (int8 as q + 128; int4's low nibbles are quads 0-3
// and its high nibbles quads 4-7, split into L1 with two ANDs and a shift). The activations are
// the A operand: tiles_pack's two int8 digits of every value (x = s * (p0 + p1 / 256) + e, as in
// tile_quant_gemm.h), each block's first digits of the M rows then their second digits, [2M][32].
// One tdpbsud a block (signed digits times unsigned weights, exact int32 sums) gives the 2M x 16
// sums that the vector kernel's 16 * M * 2 (int8) or 32 * M (int4) vpdpbusd a block give, the
// same integers, folded by the same code (tile_fold.h). So the outputs are the vector kernel's,
// bit for bit.
//
// Two groups of 16 weight rows at a time, one from each half of the thread's range, so that two
// weight streams are in flight (tile_quant_gemm.h's tiles_columns: on Intel one stream a thread
// reads below the memory's speed). Tiles: A 0 (the block's digits, shared), B 1 and 2 (the two
// groups' block), C 3 and 4 (2M x 16 int32 each). A block's C is folded kAmxQLag blocks after its
// tile store, an int4 block's B unpacked kAmxQLag blocks before its tile load (a tile load waits
// until the vector stores it reads have left the core, and vector loads of a tile store the
// same). An Intel Xeon, SmolLM2's shapes cold (`graphrt bench kernels --rows 5,8`, two runs each):
// int8 at eight rows 17.5-17.6 GB/s on the vector kernel, 17.4-18.0 on AMX one group at a time,
// 20.2-20.4 on AMX two at a time; int4 12.6-13.2, 13.1-14.0 and 13.5-14.7; at five rows int8
// 19.0-19.7, 19.8-20.6, 21.6-22.2, int4 14.9-15.7, 15.6-16.2, 16.2-17.2.

// Row groups [g0, g1) of y [M, N] from records packed by tiles_pack (`rec`, tile_row_bytes(K)
// a row), two groups at a time (one from each half of the range); scratch:
// graphrt_native::tiles_amx_scratch(M, K) bytes, 64-byte aligned.
template <int BITS>
static void amx_tiles_pairs(const uint8_t* rec, const uint8_t* tiles, float* y, int64_t M, int64_t N, int64_t K,
                            int64_t g0, int64_t g1, uint8_t* scratch) {
  constexpr int64_t kBytes = graphrt_native::tile_bytes(BITS);
  constexpr int64_t kAhead = 8192;  // the weight streams' prefetch distance, as the vector kernel's
  const int64_t blocks = K / 32, row_bytes = graphrt_native::tile_row_bytes(K), rows = 2 * M;
  int8_t* a = reinterpret_cast<int8_t*>(scratch);                          // [blocks][2M][32] digits
  int32_t* c = reinterpret_cast<int32_t*>(scratch + blocks * rows * 32);  // ring of C: [slot][group][2M][16]
  uint8_t* unpacked = reinterpret_cast<uint8_t*>(c + kAmxQRing * 512);    // int4's ring of B: [slot][group][8][64]
  for (int64_t b = 0; b < blocks; ++b)
    for (int64_t m = 0; m < M; ++m) {
      const uint8_t* digits = rec + m * row_bytes + b * 64;
      std::memcpy(a + (b * rows + m) * 32, digits, 32);
      std::memcpy(a + (b * rows + M + m) * 32, digits + 32, 32);
    }
  const float* lane_scales[8];  // per activation row: K / 32 lane scales, then sums, then int8's corrections
  for (int64_t m = 0; m < M; ++m) lane_scales[m] = reinterpret_cast<const float*>(rec + m * row_bytes + blocks * 64);
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  auto c_block = [&](int64_t b, int h) { return c + (b % kAmxQRing * 2 + h) * 256; };
  auto b_block = [&](int64_t b, int h) { return unpacked + (b % kAmxQRing * 2 + h) * 512; };
  auto unpack = [&](const uint8_t* tile, uint8_t* out) {  // int4: quads 0-3 the low nibbles, 4-7 the high
#pragma GCC unroll 4
    for (int q = 0; q < 4; ++q) {
      const __m512i bytes = _mm512_loadu_si512(tile + 64 * q);
      _mm512_store_si512(out + 64 * q, _mm512_and_si512(bytes, nibble));
      _mm512_store_si512(out + 64 * (4 + q), _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble));
    }
  };
  {
    TileConfig cfg;
    cfg.rows[0] = uint8_t(rows);
    cfg.colsb[0] = 32;
    for (int t : {1, 2}) {
      cfg.rows[t] = 8;
      cfg.colsb[t] = 64;
    }
    for (int t : {3, 4}) {
      cfg.rows[t] = uint8_t(rows);
      cfg.colsb[t] = 64;
    }
    asm volatile("" : : "r"(&cfg) : "memory");  // the fields' stores before the load (GCC 12 dropped them)
    _tile_loadconfig(&cfg);
  }
  const int64_t half = (g1 - g0) / 2;
  // groups ga and gb (the same group, computed twice and stored once, where one is left over)
  auto run = [&](int64_t ga, int64_t gb, bool two) {
    const uint8_t* grp[2] = {tiles + ga * blocks * kBytes, tiles + gb * blocks * kBytes};
    __m512 acc[2][8];
    for (int h = 0; h < 2; ++h)
      for (int m = 0; m < 8; ++m) acc[h][m] = _mm512_setzero_ps();
    if constexpr (BITS == 4)
      for (int64_t b = 0; b < std::min<int64_t>(kAmxQLag, blocks); ++b)
        for (int h = 0; h < 2; ++h) unpack(grp[h] + b * kBytes, b_block(b, h));
    for (int64_t b = 0; b < blocks + kAmxQLag; ++b) {
      if (b < blocks) {
        const uint8_t* t0 = grp[0] + b * kBytes;
        const uint8_t* t1 = grp[1] + b * kBytes;
        for (int64_t l = 0; l < kBytes; l += 64) {
          stream_prefetch(t0 + kAhead + l);
          stream_prefetch(t1 + kAhead + l);
        }
        _tile_loadd(0, a + b * rows * 32, 32);
        _tile_loadd(1, BITS == 8 ? t0 : b_block(b, 0), 64);
        _tile_loadd(2, BITS == 8 ? t1 : b_block(b, 1), 64);
        _tile_zero(3);
        _tile_zero(4);
        _tile_dpbsud(3, 0, 1);
        _tile_dpbsud(4, 0, 2);
        _tile_stored(3, c_block(b, 0), 64);
        _tile_stored(4, c_block(b, 1), 64);
        if constexpr (BITS == 4) {
          const int64_t next = b + kAmxQLag;
          if (next < blocks)
            for (int h = 0; h < 2; ++h) unpack(grp[h] + next * kBytes, b_block(next, h));
        }
      }
      if (b >= kAmxQLag) {  // fold block f
        const int64_t f = b - kAmxQLag;
        for (int h = 0; h < 2; ++h) {
          const uint8_t* tile = grp[h] + f * kBytes;
          const int32_t* cf = c_block(f, h);
          __m512 scales, mins;
          tile_scales<BITS>(tile, &scales, &mins);
          for (int64_t m = 0; m < M; ++m)
            acc[h][m] = fold_block<BITS>(acc[h][m], _mm512_load_si512(cf + m * 16), _mm512_load_si512(cf + (M + m) * 16),
                                         scales, mins, lane_scales[m], blocks, f);
        }
      }
    }
    for (int64_t m = 0; m < M; ++m) _mm512_storeu_ps(y + m * N + ga * 16, acc[0][m]);
    if (two)
      for (int64_t m = 0; m < M; ++m) _mm512_storeu_ps(y + m * N + gb * 16, acc[1][m]);
  };
  for (int64_t g = g0; g < g0 + half; ++g) run(g, g + half, true);
  for (int64_t g = g0 + 2 * half; g < g1; ++g) run(g, g, false);
  _tile_release();
}

static void tiles_gemm_amx(const uint8_t* packed, const uint8_t* tiles, float* y, int64_t M, int64_t N, int64_t K,
                           int64_t g0, int64_t g1, int bits, uint8_t* scratch) {
  if (bits == 4) return amx_tiles_pairs<4>(packed, tiles, y, M, N, K, g0, g1, scratch);
  amx_tiles_pairs<8>(packed, tiles, y, M, N, K, g0, g1, scratch);
}
