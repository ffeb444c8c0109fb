// C++ source of the CPU paged decode attention kernel (see cpu_decode.py).
//
// Shipped as package data (pyproject: tool.setuptools.package-data). The source includes
// only ATen/c10 core headers and registers
// the operator `torch.ops.kvforge_cpu.paged_decode_attention` through TORCH_LIBRARY, so no
// pybind11/Python headers are compiled (a faster first build).
//
// Invariants the kernel relies on (checked on entry, mostly made true by the Python wrapper):
// - q, k_self, v_self are contiguous [B, heads, D] / [B, kv_heads, D] of one dtype in {f32,
//   bf16, f16} (widened to float32 on entry; the output has their dtype, rounded once);
// - k_pages/v_pages are [kv_heads, num_pages, block, D] of one dtype in {f32, bf16, f16,
//   float8_e4m3fn, float8_e5m2}, any strides for the first three dims but unit stride along
//   D (a `store[layer]` view); float8 pages come with float32 scales [kv_heads, num_pages,
//   block] (one per stored row, any strides): a row's value is its codes x its scale;
// - page_table [B, P] and the three position vectors [B] are contiguous int64;
// - heads is a multiple of kv_heads.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "cpu_bf16_attention.h"  // defines KVFORGE_BF16_DOT with AVX512-BF16
#include "cpu_checks.h"
#include "cpu_convert.h"
#include "cpu_prefetch.h"
#include "cpu_simd.h"  // ArrayVec, NativeVec (KVFORGE_NATIVE_VEC), dot, dot4, exp_nonpositive_in_place

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

// Stored rows handled per softmax update: one rescale of the accumulators per tile, and a
// tile's scores and (for 16-bit storage) widened rows stay in L1/L2.
constexpr int64_t kTile = 64;
// A work unit (one slice of one (sequence, kv head) pair) covers at least this many rows,
// so loading its queries and merging its partial state stay cheap.
constexpr int64_t kMinUnitRows = 256;

// The kernel is written once over a vector type V (cpu_simd.h): NativeVec (the widest ISA
// compiled for) or ArrayVec<N> (plain C++; N = 1 serves head dims of any size). Scores of one
// row are dot<V, 4> (four accumulator chains), or dot4 for four rows at once.
using kvforge_simd::ArrayVec;
using kvforge_simd::dot;
using kvforge_simd::dot4;
using kvforge_simd::exp_nonpositive_in_place;
using kvforge_simd::max_of;
using kvforge_simd::sum_of;
#ifdef KVFORGE_NATIVE_VEC
using kvforge_simd::NativeVec;
#endif

// acc[:dim] += sum_t weights[t] * rows[t][:dim]. The accumulator stays in registers across
// the rows (blocks of four vectors: independent FMA chains).
template <typename V>
inline void accumulate(float* acc, const float* weights, const float* const* rows, int64_t n,
                       int64_t dim) {
  constexpr int64_t L = V::kLanes;
  int64_t d = 0;
  for (; d + 4 * L <= dim; d += 4 * L) {
    V a0 = V::load(acc + d), a1 = V::load(acc + d + L);
    V a2 = V::load(acc + d + 2 * L), a3 = V::load(acc + d + 3 * L);
    for (int64_t t = 0; t < n; ++t) {
      const V w = V::broadcast(weights[t]);
      const float* r = rows[t] + d;
      a0 = V::fmadd(w, V::load(r), a0);
      a1 = V::fmadd(w, V::load(r + L), a1);
      a2 = V::fmadd(w, V::load(r + 2 * L), a2);
      a3 = V::fmadd(w, V::load(r + 3 * L), a3);
    }
    a0.store(acc + d);
    a1.store(acc + d + L);
    a2.store(acc + d + 2 * L);
    a3.store(acc + d + 3 * L);
  }
  for (; d < dim; d += L) {
    V a = V::load(acc + d);
    for (int64_t t = 0; t < n; ++t) a = V::fmadd(V::broadcast(weights[t]), V::load(rows[t] + d), a);
    a.store(acc + d);
  }
}

// Query heads per KV head up to which the group-fused tile path runs (4 x 4 score
// accumulators, or 4 x 4 value accumulators, plus the loaded rows fit 32 zmm registers).
constexpr int64_t kMaxFusedGroup = 4;

// Calls fn(std::integral_constant<int, G>) for G = group in 1..kMaxFusedGroup.
template <typename Fn>
inline void with_group(int64_t group, Fn&& fn) {
  switch (group) {
    case 1:
      return fn(std::integral_constant<int, 1>{});
    case 2:
      return fn(std::integral_constant<int, 2>{});
    case 3:
      return fn(std::integral_constant<int, 3>{});
    default:
      return fn(std::integral_constant<int, 4>{});
  }
}

// scores[g * kTile + i] = q_g . rows[i] for the G queries (qs, [G, dim]) and four rows of
// storage type scalar_t. Each row chunk is loaded and widened once for the G queries. Per
// score: one accumulator over the chunks in order, then sum4: exactly dot4's arithmetic.
template <typename V, typename scalar_t, int G>
inline void scores4_group(const float* qs, const scalar_t* const* rows, int64_t dim, float* scores) {
  constexpr int64_t L = V::kLanes;
  V s[G][4];
  for (int g = 0; g < G; ++g) {
    for (int i = 0; i < 4; ++i) s[g][i] = V::zero();
  }
  for (int64_t d = 0; d < dim; d += L) {
    const V r0 = V::load(rows[0] + d), r1 = V::load(rows[1] + d);
    const V r2 = V::load(rows[2] + d), r3 = V::load(rows[3] + d);
    for (int g = 0; g < G; ++g) {
      const V x = V::load(qs + g * dim + d);
      s[g][0] = V::fmadd(x, r0, s[g][0]);
      s[g][1] = V::fmadd(x, r1, s[g][1]);
      s[g][2] = V::fmadd(x, r2, s[g][2]);
      s[g][3] = V::fmadd(x, r3, s[g][3]);
    }
  }
  for (int g = 0; g < G; ++g) V::sum4(s[g][0], s[g][1], s[g][2], s[g][3], scores + g * kTile);
}

