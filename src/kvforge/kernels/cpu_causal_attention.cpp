// C++ source of the causal prefill attention CPU kernel, bf16 and float32 (see
// cpu_causal_attention.py).
//
//   causal_attention(q [n, heads, D], k [kv_heads, m, D], v [kv_heads, m, D], scale)
//     -> (out [n, heads, D] in q's dtype, lse [heads, n] float32)
//   Query i sits at key position i + m - n and sees keys j <= i + m - n (a prefill chunk
//   that is the last n of m keys; n == m is a whole prompt). Query head h reads kv head
//   h / (heads / kv_heads) (grouped-query attention, no copy of K/V per query head).
//   lse = log sum_j exp(scale * q.k_j) over the visible keys, for merging partial attentions.
//
// The loops are written once over the element type (`Bf16`, `Float32` below: how a pair of
// dims or keys is loaded, multiplied and stored).
//
// Arithmetic, block by block (flash attention), for bf16: scores s are bf16 x bf16 products
// summed in float32 by AVX512-BF16 `vdpbf16ps` (each product is exact in float32; the sums
// round). Per query row an online softmax over 64-key blocks keeps the running max m of s and
// the sum l in float32; a block's weights p = exp(scale (s - m)), computed as 2^(s c - m c) with
// c = scale log2(e) (one fused multiply-subtract per lane, then a base-2 exponential: half the
// work of a base-e one), are rounded to bf16 once, and those rounded weights are both what
// multiplies V (again by `vdpbf16ps`, into float32 accumulators) and what l sums, so the
// output is exactly a convex combination of value rows with the weights actually used. The
// output is rounded to bf16 once. This is the precision of ATen's bf16 flash attention
// (float32 softmax, bf16 weights into the value product).
//
// For float32 the same softmax, with float32 FMAs for both products and float32 weights (l
// sums exactly the weights that multiply V), and one difference in the order of sums: the
// score of 64 dims and the value sum of one 64-key block each start from fresh registers and
// are then added to the running sum (the scores' in s, the output's after its correction).
// A 2,000-key row's output then carries the rounding of ~64 + 2,000/64 additions instead of
// 2,000 (ATen's GEMMs block their sums too); bf16 keeps its single running sums, whose
// rounding hides under bf16's. tests/kernels/test_cpu_causal_attention.py and
// test_cpu_causal_attention_float32.py compare both dtypes with ATen against a float64
// definition.
//
// INVARIANTS:
// - every key block a row reads holds at least one visible key for it in block 0 (key 0
//   is visible to every query), so m is finite after the first block and a fully masked
//   later block only multiplies by 1 and adds 0;
// - masked and padding keys get weight exactly 0 (masked, not exp(-87)), and padding
//   rows of the packed K/V are zero, so they add nothing and no NaN can enter;
// - one (query head, 64-row block) unit is computed by one thread, in a fixed key order,
//   so results do not depend on the thread count.
//
// bf16 needs AVX512-BF16 (Zen 4, Sapphire Rapids and later), float32 AVX-512F; built
// without them the kernel compiles to `supported() == false` (bf16) and
// `supported_float32() == false`, and the Python wrapper falls back to ATen.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

#include "cpu_avx512_softmax.h"  // defines KVFORGE_AVX512_SOFTMAX with AVX-512F
#include "cpu_bf16_attention.h"  // defines KVFORGE_BF16_DOT with AVX512-BF16

