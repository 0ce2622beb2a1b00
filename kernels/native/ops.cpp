// CPU implementations of graphrt::linear, linear_quantized and dequantize over the ISA kernel
// table (the tiles' two ops: quant_tiles.cpp; slot_mapping and paged_attention: attention.cpp).
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
#include <c10/core/InferenceMode.h>
#include <c10/util/accumulate.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

#include "isa_kernels.h"
#include "ops.h"

namespace graphrt_native {

// A thread's scratch floats, kept between calls: a decode step runs ~150 products and attention
// calls, each of whose threads needs kilobytes of scratch; a fresh vector each time cost a malloc,
// a zeroing memset and a free. The contents are whatever the thread's last call left.
float* thread_scratch(int64_t n) {
  thread_local std::vector<float> buffer;
  if (static_cast<int64_t>(buffer.size()) < n) buffer.resize(n);
  return buffer.data();
}

namespace {
thread_local bool reusing_outputs = false;
}

ReusedOutputs::ReusedOutputs() : outer(!reusing_outputs) { reusing_outputs = true; }
ReusedOutputs::~ReusedOutputs() {
  if (outer) reusing_outputs = false;
}

// A package's decode step makes about 150 calls of these ops, each returning a small new tensor
// that the next op or two read and drop: after the step's weight streams, at::empty's malloc and
// tensor set-up run with their code and data evicted. An output is reused only when this list's
// handle is its last one and its storage's only user (no view of it lives), with the shape,
// dtype, layout and inference mode a new one would have; it is then written whole by the op.
// Outputs over 1 MiB (a prefill's) are not kept: their allocation is small beside their product.
//
// Each kept output's shape, dtype and inference mode are also kept as one word in an array of
// their own, which the search reads first: only a tensor whose word matches is looked at, where
// the search read every kept tensor's use counts and sizes, lines the step's weight streams had
// evicted too (a bf16 engine at one row, alternated in one process: 0.63 against 0.66-0.70 µs a
// call, the step 34 µs shorter, in five pairs of six).
namespace {

constexpr size_t kKept = 16;

uint64_t output_key(at::IntArrayRef sizes, at::ScalarType dtype, bool inference) {
  uint64_t key = uint64_t(static_cast<int8_t>(dtype)) | uint64_t(inference) << 8 | uint64_t(sizes.size()) << 9;
  for (const int64_t n : sizes) key = key * 0x9E3779B97F4A7C15ull + uint64_t(n) + 1;
  return key | 1;  // never 0, an empty place's word
}

// Held by nothing but the kept handle: no other tensor, and no view of its storage.
bool unheld(const at::Tensor& t) { return t.use_count() == 1 && t.storage().use_count() == 1; }

bool reusable(const at::Tensor& t, at::IntArrayRef sizes, at::ScalarType dtype, bool inference) {
  return t.defined() && unheld(t) && t.scalar_type() == dtype &&
         t.sizes() == sizes && t.is_contiguous() && t.storage_offset() == 0 && t.is_inference() == inference &&
         !t.requires_grad() && t.storage().nbytes() == static_cast<size_t>(t.numel()) * t.element_size();
}

}  // namespace

at::Tensor new_output(at::IntArrayRef sizes, at::ScalarType dtype) {
  if (!reusing_outputs || c10::multiply_integers(sizes) * c10::elementSize(dtype) > (size_t(1) << 20))
    return at::empty(sizes, at::TensorOptions().dtype(dtype));
  thread_local std::array<uint64_t, kKept> keys{};  // 0: an empty place
  thread_local std::array<at::Tensor, kKept> kept;
  thread_local size_t next = 0;
  thread_local size_t last = kKept;  // the place of this thread's previous output
  const bool inference = c10::InferenceMode::is_enabled();
  const uint64_t key = output_key(sizes, dtype, inference);
  for (size_t i = 0; i < kKept; ++i)
    if (keys[i] == key && reusable(kept[i], sizes, dtype, inference)) return kept[last = i];
  // a new output takes an empty place, else one whose tensor is held elsewhere (an output that
  // lives on, the residual stream's say), else the next in turn: a free one of another shape stays.
  // Never the previous output's place: an op with two outputs (sampling's tokens and log-probs)
  // still holds its first when it asks for its second, and would otherwise drop it every call.
  at::Tensor t = at::empty(sizes, at::TensorOptions().dtype(dtype));
  size_t place = kKept;
  for (size_t i = 0; i < kKept && place == kKept; ++i)
    if (keys[i] == 0) place = i;
  for (size_t i = 0; i < kKept && place == kKept; ++i)
    if (i != last && !unheld(kept[i])) place = i;
  if (place == kKept) place = next, next = (next + 1) % kKept;
  kept[place] = t;
  keys[place] = key;
  last = place;
  return t;
}

// `t` as a contiguous tensor of `dtype`, without a dispatcher round trip when it already is one
// (these ops run about 150 times a decode step: their fixed cost shows).
at::Tensor as_contiguous(const at::Tensor& t, at::ScalarType dtype) {
  if (t.scalar_type() == dtype && t.is_contiguous()) return t;
  return t.to(dtype).contiguous();
}

namespace {

bool is_weight_dtype(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16; }

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
  at::Tensor y = new_output({M, N}, at::kFloat);
  at::Tensor out = round ? new_output({M, N}, at::kBFloat16) : y;
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
  at::Tensor y = new_output({M, N}, at::kFloat);
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

std::string isa_name() { return isa_kernels().name; }

bool packs_bf16() { return isa_kernels().gemm_bf16_packed != nullptr; }

}  // namespace graphrt_native

TORCH_LIBRARY_IMPL(graphrt, CPU, m) {
  m.impl("linear", &graphrt_native::linear);
  m.impl("dequantize", &graphrt_native::dequantize);
  m.impl("linear_quantized", &graphrt_native::linear_quantized);
  }

TORCH_LIBRARY_FRAGMENT(graphrt_native, m) {
  m.def("isa() -> str", &graphrt_native::isa_name);
  // whether linear_packed_bf16 has a product over the packed blocks here (AMX tiles, or AVX512-BF16)
  m.def("packs_bf16() -> bool", &graphrt_native::packs_bf16);
}
