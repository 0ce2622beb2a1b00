// The skinny GEMM of bf16 decode steps on AMX tiles (included by isa_kernels.cpp under the AMX
// target, for CPUs with AMX-BF16).
//
//   y[m, n] = sum_k x[m, k] * w[n, k]      x: bf16 [M, K]; w: bf16 [N, K] rows; y: fp32 [M, N]
//
// With 8 or 16 activation rows, the vector dot product (vdpbf16ps) spends as long on arithmetic
// as the memory spends on the weights; one tile instruction does 16 weight rows x 32 k x M rows.
// The weights are the tile product's A operand, read in place: an A tile is 16 weight rows x 64
// bytes, loaded with the rows' stride, so no packed copy of the weights exists. The activations
// are B: in the tile's pair layout, [K/2][M] 32-bit pairs, packed once a call (they are small).
// C is 16 weight rows x M fp32, stored and transposed into y. Two weight-row blocks share each B
// load. Rows that do not fill a block of 32 go to the vector kernel; K must be a multiple of 32.

constexpr int kAmxRows = graphrt_native::kAmxBlock;  // weight rows a step: two A tiles, two C tiles
static_assert(kAmxRows == 32, "two tiles of 16 weight rows a step");
// Prefetch distance in k-steps of 32: 8 measured best of 2, 4, 8, 16 and a row block ahead
// (`graphrt bench kernels --dtypes bfloat16`: 69% of the read bandwidth at 8 rows, 63% at 16).
constexpr int64_t kAmxAhead = 8;

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles: 0, 1 accumulators (16 x M fp32); 2, 3 weight blocks (16 x 32 bf16); 4 activations (16
// pairs x M).
// 0, M, 2M, ... 15M: the offsets of one column of a [rows][M] matrix, a lane each.
static inline __m512i lane_times(int64_t M) {
  return _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                            _mm512_set1_epi32(int(M)));
}

static inline void configure_tiles(int64_t M) {
  TileConfig cfg;
  for (int t : {0, 1, 4}) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = uint16_t(M * 4);
  }
  for (int t : {2, 3}) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// x [M, K] bf16 → pairs [K/2][M] (32-bit: x[m, 2p], x[m, 2p + 1]).
static inline void pack_activation_pairs(const uint16_t* x, uint32_t* pairs, int64_t M, int64_t K) {
  const uint32_t* x32 = reinterpret_cast<const uint32_t*>(x);
  const int64_t P = K / 2;  // a multiple of 16
  const __m512i row = lane_times(M);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t p = 0; p < P; p += 16)
      _mm512_i32scatter_epi32(pairs + p * M + m, row, _mm512_loadu_si512(x32 + m * P + p), 4);
}

// Output columns [n0, n1) with n1 - n0 a multiple of kAmxRows; pairs from pack_activation_pairs.
static void amx_gemm_rows(const uint32_t* pairs, const uint16_t* w, float* y, int64_t M, int64_t N, int64_t K,
                          int64_t n0, int64_t n1) {
  configure_tiles(M);
  alignas(64) float c[kAmxRows * 16];
  const int64_t wstride = K * int64_t(sizeof(uint16_t));
  const int64_t xstride = M * 4;
  const __m512i column = lane_times(M);
  for (int64_t n = n0; n < n1; n += kAmxRows) {
    const uint16_t* w0 = w + n * K;
    const uint16_t* w1 = w0 + 16 * K;
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t k = 0; k < K; k += 32) {
      // each of the 32 rows' line kAmxAhead k-steps on (into the next row block near the end)
      const int64_t on = k + kAmxAhead * 32;
      const uint16_t* ahead = on < K ? w0 + on : w0 + kAmxRows * K + (on - K);
      if (ahead < w + n1 * K) {
#pragma GCC unroll 8
        for (int r = 0; r < kAmxRows; ++r) __builtin_prefetch(ahead + r * K);
      }
      _tile_loadd(2, w0 + k, wstride);
      _tile_loadd(3, w1 + k, wstride);
      _tile_loadd(4, pairs + (k / 2) * M, xstride);
      _tile_dpbf16ps(0, 2, 4);
      _tile_dpbf16ps(1, 3, 4);
    }
    _tile_stored(0, c, xstride);
    _tile_stored(1, c + 16 * M, xstride);
    // c is [32 weight rows][M]: each activation row's 32 outputs are a column, gathered
    for (int64_t m = 0; m < M; ++m) {
      _mm512_storeu_ps(y + m * N + n, _mm512_i32gather_ps(column, c + m, 4));
      _mm512_storeu_ps(y + m * N + n + 16, _mm512_i32gather_ps(column, c + 16 * M + m, 4));
    }
  }
  _tile_release();
}