namespace {

bool supported() {  // the bf16 kernel
#ifdef KVFORGE_BF16_DOT
  return true;
#else
  return false;
#endif
}

bool supported_float32() {
#ifdef KVFORGE_AVX512_SOFTMAX
  return true;
#else
  return false;
#endif
}

#ifdef KVFORGE_AVX512_SOFTMAX

constexpr int64_t kQueryBlock = 64;  // query rows per work unit
constexpr int64_t kKeyBlock = 64;    // keys per online-softmax update: four 16-key groups
constexpr int kScoreRows = 8;        // rows per score micro-kernel: 8 x 2 accumulators
constexpr int kValueRows = 6;        // rows per value micro-kernel: 6 x 4 accumulators (64 dims)

constexpr int kSoftmaxRows = 8;     // rows per online-softmax update (one 8-lane fold)
constexpr int64_t kSumBlock = 64;   // kBlockSums: dim words summed in registers before the running sum
static_assert(kQueryBlock % kSoftmaxRows == 0, "a unit's scratch holds whole softmax row groups");

// The element type's arithmetic; the loops below are written once over it. A "word" is what
// one 32-bit lane holds: two bf16 (two dims of a query or key row; two keys' weights or
// values) or one float32 (one dim; one key).
#ifdef KVFORGE_BF16_DOT
struct Bf16 {
  using Elem = uint16_t;    // q, k, v and out
  using Word = uint32_t;
  using Weight = uint16_t;  // softmax weights p
  using Vec = __m512i;      // 16 words
  static constexpr int64_t kPerWord = 2;
  static constexpr bool kBlockSums = false;  // single running sums (see the header comment)
  static Vec load(const Word* p) { return _mm512_loadu_si512(p); }
  static Vec broadcast(Word w) { return _mm512_set1_epi32(static_cast<int>(w)); }
  // acc + a . b over bf16 pairs (vdpbf16ps: exact products, float32 sums)
  static __m512 multiply_add(__m512 acc, Vec a, Vec b) { return kvforge_bf16::dot_pairs(acc, a, b); }
  // Stores the weights e rounded to bf16 once; returns what l sums: the rounded weights, the
  // ones the value product uses.
  static __m512 store_weights(Weight* p, __m512 e) {
    const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), rounded);
    return kvforge_simd::widen_bf16(rounded);
  }
  static void store_out(Elem* dst, __m512 o) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(o));
  }
};
#endif

struct Float32 {
  using Elem = float;
  using Word = float;
  using Weight = float;
  using Vec = __m512;
  static constexpr int64_t kPerWord = 1;
  static constexpr bool kBlockSums = true;  // sums of 64 dims / 64 keys, then the running sum
  static Vec load(const Word* p) { return _mm512_loadu_ps(p); }
  static Vec broadcast(Word w) { return _mm512_set1_ps(w); }
  // acc + a b rounded once (FMA)
  static __m512 multiply_add(__m512 acc, Vec a, Vec b) { return _mm512_fmadd_ps(a, b, acc); }
  // The weights stay float32: l sums exactly the ones the value product uses.
  static __m512 store_weights(Weight* p, __m512 e) {
    _mm512_storeu_ps(p, e);
    return e;
  }
  static void store_out(Elem* dst, __m512 o) { _mm512_storeu_ps(dst, o); }
};

// One row-major 2-D view of rows whose dims are contiguous: row i at data + i * stride.
template <typename E>
struct Rows {
  const E* data;
  int64_t stride;  // elements
};

// K of one kv head as 16-key groups of words: word (g, dw, t) holds dim word dw (dims 2dw,
// 2dw+1 for bf16, dim dw for float32) of key 16g + t, so one 64-byte load gives one dim word
// of 16 keys. Keys >= m are zero.
template <typename T>
void pack_keys(Rows<typename T::Elem> k, int64_t m, int64_t dim, int64_t groups, typename T::Word* out) {
  using Word = typename T::Word;
  const int64_t dwords = dim / T::kPerWord;
  for (int64_t g = 0; g < groups; ++g) {
    Word* block = out + g * dwords * 16;
    for (int64_t t = 0; t < 16; ++t) {
      const int64_t key = g * 16 + t;
      const auto* row = reinterpret_cast<const Word*>(k.data + key * k.stride);
      for (int64_t dw = 0; dw < dwords; ++dw) block[dw * 16 + t] = key < m ? row[dw] : Word{0};
    }
  }
}

