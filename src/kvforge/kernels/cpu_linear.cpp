// C++ source of the small-M linear kernel (see cpu_linear.py).
//
// y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N]) for the few rows of a decode step. W is float32,
// bfloat16 or float16 (a decode step reads W once and nothing else of that size, so 2-byte
// weights halve its time), x and y of W's dtype. Every product and sum is float32 and each y
// is rounded once to the dtype: x is widened once into a small buffer (or, bf16 with
// AVX512-BF16, read as is by the pair dot product), with no ATen cast ops (at ~200 calls per
// decode step their dispatch would cost a visible part of the step; docs/benchmarks.md,
// 'Measurements behind design choices'). BLAS sgemm is tuned for large M and streams W at a
// fraction of the memory bandwidth when M is 1..32;
// here every W row is read from memory exactly once: W is walked in tiles of NR = 4
// consecutive rows (one contiguous block of 4 * K floats), and while a tile sits in L1 all
// rows of x (small: M * K floats, L1/L2 resident) are multiplied with it, MR rows at a time,
// with NR * MR vector accumulators. A later tile is software-prefetched (into L2 for up to
// kL2PrefetchMaxGroups row groups, into L1 beyond), spread over the
// K steps of all the groups. Tiles are split over threads with at::parallel_for.
//
// bf16 on a CPU with AMX (and a fitting shape) takes the tile path of cpu_amx_linear.h instead.
//
// Registers `torch.ops.kvforge_cpu_linear.small_m_linear` through TORCH_LIBRARY (no
// pybind11/Python headers, like cache/full/cpu_decode.cpp).
//
// INVARIANT (M-invariance): every output y[m, n] is computed by exactly the same sequence of
// floating point operations whatever M is, whichever other rows x holds, where row m sits in
// x, and however many threads run:
//   - one vector accumulator per (m, n), starting at zero; lane l accumulates
//     float(x[m, k]) * float(W[n, k]) (widening bf16/f16 to float is exact) with a fused
//     multiply-add for k = l, l + L, l + 2L, ... in increasing k (bf16 with AVX512-BF16: the
//     pairs k = 2l, 2l + 1, then 2l + 32, 2l + 33, ... with VDPBF16PS; see Avx512Bf16); the
//     last partial step reads zero-padded copies, whose zero lanes add exactly 0;
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
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "cpu_amx_linear.h"  // defines KVFORGE_AMX_LINEAR with AMX-BF16 (Linux)
#include "cpu_bf16_round.h"
#include "cpu_convert.h"
#include "cpu_simd.h"  // NativeVec (KVFORGE_NATIVE_VEC), ArrayVec

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace {

constexpr int kNR = 4;  // W rows per tile (the four outputs one reduce4 produces)

// Minimum W floats per parallel chunk: below this a thread hand-off costs more than it saves.
constexpr int64_t kMinChunkFloats = 32 * 1024;

// How far ahead W is software-prefetched: ceil(this / tile bytes) tiles (a tile is kNR rows
// of K weights: 4.5 KiB at K = 576 in bf16, so 2 tiles ahead; 12 KiB at K = 1536, so 1).
// Against 1 tile ahead (the previous rule) this made smollm2-135m's bf16 decode steps faster
// at batch 1 (in most runs) and 4 and left batch 16 (compute-bound there) about the same, and
// the linear layers alone faster at M = 1; in a C++ stream of W at M = 1, 2 tiles ahead read
// faster than 1, and 3, 4 and 8 tiles were slower than 2 (docs/benchmarks.md, 'Measurements
// behind design choices'). Settable for A/B runs (`set_prefetch_bytes`).
std::atomic<int64_t> g_prefetch_bytes{8192};

// Up to this many x-row groups per tile (M <= 18 with AVX-512), the later tile is prefetched
// into L2 instead of L1. On a 2-core Zen 4 this made M = 4 and M = 16 faster and left M = 1
// and M = 8 unchanged within noise. With the T0 hint the single-thread stream at M = 4 read
// W much slower than at M = 1, its time in the W loads (the L1 prefetches evidently did not
// land in time). At M = 32 (6 groups) T1 everywhere was slower than T0, so more groups keep
// T0 (docs/benchmarks.md, 'Measurements behind design choices').
constexpr int64_t kL2PrefetchMaxGroups = 3;

#ifdef KVFORGE_NATIVE_VEC
// One cache line towards the core: into L2 only (T1) or all the way into L1 (T0).
inline void prefetch_line(const float* p, bool to_l2) {
  if (to_l2) {
    _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1);
  } else {
    _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0);
  }
}
#endif

