// float32 -> bf16 rounding in vector registers, bit for bit c10::BFloat16(float)'s rule:
// round to nearest even (add 0x7FFF plus the lowest kept bit, keep the top half), and any
// NaN becomes 0x7FC0 (its sign dropped). One place for the rule, at the two widths the
// kernels use: 4 lanes (SSE4.1; the small-M linear's tile of 4 outputs) and 16 lanes
// (AVX-512; fused elementwise ops). Each lane's result is the scalar conversion's.
#pragma once

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>

#include <cstdint>

namespace kvforge_bf16_round {

// The 4 lanes of v as bf16 bits, in the low 16 bits of each 32-bit lane.
inline __m128i bits4(__m128 v) {
  const __m128i bits = _mm_castps_si128(v);
  const __m128i lowest_kept = _mm_and_si128(_mm_srli_epi32(bits, 16), _mm_set1_epi32(1));
  const __m128i rounded = _mm_srli_epi32(_mm_add_epi32(_mm_add_epi32(bits, _mm_set1_epi32(0x7FFF)), lowest_kept), 16);
  return _mm_blendv_epi8(rounded, _mm_set1_epi32(0x7FC0), _mm_castps_si128(_mm_cmpunord_ps(v, v)));
}

// Stores the 4 lanes of v as bf16 at y (8 bytes).
inline void store4(__m128 v, void* y) {
  const __m128i rounded = bits4(v);
  // every lane is below 2^16 after the shift, so the unsigned saturating pack is exact
  _mm_storel_epi64(reinterpret_cast<__m128i*>(y), _mm_packus_epi32(rounded, rounded));
}

#if defined(__AVX512F__)
// The 16 lanes of v as bf16 bits, packed to 16 x 16 bits.
inline __m256i bits16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lowest_kept = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), lowest_kept), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}
#endif

}  // namespace kvforge_bf16_round

#endif
