// The end of a quantized tile's block, shared by the VNNI kernel (tile_quant_gemm.h) and the AMX
// one (amx_tile_quant_gemm.h), included in each of their namespaces: one activation row's integer
// sums over the block, its first digits' (`first`) and second digits' (`second`), folded into the
// row's 16 outputs the same way in both, so that the two give the same outputs bit for bit.

// A tile's 16 weight rows' scales and (int4) minimums, as fp32 lanes.
template <int BITS>
static inline void tile_scales(const uint8_t* tile, __m512* scales, __m512* mins) {
  constexpr int64_t kValues = graphrt_native::tile_value_bytes(BITS);
  *scales = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + kValues)));
  *mins = _mm512_setzero_ps();
  if constexpr (BITS == 4)
    *mins = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + kValues + 32)));
}

// acc + (256 * first + second [- int8's offset correction]) * scales * the row's lane scale
// [+ int4's minimums * the row's sum of x], for block b of the record whose lane scales (then sums,
// then corrections, K / 32 of each) start at `lane_scales`.
template <int BITS>
static inline __m512 fold_block(__m512 acc, __m512i first, __m512i second, __m512 scales, __m512 mins,
                                const float* lane_scales, int64_t blocks, int64_t b) {
  __m512i total = _mm512_add_epi32(_mm512_slli_epi32(first, 8), second);
  if constexpr (BITS == 8) {
    const int32_t* corrections = reinterpret_cast<const int32_t*>(lane_scales + 2 * blocks);
    total = _mm512_sub_epi32(total, _mm512_set1_epi32(corrections[b]));
  }
  const __m512 s = _mm512_mul_ps(scales, _mm512_set1_ps(lane_scales[b]));
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), s, acc);
  if constexpr (BITS == 4) acc = _mm512_fmadd_ps(mins, _mm512_set1_ps(lane_scales[blocks + b]), acc);
  return acc;
}
