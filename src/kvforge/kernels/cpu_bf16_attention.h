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

#include "cpu_simd.h"  // widen_bf16

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

// 2^y for y <= 0 (a few ulp above 0 is fine) within ~2 ulp: y = n + f with n = round(y) and
// f in [-1/2, 1/2], a degree-5 polynomial for 2^f (its constant term is 1, so 2^0 is exactly
// 1), and 2^n applied by vscalefps. Inputs are clamped at -126 (2^-126 is float's smallest
// normal), so -inf gives 2^-126, not 0: callers multiply it only into sums that are still 0.
// Half the operations of exp_nonpositive16 (no ln2 split), for softmax weights in base 2.
inline __m512 exp2_nonpositive16(__m512 y) {
  y = _mm512_max_ps(y, _mm512_set1_ps(-126.f));
  const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(y, n);
  __m512 p = _mm512_set1_ps(1.326472614891827e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.671512991189957e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550733581185341e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022242426872253e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931470036506653e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

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

// Lane i of the result = op over the 16 lanes of v[i], for 8 vectors (a transposing tree:
// 24 shuffles and ops), op = _mm512_add_ps (sums8) or _mm512_max_ps (maxes8). The order is
// fixed, so equal inputs give equal results: within each 128-bit lane (x0 op x2) op
// (x1 op x3), then over the four 128-bit lanes (L0 op L1) op (L2 op L3).
template <typename Op>
inline __m256 fold8(const __m512* v, Op op) {
  __m512 pairs[4];  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] of (a, b) = v[2i], v[2i+1]
  for (int i = 0; i < 4; ++i) {
    pairs[i] = op(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  __m512 quads[2];  // per 128-bit lane: the partial sums (within that lane) of v[4i .. 4i+3]
  for (int i = 0; i < 2; ++i) {
    const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = op(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // Fold the four 128-bit lanes: first neighbours (0+1, 2+3), then the two halves.
  const __m512 h = op(_mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(2, 0, 2, 0)),
                      _mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_castps512_ps256(op(_mm512_shuffle_f32x4(h, h, _MM_SHUFFLE(3, 1, 2, 0)),
                                   _mm512_shuffle_f32x4(h, h, _MM_SHUFFLE(2, 0, 3, 1))));
}

inline __m256 sums8(const __m512* v) {
  return fold8(v, [](__m512 a, __m512 b) { return _mm512_add_ps(a, b); });
}

inline __m256 maxes8(const __m512* v) {
  return fold8(v, [](__m512 a, __m512 b) { return _mm512_max_ps(a, b); });
}

}  // namespace kvforge_bf16

#endif  // AVX512-BF16
