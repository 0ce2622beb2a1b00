// CPU implementations of graphrt::linear, linear_quantized, dequantize, slot_mapping and
// paged_attention over the ISA kernel table (the tiles' two ops: quant_tiles.cpp).
//
// The ops' schemas are defined in Python (kernels/linear.py, quantized.py, cache.py,
// attention.py); this library registers their CPU kernels, so a compiled graph (Inductor's
// wrapper) reaches native code through the dispatcher with no Python in between, and an
// AOTInductor package calls them directly through the C entry points of c_shims.cpp. Argument checks that name the argument live in the Python wrappers; the
// TORCH_CHECKs here guard the raw pointers.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

#include "isa_kernels.h"
#include "ops.h"

namespace graphrt_native {

constexpr int64_t kChunk = 128;    // keys per attention work item, at most
constexpr int64_t kMinChunk = 32;  // and at least, where a step is split further for its threads

// A thread's scratch floats, kept between calls: a decode step runs ~150 products and attention
// calls, each of whose threads needs kilobytes of scratch; a fresh vector each time cost a malloc,
// a zeroing memset and a free. The contents are whatever the thread's last call left.
float* thread_scratch(int64_t n) {
  thread_local std::vector<float> buffer;
  if (static_cast<int64_t>(buffer.size()) < n) buffer.resize(n);
  return buffer.data();
}

// `t` as a contiguous tensor of `dtype`, without a dispatcher round trip when it already is one
// (these ops run about 150 times a decode step: their fixed cost shows).
at::Tensor as_contiguous(const at::Tensor& t, at::ScalarType dtype) {
  if (t.scalar_type() == dtype && t.is_contiguous()) return t;
  return t.to(dtype).contiguous();
}

namespace {

bool is_weight_dtype(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16; }

// fp32 → bf16 bits, round to nearest even (NaN stays NaN), as torch's conversion.
inline uint16_t round_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// Columns [n0, n1) of y [M, N]: bias added (when given), then rounded into out (when bf16).
void finish_columns(float* y, const float* bias, uint16_t* out, int64_t M, int64_t N, int64_t n0, int64_t n1) {
  for (int64_t m = 0; m < M; ++m) {
    float* row = y + m * N;
    if (bias != nullptr)
      for (int64_t n = n0; n < n1; ++n) row[n] += bias[n];
    if (out != nullptr)
      for (int64_t n = n0; n < n1; ++n) out[m * N + n] = round_bf16(row[n]);
  }
}

}  // namespace

// x [..., K] · w[N, K]^T (+ bias) → [..., N] in x's dtype; fp32 accumulation.
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "graphrt::linear: weight must be a contiguous [N, K] matrix");
  TORCH_CHECK(is_weight_dtype(w.scalar_type()), "graphrt::linear: weight must be float32 or bfloat16");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == K, "graphrt::linear: x's last dim must equal the weight's K");
  const IsaKernels& isa = isa_kernels();
  // bf16 times bf16 runs on the dot-product instruction where the CPU has one; otherwise the
  // activations are widened to fp32 once (they are small) and the weights as they stream.
  const bool dot = isa.gemm_bf16_dot != nullptr && x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16;
  const at::Tensor x2 = as_contiguous(x.dim() == 2 ? x : x.reshape({-1, K}), dot ? at::kBFloat16 : at::kFloat);
  const int64_t M = x2.size(0);
  // fp32 results; a bf16 caller's output is rounded from them by each thread, bias added first
  const bool round = x.scalar_type() == at::kBFloat16;
  at::Tensor y = at::empty({M, N}, x2.options().dtype(at::kFloat));
  at::Tensor out = round ? at::empty({M, N}, x2.options().dtype(at::kBFloat16)) : y;
  const at::Tensor b = bias.has_value() && bias->defined() ? as_contiguous(*bias, at::kFloat) : at::Tensor();
  TORCH_CHECK(!b.defined() || b.numel() == N, "graphrt::linear: bias must have N elements");
  const void* xp = x2.data_ptr();
  const void* wp = w.data_ptr();
  float* yp = y.data_ptr<float>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  uint16_t* op = round ? reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()) : nullptr;
  auto finish = [&](int64_t n0, int64_t n1) { finish_columns(yp, bp, op, M, N, n0, n1); };
  const GemmFn gemm = w.scalar_type() == at::kFloat ? isa.gemm_f32 : isa.gemm_bf16;
  if (dot && isa.gemm_bf16_amx != nullptr && M >= kAmxMinRows && M <= kAmxMaxRows && K % 32 == 0 && N >= kAmxBlock) {
    // AMX tiles: blocks of 32 output rows; the rows past the last full block take the dot product
    const int64_t full = N / kAmxBlock;
    const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 15) / (kAmxBlock * K));
    at::parallel_for(0, full, grain, [&](int64_t b0, int64_t b1) {
      const int64_t n1 = b1 == full ? N : b1 * kAmxBlock;
      // each thread packs its own copy of the B tiles' pairs: see linear_quantized
      uint32_t* pp = reinterpret_cast<uint32_t*>(thread_scratch(K / 2 * M));
      isa.pack_pairs(static_cast<const uint16_t*>(xp), pp, M, K);
      isa.gemm_bf16_amx(pp, wp, yp, M, N, K, b0 * kAmxBlock, b1 * kAmxBlock);
      if (n1 > b1 * kAmxBlock) isa.gemm_bf16_dot(static_cast<const uint16_t*>(xp), wp, yp, M, N, K, b1 * kAmxBlock, n1);
      finish(b0 * kAmxBlock, n1);
    });
  } else if (M > 0) {
    // Blocks of 4 output rows (the kernel's tile); small matrices stay on one thread.
    const int64_t blocks = (N + 3) / 4;
    const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 15) / std::max<int64_t>(1, 4 * K));
    at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
      const int64_t n0 = b0 * 4, n1 = std::min(N, b1 * 4);
      if (dot) {
        isa.gemm_bf16_dot(static_cast<const uint16_t*>(xp), wp, yp, M, N, K, n0, n1);
      } else {
        gemm(static_cast<const float*>(xp), wp, yp, M, N, K, n0, n1);
      }
      finish(n0, n1);
    });
  }
  if (x.scalar_type() != at::kFloat && !round) out = y.to(x.scalar_type());
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  return x.dim() == 2 ? out : out.reshape(shape);
}

