// A row of 32 outputs of the products over packed bf16 weights (kernels/packed_bf16.py), for the
// instruction sets with AVX-512 (included by amx_gemm.h and dot_packed_gemm.h).

// 16 fp32 → bf16, rounded to nearest even as round_bf16 (ops.h) does, NaN kept quiet.
static inline __m256i round_to_bf16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
  const __mmask16 nan =
      _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
  r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
  return _mm512_cvtepi32_epi16(r);
}

// Columns n.. n + 15 (lo) and n + 16.. n + 31 (hi) of one output row, with their bias (b0, b1),
// rounded to bf16 and stored at `to`; a streaming store where the row is 64-byte aligned: the line
// is whole, and an ordinary store's read of each line took the line-fill buffers the weights'
// stream needs (SmolLM2's LM head on an Intel Xeon's tiles, 8 rows: 32.0-33.2 against 28.7-29.2
// GB/s).
static inline void store_packed_row(__m512 lo, __m512 hi, __m512 b0, __m512 b1, uint16_t* to, bool aligned) {
  const __m256i l = round_to_bf16(_mm512_add_ps(lo, b0));
  const __m256i h = round_to_bf16(_mm512_add_ps(hi, b1));
  const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(l), h, 1);
  if (aligned)
    _mm512_stream_si512(reinterpret_cast<__m512i*>(to), both);
  else
    _mm512_storeu_si512(to, both);
}