// V rows the values loops (accumulate_group; values_dot on the bf16 dot path) request into L1
// ahead of their use, plus each tile's first ones before its softmax. The tile-ahead prefetch
// (walk_tiles) leaves rows in L2, and the loops' loads waited on L2 -> L1: perf put a large
// share of the bf16 kernel's samples on two V-row loads. With these requests the kernel ran
// faster for bf16, float32 and float16 pages, most on ascending pages (scattered float16
// pages about the same; neutral at head dim 256); 4-16 rows ahead without the early request
// gained less, 24 ahead no more than 16, and the same into L1 for K rows nothing measurable
// (docs/benchmarks.md, 'Measurements behind design choices').
constexpr int64_t kValuesL1Ahead = 16;

// acc[g][:dim] += sum_t weights[g * kTile + t] * rows[t][:dim] for the G queries: each
// stored row chunk is loaded and widened once for all of them. Per element: the same FMA
// chain over t as `accumulate`. Each row step requests the row kValuesL1Ahead further on into
// L1 (the caller requested the first ones).
template <typename V, typename scalar_t, int G>
inline void accumulate_group(float* acc, const float* weights, const scalar_t* const* rows, int64_t n,
                             int64_t dim) {
  constexpr int64_t L = V::kLanes;
  constexpr int C = V::kLanes >= 16 ? 4 : 2;  // chunks per pass: G * C accumulators in registers
  int64_t d = 0;
  for (; d + C * L <= dim; d += C * L) {
    V a[G][C];
    for (int g = 0; g < G; ++g) {
      for (int c = 0; c < C; ++c) a[g][c] = V::load(acc + g * dim + d + c * L);
    }
    for (int64_t t = 0; t < n; ++t) {
      if (t + kValuesL1Ahead < n) kvforge_prefetch::to_l1(rows[t + kValuesL1Ahead] + d, C * L * static_cast<int64_t>(sizeof(scalar_t)));
      V r[C];
      for (int c = 0; c < C; ++c) r[c] = V::load(rows[t] + d + c * L);
      for (int g = 0; g < G; ++g) {
        const V w = V::broadcast(weights[g * kTile + t]);
        for (int c = 0; c < C; ++c) a[g][c] = V::fmadd(w, r[c], a[g][c]);
      }
    }
    for (int g = 0; g < G; ++g) {
      for (int c = 0; c < C; ++c) a[g][c].store(acc + g * dim + d + c * L);
    }
  }
  for (; d < dim; d += L) {
    for (int g = 0; g < G; ++g) {
      V a = V::load(acc + g * dim + d);
      for (int64_t t = 0; t < n; ++t) a = V::fmadd(V::broadcast(weights[g * kTile + t]), V::load(rows[t] + d), a);
      a.store(acc + g * dim + d);
    }
  }
}

template <typename scalar_t>
constexpr bool kFloat8 = std::is_same_v<scalar_t, c10::Float8_e4m3fn> || std::is_same_v<scalar_t, c10::Float8_e5m2>;

// Rows as float pointers: float32 rows are read in place, 16-bit rows are widened once per
// tile into `buffer` so the inner loops (run `group` times per row) stay pure float; float8
// rows are widened and multiplied by their row's scale (`scales[t]`).
template <typename V, typename scalar_t>
inline void tile_rows(const scalar_t* const* src, const float* const* scales, int64_t n, int64_t dim,
                      float* buffer, const float** rows) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    for (int64_t t = 0; t < n; ++t) rows[t] = src[t];
  } else {
    for (int64_t t = 0; t < n; ++t) {
      float* out = buffer + t * dim;
      if constexpr (kFloat8<scalar_t>) {
        const V scale = V::broadcast(*scales[t]);
        for (int64_t d = 0; d < dim; d += V::kLanes) V::fmadd(V::load(src[t] + d), scale, V::zero()).store(out + d);
      } else {
        for (int64_t d = 0; d < dim; d += V::kLanes) V::load(src[t] + d).store(out + d);
      }
      rows[t] = out;
    }
  }
}

// A slice [col_begin, col_end) of the flattened page-table row of one sequence, for one kv
// head. with_self: this unit also accounts for the step's own token (exactly one unit of
// each pair does, so the pair's softmax counts it once).
struct Unit {
  int64_t pair;  // b * kv_heads + kv_head
  int64_t col_begin;
  int64_t col_end;
  bool with_self;
};

struct PageGeometry {
  int64_t num_pages, block, stride_head, stride_page, stride_row;
};

// Scales of float8 rows [kv_heads, num_pages, block] (null data otherwise).
struct ScaleGeometry {
  const float* data;
  int64_t stride_head, stride_page, stride_row;
};

struct Problem {
  int64_t kv_heads, group, dim, table_width;
  float scale;
  const float *q, *k_self, *v_self;
  const int64_t* page_table;
  PageGeometry kg, vg;
  ScaleGeometry ks, vs;
  // q's bf16 bits when the bf16 dot path runs (bf16 q and pages, see run_unit_dot), else null.
  const uint16_t* q_bf16;
};

// The rows of one tile of a unit: K and V row pointers in the paged storage (and, float8
// only, each row's scale), n <= kTile of them.
template <typename scalar_t>
struct TileRows {
  const scalar_t* const* k;
  const scalar_t* const* v;
  const float* const* k_scale;
  const float* const* v_scale;
  int64_t n;
};

// Requests the K and V rows [0, count) into L2. Kept out of the hot loop's code (it runs
// once per scattered page). noipa, not just noinline: GCC finds a function made only of
// prefetches free of side effects and deletes its calls (measured: with noinline alone the
// gain on scattered pages was gone).
template <typename scalar_t>
__attribute__((noipa)) void prefetch_rows(const scalar_t* const* k, const scalar_t* const* v, int64_t count,
                                          int64_t row_bytes) {
  for (int64_t i = 0; i < count; ++i) {
    kvforge_prefetch::to_l2(k[i], row_bytes);
    kvforge_prefetch::to_l2(v[i], row_bytes);
  }
}

