// CPU implementations of graphrt::linear_packed_bf16 and unpack_bf16 (kernels/packed_bf16.py) over
// the ISA kernel table: the AMX product over the packed blocks where the CPU has tiles, else the
// row-major product over the matrix put back.

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

constexpr int64_t kPackedRows = 32;  // weight rows a block holds; also the values of a k-step

void check_packed(const at::Tensor& packed, const char* op) {
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 4 && packed.size(2) == kPackedRows &&
                  packed.size(3) == kPackedRows && packed.is_contiguous(),
              op, ": packed must be contiguous bfloat16 [N / 32, K / 32, 32, 32]");
}

}  // namespace

// The row-major matrix [N, K]: element (b, s, h, p, c, e) of the packed one is
// w[32 b + 16 h + c, 32 s + 2 p + e] (kernels/packed_bf16.py).
at::Tensor unpack_bf16(const at::Tensor& packed) {
  check_packed(packed, "graphrt::unpack_bf16");
  const int64_t B = packed.size(0), S = packed.size(1), N = B * kPackedRows, K = S * kPackedRows;
  at::Tensor out = at::empty({N, K}, packed.options());
  const uint32_t* src = reinterpret_cast<const uint32_t*>(packed.data_ptr<at::BFloat16>());
  uint32_t* dst = reinterpret_cast<uint32_t*>(out.data_ptr<at::BFloat16>());  // a pair at a time
  const int64_t row_pairs = K / 2;
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t s = 0; s < S; ++s) {
        const uint32_t* step = src + (b * S + s) * 512;  // 2 halves x 16 pairs x 16 columns
        for (int64_t h = 0; h < 2; ++h)
          for (int64_t p = 0; p < 16; ++p)
            for (int64_t c = 0; c < 16; ++c)
              dst[(b * kPackedRows + h * 16 + c) * row_pairs + s * 16 + p] = step[(h * 16 + p) * 16 + c];
      }
  });
  return out;
}

// x [..., K] · W^T (+ bias) → [..., N] in bf16, W packed; fp32 accumulation.
at::Tensor linear_packed_bf16(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  check_packed(packed, "graphrt::linear_packed_bf16");
  const int64_t N = packed.size(0) * kPackedRows, K = packed.size(1) * kPackedRows;
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "graphrt::linear_packed_bf16: x must be bfloat16");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == K, "graphrt::linear_packed_bf16: x's last dim must equal the weight's K");
  const at::Tensor b = bias.has_value() && bias->defined() ? as_contiguous(*bias, at::kFloat) : at::Tensor();
  TORCH_CHECK(!b.defined() || b.numel() == N, "graphrt::linear_packed_bf16: bias must have N elements");
  const IsaKernels& isa = isa_kernels();
  if (isa.gemm_bf16_packed == nullptr || K == 0) return linear(x, unpack_bf16(packed), bias);  // no AMX tiles here
  const at::Tensor x2 = as_contiguous(x.dim() == 2 ? x : x.reshape({-1, K}), at::kBFloat16);
  const int64_t M = x2.size(0);
  at::Tensor out = new_output({M, N}, at::kBFloat16);
  if (M > 0) {
    const uint16_t* xp = reinterpret_cast<const uint16_t*>(x2.data_ptr<at::BFloat16>());
    const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
    const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
    uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
    const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 15) / (kAmxBlock * K));
    at::parallel_for(0, N / kAmxBlock, grain, [&](int64_t b0, int64_t b1) {
      isa.gemm_bf16_packed(xp, wp, bp, op, M, N, K, b0 * kAmxBlock, b1 * kAmxBlock);
    });
  }
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  return x.dim() == 2 ? out : out.reshape(shape);
}

}  // namespace graphrt_native

TORCH_LIBRARY_IMPL(graphrt, CPU, m) {
  m.impl("unpack_bf16", &graphrt_native::unpack_bf16);
  m.impl("linear_packed_bf16", &graphrt_native::linear_packed_bf16);
}
