// Paged attention of one query token against one KV head, for one instruction set (included per
// set by isa_kernels.cpp).
//
// The G query heads that share KV head `head` read each key and value row once. Keys 0..n_keys-1
// of the token's sequence live at slot blocks[l / block_size] * block_size + l % block_size of
// the caches [num_slots, num_kv_heads, D]. Scores, softmax and the weighted sum are fp32.

template <typename C>
static inline float dot(const float* q, const C* key, int64_t D) {
  vf acc = vf{};
  int64_t d = 0;
  for (; d + kLanes <= D; d += kLanes) acc += load(q + d) * load(key + d);
  float s = hsum(acc);
  for (; d < D; ++d) s += q[d] * to_float(key[d]);
  return s;
}

// One token's attention over its keys [l0, l1) (a chunk of its sequence), every head at once:
// for each head h the chunk's max score m[h], the sum of exp(score - m[h]) sums[h], and the
// unnormalised weighted sum of values acc[h, :]; chunks merge afterwards (merge_chunks in ops.cpp).
// Chunks let two threads share one decode token; reading each key slot's heads together reads
// [Hkv, D] contiguous bytes, and the slot PREFETCH keys ahead is requested early: the KV cache of
// a decode step is cold, so latency, not bandwidth, bounds a loop that waits for each row.
constexpr int64_t kPrefetchKeys = 8;

// Locality 3 (the default) requests the bytes into L1, 2 into L2.
template <int Locality = 3>
static inline void prefetch_bytes(const void* at, int64_t bytes) {
  const char* p = static_cast<const char*>(at);
#pragma GCC unroll 4
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, Locality);
}

template <int Locality = 3, typename C>
static inline void prefetch_slot(const C* cache, int64_t slot, int64_t slot_elems) {
  prefetch_bytes<Locality>(cache + slot * slot_elems, slot_elems * int64_t(sizeof(C)));
}

// Key l's cache slot, walked key by key: one division where the walk starts, then a step to the
// next block every block_size keys.
struct SlotCursor {
  const int64_t* blocks;
  int64_t block_size, block, offset;
  SlotCursor(const int64_t* blocks_, int64_t block_size_, int64_t l)
      : blocks(blocks_), block_size(block_size_), block(l / block_size_), offset(l % block_size_) {}
  int64_t slot() const { return blocks[block] * block_size + offset; }
  void next() {
    if (++offset == block_size) offset = 0, ++block;
  }
};

// Requests a range's K/V slots into L2, spread evenly over `steps` calls of step(): a call walks
// its thread's next work item this way while it computes the current one, so that memory streams
// during the compute-bound passes too (without it the cold K/V arrives only in the first K pass,
// and a step's memory and arithmetic take turns). The spread is an error accumulator (a division
// a call was 5% of a decode call).
template <typename C>
struct AheadStream {
  const C *k_cache, *v_cache;
  int64_t slot_elems, total, steps, done = 0, owed = 0;
  SlotCursor at;
  AheadStream(const C* k, const C* v, int64_t slot_elems_, int64_t block_size, const graphrt_native::KeyRange* next,
              int64_t steps_)
      : k_cache(k),
        v_cache(v),
        slot_elems(slot_elems_),
        total(next ? next->l1 - next->l0 : 0),
        steps(std::max<int64_t>(1, steps_)),
        at(next ? next->blocks : nullptr, block_size, next ? next->l0 : 0) {}
  void step(int64_t calls = 1) {  // as `calls` calls of one step
    for (owed += total * calls; owed >= steps && done < total; owed -= steps, ++done, at.next()) {
      prefetch_slot<2>(k_cache, at.slot(), slot_elems);
      prefetch_slot<2>(v_cache, at.slot(), slot_elems);
    }
  }
};

