// C++ source of the small-M fp32 linear kernel (see cpu_linear.py).
//
// y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N]) for the few rows of a decode step. BLAS sgemm
// is tuned for large M and streams W at a fraction of the memory bandwidth when M is 1..32;
// here every W row is read from memory exactly once: W is walked in tiles of NR = 4
// consecutive rows (one contiguous block of 4 * K floats), and while a tile sits in L1 all
// rows of x (small: M * K floats, L1/L2 resident) are multiplied with it, MR rows at a time,
// with NR * MR vector accumulators. A later tile is software-prefetched, spread over the
// K steps of all the groups. Tiles are split over threads with at::parallel_for.
//
// Registers `torch.ops.kvforge_cpu_linear.small_m_linear` through TORCH_LIBRARY (no
// pybind11/Python headers, like cache/full/cpu_decode.cpp).
//
// INVARIANT (M-invariance): every output y[m, n] is computed by exactly the same sequence of
// floating point operations whatever M is, whichever other rows x holds, where row m sits in
// x, and however many threads run:
//   - one vector accumulator per (m, n), starting at zero; lane l accumulates
//     x[m, k] * W[n, k] with a fused multiply-add for k = l, l + L, l + 2L, ... in increasing
//     k (the last partial step uses masked loads, whose zero lanes add exactly 0);
//   - the L lanes are reduced with one fixed tree (`reduce4`: the same tree for each of its
//     four outputs; unused slots get zero vectors and their results are dropped);
//   - then the bias is added (if any).
// The tile shape (NR, MR) only decides how many accumulators are live at once, never the
// arithmetic of one of them, and one output is never split between threads. So batched and
// single-sequence decode give bitwise-identical rows. The build uses -ffp-contract=off so
// the portable path's a * b + c is not fused in some instantiations and not in others.
// (The result differs from BLAS in the last bits: a different but fixed summation order.)
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace {

constexpr int kNR = 4;  // W rows per tile (the four outputs one reduce4 produces)

// Minimum W floats per parallel chunk: below this a thread hand-off costs more than it saves.
constexpr int64_t kMinChunkFloats = 32 * 1024;

// How many tiles ahead W is software-prefetched (1, 2, 4 and 8 measured about the same).
constexpr int64_t kPrefetchTiles = 1;

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// [sum(a), sum(b), sum(c), sum(d)] of 8-lane vectors; each sum is
// ((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 + v7)), independently of the other inputs.
inline __m128 sum4_256(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}
#endif

// ---- vector types: one per ISA, selected at compile time ------------------------------
// Each provides: V (register type), L (lanes), MR (x rows per tile, sized so that the
// NR * MR accumulators and NR weight vectors fit the register file), zero, load,
// load_tail (first n < L lanes, rest zero), fmadd(a, b, c) = a * b + c, in_register (an
// optimisation barrier, no arithmetic), prefetch, and
// reduce4 (writes the four sums with the fixed reduction tree of the invariant above).
#if defined(__AVX512F__)
struct Avx512 {
  using V = __m512;
  static constexpr int64_t L = 16;
  static constexpr int MR = 6;  // 24 accumulators + 4 weights of 32 zmm registers
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load_tail(const float* p, int64_t n) {
    return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1u), p);
  }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  // Pins a loaded vector in a register: otherwise GCC folds the x load into each of the NR
  // FMAs that use it (NR loads instead of one), and the kernel becomes load-port bound.
  static V in_register(V v) {
    __asm__("" : "+v"(v));
    return v;
  }
  static void prefetch(const float* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0); }
  // Fold 16 lanes to 8 (lane i + lane i + 8), then the 8-lane tree.
  static __m256 fold(V x) {
    return _mm256_add_ps(_mm512_castps512_ps256(x),
                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
  }
  static void reduce4(V a, V b, V c, V d, float* out) {
    _mm_storeu_ps(out, sum4_256(fold(a), fold(b), fold(c), fold(d)));
  }
};
using NativeIsa = Avx512;
#elif defined(__AVX2__) && defined(__FMA__)
struct Avx2 {
  using V = __m256;
  static constexpr int64_t L = 8;
  static constexpr int MR = 3;  // 12 accumulators + 4 weights of 16 ymm registers
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V load_tail(const float* p, int64_t n) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), lanes);
    return _mm256_maskload_ps(p, mask);
  }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V in_register(V v) {
    __asm__("" : "+x"(v));
    return v;
  }
  static void prefetch(const float* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0); }
  static void reduce4(V a, V b, V c, V d, float* out) { _mm_storeu_ps(out, sum4_256(a, b, c, d)); }
};
using NativeIsa = Avx2;
#endif

