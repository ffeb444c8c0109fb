// C++ source of the CPU KIVI decode attention kernel (see cpu_decode.py).
//
// Registers `torch.ops.kvforge_cpu_kivi.kivi_decode_attention` through TORCH_LIBRARY; only
// ATen/c10 core headers, no pybind11.
//
// Layout (one cache layer; /work/notes/kivi_layout.md): k_codes uint8 [H, P, D, G*b/8] keys
// per channel over a page's G tokens; k_scale/k_zero fp16 [H, P, D]; v_codes uint8
// [H, P, G, D*b/8] values per token over groups of GV channels (GV = G in the paper's
// setting); v_scale/v_zero fp16 [H, P, G, D/GV]; k_res/v_res [S, H, R, D] (f32/bf16/f16),
// token t at offset t % R of the sequence's slot. Codes are packed low bits first, 8/b per
// byte. Optional sinks (`kivi:sinks=N`): k_sink/v_sink [S, H, N, D] in the residual dtype,
// token t < N at index t of its slot; those tokens are read from there only (hidden from
// the pages, the ring and the residual).
// Optional RoPE tables (`kivi:key_space=pre_rope`): rope_cos/rope_sin float32 [D/2, T],
// channel-major, the layer's cos/sin of angle position * inv_freq[i] for positions < T. Then
// every stored key (page, ring, sink) is pre-RoPE and is rotated at its token's position
// after dequantisation (rotate-half pairs (i, i + D/2)); k_self is the attention key already.
//
// For a sequence holding n tokens: nk = (n / R) * R, nv = max(0, n - R); stored token t in
// [visible_from, n) is visible; its key is quantised iff t < nk, its value iff t < nv.
// page_table row b lists the pages of tokens [first_page_position[b], nk).
//
// How the work is shaped (the reasons behind the structure below):
// - Codes are never unpacked into memory: a vector of L consecutive codes is unpacked in
//   registers (broadcast a word, variable shift, then a 16-entry table lookup or mask and
//   int->float) and fed straight to the FMAs of every query head of the kv group, so one
//   unpack serves all of them. Keys are packed along tokens, so lanes are tokens of a
//   page and the page's scores stay in registers across the channel loop; values are
//   packed along channels, so lanes are channels and a block of the [heads, D]
//   accumulator stays in registers across the page's tokens.
// - Keys use the pre-scaling algebra: q.k_hat(t) = sum_c q_c zero_c + sum_c (q_c scale_c)
//   code(t, c), q scaled once per page, so a key code costs one FMA per head. Values are
//   dequantised in registers, once per vector for all heads: with the table lookup the
//   table holds code * scale + zero of the (token, channel group) and costs nothing more;
//   without it one FMA per vector.
// - Pages are scattered in the pool, so the hardware prefetcher cannot follow them: the
//   six small arrays of each page of the next tile, and the ring rows it will read, are
//   prefetched while a tile runs (without it the kernel was much slower on a store larger
//   than the caches; docs/benchmarks.md, 'Measurements behind design choices'). What
//   remains is bound by FMA throughput: per token and kv head, group * D FMAs for keys and
//   about as many for values, as many as a full-precision kernel does, while reading 3/16
//   of its bytes (2-bit codes).
// - Work units are slices of pages of one (sequence, kv head) pair (split-K, merged by
//   log-sum-exp) so a small batch still keeps every thread busy; threads take units
//   dynamically, so sequences of different lengths do not leave a thread idle.
//
// Invariants relied on (checked on entry): every tensor contiguous; q, k_self, v_self of
// one dtype (float32, or bf16/fp16 widened on entry; the output has their dtype); heads % H == 0; D % G == 0; bits in {2, 4, 8}.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "cpu_checks.h"
#include "cpu_prefetch.h"
#include "cpu_simd.h"  // ArrayVec, NativeVec (KVFORGE_NATIVE_VEC), exp_nonpositive, dot

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

// Tokens scored per softmax update (rounded to whole pages): one rescale of the
// accumulators and one max/sum reduction per tile; the next tile's pages are prefetched
// while one runs. 128 measured faster than 64 on the smollm2 geometry (docs/benchmarks.md,
// 'Measurements behind design choices').
constexpr int64_t kTileTokens = 128;
// A work unit covers at least this many stored tokens, so loading its queries and merging
// its partial state stay cheap next to the unit's work.
constexpr int64_t kMinUnitTokens = 512;
// Query heads handled in one pass over a page's codes; larger GQA groups take several
// passes. Eight keeps the accumulators of a pass within the 32 AVX-512 registers.
constexpr int kMaxHeadsPerPass = 8;

// ---- vectors ----------------------------------------------------------------------------
// The kernel is written once over a vector type V (cpu_simd.h): NativeVec (the widest ISA
// compiled for) or ArrayVec<N> (plain C++; N = 1 handles any group size). Codes<V> unpacks
// packed codes for it: `codes<BITS>(row, first)` returns codes [first, first + lanes) of a
// packed row as floats.
using kvforge_simd::ArrayVec;
using kvforge_simd::dot;
using kvforge_simd::exp_nonpositive;
#ifdef KVFORGE_NATIVE_VEC
using kvforge_simd::NativeVec;
#endif

template <typename V>
struct Codes;

template <int N>
struct Codes<ArrayVec<N>> {
  template <int BITS>
  static constexpr bool kLookup = false;
  template <int BITS>
  static ArrayVec<N> codes(const uint8_t* row, int64_t first) {
    ArrayVec<N> r;
    for (int i = 0; i < N; ++i) {
      const int64_t bit = (first + i) * BITS;
      r.v[i] = static_cast<float>((row[bit >> 3] >> (bit & 7)) & ((1 << BITS) - 1));
    }
    return r;
  }
};

// The first `bytes` (<= 4) bytes at p as a little-endian word.
inline uint32_t word_of(const uint8_t* p, int bytes) {
  uint32_t w = 0;
  std::memcpy(&w, p, bytes);  // exact size: a row's last bytes may end the allocation
  return w;
}

#if defined(__AVX512F__)
template <>
struct Codes<NativeVec> {
  // 16 codes = 32 bits (b=2), 64 bits (b=4) or 128 bits (b=8) starting at a byte boundary.
  // For b < 8, lane i gets the word holding code i shifted so that the code is in its low
  // bits, and a 16-entry table lookup (vpermps reads the low 4 bits of each lane) maps
  // those bits to a float: table[j] = j mod 2^b gives the code itself (no masking, no
  // int->float conversion), table[j] = (j mod 2^b) * scale + zero the dequantised value.
  template <int BITS>
  static constexpr bool kLookup = BITS != 8;
  template <int BITS>
  static __m512i code_bits(const uint8_t* row, int64_t first) {
    const uint8_t* p = row + first * BITS / 8;
    if constexpr (BITS == 2) {
      return _mm512_srlv_epi32(_mm512_set1_epi32(static_cast<int>(word_of(p, 4))),
                               _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0));
    } else {
      uint64_t w;
      std::memcpy(&w, p, 8);
      // Lanes 0-7 take the low word, lanes 8-15 the high word.
      const __m512i words = _mm512_permutexvar_epi32(
          _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0),
          _mm512_castsi128_si512(_mm_cvtsi64_si128(static_cast<long long>(w))));
      return _mm512_srlv_epi32(words, _mm512_set_epi32(28, 24, 20, 16, 12, 8, 4, 0, 28, 24, 20, 16, 12, 8, 4, 0));
    }
  }
  template <int BITS>
  static NativeVec code_table() {
    return {BITS == 2 ? _mm512_set_ps(3, 2, 1, 0, 3, 2, 1, 0, 3, 2, 1, 0, 3, 2, 1, 0)
                      : _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0)};
  }
  template <int BITS>
  static NativeVec lookup(const uint8_t* row, int64_t first, NativeVec table) {
    return {_mm512_permutexvar_ps(code_bits<BITS>(row, first), table.v)};
  }
  template <int BITS>
  static NativeVec codes(const uint8_t* row, int64_t first) {
    if constexpr (BITS == 8) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + first));
      return {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes))};
    } else {
      return lookup<BITS>(row, first, code_table<BITS>());
    }
  }
};
#elif defined(KVFORGE_NATIVE_VEC)
template <>
struct Codes<NativeVec> {
  template <int BITS>
  static constexpr bool kLookup = false;
  // 8 codes = 16 bits (b=2), 32 bits (b=4) or 64 bits (b=8) starting at a byte boundary.
  template <int BITS>
  static NativeVec codes(const uint8_t* row, int64_t first) {
    const uint8_t* p = row + first * BITS / 8;
    if constexpr (BITS == 8) {
      uint64_t w;
      std::memcpy(&w, p, 8);
      return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(w))))};
    } else {
      const __m256i words = _mm256_set1_epi32(static_cast<int>(word_of(p, BITS)));  // 8 * BITS / 8 bytes
      const __m256i shifts = BITS == 2 ? _mm256_set_epi32(14, 12, 10, 8, 6, 4, 2, 0)
                                       : _mm256_set_epi32(28, 24, 20, 16, 12, 8, 4, 0);
      const __m256i codes = _mm256_and_si256(_mm256_srlv_epi32(words, shifts), _mm256_set1_epi32((1 << BITS) - 1));
      return {_mm256_cvtepi32_ps(codes)};
    }
  }
};
#endif

struct Problem {
  int64_t batch, kv_heads, group, dim, g, residual, pages, table_width, slots;
  int64_t gv;     // channels per value group
  int64_t sinks;  // N (0: none)
  const void *k_sink, *v_sink;
  float scale;
  const float *q, *k_self, *v_self;
  const uint8_t *k_codes, *v_codes;
  const c10::Half *k_scale, *k_zero, *v_scale, *v_zero;
  const void *k_res, *v_res;
  at::ScalarType res_dtype;
  int64_t res_row_bytes;  // D * element size of the residual dtype
  const int64_t *page_table, *first, *from, *lengths, *slot_of;
  const float *rope_cos, *rope_sin;  // [D/2, rope_len] channel-major; nullptr: keys stored post-RoPE
  int64_t rope_len;
  bool key_int8;    // key_dot=int8: integer-domain scores of quantised post-RoPE keys
  bool value_int8;  // value_dot=int8: integer-domain sums of quantised values
};

// Page columns [col_begin, col_end) of one (sequence, kv head) pair. with_self: this unit
// also takes the step's own token and the residual tokens [max(nk, lo), n) (exactly one
// unit of each pair does, so the pair's softmax counts them once).
struct Unit {
  int64_t pair, col_begin, col_end;
  bool with_self;
};