// Softmax of each head's scores over the chunk, in place (exp(score - max)); m and sums per head.
static inline void chunk_softmax(float* scores, int64_t H, int64_t n, float* m, float* sums) {
  for (int64_t h = 0; h < H; ++h) {
    float* s = scores + h * n;
    // the max a vector at a time (a scalar max is one dependent instruction an element)
    float mx = s[0];
    int64_t i = 0;
    if (n >= kLanes) {
      vf vmax = load(s);
      for (i = kLanes; i + kLanes <= n; i += kLanes) {
        const vf v = load(s + i);
        vmax = v > vmax ? v : vmax;
      }
      for (int l = 0; l < kLanes; ++l) mx = vmax[l] > mx ? vmax[l] : mx;
    }
    for (; i < n; ++i) mx = s[i] > mx ? s[i] : mx;
    // the total a vector at a time, summed across lanes once (a horizontal sum a vector was a
    // tenth of a call's time)
    vf lanes_total = vf{};
    i = 0;
    for (; i + kLanes <= n; i += kLanes) {
      const vf e = exp_nonpositive(load(s + i) - splat(mx));
      store(s + i, e);
      lanes_total += e;
    }
    float total = hsum(lanes_total);
    if (i < n) {  // the last keys' exps in one vector (one vector each was 13% of a decode call)
      vf tail = splat(0.0f);
      for (int64_t j = i; j < n; ++j) tail[j - i] = s[j] - mx;
      const vf e = exp_nonpositive(tail);
      for (int64_t j = i; j < n; ++j) {
        s[j] = e[j - i];
        total += s[j];
      }
    }
    m[h] = mx;
    sums[h] = total;
  }
}

// The chunk with head_dim = DV vectors and G query heads per KV head known at compile time, on
// AVX-512 (where lane_sums exists). One KV head at a time:
// - scores kLanes keys at a time: for each query head, each key's products summed into one vector,
//   the kLanes vectors then summed lane-wise by one tree (lane_sums: the same additions as a
//   horizontal sum a key and head, about a quarter of the instructions). The block's keys are read
//   from L1 once per query head.
// - values with the G output rows held in registers across the keys (the general loop reloads
//   and re-stores them for every key); only where they fit the registers.
// The first KV head's pass prefetches whole slots, so the others find the chunk in L2, and
// requests the same slots' values into L2 for the value pass: two streams from memory at once
// instead of one after the other (a probe of 30 layers' attention at 512 keys, each call after a
// 19 MB product: 55.4 against 58.8 µs a call over seven interleaved pairs). The other passes
// request the thread's next item (AheadStream), except over an fp32 cache on AMD, where each item
// of new keys is read first instead (read_slots).
#if GRT_VEC_BYTES == 64 && defined(GRT_LANE_SUMS)
template <int DV, int G>
constexpr bool kFitsRegisters = DV * (G + 1) <= 28;

// Every K and V slot of a chunk read once, in key order, with plain loads (the values are
// dropped). On an AMD EPYC (family 19h) a thread's first item, which nothing requested, arrived
// faster this way than through the first pass's prefetches: in the engine at 512 keys, one row,
// 37.6-47.9 against 41.8-51.6 us a call (nine alternated pairs, one process; the log's
// "Attention's first item read first"). On a family-1Ah EPYC, over an fp32 cache, every item of
// new keys read this way beat the previous item's requests for it: 30 layers' cold caches,
// alternated call by call, 57.1 against 60.8 us a call at eight rows of 150 keys, 89.0-89.7
// against 93.8-97.8 at eight of 250, 26.7-28.0 against 28.2-29.3 at one row of 530; the engine's
// fp32 steps 0.6-1.3% shorter. Over a bf16 cache (half the bytes for the same arithmetic) the
// requests won: 53.6 against 55.8 us a call at eight rows of 250 keys for a bf16 model, 18.4
// against 19.5 at one row of 530 (the log's "Longer attention items").
static inline void read_slots(const void* k_cache, const void* v_cache, const int64_t* offset, int64_t n,
                              int64_t slot_bytes, int64_t elem_bytes) {
  vf a0 = vf{}, a1 = vf{};
  for (int64_t j = 0; j < n; ++j)
    for (const void* cache : {k_cache, v_cache}) {
      const char* p = static_cast<const char*>(cache) + offset[j] * elem_bytes;
      int64_t b = 0;
      for (; b + 128 <= slot_bytes; b += 128) {
        a0 += load(reinterpret_cast<const float*>(p + b));
        a1 += load(reinterpret_cast<const float*>(p + b + 64));
      }
      if (b + 64 <= slot_bytes) a0 += load(reinterpret_cast<const float*>(p + b));
    }
  asm volatile("" : : "v"(a0), "v"(a1));
}