// Portable: plain C++ over 8 lanes that compilers auto-vectorise (SSE, NEON).
struct Portable {
  struct V {
    float v[8];
  };
  static constexpr int64_t L = 8;
  static constexpr int MR = 4;
  static V zero() { return V{}; }
  static V load(const float* p) {
    V r;
    for (int i = 0; i < 8; ++i) r.v[i] = p[i];
    return r;
  }
  static V load_tail(const float* p, int64_t n) {
    V r{};
    for (int64_t i = 0; i < n; ++i) r.v[i] = p[i];
    return r;
  }
  static V fmadd(const V& a, const V& b, const V& c) {
    V r;
    for (int i = 0; i < 8; ++i) r.v[i] = a.v[i] * b.v[i] + c.v[i];  // not contracted: -ffp-contract=off
    return r;
  }
  static const V& in_register(const V& v) { return v; }
  static void prefetch(const float* p) {
#if defined(__GNUC__)
    __builtin_prefetch(p);
#else
    (void)p;
#endif
  }
  static float sum(const V& x) {
    return ((x.v[0] + x.v[1]) + (x.v[2] + x.v[3])) + ((x.v[4] + x.v[5]) + (x.v[6] + x.v[7]));
  }
  static void reduce4(const V& a, const V& b, const V& c, const V& d, float* out) {
    out[0] = sum(a);
    out[1] = sum(b);
    out[2] = sum(c);
    out[3] = sum(d);
  }
};

struct Problem {
  const float* x;     // [M, K]
  const float* w;     // [N, K]
  const float* bias;  // [N] or nullptr
  float* y;           // [M, N]
  int64_t m, k, n;
};

// Software prefetch of a W range (a later tile), spread evenly over all the K steps of all
// the x-row groups of the current tile, so the memory stream stays busy while the later
// groups compute from L1 (issuing it all at once would stall on the miss buffers).
struct Prefetcher {
  const float* cur = nullptr;  // next cache line to prefetch
  const float* end = nullptr;
  int64_t per_step = 0;  // lines per K step
};

constexpr int64_t kLineFloats = 16;  // 64-byte cache lines

// y[m0 : m0 + MR, n0 : n0 + NR] for one W tile and MR rows of x.
template <typename Isa, int NR, int MR>
inline void tile(const Problem& p, int64_t n0, int64_t m0, Prefetcher& pf) {
  using V = typename Isa::V;
  constexpr int64_t L = Isa::L;
  const int64_t K = p.k;
  const float* w = p.w + n0 * K;
  const float* x = p.x + m0 * K;
  V acc[NR][MR];
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r) {
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) acc[r][i] = Isa::zero();
  }
  int64_t k = 0;
  for (; k + L <= K; k += L) {
    for (int64_t j = 0; j < pf.per_step && pf.cur < pf.end; ++j, pf.cur += kLineFloats) Isa::prefetch(pf.cur);
    V wv[NR];
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) wv[r] = Isa::load(w + r * K + k);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const V xv = Isa::in_register(Isa::load(x + i * K + k));
#pragma GCC unroll 8
      for (int r = 0; r < NR; ++r) acc[r][i] = Isa::fmadd(wv[r], xv, acc[r][i]);
    }
  }
  if (k < K) {  // masked tail: same accumulators, zero lanes contribute exactly 0
    const int64_t rest = K - k;
    V wv[NR];
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) wv[r] = Isa::load_tail(w + r * K + k, rest);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const V xv = Isa::load_tail(x + i * K + k, rest);
#pragma GCC unroll 8
      for (int r = 0; r < NR; ++r) acc[r][i] = Isa::fmadd(wv[r], xv, acc[r][i]);
    }
  }
  const V z = Isa::zero();
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    float sums[4];
    Isa::reduce4(acc[0][i], NR > 1 ? acc[1 % NR][i] : z, NR > 2 ? acc[2 % NR][i] : z,
                 NR > 3 ? acc[3 % NR][i] : z, sums);
    float* y = p.y + (m0 + i) * p.n + n0;
    if (p.bias != nullptr) {
      for (int r = 0; r < NR; ++r) y[r] = sums[r] + p.bias[n0 + r];
    } else {
      for (int r = 0; r < NR; ++r) y[r] = sums[r];
    }
  }
}