// Walks the unit's rows tile by tile in column order. With Ahead = 1 it calls
// fn(tile, prefetch_next) per tile; with Ahead = 2, fn(tile, next tile, prefetch_next) (the
// next tile's n is 0 past the end), prefetch_next then requesting rows of the tile after
// that one. Two kinds of software prefetch (into L2; into L1, hint 3, measured slower: the
// L1 miss buffers are the limit):
// - jumps: `locate` notes the pages of a tile that do not follow the page before them in
//   memory (a sequence's first page, or a page scattered in the pool); each of the tile
//   Ahead tiles on is requested whole, at once, before the current tile is computed. The
//   hardware prefetcher follows a run of adjacent pages on its own but cannot foresee a jump.
//   It made scattered pages much faster and left ascending pages (no jumps) unchanged
//   (`benchmarks/bench_decode_attention.py --baseline-source` repeats the comparison).
// - prefetch_next(i), which callers issue once per row they compute, requests row i of the
//   tile Ahead tiles on: on ascending pages this measured slightly faster than without
//   it. Alone it did not help scattered pages at all (spread over the tile's compute, it
//   started each new page's stream too late, apparently). Figures: docs/benchmarks.md,
//   'Measurements behind design choices'.
template <int Ahead = 1, typename scalar_t, typename Fn>
void walk_tiles(const Unit& unit, const Problem& p, const scalar_t* k_pages, const scalar_t* v_pages, Fn&& fn) {
  static_assert(Ahead == 1 || Ahead == 2, "walk_tiles: one or two tiles ahead");
  constexpr int kSlots = Ahead + 1;
  const int64_t block = p.kg.block;
  const int64_t b = unit.pair / p.kv_heads;
  const int64_t h = unit.pair % p.kv_heads;
  const int64_t* table_row = p.page_table + b * p.table_width;
  const scalar_t* k_head = k_pages + h * p.kg.stride_head;
  const scalar_t* v_head = v_pages + h * p.vg.stride_head;
  // Row pointers of the tiles in flight: the current one and the Ahead after it, in a ring.
  const scalar_t* k_src[kSlots][kTile];
  const scalar_t* v_src[kSlots][kTile];
  const float* k_scale[kSlots][kTile];  // float8 only: each row's scale
  const float* v_scale[kSlots][kTile];
  int64_t rows[kSlots] = {};
  const int64_t row_bytes = p.dim * static_cast<int64_t>(sizeof(scalar_t));
  auto page_at = [&](int64_t index) -> int64_t {
    const int64_t page = table_row[index];
    TORCH_CHECK(page >= 0 && page < p.kg.num_pages, "paged_decode_attention: page id ", page,
                " out of range [0, ", p.kg.num_pages, ")");
    return page;
  };
  // Whether page i + 1 of the pool directly follows page i in memory, for K and V alike.
  const bool pages_adjacent =
      p.kg.stride_page == block * p.kg.stride_row && p.vg.stride_page == block * p.vg.stride_row;
  // jumps[slot][0 .. jump_count[slot]): the tile rows where a page starts that does not
  // follow the one before it in memory (a sequence's first page, or one scattered in the pool).
  int64_t jumps[kSlots][kTile];
  int64_t jump_count[kSlots] = {};
  // Fills slot `slot` with the rows of the tile starting at column `start` (none past the
  // unit's end); returns its size.
  auto locate = [&](int64_t start, int slot) -> int64_t {
    rows[slot] = 0;
    jump_count[slot] = 0;
    if (start >= unit.col_end) return 0;
    const int64_t n = std::min(kTile, unit.col_end - start);
    int64_t index = start / block, row = start % block;
    int64_t page = page_at(index);
    int64_t count = 0;
    if (row == 0 && (index == 0 || !pages_adjacent || page != table_row[index - 1] + 1)) jumps[slot][count++] = 0;
    for (int64_t t = 0; t < n; ++t, ++row) {
      if (row == block) {
        row = 0;
        const int64_t previous = page;
        page = page_at(++index);
        if (!pages_adjacent || page != previous + 1) jumps[slot][count++] = t;
      }
      k_src[slot][t] = k_head + page * p.kg.stride_page + row * p.kg.stride_row;
      v_src[slot][t] = v_head + page * p.vg.stride_page + row * p.vg.stride_row;
      if constexpr (kFloat8<scalar_t>) {
        k_scale[slot][t] = p.ks.data + h * p.ks.stride_head + page * p.ks.stride_page + row * p.ks.stride_row;
        v_scale[slot][t] = p.vs.data + h * p.vs.stride_head + page * p.vs.stride_page + row * p.vs.stride_row;
      }
    }
    jump_count[slot] = count;
    rows[slot] = n;
    return n;
  };
  auto tile_at = [&](int slot) {
    return TileRows<scalar_t>{k_src[slot], v_src[slot], k_scale[slot], v_scale[slot], rows[slot]};
  };
  for (int i = 0; i < Ahead; ++i) locate(unit.col_begin + i * kTile, i);
  // The tiles between the first and the far one are computed before any prefetch_next
  // reaches them: requested whole now.
  for (int i = 1; i < Ahead; ++i) prefetch_rows(k_src[i], v_src[i], rows[i], row_bytes);
  int slot = 0;
  for (int64_t start = unit.col_begin; start < unit.col_end; start += kTile, slot = (slot + 1) % kSlots) {
    const int far = (slot + Ahead) % kSlots;
    const int64_t far_n = locate(start + Ahead * kTile, far);
    for (int64_t j = 0; j < jump_count[far]; ++j) {  // the far tile's jumps, each page whole
      const int64_t t = jumps[far][j];
      prefetch_rows(k_src[far] + t, v_src[far] + t, std::min(block, far_n - t), row_bytes);
    }
    auto prefetch_next = [&](int64_t t) {
      if (t >= far_n) return;
      kvforge_prefetch::to_l2(k_src[far][t], row_bytes);
      kvforge_prefetch::to_l2(v_src[far][t], row_bytes);
    };
    if constexpr (Ahead == 1) {
      fn(tile_at(slot), prefetch_next);
    } else {
      fn(tile_at(slot), tile_at((slot + 1) % kSlots), prefetch_next);
    }
  }
}