namespace {

// The quantized matrix behind (qweight, scales, mins): layout checks on the raw pointers' behalf.
QuantRows quant_rows(const at::Tensor& q, const at::Tensor& scales, const std::optional<at::Tensor>& mins) {
  const bool int4 = q.scalar_type() == at::kByte;
  TORCH_CHECK(int4 || q.scalar_type() == at::kChar, "graphrt: qweight must be uint8 (int4) or int8 (int8)");
  TORCH_CHECK(q.dim() >= 1 && q.is_contiguous() && scales.is_contiguous() && scales.scalar_type() == at::kHalf,
              "graphrt: qweight and float16 scales must be contiguous");
  const int64_t K = q.size(-1) * (int4 ? 2 : 1);
  TORCH_CHECK(K % 32 == 0 && scales.numel() * 32 == q.numel() / q.size(-1) * K,
              "graphrt: scales must hold one value per 32-value block of qweight");
  const bool has_mins = mins.has_value() && mins->defined();
  TORCH_CHECK(has_mins == int4, "graphrt: int4 weights need mins, int8 weights take none");
  if (has_mins)
    TORCH_CHECK(mins->is_contiguous() && mins->scalar_type() == at::kHalf && mins->numel() == scales.numel(),
                "graphrt: mins must be float16 and shaped like scales");
  QuantRows w;
  w.q = q.data_ptr();
  w.scales = reinterpret_cast<const uint16_t*>(scales.data_ptr());
  w.mins = has_mins ? reinterpret_cast<const uint16_t*>(mins->data_ptr()) : nullptr;
  w.bits = int4 ? 4 : 8;
  w.K = K;
  return w;
}

}  // namespace