// What a pair reads, derived from its sequence's length and visibility. lo: the first
// token read from the pages, the ring or the residual (sink tokens are below it);
// sinks [sink_lo, sink_hi): the visible tokens read from the sink buffers.
struct Span {
  int64_t n, nk, nv, lo, first, slot, sink_lo, sink_hi;
};

Span span_of(const Problem& p, int64_t b) {
  const int64_t n = p.lengths[b], R = p.residual;
  const int64_t first = p.first[b], from = std::max<int64_t>(0, p.from[b]);
  return {n, (n / R) * R, std::max<int64_t>(0, n - R), std::max(std::max(from, first), p.sinks), first,
          p.slot_of[b], from, std::min(n, p.sinks)};
}

// Per-thread buffers, sized once per thread for the problem.
struct Scratch {
  std::vector<float> qs, qsc, zk, scores, sv, zv, rows, kf, sq;
  std::vector<int8_t> q8;  // key_dot=int8: a page's scaled queries as int8 [nh, D]
  std::vector<uint8_t> w8;  // value_dot=int8: a page's weights [nh, D/GV, G] and their steps and zero parts
  std::vector<float> wstep, wzero;
  std::vector<const float*> row_ptrs;
  explicit Scratch(const Problem& p, int64_t tile) {
    const int64_t nh = std::min<int64_t>(p.group, kMaxHeadsPerPass), dim = p.dim;
    qs.resize(nh * dim);
    qsc.resize(nh * dim);
    zk.resize(nh);
    sq.resize(nh);
    q8.resize(nh * dim);
    scores.resize(nh * tile);
    sv.resize(p.g * (dim / p.gv));  // a page's value scales: G tokens x D/GV groups
    w8.resize(nh * (dim / p.gv) * p.g);
    wstep.resize(nh * (dim / p.gv));
    wzero.resize(nh * (dim / p.gv));
    zv.resize(p.g * (dim / p.gv));
    kf.resize(2 * dim);  // a pre-RoPE page's key scales and zeros as floats
    rows.resize(tile * dim);
    row_ptrs.resize(tile);
  }
};

// A float view of a residual row: float32 rows in place, 16-bit rows widened into `buffer`.
template <typename V>
const float* residual_row(const Problem& p, const void* base, int64_t index, float* buffer) {
  const int64_t dim = p.dim;
  switch (p.res_dtype) {
    case at::kFloat:
      return static_cast<const float*>(base) + index * dim;
    case at::kHalf: {
      const c10::Half* src = static_cast<const c10::Half*>(base) + index * dim;
      for (int64_t d = 0; d < dim; d += V::kLanes) V::load(src + d).store(buffer + d);
      return buffer;
    }
    default: {
      const c10::BFloat16* src = static_cast<const c10::BFloat16*>(base) + index * dim;
      for (int64_t d = 0; d < dim; d += V::kLanes) V::load(src + d).store(buffer + d);
      return buffer;
    }
  }
}

// Float views of the residual rows of tokens [t_first, t_first + count) (ring offsets
// t % R from row index `ring`): ptrs[i] for token t_first + i, 16-bit rows widened into
// `buffer` [count, D].
template <typename V>
void residual_rows(const Problem& p, const void* base, int64_t ring, int64_t t_first, int64_t count, float* buffer,
                   const float** ptrs) {
  for (int64_t i = 0; i < count; ++i) {
    ptrs[i] = residual_row<V>(p, base, ring + (t_first + i) % p.residual, buffer + i * p.dim);
  }
}

// acc[g * D + c] += sum_{i in [i0, i1)} prob[g * stride + i] * rows[i][c]: like
// value_accumulate for full-precision rows, a block of NH * KB accumulators in registers
// across the rows (each row read once per block for all heads).
template <typename V, int NH, int KB>
inline void rows_accumulate(const float* prob, int64_t stride, const float* const* rows, int64_t i0, int64_t i1,
                            int64_t dim, float* acc) {
  constexpr int64_t L = V::kLanes;
  for (int64_t j = 0; j < dim; j += KB * L) {
    V a[NH][KB];
    for (int g = 0; g < NH; ++g) {
      for (int k = 0; k < KB; ++k) a[g][k] = V::load(acc + g * dim + j + k * L);
    }
    for (int64_t i = i0; i < i1; ++i) {
      V y[KB];
      for (int k = 0; k < KB; ++k) y[k] = V::load(rows[i] + j + k * L);
      for (int g = 0; g < NH; ++g) {
        const V w = V::broadcast(prob[g * stride + i]);
        for (int k = 0; k < KB; ++k) a[g][k] = V::fmadd(w, y[k], a[g][k]);
      }
    }
    for (int g = 0; g < NH; ++g) {
      for (int k = 0; k < KB; ++k) a[g][k].store(acc + g * dim + j + k * L);
    }
  }
}

template <typename V, int NH>
inline void rows_accumulate(const float* prob, int64_t stride, const float* const* rows, int64_t i0, int64_t i1,
                            int64_t dim, float* acc) {
  if ((dim / V::kLanes) % 2 == 0) {
    rows_accumulate<V, NH, 2>(prob, stride, rows, i0, i1, dim, acc);
  } else {
    rows_accumulate<V, NH, 1>(prob, stride, rows, i0, i1, dim, acc);
  }
}

// Running softmax state of the NH query heads of one pass (pointers into the unit's
// partial state: m [NH], l [NH], acc [NH * D]).
struct State {
  float *m, *l, *acc;
};

// Softmax update for a tile: scores[g * stride + i], i < n, become probabilities relative
// to the new running max; the first `hidden` entries (tokens before visible_from) become
// exactly 0. Accumulators are rescaled when the max moves. n is a multiple of the vector
// width for quantised tiles (whole pages), so those take the vector loops; residual tiles
// of any length take the scalar ones.
template <typename V>
void update(State& s, float* scores, int64_t stride, int64_t n, int64_t hidden, int nh, int64_t dim) {
  constexpr int64_t L = V::kLanes;
  const bool vector = n % L == 0;
  for (int g = 0; g < nh; ++g) {
    float* row = scores + g * stride;
    for (int64_t i = 0; i < hidden; ++i) row[i] = -std::numeric_limits<float>::infinity();
    float top = s.m[g], sum = 0.f;
    if (vector) {
      V mx = V::broadcast(top);
      for (int64_t i = 0; i < n; i += L) mx = V::max(mx, V::load(row + i));
      top = mx.hmax();
      const V t = V::broadcast(top);
      V total = V::zero();
      for (int64_t i = 0; i < n; i += L) {
        const V e = V::exp_nonpositive(V::sub(V::load(row + i), t));
        e.store(row + i);
        total = V::add(total, e);
      }
      sum = total.sum();
    } else {
      for (int64_t i = 0; i < n; ++i) top = top > row[i] ? top : row[i];
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < n; ++i) {
        row[i] = exp_nonpositive(row[i] - top);
        sum += row[i];
      }
    }
    // Hidden entries came out as e^-87 ~ 1e-38: make them exact zeros.
    for (int64_t i = 0; i < hidden; ++i) {
      sum -= row[i];
      row[i] = 0.f;
    }
    const float correction = std::exp(s.m[g] - top);
    s.l[g] = s.l[g] * correction + sum;
    s.m[g] = top;
    if (correction != 1.f) {
      float* a = s.acc + g * dim;
      const V c = V::broadcast(correction);
      for (int64_t d = 0; d < dim; d += L) V::mul(V::load(a + d), c).store(a + d);
    }
  }
}

// Scores of the G tokens of one page for NH query heads: out[g * stride + i] =
// zk[g] + sum_c qsc[g * D + c] * code(i, c), codes [D, G*b/8]. Lanes are tokens, so each
// unpacked vector of codes feeds the FMAs of all NH heads. With few heads, two accumulator
// sets (even and odd channels) keep enough independent FMA chains in flight.
template <typename V, int BITS, int NH>
inline void key_scores(const float* qsc, const float* zk, const uint8_t* codes, int64_t dim, int64_t G, float* out,
                       int64_t stride) {
  constexpr int64_t L = V::kLanes;
  constexpr int SETS = NH >= 4 ? 1 : 2;
  const int64_t row_bytes = G * BITS / 8;
  for (int64_t j = 0; j < G; j += L) {
    V a[SETS][NH];
    for (int g = 0; g < NH; ++g) {
      a[0][g] = V::broadcast(zk[g]);
      if constexpr (SETS == 2) a[1][g] = V::zero();
    }
    int64_t c = 0;
    for (; c + SETS <= dim; c += SETS) {
      for (int k = 0; k < SETS; ++k) {
        const V x = Codes<V>::template codes<BITS>(codes + (c + k) * row_bytes, j);
        for (int g = 0; g < NH; ++g) a[k][g] = V::fmadd(V::broadcast(qsc[g * dim + c + k]), x, a[k][g]);
      }
    }
    for (; c < dim; ++c) {
      const V x = Codes<V>::template codes<BITS>(codes + c * row_bytes, j);
      for (int g = 0; g < NH; ++g) a[0][g] = V::fmadd(V::broadcast(qsc[g * dim + c]), x, a[0][g]);
    }
    for (int g = 0; g < NH; ++g) {
      if constexpr (SETS == 2) a[0][g] = V::add(a[0][g], a[1][g]);
      a[0][g].store(out + g * stride + j);
    }
  }
}

// ---- integer-domain key scores (`kivi:key_dot=int8`) -------------------------------------
// q . k_hat(t) = zk + sum_c qsc_c code(t, c) with qsc = q * scale (the page's channel
// scales), as key_scores; here qsc is quantised per (page, query head) to int8,
// q8_c = round(qsc_c * 127 / max|qsc|) (ties to even), and the sum is taken exactly in
// int32: score(t) = zk + (max|qsc| / 127) * sum_c q8_c code(t, c). The PyTorch path of
// attention.py computes the same definition (parity-tested); a key code then costs 1/4 of
// a VNNI instruction per head instead of one float FMA, which is what makes this faster.

// Below this max |qsc| a row counts as zero (q8 = 0): 127 / max would overflow to inf near
// float32's smallest normals (int8_keys.ZERO_ROW).
constexpr float kZeroRow = 1e-30f;

