// Vector types and small reductions shared by the CPU kernels: the decode attention of
// cache/full, cache/kivi and cache/shadowkv, the small-M linear (cpu_linear.cpp), the fused
// elementwise ops (cpu_fused.cpp) and the bf16 attention blocks (cpu_bf16_attention.h).
//
// A kernel loop is written once over a vector type V:
// - `NativeVec`: the widest ISA the compiler targets (-march=native): __m512 (16 lanes) with
//   AVX-512F, else __m256 (8 lanes) with AVX2, FMA and F16C. KVFORGE_NATIVE_VEC is defined
//   where it exists; the portable flag sets of kernels/build.py have none;
// - `ArrayVec<N>`: plain C++ over N lanes that compilers auto-vectorise (SSE, NEON) and, with
//   N = 1, serves any length.
// Both have kLanes, zero, broadcast, load (float32, bf16, fp16, float8 e4m3fn / e5m2: every
// widening is exact), store, fmadd (a * b + c), mul, add, sub, max, exp_nonpositive, sum,
// hmax and sum4.
//
// INVARIANT: every operation is one sequence of float operations per lane, fixed at compile
// time, so a kernel that calls the same operations in the same order gets the same bits
// wherever it calls them. Where the types differ is the order of their reductions, and
// operations with different orders have different names (the kernels' parity tests pin the
// results of each):
// - ArrayVec::sum adds lanes 0, 1, ..., N - 1 in order onto 0; ArrayVec::sum_pairwise adds
//   neighbours, then neighbouring pair sums, and so on (at N = 8 the tree of the 8-lane
//   sum4: ((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 + v7)));
// - NativeVec::sum is the ISA's horizontal reduction; NativeVec::sum4 gives four sums through
//   one tree of horizontal adds, the 16-lane type first adding lane i + 8 onto lane i;
// - dot<V, Chains> runs Chains independent accumulators, added as a pairwise tree before
//   V::sum ((s0 + s1) + (s2 + s3) for four): dot<V, 2> and dot<V, 4> differ in the last bits;
// - max_of, sum_of and dot_simd_reduction are `omp simd` reductions: their order is the
//   vectoriser's for the target (fixed per build).
// fmadd is one fused instruction on the native types; ArrayVec writes a * b + c, which the
// compiler fuses or not as the build's -ffp-contract says (the linear and fused kernels
// build with -ffp-contract=off).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#define KVFORGE_NATIVE_VEC 1
#include <immintrin.h>
#endif

namespace kvforge_simd {

// e^x for x <= 0 (scores minus their running max): x = k ln2 + r with |r| <= ln2 / 2 (ln2
// split in two parts for accuracy), e^r by a degree-7 polynomial, 2^k assembled in the
// exponent bits. k comes from the float magic-number trick (adding 1.5 * 2^23 rounds to an
// integer in the low mantissa bits), since floor() and float-to-int conversions block GCC's
// vectoriser under default trapping-math: loops computing this vectorise without
// -ffast-math. Below -87 the result would be denormal; clamping gives ~1e-38, far below what
// a softmax whose largest term is 1 can resolve. Relative error ~1e-7.
//
// One text, two forms: the scalar function and the in-place loop, which spells the steps out
// rather than calling the function (with the call GCC emitted different code around the
// loop, and fused other multiply-adds of a kernel's plain-C++ path differently: float8 pages
// at head dim 12 came out different in the last bits).
#define KVFORGE_SIMD_EXP_NONPOSITIVE(x, out)                                     \
  do {                                                                           \
    const float v_ = (x) < -87.0f ? -87.0f : (x);                                \
    const float magic_ = v_ * 1.44269504088896341f + 12582912.0f;                \
    const float k_ = magic_ - 12582912.0f;                                       \
    const float r_ = (v_ - k_ * 0.693359375f) + k_ * 2.12194440e-4f;             \
    float poly_ = 1.9875691500e-4f;                                              \
    poly_ = poly_ * r_ + 1.3981999507e-3f;                                       \
    poly_ = poly_ * r_ + 8.3334519073e-3f;                                       \
    poly_ = poly_ * r_ + 4.1665795894e-2f;                                       \
    poly_ = poly_ * r_ + 1.6666665459e-1f;                                       \
    poly_ = poly_ * r_ + 5.0000001201e-1f;                                       \
    poly_ = poly_ * r_ * r_ + r_ + 1.0f;                                         \
    int32_t k_bits_;                                                             \
    std::memcpy(&k_bits_, &magic_, sizeof(k_bits_));                             \
    const int32_t exponent_ = (k_bits_ - 0x4B400000 + 127) << 23; /* 2^k */     \
    float two_k_;                                                                \
    std::memcpy(&two_k_, &exponent_, sizeof(two_k_));                            \
    (out) = poly_ * two_k_;                                                      \
  } while (0)

__attribute__((always_inline)) inline float exp_nonpositive(float x) {
  float result;
  KVFORGE_SIMD_EXP_NONPOSITIVE(x, result);
  return result;
}

// x[i] = exp_nonpositive(x[i]) for i < n, in place (vectorised by the compiler).
inline void exp_nonpositive_in_place(float* x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) KVFORGE_SIMD_EXP_NONPOSITIVE(x[i], x[i]);
}