#ifdef KVFORGE_BF16_DOT
// bf16 V of one kv head as key pairs: word (jp, d) holds (V[2jp][d], V[2jp+1][d]), so one
// 64-byte load gives 16 dims of two keys. Keys >= m are zero.
void pack_values(Rows<uint16_t> v, int64_t m, int64_t dim, int64_t pairs, uint32_t* out) {
  for (int64_t jp = 0; jp < pairs; ++jp) {
    const int64_t j0 = 2 * jp, j1 = j0 + 1;
    const uint16_t* r0 = v.data + j0 * v.stride;
    const uint16_t* r1 = v.data + j1 * v.stride;
    uint32_t* row = out + jp * dim;
    for (int64_t d = 0; d < dim; ++d) {
      const uint32_t lo = j0 < m ? r0[d] : 0u, hi = j1 < m ? r1[d] : 0u;
      row[d] = lo | (hi << 16);
    }
  }
}
#endif

// float32 V of one kv head as contiguous rows, keys >= m zero (a padding key's weight is 0,
// and a zero row keeps whatever lies past the tensor out of the sums).
void pack_values(Rows<float> v, int64_t m, int64_t dim, int64_t keys, float* out) {
  for (int64_t j = 0; j < keys; ++j) {
    float* row = out + j * dim;
    for (int64_t d = 0; d < dim; ++d) row[d] = j < m ? v.data[j * v.stride + d] : 0.f;
  }
}

// s[r][0:32] = q_r . keys of two 16-key groups, for R query rows (q as words); unscaled (the
// softmax applies the scale inside its exponent). With kBlockSums in chunks of kSumBlock dim
// words, each summed from 0 and added to s.
template <typename T, int R>
inline void score_rows(const typename T::Word* q, int64_t q_stride, const typename T::Word* keys, int64_t dwords,
                       float* s, int64_t s_stride) {
  const typename T::Word* keys1 = keys + dwords * 16;
  const int64_t chunk = T::kBlockSums ? kSumBlock : dwords;  // dim words summed in registers at a time
  for (int64_t c0 = 0; c0 < dwords; c0 += chunk) {
    __m512 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t dw = c0; dw < c0 + chunk; ++dw) {
      const auto k0 = T::load(keys + dw * 16), k1 = T::load(keys1 + dw * 16);
      for (int r = 0; r < R; ++r) {
        const auto b = T::broadcast(q[r * q_stride + dw]);
        acc[r][0] = T::multiply_add(acc[r][0], k0, b);
        acc[r][1] = T::multiply_add(acc[r][1], k1, b);
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int h = 0; h < 2; ++h) {
        float* dst = s + r * s_stride + 16 * h;
        _mm512_storeu_ps(dst, c0 == 0 ? acc[r][h] : _mm512_add_ps(_mm512_loadu_ps(dst), acc[r][h]));
      }
    }
  }
}