// Streaming softmax of one unit. Writes the unnormalised partial state: running max m[g],
// sum l[g] and accumulator acc[g][:] for the `group` queries sharing the kv head. Every K
// and V row of the slice is loaded from storage exactly once and used by all of them.
template <typename V, typename scalar_t>
void run_unit(const Unit& unit, const Problem& p, const scalar_t* k_pages, const scalar_t* v_pages,
              float* m, float* l, float* acc, std::vector<float>& scratch) {
  const int64_t group = p.group, dim = p.dim;
  const int64_t b = unit.pair / p.kv_heads;
  const int64_t h = unit.pair % p.kv_heads;
  // scratch: scaled queries [group, dim], scores [group, kTile], widened K and V tiles.
  scratch.resize(group * dim + group * kTile + 2 * kTile * dim);
  float* qs = scratch.data();
  float* scores = qs + group * dim;
  float* k_buffer = scores + group * kTile;
  float* v_buffer = k_buffer + kTile * dim;

  // Query heads h*group .. h*group+group-1 of sequence b share kv head h (GQA).
  const float* q_rows = p.q + (b * p.kv_heads * group + h * group) * dim;
  for (int64_t i = 0; i < group * dim; ++i) qs[i] = q_rows[i] * p.scale;

  if (unit.with_self) {
    // The own token is always visible: seeding with it keeps every row finite.
    const float* ks = p.k_self + (b * p.kv_heads + h) * dim;
    const float* vs = p.v_self + (b * p.kv_heads + h) * dim;
    for (int64_t g = 0; g < group; ++g) {
      m[g] = dot<V, 4>(qs + g * dim, ks, dim);
      l[g] = 1.f;
      std::memcpy(acc + g * dim, vs, dim * sizeof(float));
    }
  } else {
    // Units without the own token have >= 1 row, so m turns finite on the first tile and
    // the correction exp(-inf) = 0 only multiplies the zero accumulator.
    for (int64_t g = 0; g < group; ++g) {
      m[g] = -std::numeric_limits<float>::infinity();
      l[g] = 0.f;
      std::fill(acc + g * dim, acc + (g + 1) * dim, 0.f);
    }
  }

  const float* k_rows[kTile];
  const float* v_rows[kTile];
  // Online softmax update of query g over the tile's scores (turned into weights in place);
  // rescales acc[g] for the new running max.
  auto softmax_update = [&](int64_t g, int64_t n) {
    float* s = scores + g * kTile;
    const float new_max = std::max(m[g], max_of(s, n));
    const float correction = std::exp(m[g] - new_max);
    for (int64_t t = 0; t < n; ++t) s[t] -= new_max;
    exp_nonpositive_in_place(s, n);
    const float sum = sum_of(s, n);
    float* a = acc + g * dim;
    if (correction != 1.f) {
      for (int64_t d = 0; d < dim; ++d) a[d] *= correction;
    }
    l[g] = l[g] * correction + sum;
    m[g] = new_max;
  };

  walk_tiles(unit, p, k_pages, v_pages, [&](const TileRows<scalar_t>& tile, auto&& prefetch_next) {
    const int64_t n = tile.n;
    if constexpr (!kFloat8<scalar_t>) {
      if (group <= kMaxFusedGroup) {
        // Group-fused: every K and V row is loaded (and widened) in registers once and used
        // by all the queries of the group; no widened copy of the tile. Same arithmetic per
        // score and per accumulator element as the path below, so the same results.
        const int64_t full = n - n % 4;
        for (int64_t t = 0; t < full; t += 4) {
          for (int64_t i = t; i < t + 4; ++i) prefetch_next(i);
          with_group(group, [&](auto g_) { scores4_group<V, scalar_t, decltype(g_)::value>(
                                               qs, tile.k + t, dim, scores + t); });
        }
        for (int64_t t = full; t < n; ++t) {  // rows past a multiple of 4: widened, as below
          prefetch_next(t);
          tile_rows<V, scalar_t>(tile.k + t, tile.k_scale + t, 1, dim, k_buffer, k_rows);
          for (int64_t g = 0; g < group; ++g) scores[g * kTile + t] = dot<V, 4>(qs + g * dim, k_rows[0], dim);
        }
        // The tile's first V rows (their first 64 dims) into L1 while the softmax runs.
        for (int64_t t = 0; t < std::min(n, kValuesL1Ahead); ++t) {
          kvforge_prefetch::to_l1(tile.v[t], std::min<int64_t>(dim, 64) * static_cast<int64_t>(sizeof(scalar_t)));
        }
        for (int64_t g = 0; g < group; ++g) softmax_update(g, n);
        with_group(group, [&](auto g_) {
          accumulate_group<V, scalar_t, decltype(g_)::value>(acc, scores, tile.v, n, dim);
        });
        return;
      }
    }
    // Scores of the tile: each K row is loaded from storage once for the whole group.
    tile_rows<V, scalar_t>(tile.k, tile.k_scale, n, dim, k_buffer, k_rows);
    int64_t t = 0;
    for (; t + 4 <= n; t += 4) {
      for (int64_t i = t; i < t + 4; ++i) prefetch_next(i);
      for (int64_t g = 0; g < group; ++g) dot4<V>(qs + g * dim, k_rows + t, dim, scores + g * kTile + t);
    }
    for (; t < n; ++t) {
      prefetch_next(t);
      for (int64_t g = 0; g < group; ++g) scores[g * kTile + t] = dot<V, 4>(qs + g * dim, k_rows[t], dim);
    }
    // Online softmax update, then the weighted values (each V row loaded once).
    tile_rows<V, scalar_t>(tile.v, tile.v_scale, n, dim, v_buffer, v_rows);
    for (int64_t g = 0; g < group; ++g) {
      softmax_update(g, n);
      accumulate<V>(acc + g * dim, scores + g * kTile, v_rows, n, dim);
    }
  });
}

// Whether bf16 q over bf16 pages takes the bf16 dot path (run_unit_dot). On by default;
// the float path stays as the reference (tests switch it off through `set_bf16_dot`).
std::atomic<bool> g_bf16_dot{true};