// q8 [NH, D] and sq [NH] of one page from qsc [NH, D]; q8 = 0 for a row below kZeroRow.
inline void quantise_scaled_queries(const float* qsc, int64_t dim, int nh, int8_t* q8, float* sq) {
  for (int g = 0; g < nh; ++g) {
    const float* row = qsc + g * dim;
    float top = 0.f;
    for (int64_t c = 0; c < dim; ++c) top = std::max(top, std::fabs(row[c]));
    sq[g] = top / 127.f;
    const float inv = top > kZeroRow ? 127.f / top : 0.f;
    for (int64_t c = 0; c < dim; ++c) q8[g * dim + c] = static_cast<int8_t>(std::nearbyint(row[c] * inv));
  }
}

// The exact integer sums, any group size and bit width: out[g * stride + i] = zk[g] +
// sq[g] * sum_c q8[g, c] code(i, c), codes [D, G*b/8].
template <int BITS>
void key_scores_int8_generic(const int8_t* q8, const float* sq, const float* zk, const uint8_t* codes, int64_t dim,
                             int64_t G, int nh, float* out, int64_t stride) {
  const int64_t row_bytes = G * BITS / 8;
  for (int64_t i = 0; i < G; ++i) {
    const int64_t bit = i * BITS;
    for (int g = 0; g < nh; ++g) {
      int32_t total = 0;
      for (int64_t c = 0; c < dim; ++c) {
        const int code = (codes[c * row_bytes + (bit >> 3)] >> (bit & 7)) & ((1 << BITS) - 1);
        total += static_cast<int32_t>(q8[g * dim + c]) * code;
      }
      out[g * stride + i] = std::fma(sq[g], static_cast<float>(total), zk[g]);
    }
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VBMI__) && defined(__AVX512VNNI__)
#define KVFORGE_KIVI_VNNI 1
// Index table of a two-source byte permute (vpermt2b) gathering 4 qwords into vpdpbusd's
// layout: byte k of dword t (t < 16) takes byte t % 8 of qword first + k * step, from the
// first source for t < 8 and the second for t >= 8 (index bit 6).
constexpr std::array<uint8_t, 64> dword_gather(int first, int step) {
  std::array<uint8_t, 64> index{};
  for (int t = 0; t < 16; ++t) {
    for (int k = 0; k < 4; ++k) index[4 * t + k] = static_cast<uint8_t>((t < 8 ? 0 : 64) + (first + k * step) * 8 + t % 8);
  }
  return index;
}

// Codes of 32 tokens x 8 channels (channels c0..c0+7) rearranged for vpdpbusd: out[0]
// tokens 0-15 x channels 0-3, out[1] tokens 0-15 x channels 4-7, out[2] and out[3] the same
// for tokens 16-31; dword t holds the 4 channels' codes of token t, one per byte. `block`:
// the 8 channels' 32-token rows back to back (8 bytes each for 2 bits, 16 for 4). Each
// vpmultishiftqb takes a code's bits to a byte of the qword it is in (a channel's row, or
// half of it for 4 bits); a two-source byte permute then gathers 4 channels per token.
template <int BITS>
inline void unpack_32x8(const uint8_t* block, __m512i out[4]) {
  const __m512i mask = _mm512_set1_epi8(static_cast<char>((1 << BITS) - 1));
  if constexpr (BITS == 2) {
    // Qword k = channel k's 32 tokens; M_j byte i of qword k = code(8j + i, k).
    const __m512i s = _mm512_loadu_si512(block);
    __m512i m[4];
    for (int j = 0; j < 4; ++j) {
      const int64_t base = 16 * j;
      const int64_t ctrl = base | (base + 2) << 8 | (base + 4) << 16 | (base + 6) << 24 | (base + 8) << 32 |
                           (base + 10) << 40 | (base + 12) << 48 | (base + 14) << 56;
      m[j] = _mm512_multishift_epi64_epi8(_mm512_set1_epi64(ctrl), s);
    }
    static constexpr std::array<uint8_t, 64> kLo = dword_gather(0, 1), kHi = dword_gather(4, 1);
    const __m512i lo = _mm512_loadu_si512(kLo.data()), hi = _mm512_loadu_si512(kHi.data());
    out[0] = _mm512_and_si512(_mm512_permutex2var_epi8(m[0], lo, m[1]), mask);
    out[1] = _mm512_and_si512(_mm512_permutex2var_epi8(m[0], hi, m[1]), mask);
    out[2] = _mm512_and_si512(_mm512_permutex2var_epi8(m[2], lo, m[3]), mask);
    out[3] = _mm512_and_si512(_mm512_permutex2var_epi8(m[2], hi, m[3]), mask);
  } else {
    // Two registers of 4 channels; qword 2k = channel k's tokens 0-15, qword 2k+1 its
    // tokens 16-31. A: byte i of qword 2k(+1) = code(i (16 + i), k); B: code(8 + i (24 + i), k).
    static constexpr std::array<uint8_t, 64> kFirst = dword_gather(0, 2), kSecond = dword_gather(1, 2);
    const __m512i first = _mm512_loadu_si512(kFirst.data()), second = _mm512_loadu_si512(kSecond.data());
    constexpr int64_t kLow = 0 | 4LL << 8 | 8LL << 16 | 12LL << 24 | 16LL << 32 | 20LL << 40 | 24LL << 48 | 28LL << 56;
    const __m512i ctrl_a = _mm512_set1_epi64(kLow), ctrl_b = _mm512_set1_epi64(kLow + 0x2020202020202020LL);
    for (int half = 0; half < 2; ++half) {  // channels 0-3, then 4-7
      const __m512i s = _mm512_loadu_si512(block + 64 * half);
      const __m512i a = _mm512_multishift_epi64_epi8(ctrl_a, s), b = _mm512_multishift_epi64_epi8(ctrl_b, s);
      out[half] = _mm512_and_si512(_mm512_permutex2var_epi8(a, first, b), mask);
      out[2 + half] = _mm512_and_si512(_mm512_permutex2var_epi8(a, second, b), mask);
    }
  }
}

// quantise_scaled_queries in AVX-512 (D % 16 == 0): the same products and the same
// rounding (cvtps rounds to nearest even, as std::nearbyint and torch.round do).
inline void quantise_scaled_queries_avx512(const float* qsc, int64_t dim, int nh, int8_t* q8, float* sq) {
  for (int g = 0; g < nh; ++g) {
    const float* row = qsc + g * dim;
    __m512 top = _mm512_setzero_ps();
    for (int64_t c = 0; c < dim; c += 16) top = _mm512_max_ps(top, _mm512_abs_ps(_mm512_loadu_ps(row + c)));
    const float t = _mm512_reduce_max_ps(top);
    sq[g] = t / 127.f;
    const __m512 inv = _mm512_set1_ps(t > kZeroRow ? 127.f / t : 0.f);
    for (int64_t c = 0; c < dim; c += 16) {
      const __m512i rounded = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(row + c), inv));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q8 + g * dim + c), _mm512_cvtsepi32_epi8(rounded));
    }
  }
}

// key_scores_int8_generic for BITS in {2, 4}, G % 32 == 0 and D % 16 == 0 with VNNI; q8
// and sq are scratch for the quantised qsc [NH, D].
template <int BITS, int NH>
void key_scores_int8_vnni(const float* qsc, int8_t* q8, float* sq, const float* zk, const uint8_t* codes,
                          int64_t dim, int64_t G, float* out, int64_t stride) {
  constexpr int64_t kBlockRow = 32 * BITS / 8;  // bytes of one channel's 32 tokens
  const int64_t row_bytes = G * BITS / 8;
  quantise_scaled_queries_avx512(qsc, dim, NH, q8, sq);
  alignas(64) uint8_t staging[8 * kBlockRow];
  for (int64_t j = 0; j < G; j += 32) {
    __m512i acc[NH][2];
    for (int g = 0; g < NH; ++g) acc[g][0] = acc[g][1] = _mm512_setzero_si512();
    for (int64_t c0 = 0; c0 < dim; c0 += 8) {
      const uint8_t* block = codes + c0 * row_bytes + j * BITS / 8;
      if (row_bytes != kBlockRow) {  // rows longer than 32 tokens: gather this block's pieces
        for (int k = 0; k < 8; ++k) std::memcpy(staging + k * kBlockRow, block + k * row_bytes, kBlockRow);
        block = staging;
      }
      __m512i t[4];
      unpack_32x8<BITS>(block, t);
      for (int g = 0; g < NH; ++g) {
        int32_t w0, w1;
        std::memcpy(&w0, q8 + g * dim + c0, 4);
        std::memcpy(&w1, q8 + g * dim + c0 + 4, 4);
        const __m512i qa = _mm512_set1_epi32(w0), qb = _mm512_set1_epi32(w1);
        acc[g][0] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc[g][0], t[0], qa), t[1], qb);
        acc[g][1] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc[g][1], t[2], qa), t[3], qb);
      }
    }
    for (int g = 0; g < NH; ++g) {
      const __m512 s = _mm512_set1_ps(sq[g]), z = _mm512_set1_ps(zk[g]);
      for (int h = 0; h < 2; ++h) {
        _mm512_storeu_ps(out + g * stride + j + 16 * h, _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(acc[g][h]), z));
      }
    }
  }
}
#endif

// Integer-domain scores of one page for NH heads from qsc [NH, D] (see above): the VNNI
// path where it applies, else the generic one (the same integers, so the same scores).
template <int BITS, int NH>
inline void key_scores_int8(const float* qsc, int8_t* q8, float* sq, const float* zk, const uint8_t* codes,
                            int64_t dim, int64_t G, float* out, int64_t stride) {
#ifdef KVFORGE_KIVI_VNNI
  if constexpr (BITS == 2 || BITS == 4) {
    if (G % 32 == 0 && dim % 16 == 0) {
      return key_scores_int8_vnni<BITS, NH>(qsc, q8, sq, zk, codes, dim, G, out, stride);
    }
  }
#endif
  quantise_scaled_queries(qsc, dim, NH, q8, sq);
  key_scores_int8_generic<BITS>(q8, sq, zk, codes, dim, G, NH, out, stride);
}