// Online softmax of kSoftmaxRows rows over one key block (their kKeyBlock unscaled scores
// each, row i at s + i * kKeyBlock): row i sees keys j <= limit + i of the block, the rest get
// weight exactly 0. Writes the weights p (row-major like s; bf16 or float32 as T says),
// updates each row's running max m (of unscaled scores) and sum l (of the stored weights), and
// stores in `correction` the factor by which each row's accumulator must be scaled. Eight rows
// at a time so that their block maxima, their corrections and their sums each take one vector
// operation (maxes8/sums8 fold 8 rows' lanes at once) instead of a horizontal reduction and a
// scalar exp per row.
// INVARIANT: every row sees at least one key of the block (limit >= 0), so m is finite
// afterwards; a first block's correction is 2^-126 (m was -inf), multiplied into an
// accumulator and a sum that are still 0.
template <typename T, bool kAllVisible>
inline void softmax_rows8(const float* s, int64_t limit, float c, float* m, float* l, float* correction,
                          typename T::Weight* p) {
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __mmask16 visible[kSoftmaxRows][4];
  __m512 row_max[kSoftmaxRows];
  for (int i = 0; i < kSoftmaxRows; ++i) {
    const __m512i last = _mm512_set1_epi32(static_cast<int>(std::min<int64_t>(limit + i, kKeyBlock)));
    row_max[i] = minus_inf;
    for (int v = 0; v < 4; ++v) {
      visible[i][v] = kAllVisible ? __mmask16(0xFFFF)
                                  : _mm512_cmple_epi32_mask(_mm512_add_epi32(lane, _mm512_set1_epi32(16 * v)), last);
      row_max[i] = _mm512_mask_max_ps(row_max[i], visible[i][v], row_max[i], _mm512_loadu_ps(s + i * kKeyBlock + 16 * v));
    }
  }
  const __m256 old_max = _mm256_loadu_ps(m);
  const __m256 new_max = _mm256_max_ps(old_max, kvforge_avx512::maxes8(row_max));
  const __m512 cc = _mm512_set1_ps(c);
  // exp(scale (old - new)) = 2^(c old - c new), 8 lanes in use (the upper 8 are discarded)
  const __m512 drop = _mm512_castps256_ps512(_mm256_sub_ps(old_max, new_max));
  const __m256 corr = _mm512_castps512_ps256(kvforge_avx512::exp2_nonpositive16(_mm512_mul_ps(drop, cc)));
  _mm256_storeu_ps(m, new_max);
  _mm256_storeu_ps(correction, corr);
  alignas(32) float shifted[kSoftmaxRows];
  _mm256_store_ps(shifted, _mm256_mul_ps(new_max, _mm256_set1_ps(c)));
  __m512 sums[kSoftmaxRows];
  for (int i = 0; i < kSoftmaxRows; ++i) {
    const __m512 shift = _mm512_set1_ps(shifted[i]);
    sums[i] = _mm512_setzero_ps();
    for (int v = 0; v < 4; ++v) {
      const __m512 y = _mm512_fmsub_ps(_mm512_loadu_ps(s + i * kKeyBlock + 16 * v), cc, shift);
      const __m512 e = _mm512_maskz_mov_ps(visible[i][v], kvforge_avx512::exp2_nonpositive16(y));
      sums[i] = _mm512_add_ps(sums[i], T::store_weights(p + i * kKeyBlock + 16 * v, e));
    }
  }
  _mm256_storeu_ps(l, _mm256_fmadd_ps(_mm256_loadu_ps(l), corr, kvforge_avx512::sums8(sums)));
}

// o[r][0:64] = o[r] * correction[r] + sum_jw p[r] word jw . value word row jw, for R rows: p
// holds the weights read as words (two keys' bf16 weights, or one key's float32), `values` the
// packed rows (key pairs or keys) at dim offset d0. With kBlockSums the block's sum starts at 0
// and is added to o[r] * correction[r] at the end; without, it starts from that product.
template <typename T, int R>
inline void value_rows(const typename T::Word* p, int64_t p_stride, const typename T::Word* values, int64_t dim,
                       int64_t words, const float* correction, float* o, int64_t o_stride) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r) {
    const __m512 c = _mm512_set1_ps(correction[r]);
    for (int i = 0; i < 4; ++i) {
      acc[r][i] = T::kBlockSums ? _mm512_setzero_ps() : _mm512_mul_ps(_mm512_loadu_ps(o + r * o_stride + 16 * i), c);
    }
  }
  for (int64_t jw = 0; jw < words; ++jw) {
    const typename T::Word* row = values + jw * dim;
    const auto v0 = T::load(row), v1 = T::load(row + 16);
    const auto v2 = T::load(row + 32), v3 = T::load(row + 48);
    for (int r = 0; r < R; ++r) {
      const auto b = T::broadcast(p[r * p_stride + jw]);
      acc[r][0] = T::multiply_add(acc[r][0], v0, b);
      acc[r][1] = T::multiply_add(acc[r][1], v1, b);
      acc[r][2] = T::multiply_add(acc[r][2], v2, b);
      acc[r][3] = T::multiply_add(acc[r][3], v3, b);
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m512 c = _mm512_set1_ps(correction[r]);
    for (int i = 0; i < 4; ++i) {
      float* dst = o + r * o_stride + 16 * i;
      _mm512_storeu_ps(dst, T::kBlockSums ? _mm512_fmadd_ps(_mm512_loadu_ps(dst), c, acc[r][i]) : acc[r][i]);
    }
  }
}