#ifdef KVFORGE_BF16_DOT
// ---- bf16 q over bf16 pages: AVX512-BF16 dot products -------------------------------------
// Precision as cpu_bf16_attention.h states (and the causal prefill kernel has): scores are
// scale * (q . k) with exact bf16 products summed in float32 by vdpbf16ps; float32 online
// softmax per 64-row tile; weights rounded to bf16 once and used both for P V (vdpbf16ps
// again) and for the normaliser. The float path above widens everything and keeps float32
// weights; the two differ by the bf16 rounding of the weights (relative 2^-9 each).
//
// Value accumulators are kept in "pair order": V rows are read two at a time and
// interleaved (vpunpck{l,h}wd) into (row t, row t+1) pairs of one dim, which vdpbf16ps
// multiplies by the broadcast weight pair (p_t, p_t+1). Within each 32-dim chunk c, lane j
// (0..15) of the unpack-low accumulator holds dim 32c + 8 (j / 4) + j % 4 and of the
// unpack-high one dim 32c + 8 (j / 4) + 4 + j % 4. `pair_order_dim` maps a buffer index
// (32c + 16 half + j) to its dim; the partial state is written back in dim order.
inline int64_t pair_order_dim(int64_t index) {
  const int64_t chunk = index / 32, half = (index / 16) % 2, lane = index % 16;
  return 32 * chunk + 8 * (lane / 4) + 4 * half + lane % 4;
}

// Rows of one step of the bf16 dot path's pipeline: the scores of the next tile's rows
// [r, r + kPipelineRows) are computed, then the values of the current tile's same rows, so
// the K and V streams are read side by side. Tile by tile (all scores, softmax, all values)
// the loads of each phase came from one stream at a time. A kernel with the arithmetic taken
// out (one load per cache line) showed it: the same loads took less time in the pipelined
// order than tile by tile, and tile by tile they alone took most of the whole kernel's
// time, so the loads, not the arithmetic, set the kernel's pace. The pipeline made the
// kernel faster on ascending and scattered pages (neutral at head dim 256); steps of 16
// rows gained less, of 32 nothing (docs/benchmarks.md, 'How close a decode step gets to the
// read bandwidth').
// Scores are reduced 8 rows at a time for this (sums8), with the same additions per row as
// the 16-row reduction, so the kernel's results did not change.
constexpr int64_t kPipelineRows = 8;

// s[g * kTile + t] = scale * (q_g . row t) for the G queries of q (bf16, [G, D]) and the n
// rows of a tile. Query g's D / 32 vectors stay in registers while 8 rows stream past; each
// row's 16-lane partial sums are reduced 8 rows at a time by one transposing tree (sums8:
// the same additions per row as the 16-row tree it replaced, so the same scores).
template <int D, int G, typename Prefetch>
inline void scores_dot(const uint16_t* q, const uint16_t* const* rows, int64_t n, float scale, float* s,
                       Prefetch&& prefetch_next) {
  constexpr int kChunks = D / 32;
  const __m256 sc = _mm256_set1_ps(scale);
  for (int64_t t0 = 0; t0 < n; t0 += 8) {
    const int64_t m = std::min<int64_t>(8, n - t0);
    for (int64_t t = t0; t < t0 + m; ++t) prefetch_next(t);
    for (int g = 0; g < G; ++g) {
      __m512i qv[kChunks];
      for (int c = 0; c < kChunks; ++c) qv[c] = _mm512_loadu_si512(q + g * D + 32 * c);
      __m512 partial[8];
      for (int64_t t = 0; t < 8; ++t) {
        __m512 a = _mm512_setzero_ps();
        if (t < m) {
          for (int c = 0; c < kChunks; ++c) a = kvforge_bf16::dot_pairs(a, _mm512_loadu_si512(rows[t0 + t] + 32 * c), qv[c]);
        }
        partial[t] = a;
      }
      // Lanes past n hold 0 and land in s[n .. t0 + 8), inside the kTile scores of g.
      _mm256_storeu_ps(s + g * kTile + t0, _mm256_mul_ps(kvforge_bf16::sums8(partial), sc));
    }
  }
}

// acc[g] (pair order, [G, D]) += sum_t w[g * kTile + t] v_t over the rows [begin, end) of a
// tile of n rows, two rows at a time; an odd last row is paired with a zero row (its
// partner's weight is 0 too). `begin` is even and `end` even or n, so consecutive ranges
// pair the rows as one call over [0, n) would, in the same order. Dims are done 64 at a time
// so that G x 4 accumulators stay in registers. The caller has requested the first
// kValuesL1Ahead rows into L1; each step requests the two rows kValuesL1Ahead further on in
// the tile (the tile's last row, when n is odd, is left to the loads).
template <int D, int G>
inline void values_dot(const uint16_t* const* rows, int64_t begin, int64_t end, int64_t n, const uint16_t* w,
                       float* acc) {
  alignas(64) static const uint16_t zero_row[D] = {};
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    __m512 a[G][4];
    for (int g = 0; g < G; ++g) {
      for (int i = 0; i < 4; ++i) a[g][i] = _mm512_loadu_ps(acc + g * D + d0 + 16 * i);
    }
    for (int64_t t = begin; t < end; t += 2) {
      const uint16_t* r0 = rows[t] + d0;
      const uint16_t* r1 = t + 1 < end ? rows[t + 1] + d0 : zero_row;
      if (t + kValuesL1Ahead + 1 < n) {
        kvforge_prefetch::to_l1(rows[t + kValuesL1Ahead] + d0, 64 * sizeof(uint16_t));
        kvforge_prefetch::to_l1(rows[t + kValuesL1Ahead + 1] + d0, 64 * sizeof(uint16_t));
      }
      const __m512i x0 = _mm512_loadu_si512(r0), x1 = _mm512_loadu_si512(r0 + 32);
      const __m512i y0 = _mm512_loadu_si512(r1), y1 = _mm512_loadu_si512(r1 + 32);
      const __m512i pairs[4] = {_mm512_unpacklo_epi16(x0, y0), _mm512_unpackhi_epi16(x0, y0),
                                _mm512_unpacklo_epi16(x1, y1), _mm512_unpackhi_epi16(x1, y1)};
      for (int g = 0; g < G; ++g) {
        uint32_t word;  // (w_t, w_t+1): t is even, so the pair is one aligned 32-bit word
        std::memcpy(&word, w + g * kTile + t, sizeof(word));
        const __m512i weights = _mm512_set1_epi32(static_cast<int>(word));
        for (int i = 0; i < 4; ++i) a[g][i] = kvforge_bf16::dot_pairs(a[g][i], pairs[i], weights);
      }
    }
    for (int g = 0; g < G; ++g) {
      for (int i = 0; i < 4; ++i) _mm512_storeu_ps(acc + g * D + d0 + 16 * i, a[g][i]);
    }
  }
}