// key_scores for pre-RoPE pages (key_space=pre_rope): out[g * stride + i] =
// sum_c qs[g * D + c] * rope(k_hat(i), t0 + i)_c, k_hat(i, c) = code(i, c) scale_c + zero_c.
// Lanes are tokens as in key_scores; each channel pair (c, c + D/2) is dequantised and
// rotated in registers with the tokens' cos/sin (cos, sin: the tables' entries of the
// page's first token for channel pair 0, row stride T), then feeds the FMAs of all NH heads.
// Costs more than key_scores (the dequantisation and rotation per code; the measured ratio
// is in docs/cache-methods.md, kivi), never a tile in memory.
template <typename V, int BITS, int NH>
inline void rope_key_scores(const float* qs, const float* ks, const float* kz, const uint8_t* codes, int64_t dim,
                            int64_t G, const float* cos, const float* sin, int64_t T, float* out, int64_t stride) {
  constexpr int64_t L = V::kLanes;
  const int64_t row_bytes = G * BITS / 8, half = dim / 2;
  for (int64_t j = 0; j < G; j += L) {
    V a[NH];
    for (int g = 0; g < NH; ++g) a[g] = V::zero();
    for (int64_t c = 0; c < half; ++c) {
      const V x1 = V::fmadd(Codes<V>::template codes<BITS>(codes + c * row_bytes, j), V::broadcast(ks[c]),
                            V::broadcast(kz[c]));
      const V x2 = V::fmadd(Codes<V>::template codes<BITS>(codes + (c + half) * row_bytes, j), V::broadcast(ks[c + half]),
                            V::broadcast(kz[c + half]));
      const V co = V::load(cos + c * T + j), si = V::load(sin + c * T + j);
      const V r1 = V::sub(V::mul(x1, co), V::mul(x2, si));  // rotate_half: (x1, x2) -> (-x2, x1)
      const V r2 = V::fmadd(x1, si, V::mul(x2, co));
      for (int g = 0; g < NH; ++g) {
        a[g] = V::fmadd(V::broadcast(qs[g * dim + c]), r1, a[g]);
        a[g] = V::fmadd(V::broadcast(qs[g * dim + c + half]), r2, a[g]);
      }
    }
    for (int g = 0; g < NH; ++g) a[g].store(out + g * stride + j);
  }
}

// Pre-RoPE rows (ring and sink keys) -> RoPE'd copies in `buffer` [count, D]: ptrs[i], the
// row of token t_first + i, is rotated at that position and repointed into the buffer (a
// row may already live there: each pair is read before it is written).
inline void rope_rows(const Problem& p, int64_t t_first, int64_t count, const float** ptrs, float* buffer) {
  const int64_t dim = p.dim, half = dim / 2, T = p.rope_len;
  for (int64_t i = 0; i < count; ++i) {
    const float* src = ptrs[i];
    float* dst = buffer + i * dim;
    const int64_t t = t_first + i;
    for (int64_t c = 0; c < half; ++c) {
      const float x1 = src[c], x2 = src[c + half];
      const float co = p.rope_cos[c * T + t], si = p.rope_sin[c * T + t];
      dst[c] = x1 * co - x2 * si;
      dst[c + half] = x2 * co + x1 * si;
    }
    ptrs[i] = dst;
  }
}

// Dequantisation of the codes of one (token, channel group): code * scale + zero, by a
// table lookup where the vector type has one (the table built once per token and group),
// else by an FMA per vector.
template <typename V, int BITS>
struct ValueDequant {
  V a, b;  // lookup: a = the table; else a = scale, b = zero (broadcast)
  ValueDequant(float scale, float zero) {
    if constexpr (Codes<V>::template kLookup<BITS>) {
      a = V::fmadd(Codes<V>::template code_table<BITS>(), V::broadcast(scale), V::broadcast(zero));
    } else {
      a = V::broadcast(scale);
      b = V::broadcast(zero);
    }
  }
  V operator()(const uint8_t* row, int64_t first) const {
    if constexpr (Codes<V>::template kLookup<BITS>) {
      return Codes<V>::template lookup<BITS>(row, first, a);
    } else {
      return V::fmadd(Codes<V>::template codes<BITS>(row, first), a, b);
    }
  }
};

// acc[g * D + c] += sum_{t in [t0, t1)} prob[g * stride + t] * v_hat(t, c) for the page's
// value codes [G, D*b/8], v_hat(t, c) = code(t, c) scale(t, cg) + zero(t, cg) (sv, zv: the
// page's scales and zeros as floats, [G, D/GV]). Lanes are channels; a block of KB vectors
// lies inside one channel group (GV % (KB * L) == 0), so each token's dequantiser is set up
// once per block and each dequantised vector feeds the FMAs of all NH heads. The block's
// NH * KB accumulators stay in registers across the tokens (two sets, even and odd
// tokens, when that alone gives too few independent FMA chains).
template <typename V, int BITS, int NH, int KB>
inline void value_accumulate(const float* prob, int64_t stride, const float* sv, const float* zv,
                             const uint8_t* codes, int64_t t0, int64_t t1, int64_t dim, int64_t GV, float* acc) {
  constexpr int64_t L = V::kLanes;
  constexpr int SETS = NH * KB >= 4 ? 1 : 2;
  const int64_t row_bytes = dim * BITS / 8, cgs = dim / GV;
  for (int64_t j = 0; j < dim; j += KB * L) {
    const int64_t cg = j / GV;
    V a[SETS][NH][KB];
    for (int g = 0; g < NH; ++g) {
      for (int k = 0; k < KB; ++k) {
        a[0][g][k] = V::load(acc + g * dim + j + k * L);
        if constexpr (SETS == 2) a[1][g][k] = V::zero();
      }
    }
    auto token = [&](int set, int64_t t) __attribute__((always_inline)) {
      const ValueDequant<V, BITS> dequant(sv[t * cgs + cg], zv[t * cgs + cg]);
      V y[KB];
      for (int k = 0; k < KB; ++k) y[k] = dequant(codes + t * row_bytes, j + k * L);
      for (int g = 0; g < NH; ++g) {
        const V w = V::broadcast(prob[g * stride + t]);
        for (int k = 0; k < KB; ++k) a[set][g][k] = V::fmadd(w, y[k], a[set][g][k]);
      }
    };
    int64_t t = t0;
    for (; t + SETS <= t1; t += SETS) {
      for (int set = 0; set < SETS; ++set) token(set, t + set);
    }
    for (; t < t1; ++t) token(0, t);
    for (int g = 0; g < NH; ++g) {
      for (int k = 0; k < KB; ++k) {
        if constexpr (SETS == 2) a[0][g][k] = V::add(a[0][g][k], a[1][g][k]);
        a[0][g][k].store(acc + g * dim + j + k * L);
      }
    }
  }
}

// ---- integer-domain value sums (`kivi:value_dot=int8`) ------------------------------------
// sum_t p_t v_hat(t, c) = sum_t w(t, g) code(t, c) + sum_t p_t zero(t, g), w = p sigma >= 0,
// for channel c in value group g. Here w is quantised per (page, query head, value group)
// to unsigned 8 bits, w8 = round(w * 255 / max_t w) (ties to even; 0 for tokens outside
// [t0, t1)), and the first sum is taken exactly in int32:
// (max_t w / 255) * sum_t w8(t, g) code(t, c) + sum_t p_t zero(t, g). The PyTorch path of
// attention.py computes the same definition (int8_values.py); a value code then costs 1/4
// of a VNNI instruction per head instead of a dequantisation and one FMA per head.

// Weights of one page for NH heads: w8[(g * cgs + cg) * G + t], wstep[g * cgs + cg] =
// max_t w / 255 and wzero[g * cgs + cg] = sum_t p_t zero(t, cg), from the page's
// probabilities prob[g * stride + t] and its value scales and zeros as floats, channel-group
// major (svt, zvt [cgs, G]); tokens outside [t0, t1) get w8 = 0 and add no zero part.
template <int NH>
inline void quantise_value_weights(const float* prob, int64_t stride, const float* svt, const float* zvt, int64_t t0,
                                   int64_t t1, int64_t G, int64_t cgs, uint8_t* w8, float* wstep, float* wzero) {
  for (int g = 0; g < NH; ++g) {
    const float* pg = prob + g * stride;
    for (int64_t cg = 0; cg < cgs; ++cg) {
      const float* sv = svt + cg * G;
      const float* zv = zvt + cg * G;
      float top = 0.f, zero = 0.f;
      for (int64_t t = t0; t < t1; ++t) {
        top = std::max(top, pg[t] * sv[t]);
        zero += pg[t] * zv[t];
      }
      const float inv = top > kZeroRow ? 255.f / top : 0.f;
      uint8_t* row = w8 + (g * cgs + cg) * G;
      for (int64_t t = 0; t < G; ++t) {
        row[t] = t >= t0 && t < t1 ? static_cast<uint8_t>(std::nearbyint(pg[t] * sv[t] * inv)) : 0;
      }
      wstep[g * cgs + cg] = top / 255.f;
      wzero[g * cgs + cg] = zero;
    }
  }
}

#ifdef KVFORGE_KIVI_VNNI
// The page's value scales (or zeros) [G, cgs] fp16 as floats channel-group major, out
// [cgs, G] (G % 16 == 0).
inline void group_major_floats(const c10::Half* in, int64_t G, int64_t cgs, float* out) {
  const auto* raw = reinterpret_cast<const uint16_t*>(in);
  auto halves = [&](int64_t i) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(raw + i)));
  };
  if (cgs == 1) {
    for (int64_t t = 0; t < G; t += 16) _mm512_storeu_ps(out + t, halves(t));
  } else if (cgs == 2) {
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    for (int64_t t = 0; t < G; t += 16) {
      const __m512 a = halves(2 * t), b = halves(2 * t + 16);
      _mm512_storeu_ps(out + t, _mm512_permutex2var_ps(a, even, b));
      _mm512_storeu_ps(out + G + t, _mm512_permutex2var_ps(a, odd, b));
    }
  } else {
    for (int64_t t = 0; t < G; ++t) {
      for (int64_t cg = 0; cg < cgs; ++cg) out[cg * G + t] = static_cast<float>(in[t * cgs + cg]);
    }
  }
}

