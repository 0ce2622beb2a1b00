// The native kernel bodies, compiled once per instruction set and chosen at run time.
//
// The same source (simd.h, skinny_gemm.h, paged_attention.h, quant_gemm.h) is included in three namespaces,
// each with its vector width and the skinny GEMM's register tiles (GRT_SMALL_*: weight rows x
// activation rows for 2-4 rows; GRT_WIDE_*: for more, sized to the register file; measured with
// `graphrt bench kernels`):
// amx (vnni plus AMX tiles: bf16 products of 2-16 rows, quantized ones of 5-8), vnni (avx512 plus
// AVX512-VNNI's integer dot product for quantized weights at 1-5 rows), avx512 (AVX-512F/BW + FMA),
// avx2 (AVX2 + FMA) and portable (the compiler's baseline). Each
// x86 namespace is compiled under `#pragma GCC target`, so one library runs on any x86-64 CPU and
// uses the widest vectors it has. No torch headers here: this file compiles in a second.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>

#include "isa_kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#define GRT_DEFINE_TABLE(NS)                                                                        \
  namespace NS {                                                                                  \
  static void gemm_f32(const float* x, const void* w, float* y, int64_t M, int64_t N, int64_t K,  \
                       int64_t n0, int64_t n1) {                                                  \
    skinny_gemm<FmaPolicy<float>>(x, static_cast<const float*>(w), y, M, N, K, n0, n1);           \
  }                                                                                               \
  static void gemm_bf16(const float* x, const void* w, float* y, int64_t M, int64_t N, int64_t K, \
                        int64_t n0, int64_t n1) {                                                 \
    skinny_gemm<FmaPolicy<uint16_t>>(x, static_cast<const uint16_t*>(w), y, M, N, K, n0, n1);     \
  }                                                                                               \
  static void attend_f32(const float* q, const void* kc, const void* vc, const int64_t* blocks,   \
                         int64_t l0, int64_t l1, int64_t bs, int64_t hkv, int64_t D, int64_t G,   \
                         float scale, float* scores, float* m, float* sums, float* acc,           \
                         const graphrt_native::KeyRange* next, bool cold) {                       \
    attend_chunk(q, static_cast<const float*>(kc), static_cast<const float*>(vc), blocks, l0, l1, \
                 bs, hkv, D, G, scale, scores, m, sums, acc, next, cold);                         \
  }                                                                                               \
  static void attend_bf16(const float* q, const void* kc, const void* vc, const int64_t* blocks,  \
                          int64_t l0, int64_t l1, int64_t bs, int64_t hkv, int64_t D, int64_t G,  \
                          float scale, float* scores, float* m, float* sums, float* acc,          \
                          const graphrt_native::KeyRange* next, bool cold) {                      \
    attend_chunk(q, static_cast<const uint16_t*>(kc), static_cast<const uint16_t*>(vc), blocks,   \
                 l0, l1, bs, hkv, D, G, scale, scores, m, sums, acc, next, cold);                 \
  }                                                                                               \
  static void qgemm(const float* x, const QuantRows& w, float* y, int64_t M, int64_t N,           \
                    int64_t n0, int64_t n1, float* scratch) {                                     \
    if (w.bits == 4) return quant_gemm<4>(x, w, y, M, N, n0, n1, scratch);                        \
    quant_gemm<8>(x, w, y, M, N, n0, n1, scratch);                                                \
  }                                                                                               \
  static void dequant(const QuantRows& w, float* out, int64_t r0, int64_t r1, float* scratch) {   \
    if (w.bits == 4) return dequantize_rows<4>(w, out, r0, r1, scratch);                          \
    dequantize_rows<8>(w, out, r0, r1, scratch);                                                  \
  }                                                                                               \
  static void argmax(const float* x, int64_t n, graphrt_native::ArgmaxPart* out) { argmax_sumexp(x, n, out); } \
  }

#if defined(__x86_64__) || defined(__i386__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
namespace avx512 {
#define GRT_VEC_BYTES 64
#define GRT_SMALL_NB 1
#define GRT_SMALL_MB 4
#define GRT_WIDE_NB 2
#define GRT_WIDE_MB 8
#include "simd.h"
#include "skinny_gemm.h"
#include "paged_attention.h"
#include "quant_gemm.h"
#include "greedy.h"
#undef GRT_VEC_BYTES
#undef GRT_SMALL_NB
#undef GRT_SMALL_MB
#undef GRT_WIDE_NB
#undef GRT_WIDE_MB
}  // namespace avx512
GRT_DEFINE_TABLE(avx512)
#pragma GCC pop_options