// The bf16 dot path of one unit: same partial state (m, l, acc in dim order) as run_unit.
// Queries are handled up to kMaxFusedGroup at a time (registers), rows tile by tile.
template <int D>
void run_unit_dot(const Unit& unit, const Problem& p, const c10::BFloat16* k_pages, const c10::BFloat16* v_pages,
                  float* m, float* l, float* acc_out, std::vector<float>& scratch) {
  const int64_t group = p.group;
  const int64_t b = unit.pair / p.kv_heads;
  const int64_t h = unit.pair % p.kv_heads;
  // scratch: pair-order accumulators [group, D], scores [group, kTile], bf16 weights
  // [group, kTile] (as kTile / 2 floats per query).
  scratch.resize(group * D + group * kTile + group * kTile / 2);
  float* acc = scratch.data();
  float* scores = acc + group * D;
  auto* weights = reinterpret_cast<uint16_t*>(scores + group * kTile);
  const int64_t first_head = b * p.kv_heads * group + h * group;
  const uint16_t* q = p.q_bf16 + first_head * D;
  if (unit.with_self) {
    // The own token is always visible: seeding with it (weight exactly 1) keeps every row
    // finite. Its score is computed from the widened (exact) values in float32.
    const float* ks = p.k_self + (b * p.kv_heads + h) * D;
    const float* vs = p.v_self + (b * p.kv_heads + h) * D;
    for (int64_t g = 0; g < group; ++g) {
      m[g] = dot<NativeVec, 4>(p.q + (first_head + g) * D, ks, D) * p.scale;
      l[g] = 1.f;
      for (int64_t i = 0; i < D; ++i) acc[g * D + i] = vs[pair_order_dim(i)];
    }
  } else {
    for (int64_t g = 0; g < group; ++g) {
      m[g] = -std::numeric_limits<float>::infinity();
      l[g] = 0.f;
    }
    std::fill(acc, acc + group * D, 0.f);
  }
  // Pipelined (see kPipelineRows): the scores of tile i + 1 are computed beside the values of
  // tile i, kPipelineRows rows of each in turn; the first tile's scores come alone.
  auto scores_of = [&](const uint16_t* const* k_rows, int64_t n, int64_t first, auto&& prefetch) {
    for (int64_t g0 = 0; g0 < group; g0 += kMaxFusedGroup) {
      with_group(std::min(kMaxFusedGroup, group - g0), [&](auto g_) {
        constexpr int G = decltype(g_)::value;
        // (with more than 4 queries the later passes re-issue prefetches in flight: harmless)
        scores_dot<D, G>(q + g0 * D, k_rows + first, n, p.scale, scores + g0 * kTile + first,
                         [&](int64_t t) { prefetch(first + t); });
      });
    }
  };
  bool first_tile = true;  // later tiles' scores were computed beside the tile before
  walk_tiles<2>(unit, p, k_pages, v_pages,
                [&](const TileRows<c10::BFloat16>& tile, const TileRows<c10::BFloat16>& next, auto&& prefetch_next) {
    const auto* v_rows = reinterpret_cast<const uint16_t* const*>(tile.v);
    if (first_tile) scores_of(reinterpret_cast<const uint16_t* const*>(tile.k), tile.n, 0, [](int64_t) {});
    // The tile's first V rows into L1 while the softmax runs (values_dot requests the rest).
    for (int64_t t = 0; t < std::min(tile.n, kValuesL1Ahead); ++t) kvforge_prefetch::to_l1(v_rows[t], 64 * sizeof(uint16_t));
    for (int64_t g = 0; g < group; ++g) {
      const float correction = kvforge_bf16::softmax_block(scores + g * kTile, tile.n - 1, m[g], l[g],
                                                           weights + g * kTile);
      if (correction != 1.f) {
        const __m512 c = _mm512_set1_ps(correction);
        for (int64_t i = 0; i < D; i += 16) _mm512_storeu_ps(acc + g * D + i, _mm512_mul_ps(_mm512_loadu_ps(acc + g * D + i), c));
      }
    }
    const auto* next_k = reinterpret_cast<const uint16_t* const*>(next.k);
    for (int64_t first = 0; first < std::max(tile.n, next.n); first += kPipelineRows) {
      if (first < next.n) scores_of(next_k, std::min(kPipelineRows, next.n - first), first, prefetch_next);
      if (first < tile.n) {
        const int64_t end = std::min(first + kPipelineRows, tile.n);
        for (int64_t g0 = 0; g0 < group; g0 += kMaxFusedGroup) {
          with_group(std::min(kMaxFusedGroup, group - g0), [&](auto g_) {
            values_dot<D, decltype(g_)::value>(v_rows, first, end, tile.n, weights + g0 * kTile, acc + g0 * D);
          });
        }
      }
    }
    first_tile = false;
  });
  for (int64_t g = 0; g < group; ++g) {
    for (int64_t i = 0; i < D; ++i) acc_out[g * D + pair_order_dim(i)] = acc[g * D + i];
  }
}

// Runs the unit on the bf16 dot path if it applies (bf16 q and pages, head dim 64, 128 or
// 256); returns false otherwise, and the caller takes the float path.
template <typename scalar_t>
bool try_run_unit_dot(const Unit& unit, const Problem& p, const scalar_t* k_pages, const scalar_t* v_pages, float* m,
                      float* l, float* acc, std::vector<float>& scratch) {
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    if (p.q_bf16 == nullptr) return false;
    switch (p.dim) {
      case 64:
        return run_unit_dot<64>(unit, p, k_pages, v_pages, m, l, acc, scratch), true;
      case 128:
        return run_unit_dot<128>(unit, p, k_pages, v_pages, m, l, acc, scratch), true;
      case 256:
        return run_unit_dot<256>(unit, p, k_pages, v_pages, m, l, acc, scratch), true;
      default:
        return false;
    }
  }
  return false;
}
#endif  // KVFORGE_BF16_DOT