// Calls fn(first_row, std::integral_constant<int, R'>) over `rows` in tiles of R rows, then
// one tile of the remainder (R' < R): the micro-kernels' row counts are compile-time.
template <int R, typename Fn>
inline void row_tiles(int64_t rows, Fn&& fn) {
  static_assert(R <= 8, "row_tiles handles remainders below 8");
  int64_t r = 0;
  for (; r + R <= rows; r += R) fn(r, std::integral_constant<int, R>{});
  const int64_t rest = rows - r;
  auto tail = [&](auto n_) {
    if constexpr (decltype(n_)::value < R) {
      if (rest == decltype(n_)::value) fn(r, n_);
    }
  };
  tail(std::integral_constant<int, 1>{});
  tail(std::integral_constant<int, 2>{});
  tail(std::integral_constant<int, 3>{});
  tail(std::integral_constant<int, 4>{});
  tail(std::integral_constant<int, 5>{});
  tail(std::integral_constant<int, 6>{});
  tail(std::integral_constant<int, 7>{});
}

template <typename T>
struct Problem {
  int64_t n, m, heads, kv_heads, dim, offset;  // offset = m - n: query i is key position i + offset
  float scale;
  const typename T::Elem* q;
  int64_t q_row_stride, q_head_stride;  // elements
  int64_t padded;                        // keys rounded up to kKeyBlock
  const typename T::Word *keys, *values;  // packed, per kv head: padded * dim / kPerWord words each
  typename T::Elem* out;                  // [n, heads, dim]
  float* lse;                             // [heads, n]
};

template <typename T>
struct Scratch {
  std::vector<float> s, o, m, l, correction;
  std::vector<typename T::Weight> p;
  explicit Scratch(int64_t dim)
      : s(kQueryBlock * kKeyBlock),
        o(kQueryBlock * dim),
        m(kQueryBlock),
        l(kQueryBlock),
        correction(kQueryBlock),
        p(kQueryBlock * kKeyBlock) {}
};

