// Building blocks of the AVX512-BF16 attention kernels (the causal prefill kernel in
// cpu_causal_attention.cpp and the bf16 decode path of cache/full/cpu_decode.cpp).
//
// Precision contract shared by their users: products of two bf16 numbers are exact in
// float32 and `vdpbf16ps` sums them into float32 lanes (each addition rounds); the softmax
// runs in float32; a block's weights exp(s - max) are rounded to bf16 once, and those
// rounded weights are both what multiplies V and what the normaliser l sums, so an output
// is exactly a convex combination of value rows with the weights actually used. This is
// the precision of ATen's bf16 flash attention (float32 softmax, bf16 weights into P V).
//
// Defines KVFORGE_BF16_DOT when the compiler targets AVX512-BF16 (Zen 4, Sapphire Rapids
// and later); without it nothing below exists and callers keep their float paths.
#pragma once

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define KVFORGE_BF16_DOT 1
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "cpu_avx512_softmax.h"  // exp2_nonpositive16, sums8, maxes8 (AVX-512F)
#include "cpu_simd.h"            // widen_bf16

namespace kvforge_bf16 {

// acc += a . b over bf16 pairs: lane t += a[2t] b[2t] + a[2t+1] b[2t+1], in float32.
inline __m512 dot_pairs(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}

// exp(x) for x <= 0 within ~2 ulp: x = n ln2 + r (ln2 split in two for exactness of r), a
// degree-6 polynomial in r, and 2^n applied by vscalefps. Inputs are clamped at -87 (their
// exp is below float's normal range); callers zero masked lanes themselves.
inline __m512 exp_nonpositive16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

using kvforge_avx512::exp2_nonpositive16;  // cpu_avx512_softmax.h

// Keys per online-softmax block (`softmax_block`): four 16-lane vectors of scores.
constexpr int64_t kSoftmaxBlock = 64;

// Online softmax of one query row over one block of kSoftmaxBlock scores s (all 64 floats
// readable; lanes past `limit` may hold anything): keys j <= limit are visible, the rest
// get weight exactly 0. Writes the bf16 weights p[0..64), updates the row's running max m
// and sum l (of the rounded weights), and returns the factor by which the row's
// accumulator must be scaled (exp(old m - new m); 0 when m was -inf).
// INVARIANT: at least one key is visible (limit >= 0), so m is finite afterwards.
inline float softmax_block(const float* s, int64_t limit, float& m, float& l, uint16_t* p) {
  __m512 x[4];
  __mmask16 visible[4];
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i last = _mm512_set1_epi32(static_cast<int>(std::min<int64_t>(limit, kSoftmaxBlock)));
  __m512 block_max = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int c = 0; c < 4; ++c) {
    x[c] = _mm512_loadu_ps(s + 16 * c);
    visible[c] = _mm512_cmple_epi32_mask(_mm512_add_epi32(lane, _mm512_set1_epi32(16 * c)), last);
    block_max = _mm512_mask_max_ps(block_max, visible[c], block_max, x[c]);
  }
  const float new_max = std::max(m, _mm512_reduce_max_ps(block_max));
  const float correction = std::exp(m - new_max);  // m = -inf on the first block: 0
  const __m512 shift = _mm512_set1_ps(new_max);
  __m512 sum = _mm512_setzero_ps();
  for (int c = 0; c < 4; ++c) {
    const __m512 e = _mm512_maskz_mov_ps(visible[c], exp_nonpositive16(_mm512_sub_ps(x[c], shift)));
    const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + 16 * c), rounded);
    // l sums the rounded weights: the ones the value product uses
    sum = _mm512_add_ps(sum, kvforge_simd::widen_bf16(rounded));
  }
  l = l * correction + _mm512_reduce_add_ps(sum);
  m = new_max;
  return correction;
}

using kvforge_avx512::fold8;  // cpu_avx512_softmax.h
using kvforge_avx512::maxes8;
using kvforge_avx512::sums8;

}  // namespace kvforge_bf16

#endif  // AVX512-BF16
