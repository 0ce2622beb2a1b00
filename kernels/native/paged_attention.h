// Paged attention of one query token against one KV head, for one instruction set (included per
// set by isa_kernels.cpp).
//
// The G query heads that share KV head `head` read each key and value row once. Keys 0..n_keys-1
// of the token's sequence live at slot blocks[l / block_size] * block_size + l % block_size of
// the caches [num_slots, num_kv_heads, D]. Scores, softmax and the weighted sum are fp32.

// exp for x <= 0 (softmax after the max is taken): Cephes' expf polynomial, ~1 ulp.
static inline vf exp_nonpositive(vf x) {
  x = x < splat(-87.0f) ? splat(-87.0f) : x;
  const vf t = x * splat(1.44269504088896341f) + splat(0.5f);
  typedef int32_t vi __attribute__((vector_size(GRT_VEC_BYTES)));
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

template <typename C>
static inline float dot(const float* q, const C* key, int64_t D) {
  vf acc = vf{};
  int64_t d = 0;
  for (; d + kLanes <= D; d += kLanes) acc += load(q + d) * load(key + d);
  float s = hsum(acc);
  for (; d < D; ++d) s += q[d] * to_float(key[d]);
  return s;
}

// q: [G, D] fp32; scores: scratch [G, n_keys]; out: [G, D] fp32.
template <typename C>
static void attend(const float* q, const C* k_cache, const C* v_cache, const int64_t* blocks, int64_t n_keys,
                   int64_t block_size, int64_t num_kv_heads, int64_t head, int64_t D, int64_t G, float scale,
                   float* scores, float* out) {
  const int64_t slot_stride = num_kv_heads * D;
  for (int64_t l = 0; l < n_keys; ++l) {
    const int64_t slot = blocks[l / block_size] * block_size + l % block_size;
    const C* key = k_cache + slot * slot_stride + head * D;
    for (int64_t g = 0; g < G; ++g) scores[g * n_keys + l] = dot(q + g * D, key, D) * scale;
  }
  for (int64_t g = 0; g < G; ++g) {  // softmax, normalised before the weighted sum
    float* s = scores + g * n_keys;
    float mx = s[0];
    for (int64_t l = 1; l < n_keys; ++l) mx = s[l] > mx ? s[l] : mx;
    float total = 0.0f;
    int64_t l = 0;
    for (; l + kLanes <= n_keys; l += kLanes) {
      const vf e = exp_nonpositive(load(s + l) - splat(mx));
      store(s + l, e);
      total += hsum(e);
    }
    for (; l < n_keys; ++l) {
      vf e = exp_nonpositive(splat(s[l] - mx));
      s[l] = e[0];
      total += s[l];
    }
    const float inv = 1.0f / total;
    for (l = 0; l < n_keys; ++l) s[l] *= inv;
  }
  for (int64_t i = 0; i < G * D; ++i) out[i] = 0.0f;
  for (int64_t l = 0; l < n_keys; ++l) {
    const int64_t slot = blocks[l / block_size] * block_size + l % block_size;
    const C* value = v_cache + slot * slot_stride + head * D;
    int64_t d = 0;
    for (; d + kLanes <= D; d += kLanes) {
      const vf vv = load(value + d);
      for (int64_t g = 0; g < G; ++g) store(out + g * D + d, load(out + g * D + d) + splat(scores[g * n_keys + l]) * vv);
    }
    for (; d < D; ++d) {
      const float vv = to_float(value[d]);
      for (int64_t g = 0; g < G; ++g) out[g * D + d] += scores[g * n_keys + l] * vv;
    }
  }
}