// quantise_value_weights in AVX-512 (G % 16 == 0): the same products and the same rounding
// (cvtps rounds to nearest even, as std::nearbyint and torch.round do).
template <int NH>
inline void quantise_value_weights_avx512(const float* prob, int64_t stride, const float* svt, const float* zvt,
                                          int64_t t0, int64_t t1, int64_t G, int64_t cgs, uint8_t* w8, float* wstep,
                                          float* wzero) {
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  auto read = [&](int64_t t) {  // lanes of tokens t..t+15 inside [t0, t1)
    const __m512i token = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(t)));
    return static_cast<__mmask16>(_mm512_cmpge_epi32_mask(token, _mm512_set1_epi32(static_cast<int>(t0))) &
                                  _mm512_cmplt_epi32_mask(token, _mm512_set1_epi32(static_cast<int>(t1))));
  };
  for (int g = 0; g < NH; ++g) {
    const float* pg = prob + g * stride;
    for (int64_t cg = 0; cg < cgs; ++cg) {
      const float* sv = svt + cg * G;
      const float* zv = zvt + cg * G;
      __m512 top = _mm512_setzero_ps(), zero = _mm512_setzero_ps();
      // Masked products: scales and zeros of tokens not read may be garbage (NaN * 0 = NaN).
      for (int64_t t = 0; t < G; t += 16) {
        const __mmask16 m = read(t);
        const __m512 p = _mm512_loadu_ps(pg + t);
        top = _mm512_max_ps(top, _mm512_maskz_mul_ps(m, p, _mm512_loadu_ps(sv + t)));
        zero = _mm512_mask3_fmadd_ps(p, _mm512_loadu_ps(zv + t), zero, m);
      }
      const float high = _mm512_reduce_max_ps(top);
      const __m512 inv = _mm512_set1_ps(high > kZeroRow ? 255.f / high : 0.f);
      for (int64_t t = 0; t < G; t += 16) {
        const __m512 w = _mm512_maskz_mul_ps(read(t), _mm512_loadu_ps(pg + t), _mm512_loadu_ps(sv + t));
        const __m512i levels = _mm512_cvtps_epi32(_mm512_mul_ps(w, inv));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(w8 + (g * cgs + cg) * G + t), _mm512_cvtusepi32_epi8(levels));
      }
      wstep[g * cgs + cg] = high / 255.f;
      wzero[g * cgs + cg] = _mm512_reduce_add_ps(zero);
    }
  }
}
#endif

// The exact integer sums, any shape: acc[g * D + c] += wstep * sum_t w8(t, g) code(t, c) +
// wzero for the page's value codes [G, D*b/8].
template <int BITS, int NH>
void value_sums_int8_generic(const uint8_t* w8, const float* wstep, const float* wzero, const uint8_t* codes,
                             int64_t dim, int64_t GV, int64_t G, float* acc) {
  const int64_t row_bytes = dim * BITS / 8, cgs = dim / GV;
  for (int g = 0; g < NH; ++g) {
    for (int64_t c = 0; c < dim; ++c) {
      const int64_t cg = c / GV, bit = c * BITS;
      const uint8_t* weights = w8 + (g * cgs + cg) * G;
      int32_t total = 0;
      for (int64_t t = 0; t < G; ++t) {
        const int code = (codes[t * row_bytes + (bit >> 3)] >> (bit & 7)) & ((1 << BITS) - 1);
        total += static_cast<int32_t>(weights[t]) * code;
      }
      acc[g * dim + c] += std::fma(wstep[g * cgs + cg], static_cast<float>(total), wzero[g * cgs + cg]);
    }
  }
}

#ifdef KVFORGE_KIVI_VNNI
// Layout for vpdpbusd with lanes = channels: dword j of block k holds code(t0 + r, c0 + 16k + j)
// in byte r, r < 4 (4 tokens of one channel). From X, 4 tokens' 16-byte slices of a row
// (128 / BITS channels from c0; 128-bit lane r = token r): a byte permute brings into qword
// i (channels 2i, 2i + 1 of the block, which share a byte) the 4 tokens' bytes holding them,
// then vpmultishiftqb takes each code's bits to its byte.
template <int BITS>
constexpr std::array<uint8_t, 64> value_block_gather(int k) {
  std::array<uint8_t, 64> index{};
  for (int i = 0; i < 8; ++i) {
    for (int r = 0; r < 8; ++r) index[8 * i + r] = static_cast<uint8_t>(16 * (r % 4) + 2 * BITS * k + 2 * i * BITS / 8);
  }
  return index;
}

template <int BITS>
constexpr std::array<uint8_t, 64> value_block_shifts() {
  std::array<uint8_t, 64> shift{};
  for (int i = 0; i < 8; ++i) {
    for (int h = 0; h < 2; ++h) {
      for (int r = 0; r < 4; ++r) shift[8 * i + 4 * h + r] = static_cast<uint8_t>(8 * r + ((2 * i + h) * BITS) % 8);
    }
  }
  return shift;
}

// value_sums_int8_generic for BITS in {2, 4}, G % 4 == 0, GV % 16 == 0 and D % (128 / BITS)
// == 0 with VNNI: a chunk of 128 / BITS channels (16 bytes of a row) at a time, its NH x
// (8 / BITS) int32 accumulators in registers across the page's tokens, 4 tokens per vpdpbusd.
template <int BITS, int NH>
void value_sums_int8_vnni(const uint8_t* w8, const float* wstep, const float* wzero, const uint8_t* codes,
                          int64_t dim, int64_t GV, int64_t G, float* acc) {
  constexpr int kChunk = 128 / BITS, kBlocks = 8 / BITS;
  static constexpr std::array<uint8_t, 64> kShifts = value_block_shifts<BITS>();
  static constexpr std::array<std::array<uint8_t, 64>, kBlocks> kGather = [] {
    std::array<std::array<uint8_t, 64>, kBlocks> all{};
    for (int k = 0; k < kBlocks; ++k) all[k] = value_block_gather<BITS>(k);
    return all;
  }();
  const __m512i shifts = _mm512_loadu_si512(kShifts.data());
  const __m512i mask = _mm512_set1_epi8(static_cast<char>((1 << BITS) - 1));
  __m512i gather[kBlocks];
  for (int k = 0; k < kBlocks; ++k) gather[k] = _mm512_loadu_si512(kGather[k].data());
  const int64_t row_bytes = dim * BITS / 8, cgs = dim / GV;
  for (int64_t c0 = 0; c0 < dim; c0 += kChunk) {
    __m512i sums[NH][kBlocks];
    for (int g = 0; g < NH; ++g) {
      for (int k = 0; k < kBlocks; ++k) sums[g][k] = _mm512_setzero_si512();
    }
    const uint8_t* column = codes + c0 * BITS / 8;
    for (int64_t t = 0; t < G; t += 4) {
      const uint8_t* rows = column + t * row_bytes;
      __m512i x;
      if (row_bytes == 16) {
        x = _mm512_loadu_si512(rows);
      } else {
        auto slice = [&](int r) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows + r * row_bytes)); };
        x = _mm512_inserti32x4(_mm512_inserti32x4(_mm512_inserti32x4(_mm512_castsi128_si512(slice(0)), slice(1), 1),
                                                  slice(2), 2), slice(3), 3);
      }
      __m512i y[kBlocks];
      for (int k = 0; k < kBlocks; ++k) {
        y[k] = _mm512_and_si512(_mm512_multishift_epi64_epi8(shifts, _mm512_permutexvar_epi8(gather[k], x)), mask);
      }
      for (int g = 0; g < NH; ++g) {
        for (int k = 0; k < kBlocks; ++k) {
          const int64_t cg = (c0 + 16 * k) / GV;
          int32_t w;
          std::memcpy(&w, w8 + (g * cgs + cg) * G + t, 4);
          sums[g][k] = _mm512_dpbusd_epi32(sums[g][k], _mm512_set1_epi32(w), y[k]);
        }
      }
    }
    for (int g = 0; g < NH; ++g) {
      for (int k = 0; k < kBlocks; ++k) {
        const int64_t c = c0 + 16 * k, cg = c / GV;
        const __m512 step = _mm512_set1_ps(wstep[g * cgs + cg]), zero = _mm512_set1_ps(wzero[g * cgs + cg]);
        const __m512 part = _mm512_fmadd_ps(step, _mm512_cvtepi32_ps(sums[g][k]), zero);
        _mm512_storeu_ps(acc + g * dim + c, _mm512_add_ps(_mm512_loadu_ps(acc + g * dim + c), part));
      }
    }
  }
}
#endif

// The page's weights for NH heads into scratch.w8 / wstep / wzero (quantise_value_weights),
// from its value scales and zeros vs, vz [G, cgs] (fp16).
template <int NH>
inline void value_weights(const float* prob, int64_t stride, const c10::Half* vs, const c10::Half* vz, int64_t t0,
                          int64_t t1, int64_t G, int64_t cgs, Scratch& scratch) {
  float* svt = scratch.sv.data();
  float* zvt = scratch.zv.data();
#ifdef KVFORGE_KIVI_VNNI
  if (G % 16 == 0) {
    group_major_floats(vs, G, cgs, svt);
    group_major_floats(vz, G, cgs, zvt);
    return quantise_value_weights_avx512<NH>(prob, stride, svt, zvt, t0, t1, G, cgs, scratch.w8.data(),
                                             scratch.wstep.data(), scratch.wzero.data());
  }
#endif
  for (int64_t t = 0; t < G; ++t) {
    for (int64_t cg = 0; cg < cgs; ++cg) {
      svt[cg * G + t] = static_cast<float>(vs[t * cgs + cg]);
      zvt[cg * G + t] = static_cast<float>(vz[t * cgs + cg]);
    }
  }
  quantise_value_weights<NH>(prob, stride, svt, zvt, t0, t1, G, cgs, scratch.w8.data(), scratch.wstep.data(),
                             scratch.wzero.data());
}

// Integer-domain value sums of one page for NH heads (see above): the VNNI path where it
// applies, else the generic one (the same integers, so the same sums).
template <int BITS, int NH>
inline void value_sums_int8(const uint8_t* w8, const float* wstep, const float* wzero, const uint8_t* codes,
                            int64_t dim, int64_t GV, int64_t G, float* acc) {
#ifdef KVFORGE_KIVI_VNNI
  if constexpr (BITS == 2 || BITS == 4) {
    if (G % 4 == 0 && GV % 16 == 0 && dim % (128 / BITS) == 0) {
      return value_sums_int8_vnni<BITS, NH>(w8, wstep, wzero, codes, dim, GV, G, acc);
    }
  }
#endif
  value_sums_int8_generic<BITS, NH>(w8, wstep, wzero, codes, dim, GV, G, acc);
}

// Pages are scattered in the pool, so the hardware prefetcher cannot anticipate the jump
// to the next page: its six arrays are requested (into L2, kvforge_prefetch::to_l2) while
// the current tile runs.
using kvforge_prefetch::to_l2;