PageGeometry geometry(const at::Tensor& pages) {
  return {pages.size(1), pages.size(2), pages.stride(0), pages.stride(1), pages.stride(2)};
}

ScaleGeometry scale_geometry(const at::Tensor& scales, bool used) {
  if (!used) return {nullptr, 0, 0, 0};
  return {scales.data_ptr<float>(), scales.stride(0), scales.stride(1), scales.stride(2)};
}

// Runs every unit (in parallel) and writes their partial states [m (group), l (group),
// acc (group * dim)] to `partial`.
template <typename V, typename scalar_t>
void run_units(const std::vector<Unit>& units, const Problem& problem, const at::Tensor& k_pages,
               const at::Tensor& v_pages, float* partial) {
  const scalar_t* kp = k_pages.data_ptr<scalar_t>();
  const scalar_t* vp = v_pages.data_ptr<scalar_t>();
  const int64_t group = problem.group;
  const int64_t stride = group * (problem.dim + 2);
  // Threads take units from a shared counter: a thread slowed down (by another process or
  // by a slower memory region) takes fewer, and both finish together.
  const int64_t count = static_cast<int64_t>(units.size());
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), count), 1, [&](int64_t, int64_t) {
    std::vector<float> scratch;
    for (int64_t u = next++; u < count; u = next++) {
      float* state = partial + u * stride;
#ifdef KVFORGE_BF16_DOT
      if (try_run_unit_dot(units[u], problem, kp, vp, state, state + group, state + 2 * group, scratch)) continue;
#endif
      run_unit<V, scalar_t>(units[u], problem, kp, vp, state, state + group, state + 2 * group, scratch);
    }
  });
}

template <typename V>
void dispatch_dtype(const std::vector<Unit>& units, const Problem& problem, const at::Tensor& k_pages,
                    const at::Tensor& v_pages, float* partial) {
  switch (k_pages.scalar_type()) {
    case at::kFloat:
      return run_units<V, float>(units, problem, k_pages, v_pages, partial);
    case at::kBFloat16:
      return run_units<V, c10::BFloat16>(units, problem, k_pages, v_pages, partial);
    case at::kHalf:
      return run_units<V, c10::Half>(units, problem, k_pages, v_pages, partial);
    case at::kFloat8_e4m3fn:
      return run_units<V, c10::Float8_e4m3fn>(units, problem, k_pages, v_pages, partial);
    case at::kFloat8_e5m2:
      return run_units<V, c10::Float8_e5m2>(units, problem, k_pages, v_pages, partial);
    default:
      TORCH_CHECK(false, "paged_decode_attention: storage dtype must be float32, bfloat16, float16, "
                  "float8_e4m3fn or float8_e5m2");
  }
}

bool bf16_dot_supported() {
#ifdef KVFORGE_BF16_DOT
  return true;
#else
  return false;
#endif
}

// True when bf16 queries over bf16 pages take the bf16 dot path in this build.
bool bf16_dot_applies(at::ScalarType io_dtype, at::ScalarType storage) {
  return bf16_dot_supported() && io_dtype == at::kBFloat16 && storage == at::kBFloat16 && g_bf16_dot.load();
}

// Test hook: turns the bf16 dot path on or off for the process; returns the previous setting.
bool set_bf16_dot(bool enabled) { return g_bf16_dot.exchange(enabled); }

