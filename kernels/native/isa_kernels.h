// The kernel table of the instruction set chosen for this CPU (see isa_kernels.cpp).
#pragma once

#include <cstdint>

namespace graphrt_native {

// y[M, N] = x[M, K] * w[N, K]^T over output columns [n0, n1); x and y fp32, w fp32 or bf16.
using GemmFn = void (*)(const float* x, const void* w, float* y, int64_t M, int64_t N, int64_t K, int64_t n0,
                        int64_t n1);

// One query token's G heads against KV head `head`: q [G, D], out [G, D], scores scratch [G, n_keys].
using AttendFn = void (*)(const float* q, const void* k_cache, const void* v_cache, const int64_t* blocks,
                          int64_t n_keys, int64_t block_size, int64_t num_kv_heads, int64_t head, int64_t D,
                          int64_t G, float scale, float* scores, float* out);

struct IsaKernels {
  const char* name;
  GemmFn gemm_f32;
  GemmFn gemm_bf16;
  AttendFn attend_f32;
  AttendFn attend_bf16;
};

const IsaKernels& isa_kernels();

}  // namespace graphrt_native