// One unit for query heads [h0, h0 + NH) of its kv group. m, l, acc: the unit's partial
// state for those heads (acc [NH * D]).
template <typename V, int KBITS, int VBITS, int NH>
void run_pass(const Unit& u, int64_t h0, const Problem& p, Scratch& scratch, float* m, float* l, float* acc) {
  const int64_t b = u.pair / p.kv_heads, h = u.pair % p.kv_heads;
  const int64_t dim = p.dim, G = p.g, R = p.residual;
  const int64_t v_params = G * (dim / p.gv);  // value scales (and zeros) per page
  const int64_t k_row_bytes = G * KBITS / 8, v_row_bytes = dim * VBITS / 8;
  const int64_t tile_pages = std::max<int64_t>(1, kTileTokens / G), stride = tile_pages * G;
  const Span sp = span_of(p, b);
  float* qs = scratch.qs.data();
  float* qsc = scratch.qsc.data();
  float* scores = scratch.scores.data();
  const float* q_rows = p.q + ((b * p.kv_heads + h) * p.group + h0) * dim;
  for (int64_t i = 0; i < NH * dim; ++i) qs[i] = q_rows[i] * p.scale;
  State s{m, l, acc};
  if (u.with_self) {
    // The own token is always visible: seeding with it keeps the running max finite.
    const float* ks = p.k_self + (b * p.kv_heads + h) * dim;
    const float* vs = p.v_self + (b * p.kv_heads + h) * dim;
    for (int g = 0; g < NH; ++g) {
      m[g] = dot<V, 2>(qs + g * dim, ks, dim);
      l[g] = 1.f;
      std::memcpy(acc + g * dim, vs, dim * sizeof(float));
    }
  } else {
    // A unit without the own token has a visible token in its first tile, so m turns
    // finite there and the correction e^-inf = 0 multiplies a zero accumulator.
    for (int g = 0; g < NH; ++g) {
      m[g] = -std::numeric_limits<float>::infinity();
      l[g] = 0.f;
      std::fill(acc + g * dim, acc + (g + 1) * dim, 0.f);
    }
  }
  TORCH_CHECK(sp.n == 0 || (sp.slot >= 0 && sp.slot < p.slots), "kivi_decode_attention: slot ", sp.slot,
              " out of range");
  const int64_t ring = (sp.slot * p.kv_heads + h) * R;  // row index of the pair's ring in k_res/v_res
  const int64_t* table = p.page_table + b * p.table_width;
  auto page_at = [&](int64_t column) {
    TORCH_CHECK(column < p.table_width, "kivi_decode_attention: page table too short");
    const int64_t page = table[column];
    TORCH_CHECK(page >= 0 && page < p.pages, "kivi_decode_attention: page id ", page, " out of range");
    return h * p.pages + page;
  };
  auto prefetch_keys = [&](int64_t base) __attribute__((always_inline)) {
    to_l2(p.k_codes + base * dim * k_row_bytes, dim * k_row_bytes);
    to_l2(p.k_scale + base * dim, dim * 2);
    to_l2(p.k_zero + base * dim, dim * 2);
  };
  auto prefetch_values = [&](int64_t base) __attribute__((always_inline)) {
    to_l2(p.v_codes + base * G * v_row_bytes, G * v_row_bytes);
    to_l2(p.v_scale + base * v_params, v_params * 2);
    to_l2(p.v_zero + base * v_params, v_params * 2);
  };
  auto prefetch_page = [&](int64_t base) __attribute__((always_inline)) {
    prefetch_keys(base);
    prefetch_values(base);
  };
  auto prefetch_ring = [&](const void* base, int64_t t_begin, int64_t t_end) __attribute__((always_inline)) {
    const char* rows = static_cast<const char*>(base);
    for (int64_t t = t_begin; t < t_end; ++t) to_l2(rows + (ring + t % R) * p.res_row_bytes, p.res_row_bytes);
  };
  const int64_t res_begin = std::max(sp.nk, sp.lo);  // first residual token
  // The ring rows the tile of page columns from `col` reads (its tokens in [nv, nk)); past
  // the unit's last column, the first residual tile.
  auto prefetch_tile_ring = [&](int64_t col) __attribute__((always_inline)) {
    if (col < u.col_end) {
      const int64_t end = std::min(col + tile_pages, u.col_end);
      const int64_t t_begin = sp.first + col * G, t_end = sp.first + end * G;
      prefetch_ring(p.v_res, std::max(t_begin, std::max(sp.nv, sp.lo)), t_end);
    } else if (u.with_self) {
      const int64_t t_end = std::min(sp.n, res_begin + stride);
      prefetch_ring(p.k_res, res_begin, t_end);
      prefetch_ring(p.v_res, res_begin, t_end);
    }
  };
  // The unit's first tile is requested whole up front; each later tile's pages are requested
  // one page at a time while the tile before runs (next tile's page k: its key arrays before
  // this tile's page k is scored, its value arrays before page k's values are summed).
  // Requesting the whole next tile at once (96 lines on smollm2) made the core wait for free
  // miss buffers: perf put a large share of this function's samples just after the
  // prefetch instructions, and spreading them made the kernel faster. Requesting only each
  // array's first lines (leaving the rest to the hardware) was slower (docs/benchmarks.md,
  // 'Measurements behind design choices').
  for (int64_t k = u.col_begin; k < std::min(u.col_begin + tile_pages, u.col_end); ++k) prefetch_page(page_at(k));
  prefetch_tile_ring(u.col_begin);

  // Quantised keys: the unit's page columns, a tile of pages per softmax update.
  int64_t bases[kTileTokens];  // tile_pages <= kTileTokens
  int64_t next_bases[kTileTokens];
  for (int64_t col = u.col_begin; col < u.col_end; col += tile_pages) {
    const int64_t count = std::min(tile_pages, u.col_end - col);
    for (int64_t k = 0; k < count; ++k) bases[k] = page_at(col + k);
    // A next tile exists only after a whole tile, so it has at most `count` pages.
    const int64_t next_count = std::clamp<int64_t>(u.col_end - (col + count), 0, tile_pages);
    for (int64_t k = 0; k < next_count; ++k) next_bases[k] = page_at(col + count + k);
    prefetch_tile_ring(col + count);
    const int64_t t_first = sp.first + col * G;
    const int64_t hidden = std::max<int64_t>(0, sp.lo - t_first);  // only the pair's first page has any
    for (int64_t k = 0; k < count; ++k) {
      const int64_t base = bases[k];
      if (k < next_count) prefetch_keys(next_bases[k]);
      const c10::Half* kscale = p.k_scale + base * dim;
      const c10::Half* kzero = p.k_zero + base * dim;
      const uint8_t* kcodes = p.k_codes + base * dim * k_row_bytes;
      if (p.rope_cos != nullptr) {
        float* ks = scratch.kf.data();
        float* kz = ks + dim;
        for (int64_t c = 0; c < dim; ++c) {
          ks[c] = static_cast<float>(kscale[c]);
          kz[c] = static_cast<float>(kzero[c]);
        }
        const int64_t t0 = t_first + k * G;
        rope_key_scores<V, KBITS, NH>(qs, ks, kz, kcodes, dim, G, p.rope_cos + t0, p.rope_sin + t0, p.rope_len,
                                      scores + k * G, stride);
        continue;
      }
      // q . k_hat(t) = sum_c q_c zero_c + sum_c (q_c scale_c) code(t, c)
      for (int g = 0; g < NH; ++g) {
        V z = V::zero();
        for (int64_t c = 0; c < dim; c += V::kLanes) {
          const V qv = V::load(qs + g * dim + c);
          V::mul(qv, V::load(kscale + c)).store(qsc + g * dim + c);
          z = V::fmadd(qv, V::load(kzero + c), z);
        }
        scratch.zk[g] = z.sum();
      }
      if (p.key_int8) {
        key_scores_int8<KBITS, NH>(qsc, scratch.q8.data(), scratch.sq.data(), scratch.zk.data(), kcodes, dim, G,
                                   scores + k * G, stride);
      } else {
        key_scores<V, KBITS, NH>(qsc, scratch.zk.data(), kcodes, dim, G, scores + k * G, stride);
      }
    }
    update<V>(s, scores, stride, count * G, hidden, NH, dim);
    // Values: token t is quantised iff t < nv, else it is still in the ring.
    for (int64_t k = 0; k < count; ++k) {
      const int64_t base = bases[k], t0 = t_first + k * G;
      if (k < next_count) prefetch_values(next_bases[k]);
      const int64_t q_begin = std::max<int64_t>(0, sp.lo - t0);
      const int64_t q_end = std::clamp<int64_t>(sp.nv - t0, q_begin, G);
      const float* prob = scores + k * G;
      if (q_end > q_begin) {
        float* sv = scratch.sv.data();
        float* zv = scratch.zv.data();
        const c10::Half* vs = p.v_scale + base * v_params;
        const c10::Half* vz = p.v_zero + base * v_params;
        for (int64_t i = 0; !p.value_int8 && i < v_params; ++i) {
          sv[i] = static_cast<float>(vs[i]);
          zv[i] = static_cast<float>(vz[i]);
        }
        const uint8_t* vc = p.v_codes + base * G * v_row_bytes;
        if (p.value_int8) {
          value_weights<NH>(prob, stride, vs, vz, q_begin, q_end, G, dim / p.gv, scratch);
          value_sums_int8<VBITS, NH>(scratch.w8.data(), scratch.wstep.data(), scratch.wzero.data(), vc, dim, p.gv,
                                     G, acc);
        } else if ((p.gv / V::kLanes) % 2 == 0) {
          value_accumulate<V, VBITS, NH, 2>(prob, stride, sv, zv, vc, q_begin, q_end, dim, p.gv, acc);
        } else {
          value_accumulate<V, VBITS, NH, 1>(prob, stride, sv, zv, vc, q_begin, q_end, dim, p.gv, acc);
        }
      }
      // Tokens [nv, nk) have their values still in the ring.
      const int64_t r_begin = std::max(q_begin, q_end);
      if (r_begin < G) {
        const float** rows = scratch.row_ptrs.data();
        residual_rows<V>(p, p.v_res, ring, t0 + r_begin, G - r_begin, scratch.rows.data(), rows);
        rows_accumulate<V, NH>(prob + r_begin, stride, rows, 0, G - r_begin, dim, acc);
      }
    }
  }

  // Sink tokens [sink_lo, sink_hi): exact keys and values from the sink buffers.
  if (u.with_self) {
    const int64_t sink_row = (sp.slot * p.kv_heads + h) * p.sinks;  // row index of token 0
    for (int64_t start = sp.sink_lo; start < sp.sink_hi; start += stride) {
      const int64_t count = std::min(stride, sp.sink_hi - start);
      const float** rows = scratch.row_ptrs.data();
      for (int64_t i = 0; i < count; ++i) {
        rows[i] = residual_row<V>(p, p.k_sink, sink_row + start + i, scratch.rows.data() + i * dim);
      }
      if (p.rope_cos != nullptr) rope_rows(p, start, count, rows, scratch.rows.data());
      for (int64_t i = 0; i < count; ++i) {
        for (int g = 0; g < NH; ++g) scores[g * stride + i] = dot<V, 2>(qs + g * dim, rows[i], dim);
      }
      update<V>(s, scores, stride, count, 0, NH, dim);
      for (int64_t i = 0; i < count; ++i) {
        rows[i] = residual_row<V>(p, p.v_sink, sink_row + start + i, scratch.rows.data() + i * dim);
      }
      rows_accumulate<V, NH>(scores, stride, rows, 0, count, dim, acc);
    }
  }

  // Residual tokens [max(nk, lo), n): keys and values at ring offset t % R.
  if (u.with_self) {
    for (int64_t start = res_begin; start < sp.n; start += stride) {
      const int64_t count = std::min(stride, sp.n - start);
      const int64_t next_end = std::min(sp.n, start + count + stride);
      prefetch_ring(p.k_res, start + count, next_end);
      prefetch_ring(p.v_res, start + count, next_end);
      const float** rows = scratch.row_ptrs.data();
      residual_rows<V>(p, p.k_res, ring, start, count, scratch.rows.data(), rows);
      if (p.rope_cos != nullptr) rope_rows(p, start, count, rows, scratch.rows.data());
      for (int64_t i = 0; i < count; ++i) {
        for (int g = 0; g < NH; ++g) scores[g * stride + i] = dot<V, 2>(qs + g * dim, rows[i], dim);
      }
      update<V>(s, scores, stride, count, 0, NH, dim);
      residual_rows<V>(p, p.v_res, ring, start, count, scratch.rows.data(), rows);
      rows_accumulate<V, NH>(scores, stride, rows, 0, count, dim, acc);
    }
  }
}