// bf16 activations times bf16 weights with AVX512-BF16's dot product (vdpbf16ps): 32 products
// summed pairwise into 16 fp32 lanes per instruction, no widening of either operand. Used when
// the activations are bf16 already (a bf16 model), so no input is rounded that was not before.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")
namespace avx512bf16 {
#define GRT_VEC_BYTES 64
#define GRT_SMALL_NB 1
#define GRT_SMALL_MB 4
#define GRT_WIDE_NB 2
#define GRT_WIDE_MB 8
#include "simd.h"
struct DotPolicy {
  using X = uint16_t;
  using XV = __m512bh;
  using WV = __m512bh;
  using Acc = __m512;
  static constexpr int kStep = 32;
  static __m512bh loadx(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static __m512bh loadw(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static __m512 madd(__m512 a, __m512bh x, __m512bh w) { return _mm512_dpbf16_ps(a, x, w); }
  static float reduce(__m512 a) { return _mm512_reduce_add_ps(a); }
};
#include "skinny_gemm.h"
#define GRT_BF16_DOT 1
#include "paged_attention.h"
#undef GRT_BF16_DOT
#undef GRT_VEC_BYTES
#undef GRT_SMALL_NB
#undef GRT_SMALL_MB
#undef GRT_WIDE_NB
#undef GRT_WIDE_MB
// a bf16 cache's attention with its scores on the dot product (paged_attention.h, GRT_BF16_DOT):
// 8 decode rows at 190-239 keys, SmolLM2's heads, 30 layers' caches: 79.6-81.3 against 82.7-85.1
// us a call (most of a call is not its keys' arithmetic: fp32 caches, twice the bytes, 99 us)
static void attend_bf16(const float* q, const void* kc, const void* vc, const int64_t* blocks, int64_t l0, int64_t l1,
                        int64_t bs, int64_t hkv, int64_t D, int64_t G, float scale, float* scores, float* m,
                        float* sums, float* acc, const graphrt_native::KeyRange* next, bool cold) {
  attend_chunk(q, static_cast<const uint16_t*>(kc), static_cast<const uint16_t*>(vc), blocks, l0, l1, bs, hkv, D, G,
               scale, scores, m, sums, acc, next, cold);
}
static void gemm_bf16_dot(const uint16_t* x, const void* w, float* y, int64_t M, int64_t N, int64_t K, int64_t n0,
                          int64_t n1) {
  skinny_gemm<DotPolicy>(x, static_cast<const uint16_t*>(w), y, M, N, K, n0, n1);
}
#include "packed_store.h"
#include "dot_packed_gemm.h"
static void gemm_bf16_packed(const uint16_t* x, const uint16_t* w, const float* bias, uint16_t* out, int64_t M,
                             int64_t N, int64_t K, int64_t n0, int64_t n1) {
  if (M == 1 && graphrt_native::kAmdStreams)
    dot_packed_row_streams(x, w, bias, out, N, K, n0, n1);
  else
    dot_packed_rows(x, w, bias, out, M, N, K, n0, n1);
}
}  // namespace avx512bf16
#pragma GCC pop_options

// bf16 x bf16 with 2 to 16 activation rows on AMX tiles (amx_gemm.h); other row counts, ragged
// shapes and the rows beyond the last full block of 32 take the dot product above. bf16 weights
// packed for the tiles (kernels/packed_bf16.py) with any number of rows. Quantized
// weights with 6 to 8 activation rows (int4: amx_quant_gemm.h, int8: amx_int8_gemm.h); the rows
// beyond the last full block of 16 take the avx512 vector kernel. Quantized tiles with 5 to 8
// activation rows (amx_tile_quant_gemm.h).
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16,amx-int8,avx2,fma,f16c")
namespace amx {
#include "amx_gemm.h"
#include "amx_quant_gemm.h"
#include "amx_int8_gemm.h"
#include "tile_fold.h"
#include "amx_tile_quant_gemm.h"
static void pack_parts(const float* x, uint32_t* parts, float* sums, int64_t M, int64_t K, int bits) {
  if (bits == 4) return amx_pack_parts(x, parts, sums, M, K);
  amx_pack_slices(x, reinterpret_cast<int32_t*>(parts), sums, M, K);
}
static void quant_gemm(const uint32_t* parts, const float* sums, const graphrt_native::QuantRows& w, float* y,
                       int64_t M, int64_t N, int64_t n0, int64_t n1, float* scratch) {
  if (w.bits == 4) return amx_quant_rows(parts, sums, w, y, M, N, n0, n1, scratch);
  amx_int8_rows(reinterpret_cast<const int32_t*>(parts), sums, w, y, M, N, n0, n1, scratch);
}
static void pack_pairs(const uint16_t* x, uint32_t* pairs, int64_t M, int64_t K) {
  pack_activation_pairs(x, pairs, M, K);
}
static void gemm_bf16(const uint32_t* pairs, const void* w, float* y, int64_t M, int64_t N, int64_t K, int64_t n0,
                      int64_t n1) {
  amx_gemm_rows(pairs, static_cast<const uint16_t*>(w), y, M, N, K, n0, n1);
}
static void gemm_bf16_packed(const uint16_t* x, const uint16_t* w, const float* bias, uint16_t* out, int64_t M,
                             int64_t N, int64_t K, int64_t n0, int64_t n1) {
  amx_packed_rows(x, w, bias, out, M, N, K, n0, n1);
}
}  // namespace amx
#pragma GCC pop_options

// Quantized weights times 1-5 activation rows on AVX512-VNNI's integer dot product; quantized tiles
// (int4, int8) times any.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")
namespace vnni {
#include "lane_tree.h"
#include "vnni_quant_gemm.h"
#include "tile_fold.h"
#include "tile_quant_gemm.h"
}  // namespace vnni
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
#define GRT_VEC_BYTES 32
#define GRT_SMALL_NB 1
#define GRT_SMALL_MB 4
#define GRT_WIDE_NB 2
#define GRT_WIDE_MB 4
#include "simd.h"
#include "skinny_gemm.h"
#include "paged_attention.h"
#include "quant_gemm.h"
#include "greedy.h"
#undef GRT_VEC_BYTES
#undef GRT_SMALL_NB
#undef GRT_SMALL_MB
#undef GRT_WIDE_NB
#undef GRT_WIDE_MB
}  // namespace avx2
GRT_DEFINE_TABLE(avx2)
#pragma GCC pop_options
#endif

namespace portable {
#define GRT_VEC_BYTES 16
#define GRT_SMALL_NB 1
#define GRT_SMALL_MB 4
#define GRT_WIDE_NB 2
#define GRT_WIDE_MB 4
#include "simd.h"
#include "skinny_gemm.h"
#include "paged_attention.h"
#include "quant_gemm.h"
#include "greedy.h"
#undef GRT_VEC_BYTES
#undef GRT_SMALL_NB
#undef GRT_SMALL_MB
#undef GRT_WIDE_NB
#undef GRT_WIDE_MB
}  // namespace portable
GRT_DEFINE_TABLE(portable)

namespace graphrt_native {

static IsaKernels make(const char* name, GemmFn gf, GemmFn gb, AttendFn af, AttendFn ab, QuantGemmFn qg,
                       DequantFn dq, ArgmaxFn am) {
  IsaKernels k;
  k.name = name;
  k.gemm_bf16_dot = nullptr;
  k.gemm_bf16_amx = nullptr;
  k.pack_pairs = nullptr;
  k.gemm_bf16_packed = nullptr;
  k.pack_parts = nullptr;
  k.quant_gemm_amx = nullptr;
  k.vnni_pack = nullptr;
  k.quant_gemm_vnni = nullptr;
  k.tiles_pack = nullptr;
  k.tiles_gemm = nullptr;
  k.tiles_gemm_wide = nullptr;
  k.tiles_gemm_amx = nullptr;
  k.gemm_f32 = gf;
  k.gemm_bf16 = gb;
  k.attend_f32 = af;
  k.attend_bf16 = ab;
  k.attend_bf16_wide = ab;
  k.quant_gemm = qg;
  k.dequantize = dq;
  k.argmax_sumexp = am;
  return k;
}

#if defined(__x86_64__) || defined(__i386__)
// AMX-TILE, AMX-BF16 and AMX-INT8 (CPUID leaf 7: EDX bits 24, 22 and 25), and the kernel's
// permission for this process to use the tile registers (Linux: arch_prctl ARCH_REQ_XCOMP_PERM for
// XTILEDATA).
static bool amx_usable() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  if (!(d & (1u << 24)) || !(d & (1u << 22)) || !(d & (1u << 25))) return false;
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
}
#endif

static bool supported(const char* isa) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  if (std::strcmp(isa, "amx") == 0)
    return supported("vnni") && __builtin_cpu_supports("avx512bf16") && amx_usable();
  if (std::strcmp(isa, "vnni") == 0) return supported("avx512") && __builtin_cpu_supports("avx512vnni");
  if (std::strcmp(isa, "avx512") == 0)
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("fma");
  if (std::strcmp(isa, "avx2") == 0) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
  return std::strcmp(isa, "portable") == 0;
}