using kvforge_convert::floats_of;
using kvforge_convert::store_rounded;

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_self,
                                  const at::Tensor& v_self, const at::Tensor& k_pages,
                                  const at::Tensor& v_pages, const at::Tensor& page_table,
                                  const at::Tensor& first_page_position,
                                  const at::Tensor& visible_from, const at::Tensor& visible_to,
                                  double scale, const at::Tensor& k_scales, const at::Tensor& v_scales) {
  TORCH_CHECK(q.dim() == 3 && k_self.dim() == 3 && v_self.dim() == 3,
              "q, k_self, v_self must be [B, heads, D]");
  TORCH_CHECK(k_pages.dim() == 4 && v_pages.dim() == 4,
              "k_pages, v_pages must be [kv_heads, num_pages, block, D]");
  constexpr const char* kOpName = "paged_decode_attention";
  kvforge_checks::cpu(kOpName, {&q, &k_self, &v_self, &k_pages, &v_pages, &page_table, &first_page_position,
                           &visible_from, &visible_to});
  const at::ScalarType io_dtype = q.scalar_type();
  TORCH_CHECK(io_dtype == at::kFloat || io_dtype == at::kBFloat16 || io_dtype == at::kHalf, kOpName,
              ": q must be float32, bfloat16 or float16, got ", io_dtype);
  kvforge_checks::contiguous_of(kOpName, "q, k_self, v_self", io_dtype, {&q, &k_self, &v_self});
  kvforge_checks::contiguous_of(kOpName, "page table and positions", at::kLong,
                                {&page_table, &first_page_position, &visible_from, &visible_to});
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = k_self.size(1);
  kvforge_checks::gqa(kOpName, heads, kv_heads);
  TORCH_CHECK(k_self.size(0) == batch && k_self.size(2) == dim, "k_self shape mismatch");
  TORCH_CHECK(v_self.sizes() == k_self.sizes(), "v_self shape mismatch");
  TORCH_CHECK(k_pages.sizes() == v_pages.sizes() && k_pages.scalar_type() == v_pages.scalar_type(),
              "k_pages and v_pages must have the same shape and dtype");
  TORCH_CHECK(k_pages.size(0) == kv_heads && k_pages.size(3) == dim, "k_pages shape mismatch");
  TORCH_CHECK(k_pages.stride(3) == 1 && v_pages.stride(3) == 1,
              "k_pages, v_pages must have unit stride along head_dim");
  TORCH_CHECK(page_table.dim() == 2 && page_table.size(0) == batch, "page_table must be [B, P]");
  kvforge_checks::per_sequence(kOpName, "positions", batch, {&first_page_position, &visible_from, &visible_to});
  const bool float8 = k_pages.scalar_type() == at::kFloat8_e4m3fn || k_pages.scalar_type() == at::kFloat8_e5m2;
  if (float8) {
    kvforge_checks::cpu(kOpName, {&k_scales, &v_scales});
    TORCH_CHECK(k_scales.scalar_type() == at::kFloat && v_scales.scalar_type() == at::kFloat &&
                    k_scales.dim() == 3 && k_scales.sizes() == k_pages.sizes().slice(0, 3) &&
                    v_scales.sizes() == k_scales.sizes(),
                "float8 pages need float32 scales [kv_heads, num_pages, block]");
  }
  const int64_t group = heads / kv_heads;
  const int64_t block = k_pages.size(2);
  const int64_t columns = page_table.size(1) * block;

  // Visible columns of each sequence: column j holds position first + j, so positions
  // [from, to) are columns [from - first, to - first), clipped to the table. Pages outside
  // that range (padding, released window) are never touched.
  const int64_t* first = first_page_position.data_ptr<int64_t>();
  const int64_t* from = visible_from.data_ptr<int64_t>();
  const int64_t* to = visible_to.data_ptr<int64_t>();
  std::vector<int64_t> col_lo(batch), col_hi(batch);
  int64_t total_rows = 0;
  for (int64_t b = 0; b < batch; ++b) {
    col_lo[b] = std::clamp<int64_t>(from[b] - first[b], 0, columns);
    col_hi[b] = std::max(col_lo[b], std::clamp<int64_t>(to[b] - first[b], 0, columns));
    total_rows += (col_hi[b] - col_lo[b]) * kv_heads;
  }
  // Split long pairs into slices (split-K) so that a small batch, or a single kv head,
  // still keeps every thread busy; the slices' partial softmax states are merged below.
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t target_units = 8 * threads;
  const int64_t slice = std::max(kMinUnitRows, (total_rows + target_units - 1) / target_units);
  std::vector<Unit> units;
  std::vector<int64_t> first_unit(batch * kv_heads + 1);
  for (int64_t pair = 0; pair < batch * kv_heads; ++pair) {
    const int64_t b = pair / kv_heads;
    first_unit[pair] = static_cast<int64_t>(units.size());
    const int64_t length = col_hi[b] - col_lo[b];
    const int64_t pieces = std::max<int64_t>(1, (length + slice - 1) / slice);
    for (int64_t i = 0; i < pieces; ++i) {
      units.push_back({pair, col_lo[b] + length * i / pieces, col_lo[b] + length * (i + 1) / pieces,
                       i == 0});
    }
  }
  first_unit[batch * kv_heads] = static_cast<int64_t>(units.size());

  std::vector<float> q_buffer, k_self_buffer, v_self_buffer;
  const Problem problem{kv_heads, group, dim, page_table.size(1), static_cast<float>(scale),
                        floats_of(q, q_buffer), floats_of(k_self, k_self_buffer), floats_of(v_self, v_self_buffer),
                        page_table.data_ptr<int64_t>(), geometry(k_pages), geometry(v_pages),
                        scale_geometry(k_scales, float8), scale_geometry(v_scales, float8),
                        bf16_dot_applies(io_dtype, k_pages.scalar_type())
                            ? reinterpret_cast<const uint16_t*>(q.data_ptr()) : nullptr};
  const int64_t stride = group * (dim + 2);
  std::vector<float> partial(units.size() * stride);
#ifdef KVFORGE_NATIVE_VEC
  if (dim % NativeVec::kLanes == 0) {
    dispatch_dtype<NativeVec>(units, problem, k_pages, v_pages, partial.data());
  } else
#endif
  if (dim % 8 == 0) {
    dispatch_dtype<ArrayVec<8>>(units, problem, k_pages, v_pages, partial.data());
  } else {
    dispatch_dtype<ArrayVec<1>>(units, problem, k_pages, v_pages, partial.data());
  }

  // Merge the slices of each pair: out = sum_u acc_u e^(m_u - M) / sum_u l_u e^(m_u - M).
  at::Tensor out = at::empty({batch, heads, dim}, q.options());
  std::vector<float> out_buffer(io_dtype == at::kFloat ? 0 : batch * heads * dim);
  float* op = io_dtype == at::kFloat ? out.data_ptr<float>() : out_buffer.data();
  at::parallel_for(0, batch * kv_heads, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(dim);
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t u0 = first_unit[pair], u1 = first_unit[pair + 1];
      for (int64_t g = 0; g < group; ++g) {
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t u = u0; u < u1; ++u) top = std::max(top, partial[u * stride + g]);
        float sum = 0.f;
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t u = u0; u < u1; ++u) {
          const float* state = partial.data() + u * stride;
          const float weight = std::exp(state[g] - top);
          sum += state[group + g] * weight;
          const float* part = state + 2 * group + g * dim;
          for (int64_t d = 0; d < dim; ++d) acc[d] += weight * part[d];
        }
        // pair = b * kv_heads + h; its query heads h * group + g are contiguous in out.
        float* dst = op + (pair * group + g) * dim;
        for (int64_t d = 0; d < dim; ++d) dst[d] = acc[d] / sum;
      }
    }
  });
  if (io_dtype == at::kBFloat16) {
    store_rounded(out_buffer, reinterpret_cast<c10::BFloat16*>(out.data_ptr()));
  } else if (io_dtype == at::kHalf) {
    store_rounded(out_buffer, reinterpret_cast<c10::Half*>(out.data_ptr()));
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(kvforge_cpu, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_self, Tensor v_self, Tensor k_pages, "
        "Tensor v_pages, Tensor page_table, Tensor first_page_position, Tensor visible_from, "
        "Tensor visible_to, float scale, Tensor k_scales, Tensor v_scales) -> Tensor");
  m.def("bf16_dot_supported() -> bool", &bf16_dot_supported);
  m.def("set_bf16_dot(bool enabled) -> bool", &set_bf16_dot);
}

TORCH_LIBRARY_IMPL(kvforge_cpu, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
}
