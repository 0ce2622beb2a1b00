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

#include "packed_store.h"

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

// GCC 12 may treat ldtilecfg as not reading the stores that fill cfg and drop the constant ones
// (a stand-alone build of configure_tiles lost tiles 2 and 3, and the first tile load then faulted)
static inline void load_tile_config(const TileConfig& cfg) {
  __asm__ volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
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
  load_tile_config(cfg);
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

// The product over weights packed for the tiles (kernels/packed_bf16.py), with the roles turned
// round: the activations are A, read in place (a tile of up to 16 rows x 32 values, the rows K
// apart), and the weights are B, already in the tiles' pair layout. Output columns come in blocks
// of 32 (two B tiles, two C tiles); k-step s of block b is 2 KiB at element (b * K / 32 + s) * 1024:
// for each half h, 16 pairs p x 16 columns c x 2, w[32 b + 16 h + c, 32 s + 2 p + e]. A block
// starts where its first row would (n * K) and is one stream read front to back; each k-step
// prefetches the 2 KiB that start kPackedAhead bytes past its own. C is [rows][16] in the
// output's own order: each row's 32 columns get the bias and bf16 rounding and are stored
// directly, with no transposition and no fp32 copy of y.
//
// SmolLM2's LM head shape, cold, two threads, 8 rows: the rows-in-place kernel above read 23.9-25.5
// GB/s, this one 32.9-34.4. A first version that kept that kernel's roles (C as the output's
// transpose, gathered into an fp32 y, then rounded) read 26.0, and 34.9 with no output written.
constexpr int64_t kPackedAhead = 512;

static inline void configure_packed_tiles(int64_t rows) {
  TileConfig cfg;
  for (int t : {0, 1, 4}) {  // C 0, 1 and A 4: `rows` activation rows
    cfg.rows[t] = uint8_t(rows);
    cfg.colsb[t] = 64;
  }
  for (int t : {2, 3}) {  // B: 16 pairs x 16 columns
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  load_tile_config(cfg);
}

// One C block [rows][32] of columns n.. n + 31 → out's rows m0.. (packed_store.h).
static inline void store_packed_block(const float* c, const float* bias, uint16_t* out, int64_t rows, int64_t N,
                                      int64_t m0, int64_t n, bool aligned) {
  const __m512 b0 = bias != nullptr ? _mm512_loadu_ps(bias + n) : _mm512_setzero_ps();
  const __m512 b1 = bias != nullptr ? _mm512_loadu_ps(bias + n + 16) : _mm512_setzero_ps();
  for (int64_t m = 0; m < rows; ++m)
    store_packed_row(_mm512_load_ps(c + m * kAmxRows), _mm512_load_ps(c + m * kAmxRows + 16), b0, b1,
                     out + (m0 + m) * N + n, aligned);
}

// out [M, N] bf16 over output columns [n0, n1) (multiples of 32); x bf16 [M, K], any M (16 rows
// at a time; later chunks of a block read it from cache), K > 0; bias fp32 [N] or null. A chunk's
// C tiles are written out during the next chunk's last k-step: loads that follow a tile store
// wait for it, and waiting right away held up the weights' stream (2-3% on the shapes above).
static void amx_packed_rows(const uint16_t* x, const uint16_t* w, const float* bias, uint16_t* out, int64_t M,
                            int64_t N, int64_t K, int64_t n0, int64_t n1) {
  alignas(64) float c[2][16 * kAmxRows];
  struct Chunk {
    int64_t rows, m0, n;
  } stored[2] = {};
  int64_t count = 0;  // chunks whose C tiles are in c, by parity
  const bool aligned = reinterpret_cast<uintptr_t>(out) % 64 == 0 && N % 32 == 0;
  auto write_out = [&](int64_t i) {
    const Chunk& ch = stored[i & 1];
    store_packed_block(c[i & 1], bias, out, ch.rows, N, ch.m0, ch.n, aligned);
  };
  const char* end = reinterpret_cast<const char*>(w + n1 * K);
  int64_t configured = -1;
  for (int64_t n = n0; n < n1; n += kAmxRows) {
    const uint16_t* block = w + n * K;
    for (int64_t m0 = 0; m0 < M; m0 += 16) {
      const int64_t rows = std::min<int64_t>(16, M - m0);
      if (rows != configured) configure_packed_tiles(configured = rows);
      const uint16_t* xr = x + m0 * K;
      _tile_zero(0);
      _tile_zero(1);
      for (int64_t k = 0; k < K; k += 32) {
        const uint16_t* step = block + k * kAmxRows;
        if (m0 == 0) {
          const char* ahead = reinterpret_cast<const char*>(step) + kPackedAhead;
          if (ahead < end) {
#pragma GCC unroll 32
            for (int r = 0; r < kAmxRows; ++r) __builtin_prefetch(ahead + r * 64);
          }
        }
        _tile_loadd(2, step, 64);
        _tile_loadd(3, step + 16 * 32, 64);
        _tile_loadd(4, xr + k, K * int64_t(sizeof(uint16_t)));
        _tile_dpbf16ps(0, 4, 2);
        _tile_dpbf16ps(1, 4, 3);
        if (k + 32 >= K && count > 0) write_out(count - 1);
      }
      _tile_stored(0, c[count & 1], kAmxRows * 4);
      _tile_stored(1, c[count & 1] + 16, kAmxRows * 4);
      stored[count & 1] = Chunk{rows, m0, n};
      ++count;
    }
  }
  if (count > 0) write_out(count - 1);
  if (configured >= 0) _tile_release();
  _mm_sfence();  // the streaming stores, visible before the caller's threads join
}
