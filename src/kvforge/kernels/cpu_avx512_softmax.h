// Float32 building blocks of the AVX-512 online softmax, shared by the bf16 attention blocks
// (cpu_bf16_attention.h, which re-exports them in kvforge_bf16) and the float32 causal
// prefill kernel (cpu_causal_attention.cpp). They need AVX-512F only, so the float32 kernel
// runs on CPUs without AVX512-BF16.
//
// Defines KVFORGE_AVX512_SOFTMAX when the compiler targets AVX-512F; without it nothing
// below exists.
#pragma once

#if defined(__AVX512F__)
#define KVFORGE_AVX512_SOFTMAX 1
#include <immintrin.h>

namespace kvforge_avx512 {

// 2^y for y <= 0 (a few ulp above 0 is fine) within ~2 ulp: y = n + f with n = round(y) and
// f in [-1/2, 1/2], a degree-5 polynomial for 2^f (its constant term is 1, so 2^0 is exactly
// 1), and 2^n applied by vscalefps. Inputs are clamped at -126 (2^-126 is float's smallest
// normal), so -inf gives 2^-126, not 0: callers multiply it only into sums that are still 0.
// Half the operations of exp_nonpositive16 (cpu_bf16_attention.h: no ln2 split), for softmax
// weights in base 2.
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

}  // namespace kvforge_avx512

#endif  // AVX-512F