template <int N>
struct ArrayVec {
  static constexpr int64_t kLanes = N;
  float v[N];
  static ArrayVec zero() { return broadcast(0.f); }
  static ArrayVec broadcast(float x) {
    ArrayVec r;
    for (int i = 0; i < N; ++i) r.v[i] = x;
    return r;
  }
  template <typename T>
  static ArrayVec load(const T* p) {
    ArrayVec r;
    for (int i = 0; i < N; ++i) r.v[i] = static_cast<float>(p[i]);
    return r;
  }
  void store(float* p) const {
    for (int i = 0; i < N; ++i) p[i] = v[i];
  }
  static ArrayVec fmadd(const ArrayVec& a, const ArrayVec& b, const ArrayVec& c) {
    ArrayVec r;
    for (int i = 0; i < N; ++i) r.v[i] = a.v[i] * b.v[i] + c.v[i];
    return r;
  }
  static ArrayVec mul(const ArrayVec& a, const ArrayVec& b) {
    ArrayVec r;
    for (int i = 0; i < N; ++i) r.v[i] = a.v[i] * b.v[i];
    return r;
  }
  static ArrayVec add(const ArrayVec& a, const ArrayVec& b) {
    ArrayVec r;
    for (int i = 0; i < N; ++i) r.v[i] = a.v[i] + b.v[i];
    return r;
  }
  static ArrayVec sub(const ArrayVec& a, const ArrayVec& b) {
    ArrayVec r;
    for (int i = 0; i < N; ++i) r.v[i] = a.v[i] - b.v[i];
    return r;
  }
  static ArrayVec max(const ArrayVec& a, const ArrayVec& b) {
    ArrayVec r;
    for (int i = 0; i < N; ++i) r.v[i] = a.v[i] > b.v[i] ? a.v[i] : b.v[i];
    return r;
  }
  static ArrayVec exp_nonpositive(const ArrayVec& x) {
    ArrayVec r;
    for (int i = 0; i < N; ++i) r.v[i] = kvforge_simd::exp_nonpositive(x.v[i]);
    return r;
  }
  float sum() const {
    float s = 0.f;
    for (int i = 0; i < N; ++i) s += v[i];
    return s;
  }
  float sum_pairwise() const {
    static_assert((N & (N - 1)) == 0, "sum_pairwise takes a power-of-two lane count");
    float t[N];
    for (int i = 0; i < N; ++i) t[i] = v[i];
    for (int width = 1; width < N; width *= 2) {
      for (int i = 0; i < N; i += 2 * width) t[i] += t[i + width];
    }
    return t[0];
  }
  float hmax() const {
    float m = v[0];
    for (int i = 1; i < N; ++i) m = m > v[i] ? m : v[i];
    return m;
  }
  // out[0..3] = a.sum(), b.sum(), c.sum(), d.sum().
  static void sum4(const ArrayVec& a, const ArrayVec& b, const ArrayVec& c, const ArrayVec& d, float* out) {
    out[0] = a.sum();
    out[1] = b.sum();
    out[2] = c.sum();
    out[3] = d.sum();
  }
};

