// The native kernel bodies, compiled once per instruction set and chosen at run time.
//
// The same source (simd.h, skinny_gemm.h, paged_attention.h) is included in three namespaces:
// avx512 (AVX-512F/BW + FMA), avx2 (AVX2 + FMA) and portable (the compiler's baseline). Each
// x86 namespace is compiled under `#pragma GCC target`, so one library runs on any x86-64 CPU and
// uses the widest vectors it has. No torch headers here: this file compiles in a second.

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "isa_kernels.h"

#define GRT_DEFINE_TABLE(NS)                                                                        \
  namespace NS {                                                                                  \
  static void gemm_f32(const float* x, const void* w, float* y, int64_t M, int64_t N, int64_t K,  \
                       int64_t n0, int64_t n1) {                                                  \
    skinny_gemm(x, static_cast<const float*>(w), y, M, N, K, n0, n1);                             \
  }                                                                                               \
  static void gemm_bf16(const float* x, const void* w, float* y, int64_t M, int64_t N, int64_t K, \
                        int64_t n0, int64_t n1) {                                                 \
    skinny_gemm(x, static_cast<const uint16_t*>(w), y, M, N, K, n0, n1);                          \
  }                                                                                               \
  static void attend_f32(const float* q, const void* kc, const void* vc, const int64_t* blocks,   \
                         int64_t n_keys, int64_t bs, int64_t hkv, int64_t head, int64_t D,        \
                         int64_t G, float scale, float* scores, float* out) {                     \
    attend(q, static_cast<const float*>(kc), static_cast<const float*>(vc), blocks, n_keys, bs,   \
           hkv, head, D, G, scale, scores, out);                                                  \
  }                                                                                               \
  static void attend_bf16(const float* q, const void* kc, const void* vc, const int64_t* blocks,  \
                          int64_t n_keys, int64_t bs, int64_t hkv, int64_t head, int64_t D,       \
                          int64_t G, float scale, float* scores, float* out) {                    \
    attend(q, static_cast<const uint16_t*>(kc), static_cast<const uint16_t*>(vc), blocks, n_keys, \
           bs, hkv, head, D, G, scale, scores, out);                                              \
  }                                                                                               \
  }

#if defined(__x86_64__) || defined(__i386__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
namespace avx512 {
#define GRT_VEC_BYTES 64
#define GRT_MB 4
#include "simd.h"
#include "skinny_gemm.h"
#include "paged_attention.h"
#undef GRT_VEC_BYTES
#undef GRT_MB
}  // namespace avx512
GRT_DEFINE_TABLE(avx512)
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
#define GRT_VEC_BYTES 32
#define GRT_MB 2
#include "simd.h"
#include "skinny_gemm.h"
#include "paged_attention.h"
#undef GRT_VEC_BYTES
#undef GRT_MB
}  // namespace avx2
GRT_DEFINE_TABLE(avx2)
#pragma GCC pop_options
#endif

namespace portable {
#define GRT_VEC_BYTES 16
#define GRT_MB 2
#include "simd.h"
#include "skinny_gemm.h"
#include "paged_attention.h"
#undef GRT_VEC_BYTES
#undef GRT_MB
}  // namespace portable
GRT_DEFINE_TABLE(portable)

namespace graphrt_native {

static IsaKernels make(const char* name, GemmFn gf, GemmFn gb, AttendFn af, AttendFn ab) {
  IsaKernels k;
  k.name = name;
  k.gemm_f32 = gf;
  k.gemm_bf16 = gb;
  k.attend_f32 = af;
  k.attend_bf16 = ab;
  return k;
}

static bool supported(const char* isa) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  if (std::strcmp(isa, "avx512") == 0)
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("fma");
  if (std::strcmp(isa, "avx2") == 0) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
  return std::strcmp(isa, "portable") == 0;
}

// The widest set this CPU runs; GRAPHRT_CPU_ISA=avx2|portable asks for a narrower one (to test
// the paths a CPU without AVX-512 takes). A set the CPU lacks is never chosen.
static IsaKernels choose() {
  const char* wanted = std::getenv("GRAPHRT_CPU_ISA");
  const char* order[] = {"avx512", "avx2", "portable"};
  bool allowed = wanted == nullptr || *wanted == '\0';
  for (const char* isa : order) {
    if (!allowed && std::strcmp(isa, wanted) == 0) allowed = true;
    if (!allowed || !supported(isa)) continue;
#if defined(__x86_64__) || defined(__i386__)
    if (std::strcmp(isa, "avx512") == 0)
      return make("avx512", avx512::gemm_f32, avx512::gemm_bf16, avx512::attend_f32, avx512::attend_bf16);
    if (std::strcmp(isa, "avx2") == 0)
      return make("avx2", avx2::gemm_f32, avx2::gemm_bf16, avx2::attend_f32, avx2::attend_bf16);
#endif
    break;
  }
  return make("portable", portable::gemm_f32, portable::gemm_bf16, portable::attend_f32, portable::attend_bf16);
}

const IsaKernels& isa_kernels() {
  static const IsaKernels chosen = choose();
  return chosen;
}

}  // namespace graphrt_native