// The float matrix [..., K] of a quantized one, in `dtype` (computed in fp32).
at::Tensor dequantize(const at::Tensor& q, const at::Tensor& scales, const std::optional<at::Tensor>& mins,
                      at::ScalarType dtype) {
  const QuantRows w = quant_rows(q, scales, mins);
  std::vector<int64_t> shape(q.sizes().begin(), q.sizes().end());
  shape.back() = w.K;
  at::Tensor out = at::empty(shape, q.options().dtype(at::kFloat));
  const int64_t rows = w.K ? out.numel() / w.K : 0;
  float* op = out.data_ptr<float>();
  const IsaKernels& isa = isa_kernels();
  at::parallel_for(0, rows, std::max<int64_t>(1, (int64_t(1) << 14) / std::max<int64_t>(1, w.K)),
                   [&](int64_t r0, int64_t r1) {
                     std::vector<float> scratch(2 * (w.K / 32));
                     isa.dequantize(w, op, r0, r1, scratch.data());
                   });
  return dtype == at::kFloat ? out : out.to(dtype);
}

// x [..., K] · W^T (+ bias) → [..., N] in x's dtype, W quantized; fp32 accumulation.
at::Tensor linear_quantized(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                            const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(q.dim() == 2, "graphrt::linear_quantized: qweight must be [N, packed K]");
  const QuantRows w = quant_rows(q, scales, mins);
  const int64_t N = q.size(0), K = w.K;
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == K, "graphrt::linear_quantized: x's last dim must equal the weight's K");
  const at::Tensor x2 = as_contiguous(x.dim() == 2 ? x : x.reshape({-1, K}), at::kFloat);
  const int64_t M = x2.size(0);
  at::Tensor y = at::empty({M, N}, x2.options().dtype(at::kFloat));
  const float* xp = x2.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const IsaKernels& isa = isa_kernels();
  const int64_t scratch_size = 4 * (K / 32) + 2 * K;
  if (isa.quant_gemm_amx != nullptr && M >= kAmxQuantMinRows && M <= kAmxQuantMaxRows && N >= kAmxQuantBlock) {
    // AMX tiles: the activations split into two parts (bf16 for int4, int8 for int8) once, then
    // blocks of 16 output rows; the rows past the last full block take the vector kernel
    const int64_t parts_size = amx_parts_size(M, K);
    const int64_t full = N / kAmxQuantBlock;
    const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 15) / (kAmxQuantBlock * K));
    at::parallel_for(0, full, grain, [&](int64_t b0, int64_t b1) {
      // Each thread packs its own copy (the work was serial before anyway): tile loads of a B
      // another core has just written miss to that core's cache, about 10% of a batch-8 step's
      // quantized products (by the profiler, against one copy packed before the threads start).
      const int64_t sums_size = amx_sums_size(K);
      float* packed = thread_scratch(parts_size + sums_size + std::max(scratch_size, amx_quant_scratch(K)));
      uint32_t* parts = reinterpret_cast<uint32_t*>(packed);  // then the sums, then the kernel's scratch
      float* sums = packed + parts_size;
      float* scratch = sums + sums_size;
      isa.pack_parts(xp, parts, sums, M, K, w.bits);
      isa.quant_gemm_amx(parts, sums, w, yp, M, N, b0 * kAmxQuantBlock, b1 * kAmxQuantBlock, scratch);
      if (b1 == full && N > full * kAmxQuantBlock) isa.quant_gemm(xp, w, yp, M, N, full * kAmxQuantBlock, N, scratch);
    });
  } else if (M > 0) {
    // Blocks of 4 output rows, as graphrt::linear; a quantized row is a quarter to half the bytes.
    // On VNNI CPUs 1-5 rows (1-16 without AMX tiles): the activations as int8 digits, packed by
    // each thread (as above).
    const bool vnni =
        isa.quant_gemm_vnni != nullptr && M <= (isa.quant_gemm_amx != nullptr ? kVnniMaxRows : kVnniMaxRowsNoAmx);
    const int64_t blocks = (N + 3) / 4;
    const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 15) / std::max<int64_t>(1, 2 * K));
    at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
      const int64_t n0 = b0 * 4, n1 = std::min(N, b1 * 4);
      if (!vnni) return isa.quant_gemm(xp, w, yp, M, N, n0, n1, thread_scratch(scratch_size));
      // 64-byte aligned: the kernel's loads of a record are aligned ones
      float* raw = thread_scratch(M * vnni_row_bytes(K, w.bits) / 4 + 16);
      uint8_t* packed = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw) + 63) & ~uintptr_t(63));
      isa.vnni_pack(xp, packed, M, K, w.bits);
      isa.quant_gemm_vnni(packed, w, yp, M, N, n0, n1);
    });
  }
  if (bias.has_value() && bias->defined()) y.add_(bias->to(at::kFloat));
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  at::Tensor out = x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
  return x.dim() == 2 ? out : out.reshape(shape);
}