#ifdef KVFORGE_NATIVE_VEC
// 8 bf16 (bits) as floats: bf16 is the top half of a float32, so widen to 32 bits and shift.
inline __m256 widen_bf16(__m128i bits) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

// [sum(a), sum(b), sum(c), sum(d)] of 8-lane vectors through one tree of horizontal adds
// (about three instructions per sum instead of seven); each sum is
// ((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 + v7)), whatever the other inputs hold.
inline __m128 sum4_lanes8(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}
#endif

// float8 codes are widened through float16 bits. e5m2 (sign, 5 exponent, 2 mantissa bits,
// bias 15) is exactly the top byte of a float16. e4m3fn (sign, 4 exponent, 3 mantissa bits,
// bias 7) placed as sign | 0eeee | mmm0000000 is a float16 worth 2^-8 of its value, normal
// and subnormal alike (the exponent bias differs by 8); hence the x 256. The one NaN code of
// e4m3fn would read as 480: callers store finite rows (cache/full/fp8.py scales them).
#if defined(__AVX512F__)
// 16 bf16 (bits) as floats.
inline __m512 widen_bf16(__m256i bits) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

struct NativeVec {
  static constexpr int64_t kLanes = 16;
  __m512 v;
  static NativeVec zero() { return {_mm512_setzero_ps()}; }
  static NativeVec broadcast(float x) { return {_mm512_set1_ps(x)}; }
  static NativeVec load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static NativeVec load(const c10::BFloat16* p) {
    return {widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
  }
  static NativeVec load(const c10::Half* p) {
    return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
  }
  static NativeVec load(const c10::Float8_e5m2* p) {
    const __m256i wide = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return {_mm512_cvtph_ps(_mm256_slli_epi16(wide, 8))};
  }
  static NativeVec load(const c10::Float8_e4m3fn* p) {
    const __m256i wide = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(wide, _mm256_set1_epi16(0x80)), 8);
    const __m256i rest = _mm256_slli_epi16(_mm256_and_si256(wide, _mm256_set1_epi16(0x7F)), 7);
    return {_mm512_mul_ps(_mm512_cvtph_ps(_mm256_or_si256(sign, rest)), _mm512_set1_ps(256.f))};
  }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  static NativeVec fmadd(NativeVec a, NativeVec b, NativeVec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
  static NativeVec mul(NativeVec a, NativeVec b) { return {_mm512_mul_ps(a.v, b.v)}; }
  static NativeVec add(NativeVec a, NativeVec b) { return {_mm512_add_ps(a.v, b.v)}; }
  static NativeVec sub(NativeVec a, NativeVec b) { return {_mm512_sub_ps(a.v, b.v)}; }
  static NativeVec max(NativeVec a, NativeVec b) { return {_mm512_max_ps(a.v, b.v)}; }
  // The scalar exp_nonpositive's algorithm with every multiply-add fused as written (the
  // scalar form is fused as the compiler contracts it: they may differ in the last bit).
  static NativeVec exp_nonpositive(NativeVec x) {
    const __m512 v = _mm512_max_ps(x.v, _mm512_set1_ps(-87.0f));
    const __m512 magic = _mm512_fmadd_ps(v, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(12582912.0f));
    const __m512 k = _mm512_sub_ps(magic, _mm512_set1_ps(12582912.0f));
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), v);
    r = _mm512_fmadd_ps(k, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 poly = _mm512_set1_ps(1.9875691500e-4f);
    poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(1.3981999507e-3f));
    poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(8.3334519073e-3f));
    poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(4.1665795894e-2f));
    poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(1.6666665459e-1f));
    poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(5.0000001201e-1f));
    poly = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(poly, r), r, r), _mm512_set1_ps(1.0f));
    const __m512i exponent = _mm512_slli_epi32(
        _mm512_add_epi32(_mm512_castps_si512(magic), _mm512_set1_epi32(127 - 0x4B400000)), 23);
    return {_mm512_mul_ps(poly, _mm512_castsi512_ps(exponent))};
  }
  float sum() const { return _mm512_reduce_add_ps(v); }
  float hmax() const { return _mm512_reduce_max_ps(v); }
  // Lane i + lane i + 8: the 16 lanes folded to 8.
  static __m256 fold(__m512 x) {
    return _mm256_add_ps(_mm512_castps512_ps256(x),
                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
  }
  static void sum4(NativeVec a, NativeVec b, NativeVec c, NativeVec d, float* out) {
    _mm_storeu_ps(out, sum4_lanes8(fold(a.v), fold(b.v), fold(c.v), fold(d.v)));
  }
};
#elif defined(KVFORGE_NATIVE_VEC)
struct NativeVec {
  static constexpr int64_t kLanes = 8;
  __m256 v;
  static NativeVec zero() { return {_mm256_setzero_ps()}; }
  static NativeVec broadcast(float x) { return {_mm256_set1_ps(x)}; }
  static NativeVec load(const float* p) { return {_mm256_loadu_ps(p)}; }
  static NativeVec load(const c10::BFloat16* p) {
    return {widen_bf16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))};
  }
  static NativeVec load(const c10::Half* p) {
    return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))};
  }
  static NativeVec load(const c10::Float8_e5m2* p) {
    const __m128i wide = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    return {_mm256_cvtph_ps(_mm_slli_epi16(wide, 8))};
  }
  static NativeVec load(const c10::Float8_e4m3fn* p) {
    const __m128i wide = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m128i sign = _mm_slli_epi16(_mm_and_si128(wide, _mm_set1_epi16(0x80)), 8);
    const __m128i rest = _mm_slli_epi16(_mm_and_si128(wide, _mm_set1_epi16(0x7F)), 7);
    return {_mm256_mul_ps(_mm256_cvtph_ps(_mm_or_si128(sign, rest)), _mm256_set1_ps(256.f))};
  }
  void store(float* p) const { _mm256_storeu_ps(p, v); }
  static NativeVec fmadd(NativeVec a, NativeVec b, NativeVec c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
  static NativeVec mul(NativeVec a, NativeVec b) { return {_mm256_mul_ps(a.v, b.v)}; }
  static NativeVec add(NativeVec a, NativeVec b) { return {_mm256_add_ps(a.v, b.v)}; }
  static NativeVec sub(NativeVec a, NativeVec b) { return {_mm256_sub_ps(a.v, b.v)}; }
  static NativeVec max(NativeVec a, NativeVec b) { return {_mm256_max_ps(a.v, b.v)}; }
  // As the 16-lane exp_nonpositive.
  static NativeVec exp_nonpositive(NativeVec x) {
    const __m256 v = _mm256_max_ps(x.v, _mm256_set1_ps(-87.0f));
    const __m256 magic = _mm256_fmadd_ps(v, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(12582912.0f));
    const __m256 k = _mm256_sub_ps(magic, _mm256_set1_ps(12582912.0f));
    __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), v);
    r = _mm256_fmadd_ps(k, _mm256_set1_ps(2.12194440e-4f), r);
    __m256 poly = _mm256_set1_ps(1.9875691500e-4f);
    poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(1.3981999507e-3f));
    poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(8.3334519073e-3f));
    poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(4.1665795894e-2f));
    poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(1.6666665459e-1f));
    poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(5.0000001201e-1f));
    poly = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(poly, r), r, r), _mm256_set1_ps(1.0f));
    const __m256i exponent = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_castps_si256(magic), _mm256_set1_epi32(127 - 0x4B400000)), 23);
    return {_mm256_mul_ps(poly, _mm256_castsi256_ps(exponent))};
  }
  float sum() const {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_shuffle_ps(x, x, 1));
    return _mm_cvtss_f32(x);
  }
  float hmax() const {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    x = _mm_max_ss(x, _mm_shuffle_ps(x, x, 1));
    return _mm_cvtss_f32(x);
  }
  static void sum4(NativeVec a, NativeVec b, NativeVec c, NativeVec d, float* out) {
    _mm_storeu_ps(out, sum4_lanes8(a.v, b.v, c.v, d.v));
  }
};
#endif

