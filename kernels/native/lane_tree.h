// 16 vectors of 16 lanes reduced lane-wise at once: lane j of the result combines a[j]'s lanes by
// `op`, pairing them as hsum does (simd.h: halves, then quarters, then (0 + 2) + (1 + 3)), so a
// sum equals hsum(a[j]) and _mm512_reduce_add_ps(a[j]) bit for bit. A tree of 15 pairings, each
// two shuffles and an op, then one permute: about 50 instructions where 16 horizontal reductions
// take about 200. No include guard: included in each instruction set's namespace. Where the
// compiler has no __builtin_shufflevector, GRT_LANE_TREE stays undefined and users keep their
// one-at-a-time reductions.
#if defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
#define GRT_LANE_TREE 1
template <typename V, typename Op>
static inline V lane_tree(const V* a, Op op) {
  V t[8], u[4], v[2];
  for (int p = 0; p < 8; ++p)  // 128-bit lanes: a vector's (0 + 2, 1 + 3); vectors 2p, 2p + 1
    t[p] = op(__builtin_shufflevector(a[2 * p], a[2 * p + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23),
              __builtin_shufflevector(a[2 * p], a[2 * p + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30,
                                      31));
  for (int p = 0; p < 4; ++p)  // then their sum: 128-bit lane j holds vector 4p + j's four partial sums
    u[p] = op(__builtin_shufflevector(t[2 * p], t[2 * p + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27),
              __builtin_shufflevector(t[2 * p], t[2 * p + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30,
                                      31));
  for (int p = 0; p < 2; ++p)  // within each 128-bit lane j: vectors 8p + j, 8p + 4 + j, (0 + 2, 1 + 3) each
    v[p] = op(__builtin_shufflevector(u[2 * p], u[2 * p + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29),
              __builtin_shufflevector(u[2 * p], u[2 * p + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30,
                                      31));
  // lane 4j + i: vector 4i + j
  const V w = op(__builtin_shufflevector(v[0], v[1], 0, 2, 16, 18, 4, 6, 20, 22, 8, 10, 24, 26, 12, 14, 28, 30),
                 __builtin_shufflevector(v[0], v[1], 1, 3, 17, 19, 5, 7, 21, 23, 9, 11, 25, 27, 13, 15, 29, 31));
  return __builtin_shufflevector(w, w, 0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
}
#endif
#endif