// ---- vector types: one per ISA, selected at compile time ------------------------------
// Each float ISA provides: V (register type), L (lanes), MR (x rows per tile, sized so that
// the NR * MR accumulators and NR weight vectors fit the register file), zero, load (L
// floats), load_w<T> (L weights of element type T, widened exactly), fmadd(a, b, c) =
// a * b + c, in_register (an optimisation barrier, no arithmetic), prefetch, and reduce4
// (the four sums with the fixed reduction tree of the invariant above). The vectors are
// cpu_simd.h's: NativeVec (AVX-512 or AVX2, fused multiply-adds) and ArrayVec<8> (portable).
// Tails (the last K % L elements) go through a zero-padded copy (`load_tail`).
//
// The tile loop sees an ISA through a policy: Acc (accumulator register), Op (operand
// register), XT (x's element type in memory), L (k elements per step), zero() -> Acc,
// load_x(const XT*) -> Op, load_w<T>(const T*) -> Op, madd(w, x, acc) -> Acc. The float
// ISAs widen everything to float and use one FMA per lane (the macro below); the bf16 dot
// ISA keeps x and W in bf16 and multiply-adds pairs of them into float lanes.
#define KVFORGE_FLOAT_POLICY                                       \
  using Acc = V;                                                   \
  using Op = V;                                                    \
  using XT = float;                                                \
  static V load_x(const float* p) { return load(p); }              \
  static V madd(V w, V x, V acc) { return fmadd(w, x, acc); }

// Weight element types: float, c10::BFloat16, c10::Half (2-byte types are read as bits).
template <typename T>
constexpr bool kIsBFloat16 = std::is_same_v<T, c10::BFloat16>;
#ifdef KVFORGE_NATIVE_VEC
// The widest ISA compiled for: 16 lanes with AVX-512 (6 x-row groups: 24 accumulators + 4
// weights of 32 zmm registers), 8 with AVX2 (3: 12 accumulators + 4 weights of 16 ymm).
// reduce4 is NativeVec::sum4: 16 lanes fold to 8 (lane i + lane i + 8), then the 8-lane tree.
struct Native {
  using V = kvforge_simd::NativeVec;
  static constexpr int64_t L = V::kLanes;
  static constexpr int MR = L == 16 ? 6 : 3;
  static V zero() { return V::zero(); }
  static V load(const float* p) { return V::load(p); }
  template <typename T>
  static V load_w(const T* p) { return V::load(p); }
  static V fmadd(V a, V b, V c) { return V::fmadd(a, b, c); }
  KVFORGE_FLOAT_POLICY
  // Pins a loaded vector in a register: otherwise GCC folds the x load into each of the NR
  // FMAs that use it (NR loads instead of one), and the kernel becomes load-port bound.
  static V in_register(V v) {
#if defined(__AVX512F__)
    __asm__("" : "+v"(v.v));
#else
    __asm__("" : "+x"(v.v));
#endif
    return v;
  }
  static void prefetch(const float* p, bool to_l2) { prefetch_line(p, to_l2); }
  static void reduce4(V a, V b, V c, V d, float* out) { V::sum4(a, b, c, d, out); }
};
using NativeIsa = Native;