// One W tile (rows n0 .. n0 + NR) against all M rows of x, MR rows at a time: the first
// group streams the tile from memory (or from where the prefetches put it), the others
// find it in L1.
template <typename Isa, int NR>
void tile_column(const Problem& p, int64_t n0, Prefetcher& pf) {
  constexpr int MR = Isa::MR;
  int64_t m0 = 0;
  for (; m0 + MR <= p.m; m0 += MR) tile<Isa, NR, MR>(p, n0, m0, pf);
  // rest < MR <= 6: a smaller tile, with identical per-output arithmetic.
  switch (p.m - m0) {
#define KVFORGE_REST_CASE(R)                                   \
  case R:                                                      \
    if constexpr (R < MR) tile<Isa, NR, R>(p, n0, m0, pf);     \
    break;
    KVFORGE_REST_CASE(1)
    KVFORGE_REST_CASE(2)
    KVFORGE_REST_CASE(3)
    KVFORGE_REST_CASE(4)
    KVFORGE_REST_CASE(5)
#undef KVFORGE_REST_CASE
    default:
      break;
  }
}

template <typename Isa>
void run(const Problem& p) {
  const int64_t full_tiles = p.n / kNR;
  const int64_t tiles = (p.n + kNR - 1) / kNR;
  const int64_t grain = std::max<int64_t>(1, kMinChunkFloats / std::max<int64_t>(1, kNR * p.k));
  const int64_t groups = (p.m + Isa::MR - 1) / Isa::MR;
  const int64_t steps = groups * std::max<int64_t>(1, p.k / Isa::L);  // K steps per tile
  const int64_t tile_lines = (kNR * p.k + kLineFloats - 1) / kLineFloats;
  const int64_t per_step = (tile_lines + steps - 1) / steps;
  // Each thread gets a contiguous range of tiles, so its W reads are one sequential stream.
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    const float* range_end = p.w + std::min(end * kNR, p.n) * p.k;
    Prefetcher pf;
    pf.per_step = per_step;
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kNR;
      // While tile t runs, prefetch tile t + kPrefetchTiles (within this thread's range).
      pf.cur = std::min(range_end, p.w + (n0 + kPrefetchTiles * kNR) * p.k);
      pf.end = std::min(range_end, p.w + (n0 + (kPrefetchTiles + 1) * kNR) * p.k);
      if (t < full_tiles) {
        tile_column<Isa, kNR>(p, n0, pf);
      } else {
        switch (p.n - n0) {  // the last, partial tile
          case 1:
            tile_column<Isa, 1>(p, n0, pf);
            break;
          case 2:
            tile_column<Isa, 2>(p, n0, pf);
            break;
          default:
            tile_column<Isa, 3>(p, n0, pf);
            break;
        }
      }
    }
  });
}

at::Tensor small_m_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "small_m_linear: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2, "small_m_linear: x must be [M, K] and weight [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "small_m_linear: x and weight must be float32");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "small_m_linear: x and weight must be contiguous");
  TORCH_CHECK(x.size(1) == weight.size(1), "small_m_linear: x has ", x.size(1), " columns but weight has ",
              weight.size(1));
  const float* bias_ptr = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->device().is_cpu() && bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                    bias->dim() == 1 && bias->size(0) == weight.size(0),
                "small_m_linear: bias must be a contiguous float32 CPU vector of size N");
    bias_ptr = bias->data_ptr<float>();
  }
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return y;
  const Problem p{x.data_ptr<float>(), weight.data_ptr<float>(), bias_ptr, y.data_ptr<float>(), m, k, n};
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  run<NativeIsa>(p);
#else
  run<Portable>(p);
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY(kvforge_cpu_linear, m) {
  m.def("small_m_linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvforge_cpu_linear, CPU, m) {
  m.impl("small_m_linear", &small_m_linear);
}