// A head's DV vectors of a K/V row (T = C), of q (T = float) or of an output. A bf16 row is read
// as pairs (load_pairs): vector 2c holds the even values of its 32-value chunk c, 2c + 1 the odd
// ones; q is split the same way and the outputs joined back, once a KV head of an item, so every
// dot product and weighted sum pairs the same values. The dot products add in another order than
// in place (to within fp32's rounding). An fp32 row is its vectors in place.
template <typename C, int DV>
constexpr bool kPairs = std::is_same_v<C, uint16_t> && DV % 2 == 0;

template <typename C, int DV, typename T>
static inline void load_head(const T* p, vf* v) {
  if constexpr (kPairs<C, DV>) {
    for (int c = 0; c < DV / 2; ++c) {
      if constexpr (std::is_same_v<T, float>)
        split_pairs(p + 2 * c * kLanes, v[2 * c], v[2 * c + 1]);
      else
        load_pairs(p + 2 * c * kLanes, v[2 * c], v[2 * c + 1]);
    }
  } else {
    for (int d = 0; d < DV; ++d) v[d] = load(p + d * kLanes);
  }
}

template <typename C, int DV>
static inline void store_head(float* out, const vf* v) {
  if constexpr (kPairs<C, DV>) {
    for (int c = 0; c < DV / 2; ++c) join_pairs(out + 2 * c * kLanes, v[2 * c], v[2 * c + 1]);
  } else {
    for (int d = 0; d < DV; ++d) store(out + d * kLanes, v[d]);
  }
}