#if defined(__AVX512BF16__)
// bf16 weights and bf16 x (a bf16 model's activations): VDPBF16PS multiplies 32 bf16 pairs
// and adds each adjacent pair of products into one of 16 float lanes, so lane l accumulates
// x[k] W[k] + x[k+1] W[k+1] for k = 2l, 2l + 32, ... (the products of two bf16 are exact in
// float; each addition rounds to nearest even, as an FMA chain does). Twice the multiply-adds
// of the widening path per instruction: at M >= 8 rows the float path is compute-bound.
// The invariant holds as for the float ISAs: a fixed sequence per output whatever M is.
#define KVFORGE_BF16_DOT 1
struct Avx512Bf16 {
  using Acc = __m512;
  using Op = __m512i;
  using XT = c10::BFloat16;
  static constexpr int64_t L = 32;
  static constexpr int MR = 6;
  static Acc zero() { return _mm512_setzero_ps(); }
  static Op load_x(const XT* p) { return _mm512_loadu_si512(p); }
  template <typename T>
  static Op load_w(const T* p) {
    static_assert(kIsBFloat16<T>, "the bf16 dot ISA reads bf16 weights only");
    return _mm512_loadu_si512(p);
  }
  static Acc madd(Op w, Op x, Acc acc) { return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)x); }
  static Op in_register(Op v) {
    __asm__("" : "+v"(v));
    return v;
  }
  static void prefetch(const float* p, bool to_l2) { prefetch_line(p, to_l2); }
  static void reduce4(Acc a, Acc b, Acc c, Acc d, float* out) { Native::reduce4({a}, {b}, {c}, {d}, out); }
};
#endif
#endif

// Portable: plain C++ over 8 lanes that compilers auto-vectorise (SSE, NEON); reduce4 sums
// each vector by the same tree as the 8-lane native one (ArrayVec::sum_pairwise).
struct Portable {
  using V = kvforge_simd::ArrayVec<8>;
  static constexpr int64_t L = 8;
  static constexpr int MR = 4;
  static V zero() { return V::zero(); }
  static V load(const float* p) { return V::load(p); }
  template <typename T>
  static V load_w(const T* p) { return V::load(p); }
  static V fmadd(const V& a, const V& b, const V& c) { return V::fmadd(a, b, c); }  // unfused: -ffp-contract=off
  KVFORGE_FLOAT_POLICY
  static const V& in_register(const V& v) { return v; }
  static void prefetch(const float* p, bool to_l2) {
#if defined(__GNUC__)
    if (to_l2) {
      __builtin_prefetch(p, 0, 2);
    } else {
      __builtin_prefetch(p, 0, 3);
    }
#else
    (void)p;
    (void)to_l2;
#endif
  }
  static void reduce4(const V& a, const V& b, const V& c, const V& d, float* out) {
    out[0] = a.sum_pairwise();
    out[1] = b.sum_pairwise();
    out[2] = c.sum_pairwise();
    out[3] = d.sum_pairwise();
  }
};

// The first n < L elements of p, zero-padded to L lanes, as a vector (through a copy: the
// tail is at most one step per row, so its cost does not matter).
template <typename Isa, typename T>
inline typename Isa::Op load_tail(const T* p, int64_t n) {
  T buf[Isa::L];
  std::memset(static_cast<void*>(buf), 0, sizeof(buf));  // all-zero bits are +0 in every type
  std::memcpy(static_cast<void*>(buf), p, static_cast<size_t>(n) * sizeof(T));
  if constexpr (std::is_same_v<T, typename Isa::XT>) {
    return Isa::load_x(buf);
  } else {
    return Isa::template load_w<T>(buf);
  }
}

template <typename XT, typename T>
struct Problem {
  const XT* x;        // [M, K]
  const T* w;         // [N, K]
  const float* bias;  // [N] or nullptr
  T* y;               // [M, N], each element rounded once from float (unused with y_float)
  int64_t m, k, n;
  float* y_float = nullptr;  // [M, N] float32 output instead of y: the sums unrounded (logits)
};