// a . b over dim floats (a multiple of V::kLanes) with Chains (2 or 4) independent
// accumulators to hide the FMA latency; steps past the last whole round go to the first one.
// Each chain count is written out whole: a shared body (an array of accumulators, or chains
// 3 and 4 under an `if constexpr`) changed what GCC emitted around it, spilling more and,
// in ArrayVec<1> code built without -ffp-contract=off, fusing other multiply-adds.
template <typename V, int Chains>
inline float dot(const float* a, const float* b, int64_t dim) {
  static_assert(Chains == 2 || Chains == 4, "dot keeps two or four accumulator chains");
  constexpr int64_t L = V::kLanes;
  if constexpr (Chains == 4) {
    V s0 = V::zero(), s1 = V::zero(), s2 = V::zero(), s3 = V::zero();
    int64_t d = 0;
    for (; d + 4 * L <= dim; d += 4 * L) {
      s0 = V::fmadd(V::load(a + d), V::load(b + d), s0);
      s1 = V::fmadd(V::load(a + d + L), V::load(b + d + L), s1);
      s2 = V::fmadd(V::load(a + d + 2 * L), V::load(b + d + 2 * L), s2);
      s3 = V::fmadd(V::load(a + d + 3 * L), V::load(b + d + 3 * L), s3);
    }
    for (; d < dim; d += L) s0 = V::fmadd(V::load(a + d), V::load(b + d), s0);
    return V::add(V::add(s0, s1), V::add(s2, s3)).sum();
  } else {
    V s0 = V::zero(), s1 = V::zero();
    int64_t d = 0;
    for (; d + 2 * L <= dim; d += 2 * L) {
      s0 = V::fmadd(V::load(a + d), V::load(b + d), s0);
      s1 = V::fmadd(V::load(a + d + L), V::load(b + d + L), s1);
    }
    for (; d < dim; d += L) s0 = V::fmadd(V::load(a + d), V::load(b + d), s0);
    return V::add(s0, s1).sum();
  }
}

