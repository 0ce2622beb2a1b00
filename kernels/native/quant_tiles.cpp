// CPU implementations of graphrt::linear_tiles and dequantize_tiles (kernels/quant_tiles.py) over
// the ISA kernel table: the VNNI tile products where the CPU has them, else the plain layout's
// kernels over the rows put back.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "isa_kernels.h"
#include "ops.h"

namespace graphrt_native {

namespace {

// The tiles' format: 4 or 8 bits, by the tile size.
int tile_bits(const at::Tensor& tiles) {
  TORCH_CHECK(tiles.scalar_type() == at::kByte && tiles.dim() == 3 && tiles.is_contiguous() &&
                  (tiles.size(2) == tile_bytes(4) || tiles.size(2) == tile_bytes(8)),
              "graphrt: tiles must be contiguous uint8 [N / 16, K / 32, 320 (int4) or 544 (int8)]");
  return tiles.size(2) == tile_bytes(4) ? 4 : 8;
}

// One row group's tiles [blocks][tile_bytes] → its 16 rows in the plain layout: q [16][K / 2] (int4)
// or [16][K] (int8), scales and (int4) mins [16][K / 32] (float16 bits).
void untile_group(const uint8_t* tile, int64_t blocks, int bits, uint8_t* q, uint16_t* scales, uint16_t* mins) {
  const int64_t values = tile_value_bytes(bits), chunks = values / 64, row_bytes = 4 * chunks;
  for (int64_t b = 0; b < blocks; ++b, tile += tile_bytes(bits)) {
    for (int64_t r = 0; r < kTileRows; ++r) {
      uint8_t* row = q + (r * blocks + b) * row_bytes;
      for (int64_t c = 0; c < chunks; ++c) std::memcpy(row + 4 * c, tile + 64 * c + 4 * r, 4);
      if (bits == 8)
        for (int64_t i = 0; i < row_bytes; ++i) row[i] ^= 0x80;  // q + 128 → q (two's complement)
      std::memcpy(scales + r * blocks + b, tile + values + 2 * r, 2);
      if (bits == 4) std::memcpy(mins + r * blocks + b, tile + values + 32 + 2 * r, 2);
    }
  }
}

}  // namespace

// The float matrix [N, K] of tiles, in `dtype`: each row group put back into the plain layout in
// a thread's scratch, then dequantised by the plain layout's kernel.
at::Tensor dequantize_tiles(const at::Tensor& tiles, at::ScalarType dtype) {
  const int bits = tile_bits(tiles);
  const int64_t G = tiles.size(0), blocks = tiles.size(1), K = blocks * 32;
  at::Tensor out = at::empty({G * kTileRows, K}, tiles.options().dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  const uint8_t* tp = tiles.data_ptr<uint8_t>();
  const IsaKernels& isa = isa_kernels();
  at::parallel_for(0, G, std::max<int64_t>(1, (int64_t(1) << 14) / std::max<int64_t>(1, kTileRows * K)),
                   [&](int64_t g0, int64_t g1) {
                     std::vector<uint8_t> q(kTileRows * K * bits / 8);
                     std::vector<uint16_t> halves(2 * kTileRows * blocks);
                     std::vector<float> scratch(2 * blocks);
                     uint16_t* mins = bits == 4 ? halves.data() + kTileRows * blocks : nullptr;
                     QuantRows w{q.data(), halves.data(), mins, bits, K};
                     for (int64_t g = g0; g < g1; ++g) {
                       untile_group(tp + g * blocks * tile_bytes(bits), blocks, bits, q.data(), halves.data(), mins);
                       isa.dequantize(w, op + g * kTileRows * K, 0, kTileRows, scratch.data());
                     }
                   });
  return dtype == at::kFloat ? out : out.to(dtype);
}

// x [..., K] · W^T (+ bias) → [..., N] in x's dtype, W as tiles; fp32 accumulation.
at::Tensor linear_tiles(const at::Tensor& x, const at::Tensor& tiles, const std::optional<at::Tensor>& bias) {
  const int bits = tile_bits(tiles);
  const int64_t G = tiles.size(0), blocks = tiles.size(1), N = G * kTileRows, K = blocks * 32;
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == K, "graphrt::linear_tiles: x's last dim must equal the weight's K");
  const IsaKernels& isa = isa_kernels();
  if (isa.tiles_gemm == nullptr) {  // no VNNI here: the plain layout's product over the rows put back
    at::Tensor q = at::empty({N, K * bits / 8}, tiles.options().dtype(bits == 4 ? at::kByte : at::kChar));
    at::Tensor halves = at::empty({2, N, blocks}, tiles.options().dtype(at::kHalf));
    uint16_t* hp = reinterpret_cast<uint16_t*>(halves.data_ptr<at::Half>());
    uint8_t* qp = static_cast<uint8_t*>(q.data_ptr());
    for (int64_t g = 0; g < G; ++g)
      untile_group(tiles.data_ptr<uint8_t>() + g * blocks * tile_bytes(bits), blocks, bits,
                   qp + g * kTileRows * K * bits / 8, hp + g * kTileRows * blocks, hp + (N + g * kTileRows) * blocks);
    const std::optional<at::Tensor> mins = bits == 4 ? std::optional<at::Tensor>(halves[1]) : std::nullopt;
    return linear_quantized(x, q, halves[0], mins, bias);
  }
  const at::Tensor x2 = as_contiguous(x.dim() == 2 ? x : x.reshape({-1, K}), at::kFloat);
  const int64_t M = x2.size(0);
  at::Tensor y = new_output({M, N}, at::kFloat);
  const float* xp = x2.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const uint8_t* tp = tiles.data_ptr<uint8_t>();
  const int64_t row_bytes = tile_row_bytes(K);
  if (M > 0) {
    // Row groups of 16 output columns; each thread packs its own copy of the activations (see
    // linear_quantized).
    const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 15) / (blocks * tile_bytes(bits)));
    const bool digits = M <= kVnniMaxRowsNoAmx;  // beyond: fp32 sums, as the plain layout's product
    // AMX tiles where the CPU has them, for the rows a C tile holds (the same outputs)
    const bool amx = isa.tiles_gemm_amx != nullptr && M >= kTileAmxMinRows && M <= kTileAmxMaxRows;
    const int64_t amx_bytes = amx ? tiles_amx_scratch(M, K) : 0;
    at::parallel_for(0, G, grain, [&](int64_t g0, int64_t g1) {
      if (!digits) return isa.tiles_gemm_wide(xp, tp, yp, M, N, K, g0, g1, bits);
      float* raw = thread_scratch((M * row_bytes + amx_bytes) / 4 + 16);
      uint8_t* packed = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw) + 63) & ~uintptr_t(63));
      isa.tiles_pack(xp, packed, M, K);
      if (amx) return isa.tiles_gemm_amx(packed, tp, yp, M, N, K, g0, g1, bits, packed + M * row_bytes);
      isa.tiles_gemm(packed, tp, yp, M, N, K, g0, g1, bits);
    });
  }
  if (bias.has_value() && bias->defined()) y.add_(bias->to(at::kFloat));
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  at::Tensor out = x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
  return x.dim() == 2 ? out : out.reshape(shape);
}

}  // namespace graphrt_native

TORCH_LIBRARY_IMPL(graphrt, CPU, m) {
  m.impl("dequantize_tiles", &graphrt_native::dequantize_tiles);
  m.impl("linear_tiles", &graphrt_native::linear_tiles);
}