using PassFn = void (*)(const Unit&, int64_t, const Problem&, Scratch&, float*, float*, float*);

// Heads per pass instantiated for a vector type: all up to kMaxHeadsPerPass for the main
// one; fewer for the fallbacks (G not a multiple of the native width), which only bounds
// the build time.
template <typename V>
constexpr int max_heads_per_pass() {
#ifdef KVFORGE_NATIVE_VEC
  if constexpr (std::is_same_v<V, NativeVec>) return kMaxHeadsPerPass;
  return V::kLanes == 1 ? 1 : 4;
#else
  return V::kLanes == 1 ? 1 : kMaxHeadsPerPass;
#endif
}

template <typename V, int KBITS, int VBITS>
PassFn pass_for(int nh) {
  constexpr int kMax = max_heads_per_pass<V>();
  if constexpr (kMax == 1) {
    return &run_pass<V, KBITS, VBITS, 1>;
  } else if constexpr (kMax == 4) {
    switch (nh) {
      case 1: return &run_pass<V, KBITS, VBITS, 1>;
      case 2: return &run_pass<V, KBITS, VBITS, 2>;
      case 3: return &run_pass<V, KBITS, VBITS, 3>;
      default: return &run_pass<V, KBITS, VBITS, 4>;
    }
  } else {
    switch (nh) {
      case 1: return &run_pass<V, KBITS, VBITS, 1>;
      case 2: return &run_pass<V, KBITS, VBITS, 2>;
      case 3: return &run_pass<V, KBITS, VBITS, 3>;
      case 4: return &run_pass<V, KBITS, VBITS, 4>;
      case 5: return &run_pass<V, KBITS, VBITS, 5>;
      case 6: return &run_pass<V, KBITS, VBITS, 6>;
      case 7: return &run_pass<V, KBITS, VBITS, 7>;
      default: return &run_pass<V, KBITS, VBITS, 8>;
    }
  }
}

// Runs every unit (threads take units dynamically) and writes each unit's partial state
// [m (group), l (group), acc (group * D)] to `partial`.
template <typename V, int KBITS, int VBITS>
void run_units(const std::vector<Unit>& units, const Problem& p, float* partial) {
  const int64_t group = p.group, dim = p.dim, state = group * (dim + 2);
  const int64_t tile = std::max<int64_t>(1, kTileTokens / p.g) * p.g;
  // Head passes of at most max_heads_per_pass heads, sizes as even as possible.
  constexpr int64_t kMax = max_heads_per_pass<V>();
  const int64_t passes = (group + kMax - 1) / kMax;
  std::vector<int64_t> pass_begin(passes + 1);
  for (int64_t i = 0; i <= passes; ++i) pass_begin[i] = group * i / passes;
  std::atomic<int64_t> next{0};
  const int64_t total = static_cast<int64_t>(units.size());
  const int64_t workers = std::min<int64_t>(std::max<int64_t>(1, at::get_num_threads()), total);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    Scratch scratch(p, tile);
    for (int64_t u = next.fetch_add(1); u < total; u = next.fetch_add(1)) {
      float* st = partial + u * state;
      for (int64_t i = 0; i < passes; ++i) {
        const int64_t h0 = pass_begin[i], nh = pass_begin[i + 1] - h0;
        pass_for<V, KBITS, VBITS>(static_cast<int>(nh))(units[u], h0, p, scratch, st + h0, st + group + h0,
                                                st + 2 * group + h0 * dim);
      }
    }
  });
}

// Key and value bits: the paper's equal pairs, and 4-bit keys with 2-bit values (keys
// carry most of the 2-bit error on small models: README's KIVI table). Other pairs are
// refused on entry (the PyTorch path reads them).
template <typename V>
void dispatch_bits(int64_t bits, int64_t value_bits, const std::vector<Unit>& units, const Problem& p,
                   float* partial) {
  if (bits == 4 && value_bits == 2) return run_units<V, 4, 2>(units, p, partial);
  switch (bits) {
    case 2:
      return run_units<V, 2, 2>(units, p, partial);
    case 4:
      return run_units<V, 4, 4>(units, p, partial);
    default:
      return run_units<V, 8, 8>(units, p, partial);
  }
}

// t's elements as float32: in place for a float32 tensor, else widened into `storage`
// (bf16 and fp16 widen exactly). t is contiguous (checked by the caller).
const float* as_float(const at::Tensor& t, std::vector<float>& storage) {
  if (t.scalar_type() == at::kFloat) return t.const_data_ptr<float>();
  storage.resize(t.numel());
  if (t.scalar_type() == at::kBFloat16) {
    const auto* src = t.const_data_ptr<c10::BFloat16>();
    for (int64_t i = 0; i < t.numel(); ++i) storage[i] = static_cast<float>(src[i]);
  } else {
    const auto* src = t.const_data_ptr<c10::Half>();
    for (int64_t i = 0; i < t.numel(); ++i) storage[i] = static_cast<float>(src[i]);
  }
  return storage.data();
}

// row[0, n) written at element `at` of out (float32, or rounded to out's 16-bit dtype).
void store_row(at::Tensor& out, int64_t at, const float* row, int64_t n) {
  if (out.scalar_type() == at::kFloat) {
    std::memcpy(out.data_ptr<float>() + at, row, n * sizeof(float));
  } else if (out.scalar_type() == at::kBFloat16) {
    c10::BFloat16* dst = out.data_ptr<c10::BFloat16>() + at;
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<c10::BFloat16>(row[i]);
  } else {
    c10::Half* dst = out.data_ptr<c10::Half>() + at;
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<c10::Half>(row[i]);
  }
}