// Software prefetch of a W range (a later tile), spread evenly over all the K steps of all
// the x-row groups of the current tile, so the memory stream stays busy while the later
// groups compute from L1 (issuing it all at once would stall on the miss buffers).
struct Prefetcher {
  const char* cur = nullptr;  // next cache line to prefetch
  const char* end = nullptr;
  int64_t per_step = 0;  // lines per K step
  bool to_l2 = false;    // prefetch into L2 (T1) rather than L1 (T0); see kL2PrefetchMaxGroups
};

constexpr int64_t kLineBytes = 64;

// y[m0 : m0 + MR, n0 : n0 + NR] for one W tile and MR rows of x.
template <typename Isa, typename T, int NR, int MR>
inline void tile(const Problem<typename Isa::XT, T>& p, int64_t n0, int64_t m0, Prefetcher& pf) {
  using Acc = typename Isa::Acc;
  using Op = typename Isa::Op;
  constexpr int64_t L = Isa::L;
  const int64_t K = p.k;
  const T* w = p.w + n0 * K;
  const typename Isa::XT* x = p.x + m0 * K;
  Acc acc[NR][MR];
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r) {
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) acc[r][i] = Isa::zero();
  }
  // The prefetch cursor in locals (registers) for the K loop: through the reference, GCC
  // reloads and stores it every step, as it cannot prove the stores below do not alias it.
  const char* cursor = pf.cur;
  const char* const cursor_end = pf.end;
  const int64_t per_step = pf.per_step;
  const bool to_l2 = pf.to_l2;
  int64_t k = 0;
  for (; k + L <= K; k += L) {
    for (int64_t j = 0; j < per_step && cursor < cursor_end; ++j, cursor += kLineBytes) {
      Isa::prefetch(reinterpret_cast<const float*>(cursor), to_l2);
    }
    Op wv[NR];
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) wv[r] = Isa::template load_w<T>(w + r * K + k);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const Op xv = Isa::in_register(Isa::load_x(x + i * K + k));
#pragma GCC unroll 8
      for (int r = 0; r < NR; ++r) acc[r][i] = Isa::madd(wv[r], xv, acc[r][i]);
    }
  }
  pf.cur = cursor;
  if (k < K) {  // masked tail: same accumulators, zero lanes contribute exactly 0
    const int64_t rest = K - k;
    Op wv[NR];
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) wv[r] = load_tail<Isa>(w + r * K + k, rest);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const Op xv = load_tail<Isa>(x + i * K + k, rest);
#pragma GCC unroll 8
      for (int r = 0; r < NR; ++r) acc[r][i] = Isa::madd(wv[r], xv, acc[r][i]);
    }
  }
  const Acc z = Isa::zero();
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    float sums[4];
    Isa::reduce4(acc[0][i], NR > 1 ? acc[1 % NR][i] : z, NR > 2 ? acc[2 % NR][i] : z,
                 NR > 3 ? acc[3 % NR][i] : z, sums);
    if (p.y_float != nullptr) {  // the same sums (+ bias), kept in float32
      float* yf = p.y_float + (m0 + i) * p.n + n0;
      for (int r = 0; r < NR; ++r) yf[r] = p.bias != nullptr ? sums[r] + p.bias[n0 + r] : sums[r];
      continue;
    }
    T* y = p.y + (m0 + i) * p.n + n0;
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
    if constexpr (kIsBFloat16<T> && NR == 4) {
      // The same sum (+ bias) and rounding (c10::BFloat16's rule, cpu_bf16_round.h) for the
      // tile's 4 outputs in one vector conversion rather than four scalar ones with a NaN
      // test and branch each: at K = 576 those were about a third of the instructions a row
      // group executes (counted in the compiled code); measured faster than the scalar
      // version at M = 4, 16 and 17 (docs/benchmarks.md, 'Measurements behind design
      // choices').
      __m128 v = _mm_loadu_ps(sums);
      if (p.bias != nullptr) v = _mm_add_ps(v, _mm_loadu_ps(p.bias + n0));
      kvforge_bf16_round::store4(v, y);
      continue;
    }