// The widest set this CPU runs; GRAPHRT_CPU_ISA=vnni|avx512|avx2|portable asks for a narrower one (to test
// the paths a CPU without AVX-512 takes). A set the CPU lacks is never chosen.
static IsaKernels choose() {
  const char* wanted = std::getenv("GRAPHRT_CPU_ISA");
  const char* order[] = {"amx", "vnni", "avx512", "avx2", "portable"};
  bool allowed = wanted == nullptr || *wanted == '\0';
  for (const char* isa : order) {
    if (!allowed && std::strcmp(isa, wanted) == 0) allowed = true;
    if (!allowed || !supported(isa)) continue;
#if defined(__x86_64__) || defined(__i386__)
    if (std::strcmp(isa, "amx") == 0) {
      IsaKernels k = make("amx", avx512::gemm_f32, avx512::gemm_bf16, avx512::attend_f32, avx512::attend_bf16,
                          avx512::qgemm, avx512::dequant, avx512::argmax);
      k.gemm_bf16_dot = avx512bf16::gemm_bf16_dot;
      k.attend_bf16 = avx512bf16::attend_bf16;
      k.gemm_bf16_amx = amx::gemm_bf16;
      k.pack_pairs = amx::pack_pairs;
      k.gemm_bf16_packed = amx::gemm_bf16_packed;
      k.pack_parts = amx::pack_parts;
      k.quant_gemm_amx = amx::quant_gemm;
      k.vnni_pack = vnni::vnni_pack;
      k.quant_gemm_vnni = vnni::vnni_quant_gemm;
      k.tiles_pack = vnni::tiles_pack;
      k.tiles_gemm = vnni::tiles_gemm;
      k.tiles_gemm_wide = vnni::tiles_gemm_wide;
      k.tiles_gemm_amx = amx::tiles_gemm_amx;
      return k;
    }
    if (std::strcmp(isa, "vnni") == 0 || std::strcmp(isa, "avx512") == 0) {
      IsaKernels k = make(isa, avx512::gemm_f32, avx512::gemm_bf16, avx512::attend_f32, avx512::attend_bf16, avx512::qgemm,
                    avx512::dequant, avx512::argmax);
      if (__builtin_cpu_supports("avx512bf16")) {
        k.gemm_bf16_dot = avx512bf16::gemm_bf16_dot;
        k.attend_bf16 = avx512bf16::attend_bf16;
        k.gemm_bf16_packed = avx512bf16::gemm_bf16_packed;
      }
      if (std::strcmp(isa, "vnni") == 0) {
        k.vnni_pack = vnni::vnni_pack;
        k.quant_gemm_vnni = vnni::vnni_quant_gemm;
        k.tiles_pack = vnni::tiles_pack;
        k.tiles_gemm = vnni::tiles_gemm;
        k.tiles_gemm_wide = vnni::tiles_gemm_wide;
      }
      return k;
    }
    if (std::strcmp(isa, "avx2") == 0)
      return make("avx2", avx2::gemm_f32, avx2::gemm_bf16, avx2::attend_f32, avx2::attend_bf16, avx2::qgemm,
                    avx2::dequant, avx2::argmax);
#endif
    break;
  }
  return make("portable", portable::gemm_f32, portable::gemm_bf16, portable::attend_f32, portable::attend_bf16, portable::qgemm,
                    portable::dequant, portable::argmax);
}

static bool amd_streams() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  if (const char* tuning = std::getenv("GRAPHRT_CPU_TUNING"); tuning != nullptr && *tuning != '\0')
    return std::strcmp(tuning, "amd") == 0;
  return __builtin_cpu_is("amd");
#else
  return false;
#endif
}

const bool kAmdStreams = amd_streams();

static int64_t l1d_bytes() {
#if defined(_SC_LEVEL1_DCACHE_SIZE)
  if (const long bytes = sysconf(_SC_LEVEL1_DCACHE_SIZE); bytes > 0) return bytes;
#endif
  return int64_t(32) << 10;
}

const int64_t kL1dBytes = l1d_bytes();

const IsaKernels& isa_kernels() {
  static const IsaKernels chosen = choose();
  return chosen;
}

}  // namespace graphrt_native
