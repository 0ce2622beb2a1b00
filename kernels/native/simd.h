// Vector helpers for one instruction set, written with GCC/Clang vector extensions.
//
// Included once per instruction set inside its own namespace (see isa_kernels.cpp), after
// GRT_VEC_BYTES is defined: 64 (AVX-512), 32 (AVX2) or 16 (the portable baseline: SSE2 on x86-64,
// NEON on arm64). The compiler turns the same source into that set's instructions.
// Weights and caches are float (fp32) or uint16_t (the bits of a bfloat16).

constexpr int kLanes = GRT_VEC_BYTES / 4;
typedef float vf __attribute__((vector_size(GRT_VEC_BYTES)));
typedef float vf_unaligned __attribute__((vector_size(GRT_VEC_BYTES), aligned(4)));
typedef uint32_t vu __attribute__((vector_size(GRT_VEC_BYTES)));
typedef int32_t vi __attribute__((vector_size(GRT_VEC_BYTES)));  // also a comparison's lane mask
typedef uint16_t vh_unaligned __attribute__((vector_size(GRT_VEC_BYTES / 2), aligned(2)));
typedef float v4f __attribute__((vector_size(16)));

static inline vf load(const float* p) { return *reinterpret_cast<const vf_unaligned*>(p); }

static inline vf load(const uint16_t* p) {  // bfloat16 → float32 is a 16-bit shift
  vu wide = __builtin_convertvector(*reinterpret_cast<const vh_unaligned*>(p), vu) << 16;
  vf out;
  __builtin_memcpy(&out, &wide, sizeof(out));
  return out;
}

static inline void store(float* p, vf v) { *reinterpret_cast<vf_unaligned*>(p) = v; }

static inline float to_float(float v) { return v; }

static inline float to_float(uint16_t v) {
  uint32_t bits = uint32_t(v) << 16;
  float out;
  __builtin_memcpy(&out, &bits, sizeof(out));
  return out;
}

// s - 0 is s for every s (-0 too), so this compiles to one broadcast (from memory where s is
// there, an FMA's operand then); vf{} + s compiled to an add, then a broadcast.
static inline vf splat(float s) { return s - vf{}; }

// Sum of the lanes, by halving: extract-and-add instructions rather than a scalar chain.
static inline float hsum(vf v) {
#if GRT_VEC_BYTES == 64
  typedef float v8f __attribute__((vector_size(32)));
  v8f a, b;
  __builtin_memcpy(&a, &v, 32);
  __builtin_memcpy(&b, reinterpret_cast<const char*>(&v) + 32, 32);
  v8f s8 = a + b;
  v4f c, d;
  __builtin_memcpy(&c, &s8, 16);
  __builtin_memcpy(&d, reinterpret_cast<const char*>(&s8) + 16, 16);
  v4f s = c + d;
#elif GRT_VEC_BYTES == 32
  v4f c, d;
  __builtin_memcpy(&c, &v, 16);
  __builtin_memcpy(&d, reinterpret_cast<const char*>(&v) + 16, 16);
  v4f s = c + d;
#else
  v4f s = v;
#endif
  return (s[0] + s[2]) + (s[1] + s[3]);
}

#if GRT_VEC_BYTES == 64
#include "lane_tree.h"
#if defined(GRT_LANE_TREE)
// (A macro outlives the namespace whose simd.h defined it: users test GRT_VEC_BYTES == 64 too.)
#define GRT_LANE_SUMS 1
// The sums of 16 vectors at once: lane j of the result is the sum of a[j]'s lanes, added in the
// same order as hsum (so each equals hsum(a[j]) bit for bit): paged attention's scores of 16 keys
// in one vector.
static inline vf lane_sums(const vf* a) {
  return lane_tree(a, [](vf x, vf y) { return x + y; });
}

// 32 bf16 values as two fp32 vectors, lane l of `even` value 2l and of `odd` value 2l + 1 (the
// low and high halves of 32-bit lane l, on x86's little-endian lanes): a bf16 is the high half of
// its fp32, so one load, a shift and a mask (widened in order, each 16 values took a
// zero-extending load and a shift).
static inline void load_pairs(const uint16_t* p, vf& even, vf& odd) {
  typedef uint32_t vu_unaligned __attribute__((vector_size(GRT_VEC_BYTES), aligned(2)));
  const vu w = *reinterpret_cast<const vu_unaligned*>(p);
  const vu e = w << 16, o = w & 0xFFFF0000u;
  __builtin_memcpy(&even, &e, sizeof(even));
  __builtin_memcpy(&odd, &o, sizeof(odd));
}

// 32 fp32 values split the same way (even = x[0::2], odd = x[1::2]), and joined back.
static inline void split_pairs(const float* x, vf& even, vf& odd) {
  const vf a = load(x), b = load(x + 16);
  even = __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  odd = __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

static inline void join_pairs(float* out, vf even, vf odd) {
  store(out, __builtin_shufflevector(even, odd, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23));
  store(out + 16, __builtin_shufflevector(even, odd, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31));
}
#endif
#endif

// exp for x <= 0 (softmax after the max is taken): Cephes' expf polynomial, ~1 ulp.
static inline vf exp_nonpositive(vf x) {
  x = x < splat(-87.0f) ? splat(-87.0f) : x;
  const vf t = x * splat(1.44269504088896341f) + splat(0.5f);
  vi n = __builtin_convertvector(t, vi);  // truncation toward zero, then floor for negatives
  vf fn = __builtin_convertvector(n, vf);
  const vi less = fn > t;  // all-ones lanes where truncation rounded up
  n += less;               // -1 there
  fn = __builtin_convertvector(n, vf);
  const vf r = x - fn * splat(0.693359375f) - fn * splat(-2.12194440e-4f);
  vf p = splat(1.9875691500e-4f);
  p = p * r + splat(1.3981999507e-3f);
  p = p * r + splat(8.3334519073e-3f);
  p = p * r + splat(4.1665795894e-2f);
  p = p * r + splat(1.6666665459e-1f);
  p = p * r + splat(5.0000001201e-1f);
  p = p * (r * r) + r + splat(1.0f);
  const vi bits = (n + 127) << 23;
  vf scale;
  __builtin_memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}