#endif
    if (p.bias != nullptr) {
      for (int r = 0; r < NR; ++r) y[r] = static_cast<T>(sums[r] + p.bias[n0 + r]);
    } else {
      for (int r = 0; r < NR; ++r) y[r] = static_cast<T>(sums[r]);
    }
  }
}

// One W tile (rows n0 .. n0 + NR) against all M rows of x, MR rows at a time: the first
// group streams the tile from memory (or from where the prefetches put it), the others
// find it in L1.
template <typename Isa, typename T, int NR>
void tile_column(const Problem<typename Isa::XT, T>& p, int64_t n0, Prefetcher& pf) {
  constexpr int MR = Isa::MR;
  int64_t m0 = 0;
  for (; m0 + MR <= p.m; m0 += MR) tile<Isa, T, NR, MR>(p, n0, m0, pf);
  // rest < MR <= 6: a smaller tile, with identical per-output arithmetic.
  switch (p.m - m0) {
#define KVFORGE_REST_CASE(R)                                   \
  case R:                                                      \
    if constexpr (R < MR) tile<Isa, T, NR, R>(p, n0, m0, pf);  \
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

// Several products with the same x (and K) in one parallel range: the tiles of ps[0], then
// of ps[1], ... (e.g. the q, k and v projections of a layer). One fork/join instead of one
// per product, and the smaller matrices no longer run alone. Each output's arithmetic is
// exactly that of a call for its product alone (the invariant above).
template <typename Isa, typename T>
void run_many(const std::vector<Problem<typename Isa::XT, T>>& ps) {
  const size_t count = ps.size();
  std::vector<int64_t> first_tile(count + 1, 0);
  for (size_t i = 0; i < count; ++i) first_tile[i + 1] = first_tile[i] + (ps[i].n + kNR - 1) / kNR;
  const int64_t tiles = first_tile[count];
  const Problem<typename Isa::XT, T>& p0 = ps[0];
  const int64_t grain = std::max<int64_t>(1, kMinChunkFloats / std::max<int64_t>(1, kNR * p0.k));
  const int64_t groups = (p0.m + Isa::MR - 1) / Isa::MR;
  const int64_t steps = groups * std::max<int64_t>(1, p0.k / Isa::L);  // K steps per tile
  const int64_t tile_lines = (kNR * p0.k * static_cast<int64_t>(sizeof(T)) + kLineBytes - 1) / kLineBytes;
  const int64_t per_step = (tile_lines + steps - 1) / steps;
  const int64_t row_bytes = p0.k * static_cast<int64_t>(sizeof(T));
  const int64_t tile_bytes = kNR * row_bytes;
  // in tiles (at least the next one; at most `tiles`, which keeps the row arithmetic below
  // far from overflow)
  const int64_t wanted = (g_prefetch_bytes.load() + tile_bytes - 1) / tile_bytes;
  const int64_t ahead = std::clamp<int64_t>(wanted, 1, std::max<int64_t>(1, tiles));
  // Each thread gets a contiguous range of tiles, so its W reads are sequential streams.
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    size_t s = static_cast<size_t>(std::upper_bound(first_tile.begin(), first_tile.end(), begin) -
                                   first_tile.begin()) - 1;
    Prefetcher pf;
    pf.per_step = per_step;
    pf.to_l2 = groups <= kL2PrefetchMaxGroups;
    for (int64_t t = begin; t < end; ++t) {
      while (t >= first_tile[s + 1]) ++s;
      const Problem<typename Isa::XT, T>& p = ps[s];
      const int64_t local = t - first_tile[s];
      const int64_t n0 = local * kNR;
      const char* w_bytes = reinterpret_cast<const char*>(p.w);
      const int64_t local_end = std::min(end, first_tile[s + 1]) - first_tile[s];
      const int64_t range_rows = std::min(local_end * kNR, p.n);
      // While tile t runs, prefetch tile t + ahead (within this thread's range of this product;
      // clamped as row counts, so no pointer past the weights is ever formed).
      pf.cur = w_bytes + std::min(range_rows, n0 + ahead * kNR) * row_bytes;
      pf.end = w_bytes + std::min(range_rows, n0 + (ahead + 1) * kNR) * row_bytes;
      if (local < p.n / kNR) {
        tile_column<Isa, T, kNR>(p, n0, pf);
      } else {
        switch (p.n - n0) {  // the last, partial tile
          case 1:
            tile_column<Isa, T, 1>(p, n0, pf);
            break;
          case 2:
            tile_column<Isa, T, 2>(p, n0, pf);
            break;
          default:
            tile_column<Isa, T, 3>(p, n0, pf);
            break;
        }
      }
    }
  });
}

