// Greedy sampling's reduction over one slice of a logits row, for one instruction set (included
// per set by isa_kernels.cpp, after simd.h): the slice's maximum, the first index holding it, the
// first NaN (torch.argmax's answer wherever a row has one) and sum(exp(x - max)). Slices merge
// in sampling.cpp.

static inline bool any_set(vi m) {  // any lane of a comparison's mask
  int32_t lanes[kLanes];
  __builtin_memcpy(lanes, &m, sizeof(lanes));
  int32_t any = 0;
  for (int i = 0; i < kLanes; ++i) any |= lanes[i];
  return any != 0;
}

static void argmax_sumexp(const float* x, int64_t n, graphrt_native::ArgmaxPart* out) {
  vf vmax = splat(-__builtin_inff());
  vi nans = vi{};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const vf v = load(x + i);
    vmax = v > vmax ? v : vmax;
    nans |= v != v;
  }
  bool nan = any_set(nans);
  float mx = -__builtin_inff();
  for (int l = 0; l < kLanes; ++l) mx = vmax[l] > mx ? vmax[l] : mx;
  for (; i < n; ++i) {
    nan = nan || __builtin_isnan(x[i]);
    mx = x[i] > mx ? x[i] : mx;
  }
  out->max = mx;
  out->index = -1;
  out->nan_index = -1;
  if (nan) {
    for (int64_t j = 0; j < n; ++j)
      if (__builtin_isnan(x[j])) {
        out->nan_index = j;
        break;
      }
    out->sum = __builtin_nanf("");
    return;
  }
  i = 0;
  for (; i + kLanes <= n && out->index < 0; i += kLanes)
    if (any_set(load(x + i) == splat(mx)))
      for (int l = 0; l < kLanes; ++l)
        if (x[i + l] == mx) {
          out->index = i + l;
          break;
        }
  for (; i < n && out->index < 0; ++i)
    if (x[i] == mx) out->index = i;
  if (!__builtin_isfinite(mx)) {  // every logit -inf: no mass; a +inf: log_softmax's NaN
    out->sum = mx < 0 ? 0.0f : __builtin_nanf("");
    return;
  }
  vf acc = vf{};
  i = 0;
  for (; i + kLanes <= n; i += kLanes) acc += exp_nonpositive(load(x + i) - splat(mx));
  float sum = hsum(acc);
  for (; i < n; ++i) sum += exp_nonpositive(splat(x[i] - mx))[0];
  out->sum = sum;
}