// out[i] = q . rows[i] for four rows (dim a multiple of V::kLanes): q is loaded once for the
// four, one accumulator per row, and the four horizontal sums are done together (V::sum4).
template <typename V>
inline void dot4(const float* q, const float* const* rows, int64_t dim, float* out) {
  constexpr int64_t L = V::kLanes;
  V s0 = V::zero(), s1 = V::zero(), s2 = V::zero(), s3 = V::zero();
  for (int64_t d = 0; d < dim; d += L) {
    const V x = V::load(q + d);
    s0 = V::fmadd(x, V::load(rows[0] + d), s0);
    s1 = V::fmadd(x, V::load(rows[1] + d), s1);
    s2 = V::fmadd(x, V::load(rows[2] + d), s2);
    s3 = V::fmadd(x, V::load(rows[3] + d), s3);
  }
  V::sum4(s0, s1, s2, s3, out);
}

// The largest of x[0..n), n >= 1.
inline float max_of(const float* x, int64_t n) {
  float top = x[0];
#pragma omp simd reduction(max : top)
  for (int64_t i = 1; i < n; ++i) top = top > x[i] ? top : x[i];
  return top;
}

inline float sum_of(const float* x, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += x[i];
  return sum;
}

// a . b for any n.
inline float dot_simd_reduction(const float* a, const float* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

}  // namespace kvforge_simd

#undef KVFORGE_SIMD_EXP_NONPOSITIVE