template <typename T>
void run_unit(const Problem<T>& pr, int64_t head, int64_t query_block, Scratch<T>& w) {
  using Word = typename T::Word;
  constexpr int64_t kBlockWords = kKeyBlock / T::kPerWord;  // one row's weights of a key block, in words
  const int64_t dim = pr.dim, dwords = dim / T::kPerWord, group = pr.heads / pr.kv_heads, kv_head = head / group;
  const int64_t q0 = query_block * kQueryBlock, rows = std::min(kQueryBlock, pr.n - q0);
  const int64_t key_blocks = (q0 + rows - 1 + pr.offset) / kKeyBlock + 1;  // through the last row's last key
  const Word* keys = pr.keys + kv_head * pr.padded * dwords;
  const Word* values = pr.values + kv_head * pr.padded * dwords;
  const auto* q = reinterpret_cast<const Word*>(pr.q + q0 * pr.q_row_stride + head * pr.q_head_stride);
  const int64_t q_stride = pr.q_row_stride / T::kPerWord;  // words
  std::fill(w.o.begin(), w.o.begin() + rows * dim, 0.f);
  std::fill(w.m.begin(), w.m.end(), -std::numeric_limits<float>::infinity());
  std::fill(w.l.begin(), w.l.end(), 0.f);
  const auto* p_words = reinterpret_cast<const Word*>(w.p.data());
  const float c = pr.scale * 1.44269504088896341f;  // scale log2(e): exp(scale x) = 2^(c x)
  for (int64_t kb = 0; kb < key_blocks; ++kb) {
    const Word* block_keys = keys + kb * kKeyBlock * dwords;
    for (int64_t half = 0; half < 2; ++half) {  // keys [32 half, 32 half + 32) of the block
      row_tiles<kScoreRows>(rows, [&](int64_t r0, auto r_) {
        score_rows<T, decltype(r_)::value>(q + r0 * q_stride, q_stride, block_keys + half * 32 * dwords, dwords,
                                           w.s.data() + r0 * kKeyBlock + half * 32, kKeyBlock);
      });
    }
    const int64_t first_key = kb * kKeyBlock;
    // Whole groups of 8 rows: rows past `rows` are scratch (finite scores, never stored).
    for (int64_t r = 0; r < rows; r += kSoftmaxRows) {
      const int64_t limit = q0 + r + pr.offset - first_key;
      // every key of the block visible to the 8 rows: no masks
      const auto softmax = limit >= kKeyBlock - 1 ? softmax_rows8<T, true> : softmax_rows8<T, false>;
      softmax(w.s.data() + r * kKeyBlock, limit, c, w.m.data() + r, w.l.data() + r, w.correction.data() + r,
              w.p.data() + r * kKeyBlock);
    }
    const Word* block_values = values + kb * kBlockWords * dim;
    for (int64_t d0 = 0; d0 < dim; d0 += 64) {
      row_tiles<kValueRows>(rows, [&](int64_t r0, auto r_) {
        value_rows<T, decltype(r_)::value>(p_words + r0 * kBlockWords, kBlockWords, block_values + d0, dim,
                                           kBlockWords, w.correction.data() + r0, w.o.data() + r0 * dim + d0, dim);
      });
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 inv = _mm512_set1_ps(1.f / w.l[r]);
    typename T::Elem* dst = pr.out + ((q0 + r) * pr.heads + head) * dim;
    for (int64_t d = 0; d < dim; d += 16) {
      T::store_out(dst + d, _mm512_mul_ps(_mm512_loadu_ps(w.o.data() + r * dim + d), inv));
    }
    pr.lse[head * pr.n + q0 + r] = pr.scale * w.m[r] + std::log(w.l[r]);
  }
}

// Packs K and V per kv head, then runs the (query head, 64-row block) units.
template <typename T>
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale, at::Tensor& out,
         at::Tensor& lse) {
  using Elem = typename T::Elem;
  using Word = typename T::Word;
  const int64_t n = q.size(0), heads = q.size(1), dim = q.size(2), kv_heads = k.size(0), m = k.size(1);
  const int64_t padded = (m + kKeyBlock - 1) / kKeyBlock * kKeyBlock, dwords = dim / T::kPerWord;
  std::vector<Word> keys(kv_heads * padded * dwords), values(kv_heads * padded * dwords);
  const auto* kd = reinterpret_cast<const Elem*>(k.data_ptr());
  const auto* vd = reinterpret_cast<const Elem*>(v.data_ptr());
  at::parallel_for(0, 2 * kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t h = i / 2;
      if (i % 2 == 0) {
        pack_keys<T>({kd + h * k.stride(0), k.stride(1)}, m, dim, padded / 16, keys.data() + h * padded * dwords);
      } else {
        pack_values(Rows<Elem>{vd + h * v.stride(0), v.stride(1)}, m, dim, padded / T::kPerWord,
                    values.data() + h * padded * dwords);
      }
    }
  });
  const Problem<T> pr{n, m, heads, kv_heads, dim, m - n, static_cast<float>(scale),
                      reinterpret_cast<const Elem*>(q.data_ptr()), q.stride(0), q.stride(1), padded,
                      keys.data(), values.data(), reinterpret_cast<Elem*>(out.data_ptr()), lse.data_ptr<float>()};
  // Units (query head, 64-row block) from a shared counter, latest blocks (most keys) first,
  // so two threads finish together whatever the causal triangle's imbalance.
  const int64_t query_blocks = (n + kQueryBlock - 1) / kQueryBlock, units = query_blocks * heads;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), units), 1, [&](int64_t, int64_t) {
    Scratch<T> w(dim);
    for (int64_t u = next++; u < units; u = next++) run_unit(pr, u % heads, query_blocks - 1 - u / heads, w);
  });
}

