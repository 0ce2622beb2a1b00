// The kernel table of the instruction set chosen for this CPU (see isa_kernels.cpp).
#pragma once

#include <cstdint>

namespace graphrt_native {

// y[M, N] = x[M, K] * w[N, K]^T over output columns [n0, n1); x and y fp32, w fp32 or bf16.
using GemmFn = void (*)(const float* x, const void* w, float* y, int64_t M, int64_t N, int64_t K, int64_t n0,
                        int64_t n1);

// Keys a work item covers, at most (paged attention's chunks; attention.cpp sizes them).
constexpr int64_t kMaxChunkKeys = 256;

// Keys [l0, l1) of a sequence whose block table is `blocks`: a work item's keys.
struct KeyRange {
  const int64_t* blocks;
  int64_t l0, l1;
};

// One query token's heads over its keys [l0, l1) (at most kMaxChunkKeys of them): q [H, D]; per
// head the chunk's max score m, sum of exponentials and unnormalised output acc [H, D]; scores is
// scratch [H, l1 - l0]. `next` (or null): the keys of the thread's next item, whose K/V the call
// requests while it computes. `cold`: nothing requested this item's K/V ahead (a thread's first;
// on AMD over an fp32 cache, any item whose keys the thread's previous item did not read).
using AttendFn = void (*)(const float* q, const void* k_cache, const void* v_cache, const int64_t* blocks, int64_t l0,
                          int64_t l1, int64_t block_size, int64_t num_kv_heads, int64_t D, int64_t G, float scale,
                          float* scores, float* m, float* sums, float* acc, const KeyRange* next, bool cold);

// y[M, N] = x[M, K] * w[N, K]^T with x and w both bf16 (null where the CPU has no bf16 dot product).
using GemmBf16DotFn = void (*)(const uint16_t* x, const void* w, float* y, int64_t M, int64_t N, int64_t K, int64_t n0,
                               int64_t n1);

// A weight-only quantized matrix [N, K] (kernels/quantized.py): bits 4 (q uint8 [N, K/2], mins)
// or 8 (q int8 [N, K], no mins); scales/mins float16 bits [N, K/32].
struct QuantRows {
  const void* q;
  const uint16_t* scales;
  const uint16_t* mins;
  int bits;
  int64_t K;
};

// y[M, N] = x[M, K] * w^T over output columns [n0, n1); scratch: 4 * K/32 + 2 * K floats.
using QuantGemmFn = void (*)(const float* x, const QuantRows& w, float* y, int64_t M, int64_t N, int64_t n0,
                             int64_t n1, float* scratch);
// Rows [r0, r1) of w as fp32 into out [rows, K]; scratch: 2 * K/32 floats.
using DequantFn = void (*)(const QuantRows& w, float* out, int64_t r0, int64_t r1, float* scratch);

// The AMX path (amx_gemm.h): x bf16 [M, K] packed into pairs [K/2][M]; then y over output
// columns [n0, n1), a multiple of 32 of them, K a multiple of 32 (null without AMX).
using PackPairsFn = void (*)(const uint16_t* x, uint32_t* pairs, int64_t M, int64_t K);
using AmxGemmFn = void (*)(const uint32_t* pairs, const void* w, float* y, int64_t M, int64_t N, int64_t K, int64_t n0,
                           int64_t n1);
constexpr int64_t kAmxMinRows = 2, kAmxMaxRows = 16;  // a B tile row holds 16 activation rows' pairs
constexpr int64_t kAmxBlock = 32;
// bf16 weights packed for the tiles (kernels/packed_bf16.py, amx_packed_rows): out [M, N] bf16 =
// x [M, K] bf16 (contiguous, any M) times the weights (+ bias fp32 [N] or null) over output
// columns [n0, n1), multiples of 32 (null without AMX).
using AmxPackedFn = void (*)(const uint16_t* x, const uint16_t* w, const float* bias, uint16_t* out, int64_t M,
                             int64_t N, int64_t K, int64_t n0, int64_t n1);

// The quantized AMX path: x fp32 [M, K] packed once a call, then y over output columns [n0, n1),
// a multiple of 16 of them (null without AMX). int4 (amx_quant_gemm.h): two bf16 parts of each
// activation in the tiles' pair layout, and the block sums; int8 (amx_int8_gemm.h): two int8
// slices of each block of 32 activations in the quad layout, and the blocks' column scales in
// place of the sums. Sizes in uint32 / floats: amx_parts_size, amx_sums_size.
using AmxPackPartsFn = void (*)(const float* x, uint32_t* parts, float* sums, int64_t M, int64_t K, int bits);
using AmxQuantGemmFn = void (*)(const uint32_t* parts, const float* sums, const QuantRows& w, float* y, int64_t M,
                                int64_t N, int64_t n0, int64_t n1, float* scratch);
// 2 parts (slices) x 8 rows fill a tile's 16 columns. Below 6 rows the vector kernel is as fast or
// faster (`graphrt bench kernels --rows 5,6,7,8 --dtypes int4,int8`, cold weights, two threads:
// int4 at 5/6/8 rows 9.6/9.9/9.5 GB/s on tiles against 9.6/8.8/7.1 in vectors; int8 on its
// AMX-INT8 tiles 17.4/16.8 GB/s at 6/8 rows, the vectors 16.1/15.0 at 4/5).
constexpr int64_t kAmxQuantMinRows = 6, kAmxQuantMaxRows = 8;
constexpr int64_t kAmxQuantBlock = 16;
constexpr int kAmxQuantParts = 2;  // bf16 parts (int4) or int8 slices (int8) of each activation
constexpr int64_t kAmxQuantLag = 3;  // blocks between a block's unpacking (int4), tile product and folding
inline int64_t amx_parts_size(int64_t M, int64_t K) { return K / 32 * 16 * kAmxQuantParts * M; }
inline int64_t amx_sums_size(int64_t K) { return K / 32 * 16; }  // sums [K/32][M] or scales [K/32][16]
inline int64_t amx_quant_scratch(int64_t K) { return 2 * 16 * (K / 32) + (kAmxQuantLag + 1) * 512; }

// The VNNI path (vnni_quant_gemm.h): 1 to kVnniMaxRows rows of x fp32 [M, K] (kVnniMaxRowsNoAmx
// on a CPU without AMX tiles, which take 6-8 rows where they exist) packed once a call into int8
// digits, vnni_row_bytes(K, bits) a row (64-byte aligned), then y over output columns [n0, n1)
// (null without AVX512-VNNI); register tiles of up to kVnniTileRows activation rows.
using VnniPackFn = void (*)(const float* x, uint8_t* packed, int64_t M, int64_t K, int bits);
using VnniQuantGemmFn = void (*)(const uint8_t* packed, const QuantRows& w, float* y, int64_t M, int64_t N,
                                 int64_t n0, int64_t n1);
constexpr int64_t kVnniMaxRows = 5, kVnniMaxRowsNoAmx = 16, kVnniTileRows = 8;
// A row's records, one per group of blocks (64 weight bytes a row: four int4 blocks, two int8)
constexpr int64_t vnni_group_blocks(int bits) { return bits == 4 ? 4 : 2; }
constexpr int64_t vnni_record_bytes(int bits) { return bits == 4 ? 320 : 256; }
inline int64_t vnni_row_bytes(int64_t K, int bits) {
  const int64_t blocks = K / 32, groups = (blocks + vnni_group_blocks(bits) - 1) / vnni_group_blocks(bits);
  const int64_t sums = bits == 4 ? (blocks + 15) / 16 * 64 : 0;  // int4: the blocks' sums, after the records
  return groups * vnni_record_bytes(bits) + sums;
}

// The tile path (tile_quant_gemm.h, kernels/quant_tiles.py; int4 or int8 by `bits`): x fp32
// [M, K] packed once a call into int8 digits, tile_row_bytes(K) a row (64-byte aligned), then y
// [M, N] over the row groups [g0, g1) of 16 output columns each (null without AVX512-VNNI);
// kTileMaxRows activation rows at a time. More than kVnniMaxRowsNoAmx rows take the widening
// product instead (fp32 sums, no digits).
using TilesPackFn = void (*)(const float* x, uint8_t* packed, int64_t M, int64_t K);
using TilesGemmFn = void (*)(const uint8_t* packed, const uint8_t* tiles, float* y, int64_t M, int64_t N, int64_t K,
                             int64_t g0, int64_t g1, int bits);
// AMX-INT8 over tiles (amx_tile_quant_gemm.h): kTileAmxMinRows..kTileAmxMaxRows records packed by
// tiles_pack, tiles_amx_scratch(M, K) bytes of scratch (64-byte aligned) a thread.
using TilesAmxFn = void (*)(const uint8_t* packed, const uint8_t* tiles, float* y, int64_t M, int64_t N, int64_t K,
                            int64_t g0, int64_t g1, int bits, uint8_t* scratch);
using TilesWideFn = void (*)(const float* x, const uint8_t* tiles, float* y, int64_t M, int64_t N, int64_t K,
                             int64_t g0, int64_t g1, int bits);
constexpr int64_t kTileMaxRows = 8;  // 8 against 4: 4-9% faster at 5-16 rows (int4 and int8, cold)
constexpr int64_t kTileRows = 16;  // weight rows a tile holds side by side
constexpr int64_t tile_value_bytes(int bits) { return bits == 4 ? 256 : 512; }  // 16 rows' 32 values
// one block's tile: the values, then 16 float16 scales and (int4) 16 float16 minimums
constexpr int64_t tile_bytes(int bits) { return tile_value_bytes(bits) + (bits == 4 ? 64 : 32); }
// 64 bytes of digits, a lane scale, a sum and a correction a block
inline int64_t tile_row_bytes(int64_t K) { return (K / 32 * 76 + 63) / 64 * 64; }
constexpr int64_t kTileAmxMinRows = 5, kTileAmxMaxRows = 8;  // a C tile holds 16 rows: 2 digits of 8
// the A digits [K / 32][2M][32], rings of two groups' C blocks [2M][16] int32 and int4's B blocks [8][64]
inline int64_t tiles_amx_scratch(int64_t M, int64_t K) {
  return K / 32 * 2 * M * 32 + (kAmxQuantLag + 1) * 2 * (1024 + 512);
}

// One slice of a logits row, reduced for greedy sampling (greedy.h): its maximum, sum(exp(x -
// max)), the first index of the maximum and of a NaN (-1: none; with a NaN, max and sum are not set).
struct ArgmaxPart {
  float max, sum;
  int64_t index, nan_index;
};
using ArgmaxFn = void (*)(const float* x, int64_t n, ArgmaxPart* out);

struct IsaKernels {
  const char* name;
  GemmFn gemm_f32;
  GemmFn gemm_bf16;
  GemmBf16DotFn gemm_bf16_dot;
  AmxGemmFn gemm_bf16_amx;
  PackPairsFn pack_pairs;
  AmxPackedFn gemm_bf16_packed;
  AttendFn attend_f32;
  AttendFn attend_bf16;       // a bf16 cache, its q bf16 values (a bf16 model): may take the bf16 dot
  AttendFn attend_bf16_wide;  // a bf16 cache under an fp32 q (kv_cache_dtype): keys widened, q kept
  QuantGemmFn quant_gemm;
  AmxPackPartsFn pack_parts;
  AmxQuantGemmFn quant_gemm_amx;
  VnniPackFn vnni_pack;
  VnniQuantGemmFn quant_gemm_vnni;
  TilesPackFn tiles_pack;
  TilesGemmFn tiles_gemm;
  TilesWideFn tiles_gemm_wide;
  TilesAmxFn tiles_gemm_amx;
  DequantFn dequantize;
  ArgmaxFn argmax_sumexp;
};

const IsaKernels& isa_kernels();

// How weights are streamed, tuned per CPU vendor (`graphrt bench kernels` on each):
//   AMD (true): a one-row product reads the thread's weights as three front-to-back streams at
//     once, with no software prefetch (skinny_gemm.h, dot_packed_gemm.h); the quantized tiles
//     stream without one too at one row, and at more rows prefetch their stream with a
//     non-temporal hint (the weights are read once a step; tile_quant_gemm.h);
//   Intel and others (false): rows in pairs with an ordinary prefetch (a non-temporal prefetch
//     far ahead is dropped before its use there: the single stream ran at 40% of the memory).
// GRAPHRT_CPU_TUNING=amd|intel overrides the vendor's choice.
extern const bool kAmdStreams;

// How far ahead of each weight stream products of two to eight rows on AMD request its lines into
// L1 (prefetch_ahead, below: the fp32 skinny GEMM's kAhead, the packed bf16 product).
constexpr int64_t kAheadBytes = 8 << 10;

// The core's L1 data cache in bytes (the OS's figure; 32 KiB where it gives none), and whether a
// product's requests kAheadBytes ahead on each of `streams` weight streams fit in it beside the
// activation rows it reads (skinny_gemm.h, dot_packed_gemm.h): where they do not, the lines
// requested evict the activations before they are read again (sixteen fp32 rows of 576, 36 KiB,
// beside three streams' 24 KiB on a 48 KiB L1: the requests lost 4-8%, where eight rows gained
// 5-10%).
extern const int64_t kL1dBytes;
inline bool ahead_fits(int64_t streams, int64_t activation_bytes) {
  return streams * kAheadBytes + activation_bytes <= kL1dBytes;
}

// Whether paged attention reads each work item of new keys first, with plain loads, rather than
// having the item before request it (AMD, fp32 caches; paged_attention.h, read_slots).
inline bool reads_items_first(bool fp32_cache) { return kAmdStreams && fp32_cache; }

}  // namespace graphrt_native

// A weight stream's prefetch, with the hint this CPU's vendor takes best.
static inline void stream_prefetch(const void* p) {
  if (graphrt_native::kAmdStreams)
    __builtin_prefetch(p, 0, 0);
  else
    __builtin_prefetch(p, 0, 3);
}

// The pair that products of several activation rows use instead of a far prefetch into L1
// (which holds one of the core's few line-fill buffers for a whole memory latency, and capped the
// stream once several rows lengthened the arithmetic): the far line into L2, and the line
// kNearAheadBytes on into L1 (skinny_gemm.h on every CPU, tile_quant_gemm.h off AMD).
constexpr int64_t kNearAheadBytes = 1024;
static inline void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 2); }
static inline void prefetch_near(const void* p) { __builtin_prefetch(static_cast<const char*>(p) + kNearAheadBytes); }

// The line graphrt_native::kAheadBytes on from a weight vector, into L1.
static inline void prefetch_ahead(const void* p) {
  __builtin_prefetch(static_cast<const char*>(p) + graphrt_native::kAheadBytes);
}