at::Tensor kivi_decode_attention(const at::Tensor& q, const at::Tensor& k_self, const at::Tensor& v_self,
                                 const at::Tensor& k_codes, const at::Tensor& k_scale, const at::Tensor& k_zero,
                                 const at::Tensor& v_codes, const at::Tensor& v_scale, const at::Tensor& v_zero,
                                 const at::Tensor& k_res, const at::Tensor& v_res, const at::Tensor& page_table,
                                 const at::Tensor& first_page_position, const at::Tensor& visible_from,
                                 const at::Tensor& lengths, const at::Tensor& slots, double scale, int64_t bits,
                                 const c10::optional<at::Tensor>& k_sink, const c10::optional<at::Tensor>& v_sink,
                                 int64_t value_bits, const c10::optional<at::Tensor>& rope_cos,
                                 const c10::optional<at::Tensor>& rope_sin, int64_t key_dot, int64_t value_dot) {
  constexpr const char* kOpName = "kivi_decode_attention";
  kvforge_checks::cpu(kOpName, {&q, &k_self, &v_self, &k_codes, &k_scale, &k_zero, &v_codes, &v_scale, &v_zero, &k_res,
                           &v_res, &page_table, &first_page_position, &visible_from, &lengths, &slots});
  const at::ScalarType io_dtype = q.scalar_type();
  TORCH_CHECK(io_dtype == at::kFloat || io_dtype == at::kBFloat16 || io_dtype == at::kHalf, kOpName,
              ": q must be float32, bfloat16 or float16");
  kvforge_checks::contiguous_of(kOpName, "q, k_self, v_self", io_dtype, {&q, &k_self, &v_self});
  for (const at::Tensor* t : {&q, &k_self, &v_self}) TORCH_CHECK(t->dim() == 3, "q, k_self, v_self must be [B, *, D]");
  kvforge_checks::contiguous_of(kOpName, "page table, positions and slots", at::kLong,
                                {&page_table, &first_page_position, &visible_from, &lengths, &slots});
  kvforge_checks::contiguous_of(kOpName, "codes", at::kByte, {&k_codes, &v_codes});
  kvforge_checks::contiguous_of(kOpName, "scales and zero points", at::kHalf, {&k_scale, &k_zero, &v_scale, &v_zero});
  TORCH_CHECK(k_res.is_contiguous() && v_res.is_contiguous(), kOpName, ": residuals must be contiguous");
  TORCH_CHECK(bits == 2 || bits == 4 || bits == 8, "bits must be 2, 4 or 8");
  if (value_bits == 0) value_bits = bits;
  TORCH_CHECK(key_dot == 0 || key_dot == 1, "key_dot must be 0 (float) or 1 (int8)");
  TORCH_CHECK(key_dot == 0 || (bits != 8 && !rope_cos.has_value()),
              "key_dot=int8 takes 2- or 4-bit keys stored post-RoPE");
  TORCH_CHECK(value_dot == 0 || value_dot == 1, "value_dot must be 0 (float) or 1 (int8)");
  TORCH_CHECK(value_dot == 0 || value_bits == 2 || value_bits == 4, "value_dot=int8 takes 2- or 4-bit values");
  TORCH_CHECK(value_bits == bits || (bits == 4 && value_bits == 2),
              "key/value bits must be equal, or 4-bit keys with 2-bit values");
  TORCH_CHECK(k_res.sizes() == v_res.sizes() && k_res.scalar_type() == v_res.scalar_type() && k_res.dim() == 4,
              "k_res, v_res must be [S, H, R, D] of one dtype");
  const at::ScalarType res_dtype = k_res.scalar_type();
  TORCH_CHECK(res_dtype == at::kFloat || res_dtype == at::kHalf || res_dtype == at::kBFloat16,
              "kivi_decode_attention: residual dtype must be float32, float16 or bfloat16");
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = k_self.size(1);
  kvforge_checks::gqa(kOpName, heads, kv_heads);
  TORCH_CHECK(k_self.size(0) == batch && k_self.size(2) == dim && v_self.sizes() == k_self.sizes(),
              "k_self, v_self must be [B, H, D]");
  TORCH_CHECK(k_codes.dim() == 4 && k_codes.size(0) == kv_heads && k_codes.size(2) == dim, "k_codes shape");
  const int64_t pages = k_codes.size(1);
  const int64_t g = v_codes.size(2);
  TORCH_CHECK(g > 0 && k_codes.size(3) == g * bits / 8 && (g * bits) % 8 == 0, "k_codes must be [H, P, D, G*b/8]");
  TORCH_CHECK(v_codes.dim() == 4 && v_codes.size(1) == pages && v_codes.size(3) == dim * value_bits / 8,
              "v_codes must be [H, P, G, D*b/8]");
  TORCH_CHECK(k_scale.numel() == kv_heads * pages * dim && k_zero.numel() == k_scale.numel(), "k_scale shape");
  TORCH_CHECK(v_scale.dim() == 4 && v_scale.size(0) == kv_heads && v_scale.size(1) == pages && v_scale.size(2) == g &&
                  v_scale.size(3) > 0 && dim % v_scale.size(3) == 0 && v_zero.sizes() == v_scale.sizes(),
              "v_scale, v_zero must be [H, P, G, D/GV]");
  const int64_t gv = dim / v_scale.size(3);
  TORCH_CHECK(k_sink.has_value() == v_sink.has_value(), "k_sink and v_sink come together");
  int64_t sinks = 0;
  if (k_sink.has_value()) {
    TORCH_CHECK(k_sink->is_cpu() && v_sink->is_cpu() && k_sink->is_contiguous() && v_sink->is_contiguous() &&
                    k_sink->dim() == 4 && k_sink->sizes() == v_sink->sizes() && k_sink->size(0) == k_res.size(0) &&
                    k_sink->size(1) == kv_heads && k_sink->size(3) == dim &&
                    k_sink->scalar_type() == res_dtype && v_sink->scalar_type() == res_dtype,
                "k_sink, v_sink must be contiguous CPU [S, H, N, D] in the residual dtype");
    sinks = k_sink->size(2);
  }
  TORCH_CHECK(rope_cos.has_value() == rope_sin.has_value(), "rope_cos and rope_sin come together");
  int64_t rope_len = 0;
  if (rope_cos.has_value()) {
    TORCH_CHECK(dim % 2 == 0, "pre-RoPE keys need an even head dim");
    kvforge_checks::contiguous_of(kOpName, "RoPE tables", at::kFloat, {&*rope_cos, &*rope_sin});
    TORCH_CHECK(rope_cos->is_cpu() && rope_sin->is_cpu() && rope_cos->dim() == 2 && rope_cos->size(0) == dim / 2 &&
                    rope_sin->sizes() == rope_cos->sizes(),
                "rope_cos, rope_sin must be CPU float32 [D/2, T]");
    rope_len = rope_cos->size(1);  // checked against each sequence's length below
  }
  TORCH_CHECK(k_res.size(1) == kv_heads && k_res.size(3) == dim, "residual shape");
  TORCH_CHECK(page_table.dim() == 2 && page_table.size(0) == batch, "page_table must be [B, W]");
  kvforge_checks::per_sequence(kOpName, "positions and slots", batch, {&first_page_position, &visible_from, &lengths, &slots});
  const int64_t group = heads / kv_heads;
  std::vector<float> q_wide, k_wide, v_wide;  // 16-bit q, k_self, v_self widened (exactly)
  const Problem p{batch, kv_heads, group, dim, g, k_res.size(2), pages, page_table.size(1), k_res.size(0), gv,
                  sinks, sinks ? k_sink->data_ptr() : nullptr, sinks ? v_sink->data_ptr() : nullptr,
                  static_cast<float>(scale), as_float(q, q_wide), as_float(k_self, k_wide),
                  as_float(v_self, v_wide), k_codes.data_ptr<uint8_t>(), v_codes.data_ptr<uint8_t>(),
                  k_scale.data_ptr<c10::Half>(), k_zero.data_ptr<c10::Half>(), v_scale.data_ptr<c10::Half>(),
                  v_zero.data_ptr<c10::Half>(), k_res.data_ptr(), v_res.data_ptr(), res_dtype,
                  dim * static_cast<int64_t>(k_res.element_size()),
                  page_table.data_ptr<int64_t>(), first_page_position.data_ptr<int64_t>(),
                  visible_from.data_ptr<int64_t>(), lengths.data_ptr<int64_t>(), slots.data_ptr<int64_t>(),
                  rope_len ? rope_cos->data_ptr<float>() : nullptr, rope_len ? rope_sin->data_ptr<float>() : nullptr,
                  rope_len, key_dot == 1, value_dot == 1};

  // Units: each pair's visible quantised pages [col_lo, col_hi), cut into slices when the
  // batch alone would not give every thread several units (split-K).
  std::vector<int64_t> col_lo(batch), col_hi(batch);
  int64_t total_tokens = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const Span sp = span_of(p, b);
    TORCH_CHECK(p.rope_cos == nullptr || sp.n <= rope_len, "kivi_decode_attention: RoPE tables cover ", rope_len,
                " positions, sequence ", b, " holds ", sp.n);
    col_lo[b] = (sp.lo - sp.first) / g;
    col_hi[b] = std::max(col_lo[b], (sp.nk - sp.first) / g);
    total_tokens += ((col_hi[b] - col_lo[b]) * g + (sp.n - std::min(sp.n, std::max(sp.nk, sp.lo))) +
                     (sp.sink_hi - std::min(sp.sink_hi, sp.sink_lo))) * kv_heads;
  }
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t target_units = 4 * threads;
  const int64_t slice_pages = std::max<int64_t>(1, std::max(kMinUnitTokens, total_tokens / target_units) / g);
  std::vector<Unit> units;
  std::vector<int64_t> first_unit(batch * kv_heads + 1);
  for (int64_t pair = 0; pair < batch * kv_heads; ++pair) {
    const int64_t b = pair / kv_heads;
    first_unit[pair] = static_cast<int64_t>(units.size());
    const int64_t length = col_hi[b] - col_lo[b];
    const int64_t pieces = std::max<int64_t>(1, (length + slice_pages - 1) / slice_pages);
    for (int64_t i = 0; i < pieces; ++i) {
      units.push_back({pair, col_lo[b] + length * i / pieces, col_lo[b] + length * (i + 1) / pieces, i == 0});
    }
  }
  first_unit[batch * kv_heads] = static_cast<int64_t>(units.size());

  const int64_t state = group * (dim + 2);
  std::vector<float> partial(units.size() * state);
#ifdef KVFORGE_NATIVE_VEC
  if (g % NativeVec::kLanes == 0 && gv % NativeVec::kLanes == 0) {
    dispatch_bits<NativeVec>(bits, value_bits, units, p, partial.data());
  } else
#endif
  if (g % 8 == 0 && gv % 8 == 0) {
    dispatch_bits<ArrayVec<8>>(bits, value_bits, units, p, partial.data());
  } else {
    dispatch_bits<ArrayVec<1>>(bits, value_bits, units, p, partial.data());
  }

  // Merge the slices of each pair: out = sum_u acc_u e^(m_u - M) / sum_u l_u e^(m_u - M).
  // In q's dtype: a 16-bit output is each float32 result rounded to nearest even, as
  // Tensor.to rounds it (so callers need no conversion op of their own); only a NaN's bit
  // pattern may differ from Tensor.to's (c10 writes 0x7FC0, ATen's vector path 0xFFFF).
  at::Tensor out = at::empty({batch, heads, dim}, q.options());
  std::vector<float> merged(dim);
  for (int64_t pair = 0; pair < batch * kv_heads; ++pair) {
    const int64_t u0 = first_unit[pair], u1 = first_unit[pair + 1];
    for (int64_t hg = 0; hg < group; ++hg) {
      float* dst = merged.data();
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t u = u0; u < u1; ++u) top = std::max(top, partial[u * state + hg]);
      float sum = 0.f;
      std::fill(dst, dst + dim, 0.f);
      for (int64_t u = u0; u < u1; ++u) {
        const float* st = partial.data() + u * state;
        const float weight = u1 - u0 == 1 ? 1.f : std::exp(st[hg] - top);
        sum += st[group + hg] * weight;
        const float* part = st + 2 * group + hg * dim;
        for (int64_t d = 0; d < dim; ++d) dst[d] += weight * part[d];
      }
      const float inv = 1.f / sum;
      for (int64_t d = 0; d < dim; ++d) dst[d] *= inv;
      // pair = b * kv_heads + h; its query heads h * group + hg are contiguous in out.
      store_row(out, (pair * group + hg) * dim, dst, dim);
    }
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(kvforge_cpu_kivi, m) {
  m.def("kivi_decode_attention(Tensor q, Tensor k_self, Tensor v_self, Tensor k_codes, Tensor k_scale, "
        "Tensor k_zero, Tensor v_codes, Tensor v_scale, Tensor v_zero, Tensor k_res, Tensor v_res, "
        "Tensor page_table, Tensor first_page_position, Tensor visible_from, Tensor lengths, Tensor slots, "
        "float scale, int bits, Tensor? k_sink=None, Tensor? v_sink=None, int value_bits=0, "
        "Tensor? rope_cos=None, Tensor? rope_sin=None, int key_dot=0, int value_dot=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvforge_cpu_kivi, CPU, m) {
  m.impl("kivi_decode_attention", &kivi_decode_attention);
}