template <typename Isa, typename T>
void run(const Problem<typename Isa::XT, T>& p) {
  run_many<Isa, T>({p});
}

#ifdef KVFORGE_NATIVE_VEC
using Isa = NativeIsa;
#else
using Isa = Portable;
#endif

// Whether a bf16 product takes the AMX path: AMX granted to the process, the switch on, and
// its shape fits. Never depends on M (the M-invariance).
bool amx_applies(int64_t k, const at::Tensor& weight) {
#if defined(KVFORGE_AMX_LINEAR)
  return kvforge_amx::switch_on().load() && kvforge_amx::granted() && kvforge_amx::shape_fits(k, weight.size(0));
#else
  (void)k;
  (void)weight;
  return false;
#endif
}

template <typename T>
void run_typed(const at::Tensor& x, const std::vector<const at::Tensor*>& weights,
               const std::vector<const at::Tensor*>& biases, std::vector<at::Tensor>& ys, bool widen,
               bool float_out) {
  // float_out: ys are float32 and take each output's float sum (+ bias) unrounded
  auto out_of = [&](size_t i) -> T* { return float_out ? nullptr : reinterpret_cast<T*>(ys[i].data_ptr()); };
  auto float_of = [&](size_t i) -> float* { return float_out ? ys[i].data_ptr<float>() : nullptr; };
  std::vector<std::vector<float>> bias_buffers(weights.size());
  auto bias_of = [&](size_t i) -> const float* {
    return biases[i] == nullptr ? nullptr : kvforge_convert::floats_of(*biases[i], bias_buffers[i]);
  };
#if defined(KVFORGE_BF16_DOT)
  if (kIsBFloat16<T> && !widen) {  // x stays bf16: the tile or dot instructions read it as is
    // Each product takes the AMX path if its shape fits, else the AVX512-BF16 path, as its
    // own call would (so every output equals its own call's bitwise).
    std::vector<size_t> rest;
#if defined(KVFORGE_AMX_LINEAR)
    std::vector<kvforge_amx::Product> tiled;
    for (size_t i = 0; i < weights.size(); ++i) {
      if (float_out || !amx_applies(x.size(1), *weights[i])) {  // the tile path writes bf16 only
        rest.push_back(i);
        continue;
      }
      tiled.push_back({reinterpret_cast<const uint16_t*>(weights[i]->const_data_ptr()), bias_of(i),
                       reinterpret_cast<uint16_t*>(ys[i].data_ptr()), weights[i]->size(0)});
    }
    if (!tiled.empty()) {
      kvforge_amx::linear(reinterpret_cast<const uint16_t*>(x.const_data_ptr()), x.size(0), x.size(1), tiled);
    }
#else
    for (size_t i = 0; i < weights.size(); ++i) rest.push_back(i);
#endif
    if (rest.empty()) return;
    std::vector<Problem<c10::BFloat16, T>> ps;
    for (size_t i : rest) {
      ps.push_back({reinterpret_cast<const c10::BFloat16*>(x.const_data_ptr()),
                    reinterpret_cast<const T*>(weights[i]->const_data_ptr()), bias_of(i),
                    out_of(i), x.size(0), x.size(1), weights[i]->size(0), float_of(i)});
    }
    if constexpr (kIsBFloat16<T>) run_many<Avx512Bf16, T>(ps);
    return;
  }
#endif
  std::vector<float> x_buffer;
  const float* xf = kvforge_convert::floats_of(x, x_buffer);
  std::vector<Problem<float, T>> ps;
  for (size_t i = 0; i < weights.size(); ++i) {
    ps.push_back({xf, reinterpret_cast<const T*>(weights[i]->const_data_ptr()), bias_of(i), out_of(i), x.size(0),
                  x.size(1), weights[i]->size(0), float_of(i)});
  }
  run_many<Isa, T>(ps);
}

