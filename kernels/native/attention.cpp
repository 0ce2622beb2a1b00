// CPU implementations of graphrt::slot_mapping and paged_attention (kernels/cache.py,
// attention.py) over the ISA kernel table: the work items of a step's rows, their chunks'
// attention on the threads (paged_attention.h), and the merge of each token's chunks.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

#include "isa_kernels.h"
#include "ops.h"

namespace graphrt_native {

// Keys per attention work item, at most: kMaxChunkKeys where that many keys' K and V fit in
// kChunkBytes, else as many as fit but never fewer than kChunk. Fewer, longer items measured
// faster: a thread reads a cold item's K/V first and then computes on it, and each item adds its
// own start, next-item requests and partial sums to merge. SmolLM2 (1,536 bytes of fp32 K/V a
// key), two threads, 30 layers' cold caches, alternated call by call: 26.8 against 28.2 us a call
// at 512 keys, 29.7 against 31.5 at 530, 22.3 against 23.9 at 400, 51.8 against 53.9 at eight
// rows of 150; in the engine, alternated step by step, 7.65 against 7.72 ms a step at 480-544
// tokens and 16.24 against 16.41 at eight rows of 128-256 (the log's "Longer attention items").
// The bytes bound keeps a chunk in L2 while a prefill's or a verify step's tokens run over it.
constexpr int64_t kChunk = 128;
constexpr int64_t kChunkBytes = 384 << 10;
constexpr int64_t kMinChunk = 32;  // and at least, where a step is split further for its threads

namespace {

int64_t chunk_keys(int64_t kv_bytes_per_key) {
  return std::clamp<int64_t>(kChunkBytes / std::max<int64_t>(1, kv_bytes_per_key), kChunk, kMaxChunkKeys);
}

void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& slot_mapping) {
  // the caches hold k/v's dtype, or bf16 rounded from fp32 k/v (a bf16 KV cache under an fp32 model)
  const bool narrow = k.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kBFloat16;
  TORCH_CHECK(k.scalar_type() == v.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type() &&
                  (k.scalar_type() == k_cache.scalar_type() || narrow),
              "graphrt::paged_attention: k/v and the caches must share a dtype (or be float32 into bfloat16 caches)");
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
  const int64_t bytes = row * k_cache.element_size();
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
    if (narrow) {  // rounded to nearest even, as torch's .to(bfloat16)
      const float* kf = reinterpret_cast<const float*>(ks + t * kstride);
      const float* vf = reinterpret_cast<const float*>(vs + t * vstride);
      uint16_t* kb = reinterpret_cast<uint16_t*>(kd + s * bytes);
      uint16_t* vb = reinterpret_cast<uint16_t*>(vd + s * bytes);
      for (int64_t i = 0; i < row; ++i) kb[i] = round_bf16(kf[i]), vb[i] = round_bf16(vf[i]);
    } else {
      std::memcpy(kd + s * bytes, ks + t * kstride, bytes);
      std::memcpy(vd + s * bytes, vs + t * vstride, bytes);
    }
  }
}

// One token's output o [H, D] from its chunks `its` (in key order): each chunk's unnormalised
// sums rescaled to the token's maximum score, then divided by the softmax's total (zeros for none).
void merge_chunks(const int64_t* its, int64_t count, const float* m, const float* sums, const float* acc, int64_t H,
                  int64_t D, float* o) {
  std::fill(o, o + H * D, 0.0f);
  if (count == 0) return;
  for (int64_t h = 0; h < H; ++h) {
    float mx = m[its[0] * H + h];
    for (int64_t c = 0; c < count; ++c) mx = std::max(mx, m[its[c] * H + h]);
    float total = 0.0f;
    for (int64_t c = 0; c < count; ++c) {
      const int64_t i = its[c];
      const float w = std::exp(m[i * H + h] - mx);
      total += w * sums[i * H + h];
      const float* a = &acc[(i * H + h) * D];
      for (int64_t d = 0; d < D; ++d) o[h * D + d] += w * a[d];
    }
    const float inv = 1.0f / total;
    for (int64_t d = 0; d < D; ++d) o[h * D + d] *= inv;
  }
}

// A work item: token t's keys [l0, l1).
struct Item {
  int64_t t, l0, l1;
};

