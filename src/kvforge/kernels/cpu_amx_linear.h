// AMX-BF16 path of the small-M linear (cpu_linear.cpp): y = x @ W^T (+ bias) with bf16 x, W
// and y, on CPUs with Intel AMX (Sapphire Rapids and later).
//
// Why: at M = 16 the AVX512-BF16 path is compute-bound on such a CPU (smollm2-135m's decode
// products took far longer at M = 16 than at M = 1; docs/benchmarks.md, 'Measurements behind
// design choices'), while one tile multiply (16 W rows x 32 k x 16 x rows, TDPBF16PS) does
// the work of 32 VDPBF16PS. With it the product streams W at the read bandwidth for every M
// up to 16.
//
// Layout: the tile product computes C^T = W x^T. A tiles are 16 W rows x 32 k, loaded straight
// from W (row stride K); B tiles are 16 k-pairs x 16 x rows (x repacked once per call into
// that pair layout, zero rows past M); C tiles are [16 W rows][16 x rows] float32, stored and
// read back by columns into y's rows. W is walked in units of up to 2 blocks of 16 rows (two
// independent accumulators); while a unit runs, the next unit's W (contiguous) is prefetched
// into L2 in address order, NB x 16 lines per k chunk. Tried and dropped (figures in
// docs/benchmarks.md, 'Measurements behind design choices'): the lines in row-by-row column
// order instead (no difference; address order kept as the simpler stream), the range's first
// unit requested whole up front (no change), the current unit's next chunk also into L1 (T0:
// slower).
//
// INVARIANT (M-invariance, as cpu_linear.cpp's other paths): y[m, n] is the TDPBF16PS sum of
// x[m, :] and W[n, :] over k = 0 .. K-1 in increasing 32-wide chunks into one float32
// accumulator starting at zero, then + bias, then rounded once to bf16 (c10's rule). A tile
// multiply computes each C element from its own A row and B column only, so neither M, nor
// the other rows of x, nor the thread split changes any output's bits. The path is chosen
// from the process (AMX granted, `set_amx`) and the shapes (K % 32 == 0, N % 16 == 0), never
// from M. TDPBF16PS treats bf16 denormal inputs as zero and flushes denormal results (as
// VDPBF16PS does); it differs from the AVX512-BF16 path in the last bits (another order).
#pragma once

#include "cpu_amx.h"  // defines KVFORGE_AMX

#if defined(KVFORGE_AMX)
#define KVFORGE_AMX_LINEAR 1
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_bf16_round.h"

namespace kvforge_amx {

constexpr int64_t kPackedChunk = kRows * kChunk;  // bf16 elements of one packed x tile

// The process-wide switch (test hook `set_amx`): off, bf16 takes the AVX512-BF16 path.
inline std::atomic<bool>& switch_on() {
  static std::atomic<bool> on{true};
  return on;
}

inline bool shape_fits(int64_t k, int64_t n) { return k > 0 && k % kChunk == 0 && n % kRows == 0; }

// One product of a call: W [n, K] bf16 bits, bias [n] float or null, y [M, n] bf16 bits.
struct Product {
  const uint16_t* w;
  const float* bias;
  uint16_t* y;
  int64_t n;
};

// Tiles 0-3: C (W block a, x block b) at 2a + b; tiles 4-5: A (W block a); tiles 6-7: B (x
// block b); all 16 rows x 64 bytes (load_tile_config).

// x [m, k] -> B tiles, x block b and chunk c at packed + (b * chunks + c) * kPackedChunk:
// element (pair r, x row j, e) = x[16 b + j, 32 c + 2 r + e], zero for rows past m.
inline void pack_x(const uint16_t* x, int64_t m, int64_t k, std::vector<uint16_t>& packed) {
  const int64_t blocks = (m + kRows - 1) / kRows, chunks = k / kChunk;
  packed.assign(static_cast<size_t>(blocks * chunks * kPackedChunk), 0);
  for (int64_t row = 0; row < m; ++row) {
    const int64_t b = row / kRows, j = row % kRows;
    for (int64_t c = 0; c < chunks; ++c) {
      uint16_t* tile = packed.data() + (b * chunks + c) * kPackedChunk;
      const uint16_t* src = x + row * k + c * kChunk;
      for (int64_t r = 0; r < kChunk / 2; ++r) std::memcpy(tile + r * 2 * kRows + 2 * j, src + 2 * r, 4);
    }
  }
}

// y[m0 + j, n0 + i] = round(C[i][j] + bias[n0 + i]) for the x rows j < rows of one C tile.
inline void write_tile(const float* c, const Product& p, int64_t n0, int64_t m0, int64_t rows) {
  const __m512i column = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(static_cast<int>(kRows)));
  const __m512 bias = p.bias != nullptr ? _mm512_loadu_ps(p.bias + n0) : _mm512_setzero_ps();
  for (int64_t j = 0; j < rows; ++j) {
    __m512 v = _mm512_i32gather_ps(column, c + j, 4);
    if (p.bias != nullptr) v = _mm512_add_ps(v, bias);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p.y + (m0 + j) * p.n + n0), kvforge_bf16_round::bits16(v));
  }
}