void check_operands(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                    const at::Tensor*& bias_ptr) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "small_m_linear: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2, "small_m_linear: x must be [M, K] and weight [N, K]");
  const at::ScalarType dtype = weight.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "small_m_linear: weight must be float32, bfloat16 or float16, got ", dtype);
  TORCH_CHECK(x.scalar_type() == dtype, "small_m_linear: x is ", x.scalar_type(), " but weight is ", dtype);
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "small_m_linear: x and weight must be contiguous");
  TORCH_CHECK(x.size(1) == weight.size(1), "small_m_linear: x has ", x.size(1), " columns but weight has ",
              weight.size(1));
  bias_ptr = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->device().is_cpu() && bias->scalar_type() == dtype && bias->is_contiguous() &&
                    bias->dim() == 1 && bias->size(0) == weight.size(0),
                "small_m_linear: bias must be a contiguous CPU vector of size N with the weight's dtype");
    bias_ptr = &*bias;
  }
}

// ys[i] = x @ weights[i]^T (+ biases[i]) for products sharing x (every output bitwise as its
// own small_m_linear call would give it).
std::vector<at::Tensor> linear_many(const at::Tensor& x, const std::vector<const at::Tensor*>& weights,
                                    const std::vector<const at::Tensor*>& biases, bool widen,
                                    bool float_out = false) {
  std::vector<at::Tensor> ys;
  bool empty = false;
  for (const at::Tensor* w : weights) {
    ys.push_back(at::empty({x.size(0), w->size(0)}, float_out ? x.options().dtype(at::kFloat) : x.options()));
    empty = empty || ys.back().numel() == 0;
  }
  if (weights.empty() || empty) {  // nothing to compute for an empty product: run the others alone
    for (size_t i = 0; i < weights.size(); ++i) {
      if (ys[i].numel() == 0) continue;
      std::vector<at::Tensor> one{ys[i]};
      const std::vector<const at::Tensor*> w{weights[i]}, b{biases[i]};
      switch (weights[i]->scalar_type()) {
        case at::kBFloat16: run_typed<c10::BFloat16>(x, w, b, one, widen, float_out); break;
        case at::kHalf: run_typed<c10::Half>(x, w, b, one, widen, float_out); break;
        default: run_typed<float>(x, w, b, one, widen, float_out); break;
      }
    }
    return ys;
  }
  switch (weights[0]->scalar_type()) {
    case at::kBFloat16:
      run_typed<c10::BFloat16>(x, weights, biases, ys, widen, float_out);
      break;
    case at::kHalf:
      run_typed<c10::Half>(x, weights, biases, ys, widen, float_out);
      break;
    default:
      run_typed<float>(x, weights, biases, ys, widen, float_out);
      break;
  }
  return ys;
}

