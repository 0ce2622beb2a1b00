// graphrt's native CPU ops (ops.cpp, attention.cpp, quant_tiles.cpp, packed_bf16.cpp, sampling.cpp): registered with the dispatcher
// there, and called directly by AOTInductor packages through the C entry points of c_shims.cpp.

#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <tuple>

namespace graphrt_native {

at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias);
at::Tensor dequantize(const at::Tensor& q, const at::Tensor& scales, const std::optional<at::Tensor>& mins,
                      at::ScalarType dtype);
at::Tensor linear_quantized(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                            const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& bias);
at::Tensor dequantize_tiles(const at::Tensor& tiles, at::ScalarType dtype);
at::Tensor linear_tiles(const at::Tensor& x, const at::Tensor& tiles, const std::optional<at::Tensor>& bias);
at::Tensor unpack_bf16(const at::Tensor& packed);
at::Tensor linear_packed_bf16(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias);
at::Tensor slot_mapping(const at::Tensor& positions, const at::Tensor& token_req, const at::Tensor& block_tables,
                        int64_t block_size);
at::Tensor paged_attention(const at::Tensor& q, const std::optional<at::Tensor>& k, const std::optional<at::Tensor>& v,
                           at::Tensor& k_cache, at::Tensor& v_cache, const std::optional<at::Tensor>& slot_mapping,
                           const at::Tensor& block_tables, const at::Tensor& seq_lens,
                           const at::Tensor& query_start_loc, double scale);
std::string isa_name();
bool packs_bf16();

// ops.cpp's helpers the other op files share: a thread's scratch floats, kept between calls (the
// contents are whatever the thread's last call left), and `t` as a contiguous tensor of `dtype`
// without a dispatcher round trip when it already is one.
float* thread_scratch(int64_t n);
at::Tensor as_contiguous(const at::Tensor& t, at::ScalarType dtype);

// An op's output [sizes] of `dtype`, uninitialised: inside a ReusedOutputs scope (the C entry
// points of a package's calls) one of this thread's earlier outputs of that shape that nothing
// holds any more, else a new tensor (at::empty; that one is kept for reuse in such a scope).
at::Tensor new_output(at::IntArrayRef sizes, at::ScalarType dtype);
struct ReusedOutputs {
  ReusedOutputs();
  ~ReusedOutputs();
  ReusedOutputs(const ReusedOutputs&) = delete;
  ReusedOutputs& operator=(const ReusedOutputs&) = delete;

 private:
  bool outer;  // the scope that turned reuse on (a nested one leaves it to this one)
};

// bf16 bits ↔ fp32: widening is a shift; narrowing rounds to nearest even (NaN stays NaN), as
// torch's conversion.
inline float bf16_to_float(uint16_t b) {
  const uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// n bf16 values widened into dst.
inline void widen_bf16(const uint16_t* src, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_float(src[i]);
}

inline uint16_t round_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// sampling.cpp: greedy rows of graphrt::sample, and the check that every row is one
std::tuple<at::Tensor, at::Tensor> greedy_sample(const at::Tensor& logits);
std::tuple<at::Tensor, at::Tensor> greedy_sample_plain(const at::Tensor& logits, const at::Tensor& temperature,
                                                       const std::optional<at::Tensor>& bitmask);

}  // namespace graphrt_native