// One call's bookkeeping, kept by its thread between calls (a call set up about fifteen vectors,
// each a malloc and a free; after a decode step's weight streams those run with malloc's data
// evicted). Every call sizes and fills what it reads; a long prefill's partial sums are let go.
struct CallScratch {
  std::vector<float> q_wide, m, sums, acc, row;
  std::vector<int64_t> token_row, n_keys, most, pieces, split, first, its_of, last_item, fill;
  std::vector<Item> items;
  std::vector<char> merged;
  void trim() {
    if (acc.capacity() > (size_t(1) << 18)) *this = CallScratch();
  }
};

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
  const bool bf16 = q.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || q.scalar_type() == at::kFloat, "graphrt::paged_attention: native kernel takes float32 or bfloat16");
  // a bf16 KV cache under an fp32 model (kv_cache_dtype): its keys widened, its q kept in fp32
  const bool wide = q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kBFloat16;
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() && (q.scalar_type() == k_cache.scalar_type() || wide),
              "graphrt::paged_attention: the caches hold q's dtype (or bfloat16 under a float32 q)");
  if (k.has_value() && k->defined()) write_kv(*k, *v, k_cache, v_cache, *slot_mapping);
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t block_size = k_cache.size(1), Hkv = k_cache.size(2), G = H / Hkv;
  // q in fp32: a bf16 model's q widened here, and its output rounded below, rather than by two
  // dispatched copies a layer (2.4 µs each, 2% of a bf16 decode step)
  static thread_local CallScratch s;
  std::vector<float>& q_wide = s.q_wide;
  at::Tensor qf;
  if (bf16 && q.is_contiguous()) {
    const uint16_t* src = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
    q_wide.resize(q.numel());
    widen_bf16(src, q.numel(), q_wide.data());
  } else {
    qf = as_contiguous(q, at::kFloat);
  }
  const at::Tensor tables = as_contiguous(block_tables, at::kLong);
  const at::Tensor lens = as_contiguous(seq_lens, at::kLong);
  const at::Tensor qsl = as_contiguous(query_start_loc, at::kLong);
  const int64_t R = lens.size(0), B = tables.size(1);
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t* qp = qsl.data_ptr<int64_t>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  // Each token's row and number of visible keys (0: padding, or a row of no sequence).
  std::vector<int64_t>&token_row = s.token_row, &n_keys = s.n_keys;
  token_row.assign(T, -1);
  n_keys.assign(T, 0);
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
  // A row's keys split into equal chunks of at most `chunk` keys (192 keys with 128 at most: two of
  // 96, where 128 and 64 left a thread waiting); a step of few chunks, not a multiple of the
  // threads, splits each row's chunks further (one decode row of up to `chunk` keys was one item,
  // on one thread).
  const int64_t chunk = chunk_keys(2 * Hkv * D * k_cache.element_size());
  std::vector<int64_t>&most = s.most, &pieces = s.pieces;
  most.assign(R, 0);
  pieces.assign(R, 0);
  int64_t total = 0;
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t t = std::max<int64_t>(0, qp[r]); t < std::min(T, qp[r + 1]); ++t)
      most[r] = std::max(most[r], n_keys[t]);
    pieces[r] = (most[r] + chunk - 1) / chunk;
    total += pieces[r];
  }
  const int64_t threads = at::get_num_threads();
  if (total > 0 && total < 4 * threads && total % threads != 0) {
    const int64_t times = threads / std::gcd(total, threads);
    for (int64_t r = 0; r < R; ++r)
      if (most[r] >= times * pieces[r] * kMinChunk) pieces[r] *= times;
  }
  std::vector<Item>& items = s.items;
  items.clear();
  for (int64_t r = 0; r < R; ++r) {
    const int64_t t0 = std::max<int64_t>(0, qp[r]), t1 = std::min(T, qp[r + 1]);
    for (int64_t p = 0; p < pieces[r]; ++p) {
      const int64_t l0 = most[r] * p / pieces[r], l1 = most[r] * (p + 1) / pieces[r];
      for (int64_t t = t0; t < t1; ++t)
        if (l0 < n_keys[t]) items.push_back({t, l0, std::min(n_keys[t], l1)});
    }
  }
  // the threads' shares of the items, by count (as parallel_for splits a range)
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(threads, static_cast<int64_t>(items.size())));
  std::vector<int64_t>& split = s.split;
  split.resize(parts + 1);
  for (int64_t p = 0; p <= parts; ++p) split[p] = static_cast<int64_t>(items.size()) * p / parts;
  const int64_t I = static_cast<int64_t>(items.size());
  // each token's items in key order (the merge's order: the same sums as token by token), as
  // one index list: token t's are its_of[first[t] .. first[t + 1])
  std::vector<int64_t>&first = s.first, &its_of = s.its_of, &last_item = s.last_item, &fill = s.fill;
  first.assign(T + 1, 0);
  its_of.resize(I);
  last_item.assign(T, -1);
  for (const Item& it : items) ++first[it.t + 1];
  for (int64_t t = 0; t < T; ++t) first[t + 1] += first[t];
  fill.assign(first.begin(), first.end() - 1);
  for (int64_t i = 0; i < I; ++i) its_of[fill[items[i].t]++] = i, last_item[items[i].t] = i;
  std::vector<float>&m = s.m, &sums = s.sums, &acc = s.acc;
  m.resize(I * H);
  sums.resize(I * H);
  acc.resize(I * H * D);
  const float* qd = qf.defined() ? qf.data_ptr<float>() : q_wide.data();
  const void* kd = k_cache.data_ptr();
  const void* vd = v_cache.data_ptr();
  const IsaKernels& isa = isa_kernels();
  const AttendFn attend = k_cache.scalar_type() == at::kFloat ? isa.attend_f32
                          : wide                                ? isa.attend_bf16_wide
                                                                : isa.attend_bf16;
  const float fscale = static_cast<float>(scale);
  // the output in q's dtype: a bf16 token's merged row is rounded from fp32 (no dispatched copy)
  at::Tensor out = new_output({T, H, D}, q.scalar_type());
  std::vector<char>& merged = s.merged;
  merged.assign(T, 0);
  auto merge_token = [&](int64_t t, float* row) {  // row: scratch [H, D] for a bf16 output
    float* o = bf16 ? row : out.data_ptr<float>() + t * H * D;
    merge_chunks(its_of.data() + first[t], first[t + 1] - first[t], m.data(), sums.data(), acc.data(), H, D, o);
    if (bf16) {
      uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()) + t * H * D;
      for (int64_t i = 0; i < H * D; ++i) dst[i] = round_bf16(o[i]);
    }
    merged[t] = 1;
  };
  const bool read_every_item = reads_items_first(k_cache.scalar_type() == at::kFloat);
  auto same_keys = [&](const Item& a, const Item& b) { return token_row[a.t] == token_row[b.t] && a.l0 == b.l0; };
  at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
    float* scores = thread_scratch(H * chunk + H * D);
    float* row = scores + H * chunk;
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t i0 = split[p], i1 = split[p + 1];
      for (int64_t i = i0; i < i1; ++i) {
        const Item& it = items[i];
        const int64_t* blocks = tp + token_row[it.t] * B;
        // The thread's next item streams in while this one computes, unless it reads the same keys
        // (a row's next token: already in L2). A decode step of eight rows at 150 keys, 30 layers'
        // cold K/V: 64-67 against 80-98 µs a call. On AMD a thread's first item is `cold`, read
        // first by the fixed-shape kernel (paged_attention.h, read_slots), and over an fp32 cache
        // so is every item of new keys, which that kernel then does not request ahead.
        KeyRange next{};
        const KeyRange* ahead = nullptr;
        if (i + 1 < i1 && !same_keys(items[i + 1], it)) {
          next = {tp + token_row[items[i + 1].t] * B, items[i + 1].l0, items[i + 1].l1};
          ahead = &next;
        }
        const bool cold = i == i0 || (read_every_item && !same_keys(items[i - 1], it));
        attend(qd + it.t * H * D, kd, vd, blocks, it.l0, it.l1, block_size, Hkv, D, G, fscale, scores, &m[i * H],
               &sums[i * H], &acc[i * H * D], ahead, cold);
        // A token whose items are all this thread's is merged here, once its last is done. After
        // the join, on one thread while the other waited, the merge of eight decode rows took
        // 6.6-8.1 µs of a 67-73 µs call (a timing probe, not shipped); now 0.2-1.3 µs remain there.
        const int64_t t = it.t;
        if (last_item[t] == i && its_of[first[t]] >= i0) merge_token(t, row);
      }
    }
  });
  // the tokens whose items two threads shared, and those with none (zeros)
  std::vector<float>& row = s.row;
  row.resize(bf16 ? H * D : 0);
  for (int64_t t = 0; t < T; ++t)
    if (!merged[t]) merge_token(t, row.data());
  s.trim();
  return out;
}

}  // namespace graphrt_native

TORCH_LIBRARY_IMPL(graphrt, CPU, m) {
  m.impl("paged_attention", &graphrt_native::paged_attention);
  m.impl("slot_mapping", &graphrt_native::slot_mapping);
}