// x, weight and bias (or none) of one dtype in {float32, bfloat16, float16}; y has that dtype.
// widen: bf16 through the widening float path even where the bf16 dot ISA exists (to compare
// the two; each is M-invariant on its own, they differ from each other by rounding).
at::Tensor small_m_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                          bool widen) {
  const at::Tensor* bias_ptr = nullptr;
  check_operands(x, weight, bias, bias_ptr);
  return linear_many(x, {&weight}, {bias_ptr}, widen)[0];
}

// small_m_linear with a float32 y holding each output's float sum (+ bias) before the rounding
// small_m_linear applies (the same arithmetic otherwise, so M-invariant too): the
// vocabulary projection of a 2-byte model, whose logits rounded to bf16 would tie (at |y| ~ 25
// bf16 steps by 0.125) where the model's preference is clear.
at::Tensor small_m_linear_float_out(const at::Tensor& x, const at::Tensor& weight,
                                    const std::optional<at::Tensor>& bias) {
  const at::Tensor* bias_ptr = nullptr;
  check_operands(x, weight, bias, bias_ptr);
  return linear_many(x, {&weight}, {bias_ptr}, false, true)[0];
}

// Several weights against one x (all of x's dtype and K), e.g. a layer's q, k and v.
std::vector<at::Tensor> small_m_linear_many(const at::Tensor& x, at::TensorList weights,
                                            const c10::List<std::optional<at::Tensor>>& biases) {
  TORCH_CHECK(weights.size() == biases.size(), "small_m_linear_many: one bias (or None) per weight");
  std::vector<std::optional<at::Tensor>> kept;  // owns the biases while we run
  for (size_t i = 0; i < biases.size(); ++i) kept.push_back(biases.get(i));
  std::vector<const at::Tensor*> w, b;
  for (size_t i = 0; i < weights.size(); ++i) {
    const at::Tensor* bias_ptr = nullptr;
    check_operands(x, weights[i], kept[i], bias_ptr);
    w.push_back(&weights[i]);
    b.push_back(bias_ptr);
  }
  return linear_many(x, w, b, false);
}

// Test and benchmark hook: sets how far ahead W is prefetched (bytes; 0 means the next
// tile); returns the previous setting.
int64_t set_prefetch_bytes(int64_t bytes) {
  TORCH_CHECK(bytes >= 0, "set_prefetch_bytes: bytes must be >= 0, got ", bytes);
  return g_prefetch_bytes.exchange(bytes);
}

// Whether this build and process can take the AMX path (AMX-BF16 compiled in, granted by
// the kernel); the switch is not consulted.
bool amx_supported() {
#if defined(KVFORGE_AMX_LINEAR)
  return kvforge_amx::granted();
#else
  return false;
#endif
}

// Test and benchmark hook: turns the AMX path on or off for the process; returns the
// previous setting.
bool set_amx(bool enabled) {
#if defined(KVFORGE_AMX_LINEAR)
  return kvforge_amx::switch_on().exchange(enabled);
#else
  (void)enabled;
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY(kvforge_cpu_linear, m) {
  m.def("small_m_linear(Tensor x, Tensor weight, Tensor? bias=None, bool widen=False) -> Tensor");
  m.def("small_m_linear_many(Tensor x, Tensor[] weights, Tensor?[] biases) -> Tensor[]");
  m.def("small_m_linear_float_out(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
  m.def("set_prefetch_bytes(int bytes) -> int", &set_prefetch_bytes);
  m.def("amx_supported() -> bool", &amx_supported);
  m.def("set_amx(bool enabled) -> bool", &set_amx);
}

TORCH_LIBRARY_IMPL(kvforge_cpu_linear, CPU, m) {
  m.impl("small_m_linear", &small_m_linear);
  m.impl("small_m_linear_many", &small_m_linear_many);
  m.impl("small_m_linear_float_out", &small_m_linear_float_out);
}