// NB blocks of 16 W rows (from n0) against x blocks [b0, b0 + XB) over all K. When `next` is
// set, the rows from it (as many as this unit has) are prefetched into L2, chunk by chunk.
template <int NB, int XB>
inline void unit_pass(const Product& p, int64_t k, const uint16_t* packed, int64_t m, int64_t n0, int64_t b0,
                      const uint16_t* next) {
  const int64_t chunks = k / kChunk, stride = k * static_cast<int64_t>(sizeof(uint16_t));
  const uint16_t* w0 = p.w + n0 * k;
  const uint16_t* x0 = packed + b0 * chunks * kPackedChunk;
  _tile_zero(0);
  if constexpr (XB == 2) _tile_zero(1);
  if constexpr (NB == 2) _tile_zero(2);
  if constexpr (NB == 2 && XB == 2) _tile_zero(3);
  for (int64_t c = 0; c < chunks; ++c) {
    if (next != nullptr) {  // the next unit's NB * 16 rows are contiguous: lines in order
      const char* lines = reinterpret_cast<const char*>(next) + c * NB * kRows * 64;
      for (int64_t r = 0; r < NB * kRows; ++r) _mm_prefetch(lines + r * 64, _MM_HINT_T1);
    }
    _tile_loadd(6, x0 + c * kPackedChunk, 64);
    if constexpr (XB == 2) _tile_loadd(7, x0 + (chunks + c) * kPackedChunk, 64);
    _tile_loadd(4, w0 + c * kChunk, stride);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (XB == 2) _tile_dpbf16ps(1, 4, 7);
    if constexpr (NB == 2) {
      _tile_loadd(5, w0 + kRows * k + c * kChunk, stride);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (XB == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
  alignas(64) float c[4][kRows * kRows];
  _tile_stored(0, c[0], 64);
  if constexpr (XB == 2) _tile_stored(1, c[1], 64);
  if constexpr (NB == 2) _tile_stored(2, c[2], 64);
  if constexpr (NB == 2 && XB == 2) _tile_stored(3, c[3], 64);
  for (int a = 0; a < NB; ++a) {
    for (int b = 0; b < XB; ++b) {
      const int64_t m0 = (b0 + b) * kRows;
      write_tile(c[2 * a + b], p, n0 + a * kRows, m0, std::min(kRows, m - m0));
    }
  }
}

// One unit (NB blocks from n0) against every x block, two x blocks per pass (the first pass
// streams W and prefetches `next`; later passes, M > 32 only, find the unit in cache).
template <int NB>
inline void unit(const Product& p, int64_t k, const uint16_t* packed, int64_t m, int64_t n0, const uint16_t* next) {
  const int64_t blocks = (m + kRows - 1) / kRows;
  for (int64_t b0 = 0; b0 < blocks; b0 += 2) {
    const uint16_t* pf = b0 == 0 ? next : nullptr;
    if (blocks - b0 >= 2) {
      unit_pass<NB, 2>(p, k, packed, m, n0, b0, pf);
    } else {
      unit_pass<NB, 1>(p, k, packed, m, n0, b0, pf);
    }
  }
}

// ys = x @ W^T (+ bias) for products sharing x [m, k]; every product's shape fits (shape_fits)
// and the process is granted AMX. Blocks of 16 W rows of all products are split over threads
// in contiguous ranges; a thread takes two blocks of one product at a time where it can.
inline void linear(const uint16_t* x, int64_t m, int64_t k, const std::vector<Product>& products) {
  thread_local std::vector<uint16_t> packed;  // the caller's; workers read it through xp
  pack_x(x, m, k, packed);
  const uint16_t* xp = packed.data();
  std::vector<int64_t> first_block(products.size() + 1, 0);
  for (size_t i = 0; i < products.size(); ++i) first_block[i + 1] = first_block[i] + products[i].n / kRows;
  // about 32 KiB of W per thread hand-off at least, as the AVX-512 paths
  const int64_t grain = std::max<int64_t>(2, (32 * 1024) / (kRows * k * 2));
  at::parallel_for(0, first_block.back(), grain, [&](int64_t begin, int64_t end) {
    load_tile_config();
    size_t s = 0;
    for (int64_t t = begin; t < end;) {
      while (t >= first_block[s + 1]) ++s;
      const Product& p = products[s];
      const int64_t local = t - first_block[s];
      const int64_t local_end = std::min(end, first_block[s + 1]) - first_block[s];
      const int64_t nb = local + 2 <= local_end ? 2 : 1;
      // the next unit of this product in this range, if any (never a pointer past W)
      const int64_t next_rows = std::min(local_end - (local + nb), nb) * kRows;
      const uint16_t* next = next_rows > 0 ? p.w + (local + nb) * kRows * k : nullptr;
      if (nb == 2 && next_rows == 2 * kRows) {
        unit<2>(p, k, xp, m, local * kRows, next);
      } else if (nb == 2) {
        unit<2>(p, k, xp, m, local * kRows, nullptr);
      } else {
        unit<1>(p, k, xp, m, local * kRows, nullptr);
      }
      t += nb;
    }
    _tile_release();
  });
}

}  // namespace kvforge_amx

#endif  // AMX
