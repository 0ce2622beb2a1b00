// CPU implementations of graphrt::linear and graphrt::paged_attention over the ISA kernel table.
//
// The ops' schemas are defined in Python (kernels/linear.py, kernels/attention.py); this library
// registers their CPU kernels, so a compiled graph (Inductor's wrapper or an AOTInductor package)
// reaches native code through the dispatcher with no Python in between. Argument checks that
// name the argument live in the Python wrappers; the TORCH_CHECKs here guard the raw pointers.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "isa_kernels.h"

namespace graphrt_native {
namespace {

bool is_weight_dtype(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16; }

// x [..., K] · w[N, K]^T (+ bias) → [..., N] in x's dtype; fp32 accumulation.
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "graphrt::linear: weight must be a contiguous [N, K] matrix");
  TORCH_CHECK(is_weight_dtype(w.scalar_type()), "graphrt::linear: weight must be float32 or bfloat16");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == K, "graphrt::linear: x's last dim must equal the weight's K");
  const at::Tensor x2 = x.reshape({-1, K}).to(at::kFloat).contiguous();
  const int64_t M = x2.size(0);
  at::Tensor y = at::empty({M, N}, x2.options());
  const float* xp = x2.data_ptr<float>();
  const void* wp = w.data_ptr();
  float* yp = y.data_ptr<float>();
  const IsaKernels& isa = isa_kernels();
  const GemmFn gemm = w.scalar_type() == at::kFloat ? isa.gemm_f32 : isa.gemm_bf16;
  // Blocks of 4 output rows (the kernel's tile); small matrices stay on one thread.
  const int64_t blocks = (N + 3) / 4;
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 15) / std::max<int64_t>(1, 4 * K));
  if (M > 0) {
    at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
      gemm(xp, wp, yp, M, N, K, b0 * 4, std::min(N, b1 * 4));
    });
  }
  if (bias.has_value() && bias->defined()) y.add_(bias->to(at::kFloat));
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  return y.to(x.scalar_type()).reshape(shape);
}

void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& slot_mapping) {
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == v_cache.scalar_type(),
              "graphrt::paged_attention: k/v and the caches must share a dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "graphrt::paged_attention: caches must be contiguous");
  const at::Tensor kc = k.contiguous(), vc = v.contiguous();
  const at::Tensor slots = slot_mapping.to(at::kLong).contiguous();
  const int64_t T = kc.size(0), row = kc.numel() / std::max<int64_t>(1, T);
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t bytes = row * kc.element_size();
  const int64_t* sp = slots.data_ptr<int64_t>();
  char* kd = static_cast<char*>(k_cache.data_ptr());
  char* vd = static_cast<char*>(v_cache.data_ptr());
  const char* ks = static_cast<const char*>(kc.data_ptr());
  const char* vs = static_cast<const char*>(vc.data_ptr());
  for (int64_t t = 0; t < T; ++t) {
    const int64_t s = sp[t];
    if (s < 0) continue;
    TORCH_CHECK(s < num_slots, "graphrt::paged_attention: slot ", s, " is outside the cache's ", num_slots, " slots");
    std::memcpy(kd + s * bytes, ks + t * bytes, bytes);
    std::memcpy(vd + s * bytes, vs + t * bytes, bytes);
  }
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
  const at::Tensor qf = q.to(at::kFloat).contiguous();
  const at::Tensor tables = block_tables.to(at::kLong).contiguous();
  const at::Tensor lens = seq_lens.to(at::kLong).contiguous();
  const at::Tensor qsl = query_start_loc.to(at::kLong).contiguous();
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
  at::Tensor out = at::zeros({T, H, D}, qf.options());
  const float* qd = qf.data_ptr<float>();
  float* od = out.data_ptr<float>();
  const void* kd = k_cache.data_ptr();
  const void* vd = v_cache.data_ptr();
  const IsaKernels& isa = isa_kernels();
  const AttendFn attend = k_cache.scalar_type() == at::kFloat ? isa.attend_f32 : isa.attend_bf16;
  const float fscale = static_cast<float>(scale);
  at::parallel_for(0, T * Hkv, 1, [&](int64_t i0, int64_t i1) {
    // Per-thread scratch: scores and the group's output, copied out once (threads never write
    // near each other's lines while they accumulate).
    std::vector<float> scores, acc(G * D);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / Hkv, head = i % Hkv;
      if (n_keys[t] == 0) continue;
      scores.resize(G * n_keys[t]);
      attend(qd + (t * H + head * G) * D, kd, vd, tp + token_row[t] * B, n_keys[t], block_size, Hkv, head, D, G,
             fscale, scores.data(), acc.data());
      std::memcpy(od + (t * H + head * G) * D, acc.data(), G * D * sizeof(float));
    }
  });
  return out.to(q.scalar_type());
}

std::string isa_name() { return isa_kernels().name; }

}  // namespace
}  // namespace graphrt_native

TORCH_LIBRARY_IMPL(graphrt, CPU, m) {
  m.impl("linear", &graphrt_native::linear);
  m.impl("paged_attention", &graphrt_native::paged_attention);
}

TORCH_LIBRARY_FRAGMENT(graphrt_native, m) { m.def("isa() -> str", &graphrt_native::isa_name); }