template <typename C, int DV, int G>
static void attend_chunk_fixed(const float* q, const C* k_cache, const C* v_cache, const int64_t* blocks, int64_t l0,
                               int64_t l1, int64_t block_size, int64_t Hkv, float scale, float* scores, float* m,
                               float* sums, float* acc, const graphrt_native::KeyRange* next, bool cold) {
  constexpr int64_t D = DV * kLanes;
  const int64_t slot_elems = Hkv * D, slot_bytes = slot_elems * int64_t(sizeof(C)), n = l1 - l0;
  // each key's slot as an offset into the caches, found once: the passes below index it (a walk
  // through the block table in every pass cost about ten instructions a key and pass, and the
  // registers it held)
  int64_t offset[graphrt_native::kMaxChunkKeys];
  {
    SlotCursor at(blocks, block_size, l0);
    for (int64_t j = 0; j < n; ++j, at.next()) offset[j] = at.slot() * slot_elems;
  }
  // a cold item on AMD: its K/V read first (read_slots), the passes then find it in L1/L2; over an
  // fp32 cache the next item is not requested (it is read first too, or it reads these keys)
  const bool read_first = cold && graphrt_native::kAmdStreams;
  if (read_first) read_slots(k_cache, v_cache, offset, n, slot_bytes, int64_t(sizeof(C)));
  const bool request_next = !graphrt_native::reads_items_first(std::is_same_v<C, float>);
  AheadStream<C> stream(k_cache, v_cache, slot_elems, block_size, request_next ? next : nullptr, (2 * Hkv - 1) * n);
  for (int64_t g = 0; g < Hkv; ++g) {
#if defined(GRT_BF16_DOT)
    // a bf16 cache's scores on the bf16 dot product: its q is bf16 (the cache's dtype), so its
    // pairs are exact, and each key's 32 values are one load, not two widened halves per head
    constexpr bool kDot = std::is_same_v<C, uint16_t> && DV % 2 == 0;
    __m512bh qpairs[kDot ? G : 1][kDot ? DV / 2 : 1];
    if constexpr (kDot) {
      for (int i = 0; i < G; ++i)
        for (int h = 0; h < DV / 2; ++h) {
          const float* qh = q + (g * G + i) * D + 2 * h * kLanes;
          qpairs[i][h] = _mm512_cvtne2ps_pbh((__m512)load(qh + kLanes), (__m512)load(qh));
        }
    }
#else
    constexpr bool kDot = false;
#endif
    // the KV head's query heads, loaded (over a bf16 cache: split into pairs) once for its keys
    vf qs[kDot ? 1 : G][DV];
    if constexpr (!kDot)
      for (int i = 0; i < G; ++i) load_head<C, DV>(q + (g * G + i) * D, qs[i]);
    for (int64_t l = 0; l < n; l += kLanes) {
      const int64_t count = std::min<int64_t>(kLanes, n - l);
      if (g == 0) {
        if (!read_first)  // the chunk's own slots, kPrefetchKeys ahead (an item read first has them)
          for (int64_t j = l + kPrefetchKeys; j < std::min(n, l + kLanes + kPrefetchKeys); ++j) {
            prefetch_bytes(k_cache + offset[j], slot_bytes);
            prefetch_bytes<2>(v_cache + offset[j], slot_bytes);  // the V pass's slot, into L2
          }
      } else {
        stream.step(count);
      }
      const C* key[kLanes];
      for (int64_t j = 0; j < count; ++j) key[j] = k_cache + offset[l + j] + g * D;
      for (int64_t j = count; j < kLanes; ++j) key[j] = key[0];  // a partial block's spare lanes
      for (int i = 0; i < G; ++i) {
        vf a[kLanes];
        if constexpr (kDot) {
#if defined(GRT_BF16_DOT)
#pragma GCC unroll 16
          for (int j = 0; j < kLanes; ++j) {
            const uint16_t* kj = reinterpret_cast<const uint16_t*>(key[j]);
            __m512 acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), qpairs[i][0], (__m512bh)_mm512_loadu_si512(kj));
            for (int h = 1; h < DV / 2; ++h)
              acc = _mm512_dpbf16_ps(acc, qpairs[i][h], (__m512bh)_mm512_loadu_si512(kj + 2 * h * kLanes));
            a[j] = (vf)acc;
          }
#endif
        } else {
          const vf* qv = qs[i];
#pragma GCC unroll 16
          for (int j = 0; j < kLanes; ++j) {
            vf kv[DV];
            load_head<C, DV>(key[j], kv);
            a[j] = qv[0] * kv[0];
            for (int d = 1; d < DV; ++d) a[j] += qv[d] * kv[d];
          }
        }
        const vf s = lane_sums(a) * splat(scale);
        float* out = scores + (g * G + i) * n + l;
        if (count == kLanes) {
          store(out, s);
        } else {
          for (int64_t j = 0; j < count; ++j) out[j] = s[j];
        }
      }
    }
  }
  chunk_softmax(scores, Hkv * G, n, m, sums);
  for (int64_t g = 0; g < Hkv; ++g) {
    vf o[G][DV];
    for (int i = 0; i < G; ++i)
      for (int d = 0; d < DV; ++d) o[i][d] = vf{};
    const C* values = v_cache + g * D;
    const float* p = scores + g * G * n;
    for (int64_t j = 0; j < n; ++j) {
      stream.step();
      if (g == 0 && !read_first && j + kPrefetchKeys < n)
        prefetch_bytes(v_cache + offset[j + kPrefetchKeys], slot_bytes);
      const C* value = values + offset[j];
      vf vv[DV];
      load_head<C, DV>(value, vv);
      for (int i = 0; i < G; ++i) {
        const vf pi = splat(p[i * n + j]);
        for (int d = 0; d < DV; ++d) o[i][d] += pi * vv[d];
      }
    }
    for (int i = 0; i < G; ++i) store_head<C, DV>(acc + (g * G + i) * D, o[i]);
  }
}

