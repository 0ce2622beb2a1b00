// graphrt_native::greedy_sample: the greedy rows of graphrt::sample in one native call.
//
// A greedy token is the argmax of its row, and its log-probability log_softmax(row)[argmax] is
// -log(sum(exp(row - max))). aten spends three passes and two dispatches on it (argmax, then
// log_softmax, then a gather: about 130 µs a decode step over SmolLM2's 49,152 logits, argmax
// alone 63 µs); here each row's slices are reduced in parallel (greedy.h) and merged.
// graphrt_native::greedy_sample_plain first checks what graphrt::sample's body checked with four
// aten dispatches a step (no row random, no grammar bit cleared; about 90 µs at batch 8).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include "isa_kernels.h"
#include "ops.h"

namespace graphrt_native {
namespace {

constexpr int64_t kSlice = 16384;  // logits per work item, at least (a row splits when it has more)

}  // namespace

// logits [N, V] (float32, bfloat16 or float16) → (tokens int64 [N], logprobs float32 [N]), as
// argmax and log_softmax(logits).gather(argmax) give them (NaN rows: the first NaN, logprob NaN).
std::tuple<at::Tensor, at::Tensor> greedy_sample(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0, "graphrt_native::greedy_sample: logits must be [rows, vocab]");
  // bf16 logits are widened a slice at a time into each thread's scratch (exactly, so the same
  // sums): a whole fp32 copy was a dispatched conversion and a 196 KB allocation a step, about
  // 100 µs of a bf16 batch-1 step after its weight streams
  const bool bf16 = logits.scalar_type() == at::kBFloat16 && logits.is_contiguous();
  const at::Tensor x = bf16 ? logits : as_contiguous(logits, at::kFloat);
  const int64_t N = x.size(0), V = x.size(1);
  const int64_t threads = at::get_num_threads();
  // slices per row: enough for every thread when the rows are few, none smaller than kSlice
  const int64_t slices = std::max<int64_t>(1, std::min((threads + N - 1) / std::max<int64_t>(N, 1), V / kSlice));
  std::vector<ArgmaxPart> parts(N * slices);
  const float* xp = bf16 ? nullptr : x.data_ptr<float>();
  const uint16_t* hp = bf16 ? reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()) : nullptr;
  const ArgmaxFn reduce = isa_kernels().argmax_sumexp;
  at::parallel_for(0, N * slices, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t row = i / slices, s = i % slices;
      const int64_t v0 = V * s / slices, v1 = V * (s + 1) / slices;
      const float* slice;
      if (bf16) {
        float* wide = thread_scratch(v1 - v0);
        widen_bf16(hp + row * V + v0, v1 - v0, wide);
        slice = wide;
      } else {
        slice = xp + row * V + v0;
      }
      reduce(slice, v1 - v0, &parts[i]);
      if (parts[i].index >= 0) parts[i].index += v0;
      if (parts[i].nan_index >= 0) parts[i].nan_index += v0;
    }
  });
  // kept between a package's steps (new_output): after the LM head a fresh allocation runs cold
  at::Tensor tokens = new_output({N}, at::kLong);
  at::Tensor logprobs = new_output({N}, at::kFloat);
  int64_t* tp = tokens.data_ptr<int64_t>();
  float* lp = logprobs.data_ptr<float>();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (int64_t r = 0; r < N; ++r) {
    const ArgmaxPart* p = &parts[r * slices];
    int64_t first_nan = -1;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t s = 0; s < slices && first_nan < 0; ++s) {
      if (p[s].nan_index >= 0) first_nan = p[s].nan_index;
      else mx = std::max(mx, p[s].max);
    }
    if (first_nan >= 0) {
      tp[r] = first_nan;
      lp[r] = nan;
      continue;
    }
    int64_t index = -1;
    float sum = 0.0f;
    for (int64_t s = 0; s < slices; ++s) {
      if (index < 0 && p[s].max == mx) index = p[s].index;
      sum += p[s].sum * std::exp(p[s].max - mx);
    }
    tp[r] = index;
    lp[r] = std::isfinite(mx) ? -std::log(sum) : nan;
  }
  return {tokens, logprobs};
}

// greedy_sample(logits) where every temperature is <= 0 and the bitmask (xgrammar's int32 words)
// is absent or all ones; otherwise two empty tensors: the caller samples another way.
std::tuple<at::Tensor, at::Tensor> greedy_sample_plain(const at::Tensor& logits, const at::Tensor& temperature,
                                                       const std::optional<at::Tensor>& bitmask) {
  const at::Tensor t = as_contiguous(temperature, at::kFloat);
  const float* tp = t.data_ptr<float>();
  bool plain = true;
  for (int64_t i = 0; i < t.numel() && plain; ++i) plain = !(tp[i] > 0.0f);
  if (plain && bitmask.has_value() && bitmask->defined()) {
    const at::Tensor words = as_contiguous(*bitmask, at::kInt);
    const int32_t* wp = words.data_ptr<int32_t>();
    for (int64_t i = 0; i < words.numel() && plain; ++i) plain = wp[i] == -1;
  }
  if (!plain) {
    const at::TensorOptions options = logits.options();
    return {at::empty({0}, options.dtype(at::kLong)), at::empty({0}, options.dtype(at::kFloat))};
  }
  return greedy_sample(logits);
}

}  // namespace graphrt_native

TORCH_LIBRARY_FRAGMENT(graphrt_native, m) {
  m.def("greedy_sample(Tensor logits) -> (Tensor, Tensor)", &graphrt_native::greedy_sample);
  m.def("greedy_sample_plain(Tensor logits, Tensor temperature, Tensor? bitmask) -> (Tensor, Tensor)",
        &graphrt_native::greedy_sample_plain);
}