#endif  // KVFORGE_AVX512_SOFTMAX

std::tuple<at::Tensor, at::Tensor> causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                    double scale) {
  constexpr const char* op = "causal_attention";
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), op, ": CPU tensors only");
  const bool bf16 = q.scalar_type() == at::kBFloat16;
  TORCH_CHECK((bf16 || q.scalar_type() == at::kFloat) && k.scalar_type() == q.scalar_type() &&
                  v.scalar_type() == q.scalar_type(),
              op, ": q, k and v must be bfloat16, or all float32");
  TORCH_CHECK(bf16 ? supported() : supported_float32(), op, ": this build has no ", bf16 ? "AVX512-BF16" : "AVX-512F",
              " (check ", bf16 ? "supported()" : "supported_float32()", " first)");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes(), op,
              ": q must be [n, heads, D], k and v the same [kv_heads, m, D]");
  const int64_t n = q.size(0), heads = q.size(1), dim = q.size(2), kv_heads = k.size(0), m = k.size(1);
  TORCH_CHECK(k.size(2) == dim && dim % 64 == 0, op, ": head dim must match and be a multiple of 64 (got ", dim, ")");
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, op, ": heads (", heads, ") must be a multiple of kv_heads (",
              kv_heads, ")");
  TORCH_CHECK(n >= 1 && m >= n, op, ": need 1 <= n <= m (n = ", n, ", m = ", m, ")");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, op, ": the head dim must be contiguous");
  // bf16 q and k are read as 32-bit pairs
  TORCH_CHECK(!bf16 || (q.stride(0) % 2 == 0 && q.stride(1) % 2 == 0 && k.stride(0) % 2 == 0 && k.stride(1) % 2 == 0 &&
                        reinterpret_cast<uintptr_t>(q.data_ptr()) % 4 == 0 &&
                        reinterpret_cast<uintptr_t>(k.data_ptr()) % 4 == 0),
              op, ": q and k rows must start on 4-byte boundaries (even strides)");
  auto out = at::empty({n, heads, dim}, q.options());
  auto lse = at::empty({heads, n}, q.options().dtype(at::kFloat));
#ifdef KVFORGE_BF16_DOT
  if (bf16) run<Bf16>(q, k, v, scale, out, lse);
#endif
#ifdef KVFORGE_AVX512_SOFTMAX
  if (!bf16) run<Float32>(q, k, v, scale, out, lse);
#endif
  return {out, lse};
}

// The softmax's base-2 exponential on its own (float32 in and out, any shape), so tests can hold
// it to its stated accuracy: through the attention its errors hide under the bf16 rounding.
at::Tensor exp2_nonpositive(const at::Tensor& y) {
  TORCH_CHECK(supported(), "exp2_nonpositive: this build has no AVX512-BF16 (check supported() first)");
  TORCH_CHECK(y.device().is_cpu() && y.scalar_type() == at::kFloat, "exp2_nonpositive: y must be a float32 CPU tensor");
  const at::Tensor x = y.contiguous();
  auto out = at::empty(x.sizes(), x.options());
#ifdef KVFORGE_BF16_DOT
  const float* in = x.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  const int64_t n = x.numel();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 lanes = n - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(dst + i, lanes, kvforge_bf16::exp2_nonpositive16(_mm512_maskz_loadu_ps(lanes, in + i)));
  }
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY(kvforge_cpu_causal, m) {
  m.def("supported() -> bool", &supported);
  m.def("supported_float32() -> bool", &supported_float32);
  m.def("causal_attention(Tensor q, Tensor k, Tensor v, float scale) -> (Tensor, Tensor)");
  m.def("exp2_nonpositive(Tensor y) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvforge_cpu_causal, CPU, m) {
  m.impl("causal_attention", &causal_attention);
  m.impl("exp2_nonpositive", &exp2_nonpositive);
}