namespace {

void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& slot_mapping) {
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == v_cache.scalar_type(),
              "graphrt::paged_attention: k/v and the caches must share a dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "graphrt::paged_attention: caches must be contiguous");
  // k/v [T, ...] are often views of a fused projection's output: each token's row must be
  // contiguous, the tokens may be any distance apart (no copy of the whole tensor then)
  auto rows_of = [](const at::Tensor& t) {
    int64_t expected = 1;
    for (int64_t i = t.dim() - 1; i >= 1; --i) {
      if (t.size(i) != 1 && t.stride(i) != expected) return t.contiguous();
      expected *= t.size(i);
    }
    return t;
  };
  const at::Tensor kc = rows_of(k), vc = rows_of(v);
  const at::Tensor slots = as_contiguous(slot_mapping, at::kLong);
  const int64_t T = kc.size(0), row = kc.numel() / std::max<int64_t>(1, T);
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t bytes = row * kc.element_size();
  const int64_t kstride = kc.stride(0) * kc.element_size(), vstride = vc.stride(0) * vc.element_size();
  const int64_t* sp = slots.data_ptr<int64_t>();
  char* kd = static_cast<char*>(k_cache.data_ptr());
  char* vd = static_cast<char*>(v_cache.data_ptr());
  const char* ks = static_cast<const char*>(kc.data_ptr());
  const char* vs = static_cast<const char*>(vc.data_ptr());
  for (int64_t t = 0; t < T; ++t) {
    const int64_t s = sp[t];
    if (s < 0) continue;
    TORCH_CHECK(s < num_slots, "graphrt::paged_attention: slot ", s, " is outside the cache's ", num_slots, " slots");
    std::memcpy(kd + s * bytes, ks + t * kstride, bytes);
    std::memcpy(vd + s * bytes, vs + t * vstride, bytes);
  }
}

}  // namespace

// Cache slot of every token: block_tables[req, pos / block_size] * block_size + pos % block_size,
// -1 for padding tokens (token_req < 0); the torch body's seven dispatches, in one loop.
at::Tensor slot_mapping(const at::Tensor& positions, const at::Tensor& token_req, const at::Tensor& block_tables,
                        int64_t block_size) {
  TORCH_CHECK(positions.dim() == 1 && token_req.sizes() == positions.sizes() && block_tables.dim() == 2,
              "graphrt::slot_mapping: positions and token_req are [num_tokens], block_tables 2-D");
  TORCH_CHECK(block_size > 0, "graphrt::slot_mapping: block_size must be positive, got ", block_size);
  const at::Tensor pos = as_contiguous(positions, at::kLong), req = as_contiguous(token_req, at::kLong);
  const at::Tensor tables = as_contiguous(block_tables, at::kLong);
  const int64_t T = pos.size(0), R = tables.size(0), B = tables.size(1);
  at::Tensor out = at::empty({T}, pos.options());
  const int64_t *pp = pos.data_ptr<int64_t>(), *rp = req.data_ptr<int64_t>(), *tp = tables.data_ptr<int64_t>();
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    if (rp[t] < 0) {
      op[t] = -1;
      continue;
    }
    const int64_t p = pp[t], r = rp[t];
    const int64_t b = p >= 0 ? p / block_size : -((-p + block_size - 1) / block_size);  // floor, as `//`
    TORCH_CHECK(r < R && b >= 0 && b < B, "graphrt::slot_mapping: token ", t, " (request ", r, ", position ", p,
                ") is outside block_tables [", R, ", ", B, "]");
    op[t] = tp[r * B + b] * block_size + (p - b * block_size);
  }
  return out;
}