// The fixed-shape chunk for head_dim 4 or 8 vectors and the head groups that fit; false otherwise.
template <typename C, int DV, int G>
static inline bool try_fixed(int64_t D, int64_t groups, const float* q, const C* k_cache, const C* v_cache,
                             const int64_t* blocks, int64_t l0, int64_t l1, int64_t block_size, int64_t Hkv,
                             float scale, float* scores, float* m, float* sums, float* acc,
                             const graphrt_native::KeyRange* next, bool cold) {
  if constexpr (kFitsRegisters<DV, G>) {
    if (D == DV * kLanes && groups == G && l1 - l0 <= graphrt_native::kMaxChunkKeys) {
      attend_chunk_fixed<C, DV, G>(q, k_cache, v_cache, blocks, l0, l1, block_size, Hkv, scale, scores, m, sums, acc,
                                   next, cold);
      return true;
    }
  }
  return false;
}
#endif

// q: [H, D] fp32 (H = Hkv * G); scores: scratch [H, l1 - l0]; m, sums: [H]; acc: [H, D]. `cold`:
// nothing requested this item's K/V ahead (only the fixed-shape chunk reads such an item first).
template <typename C>
static void attend_chunk(const float* q, const C* k_cache, const C* v_cache, const int64_t* blocks, int64_t l0,
                         int64_t l1, int64_t block_size, int64_t Hkv, int64_t D, int64_t G, float scale, float* scores,
                         float* m, float* sums, float* acc, const graphrt_native::KeyRange* next, bool cold) {
#if GRT_VEC_BYTES == 64 && defined(GRT_LANE_SUMS)
#define GRT_TRY(DV, GG) \
  try_fixed<C, DV, GG>(D, G, q, k_cache, v_cache, blocks, l0, l1, block_size, Hkv, scale, scores, m, sums, acc, next, \
                       cold)
  if (GRT_TRY(4, 1) || GRT_TRY(4, 2) || GRT_TRY(4, 3) || GRT_TRY(4, 4) || GRT_TRY(4, 5) || GRT_TRY(4, 6) ||
      GRT_TRY(8, 1) || GRT_TRY(8, 2))
    return;
#undef GRT_TRY
#else
  (void)cold;
#endif
  const int64_t slot_elems = Hkv * D, n = l1 - l0, H = Hkv * G;
  AheadStream<C> stream(k_cache, v_cache, slot_elems, block_size, next, 2 * n);
  SlotCursor at(blocks, block_size, l0), ahead(blocks, block_size, l0 + kPrefetchKeys);
  for (int64_t l = l0; l < l1; ++l, at.next(), ahead.next()) {
    stream.step();
    if (l + kPrefetchKeys < l1) prefetch_slot(k_cache, ahead.slot(), slot_elems);
    const C* row = k_cache + at.slot() * slot_elems;
    for (int64_t h = 0; h < H; ++h) scores[h * n + (l - l0)] = dot(q + h * D, row + (h / G) * D, D) * scale;
  }
  chunk_softmax(scores, H, n, m, sums);
  for (int64_t i = 0; i < H * D; ++i) acc[i] = 0.0f;
  SlotCursor at_v(blocks, block_size, l0), ahead_v(blocks, block_size, l0 + kPrefetchKeys);
  for (int64_t l = l0; l < l1; ++l, at_v.next(), ahead_v.next()) {
    stream.step();
    if (l + kPrefetchKeys < l1) prefetch_slot(v_cache, ahead_v.slot(), slot_elems);
    const C* row = v_cache + at_v.slot() * slot_elems;
    for (int64_t h = 0; h < H; ++h) {
      const C* value = row + (h / G) * D;
      const float p = scores[h * n + (l - l0)];
      float* out = acc + h * D;
      int64_t d = 0;
      for (; d + kLanes <= D; d += kLanes) store(out + d, load(out + d) + splat(p) * load(value + d));
      for (; d < D; ++d) out[d] += p * to_float(value[d]);
    }
  }
}