// q [T, H, D] over caches [num_blocks, block_size, Hkv, D]: rows of any kind (prefill, chunked
// prefill, decode) in one call; token t of row r sits at position seq_len[r] - (qsl[r+1] - t).
at::Tensor paged_attention(const at::Tensor& q, const std::optional<at::Tensor>& k, const std::optional<at::Tensor>& v,
                           at::Tensor& k_cache, at::Tensor& v_cache, const std::optional<at::Tensor>& slot_mapping,
                           const at::Tensor& block_tables, const at::Tensor& seq_lens,
                           const at::Tensor& query_start_loc, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "graphrt::paged_attention: q is [T, H, D], caches 4-D");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type(), "graphrt::paged_attention: q and the caches must share a dtype");
  TORCH_CHECK(is_weight_dtype(k_cache.scalar_type()), "graphrt::paged_attention: native kernel takes float32 or bfloat16");
  if (k.has_value() && k->defined()) write_kv(*k, *v, k_cache, v_cache, *slot_mapping);
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t block_size = k_cache.size(1), Hkv = k_cache.size(2), G = H / Hkv;
  const at::Tensor qf = as_contiguous(q, at::kFloat);
  const at::Tensor tables = as_contiguous(block_tables, at::kLong);
  const at::Tensor lens = as_contiguous(seq_lens, at::kLong);
  const at::Tensor qsl = as_contiguous(query_start_loc, at::kLong);
  const int64_t R = lens.size(0), B = tables.size(1);
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t* qp = qsl.data_ptr<int64_t>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  // Each token's row and number of visible keys (0: padding, or a row of no sequence).
  std::vector<int64_t> token_row(T, -1), n_keys(T, 0);
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t t = std::max<int64_t>(0, qp[r]); t < std::min(T, qp[r + 1]); ++t) {
      const int64_t keys = lp[r] - (qp[r + 1] - t) + 1;
      TORCH_CHECK(keys <= B * block_size, "graphrt::paged_attention: row ", r, " has ", lp[r],
                  " keys, more than its block table holds");
      token_row[t] = r;
      n_keys[t] = std::max<int64_t>(0, keys);
    }
  }
  // Work items: each token's keys in chunks (sized below), so that a decode step of one token still
  // gives every thread work; partial results merge per token below (max-rescaled sums). A row's
  // tokens (a verify step's k + 1, a prefill chunk's) see the same keys: the items run chunk by
  // chunk, each chunk's tokens one after another, so a chunk's K/V comes from memory once and
  // from L2 for the row's other tokens (token by token, a long context's K/V left the cache
  // between tokens: a verify step of 6 tokens at 2,100 keys cost 3.2 main steps).
  // A row's keys split into equal chunks of at most kChunk keys (192 keys: two of 96, where 128
  // and 64 left a thread waiting); a step of few chunks, not a multiple of the threads, splits
  // each row's chunks further (one decode row of up to kChunk keys was one item, on one thread).
  struct Item {
    int64_t t, l0, l1;
  };
  std::vector<int64_t> most(R, 0), pieces(R, 0);
  int64_t total = 0;
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t t = std::max<int64_t>(0, qp[r]); t < std::min(T, qp[r + 1]); ++t)
      most[r] = std::max(most[r], n_keys[t]);
    pieces[r] = (most[r] + kChunk - 1) / kChunk;
    total += pieces[r];
  }
  const int64_t threads = at::get_num_threads();
  if (total > 0 && total < 4 * threads && total % threads != 0) {
    const int64_t times = threads / std::gcd(total, threads);
    for (int64_t r = 0; r < R; ++r)
      if (most[r] >= times * pieces[r] * kMinChunk) pieces[r] *= times;
  }
  std::vector<Item> items;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t t0 = std::max<int64_t>(0, qp[r]), t1 = std::min(T, qp[r + 1]);
    for (int64_t p = 0; p < pieces[r]; ++p) {
      const int64_t l0 = most[r] * p / pieces[r], l1 = most[r] * (p + 1) / pieces[r];
      for (int64_t t = t0; t < t1; ++t)
        if (l0 < n_keys[t]) items.push_back({t, l0, std::min(n_keys[t], l1)});
    }
  }
  // each token's items, in key order (the merge's order: the same sums as token by token)
  std::vector<std::vector<int64_t>> token_items(T);
  for (int64_t i = 0; i < static_cast<int64_t>(items.size()); ++i) token_items[items[i].t].push_back(i);
  const int64_t I = static_cast<int64_t>(items.size());
  std::vector<float> m(I * H), sums(I * H), acc(I * H * D);
  const float* qd = qf.data_ptr<float>();
  const void* kd = k_cache.data_ptr();
  const void* vd = v_cache.data_ptr();
  const IsaKernels& isa = isa_kernels();
  const AttendFn attend = k_cache.scalar_type() == at::kFloat ? isa.attend_f32 : isa.attend_bf16;
  const float fscale = static_cast<float>(scale);
  at::parallel_for(0, I, 1, [&](int64_t i0, int64_t i1) {
    float* scores = thread_scratch(H * kChunk);
    for (int64_t i = i0; i < i1; ++i) {
      const Item& it = items[i];
      const int64_t* blocks = tp + token_row[it.t] * B;
      // The thread's next item streams in while this one computes, unless it reads the same keys
      // (a row's next token: already in L2). A decode step of eight rows at 150 keys, 30 layers'
      // cold K/V: 64-67 against 80-98 µs a call.
      KeyRange next{nullptr, 0, 0};
      if (i + 1 < i1) next = {tp + token_row[items[i + 1].t] * B, items[i + 1].l0, items[i + 1].l1};
      const bool fresh = next.blocks != nullptr && !(next.blocks == blocks && next.l0 == it.l0);
      attend(qd + it.t * H * D, kd, vd, blocks, it.l0, it.l1, block_size, Hkv, D, G, fscale, scores, &m[i * H],
             &sums[i * H], &acc[i * H * D], fresh ? &next : nullptr);
    }
  });
  at::Tensor out = at::empty({T, H, D}, qf.options());
  float* od = out.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {  // merge each token's chunks (a token with none: zeros)
    const std::vector<int64_t>& its = token_items[t];
    float* o = od + t * H * D;
    std::fill(o, o + H * D, 0.0f);
    if (its.empty()) continue;
    for (int64_t h = 0; h < H; ++h) {
      float mx = m[its[0] * H + h];
      for (const int64_t i : its) mx = std::max(mx, m[i * H + h]);
      float total = 0.0f;
      for (const int64_t i : its) {
        const float w = std::exp(m[i * H + h] - mx);
        total += w * sums[i * H + h];
        const float* a = &acc[(i * H + h) * D];
        for (int64_t d = 0; d < D; ++d) o[h * D + d] += w * a[d];
      }
      const float inv = 1.0f / total;
      for (int64_t d = 0; d < D; ++d) o[h * D + d] *= inv;
    }
  }
  return q.scalar_type() == at::kFloat ? out : out.to(q.scalar_type());
}

std::string isa_name() { return isa_kernels().name; }

}  // namespace graphrt_native

TORCH_LIBRARY_IMPL(graphrt, CPU, m) {
  m.impl("linear", &graphrt_native::linear);
  m.impl("paged_attention", &graphrt_native::paged_attention);
  m.impl("slot_mapping", &graphrt_native::slot_mapping);
  m.impl("dequantize", &graphrt_native::dequantize);
  m.impl("linear_quantized", &graphrt_native::linear_quantized);
  }

TORCH_LIBRARY_FRAGMENT(graphrt_native, m) { m.def("isa() -> str", &graphrt_native::isa_name); }
