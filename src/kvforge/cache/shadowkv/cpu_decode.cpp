// C++ source of ShadowKV's fused CPU decode step for one global layer (see cpu_decode.py).
//
// Registers `torch.ops.kvforge_cpu_shadowkv.shadowkv_decode` through TORCH_LIBRARY (only
// ATen/c10 core headers, no pybind11). One call handles every decode sequence of a group
// for one layer; work is split by (sequence, KV head) pair, and each pair runs the whole
// of ShadowKV's Algorithm 2 on data no other pair touches:
//   1. selection: scores q . landmark x scale of the group's query heads over the
//      sequence's candidate chunks, softmax per query head, max over the group, top-k;
//   2. reuse: picks already in a reuse slot are hits; misses take the free slots in
//      ascending order, in pick order (descending score), exactly as the PyTorch path;
//   3. rebuild: keys of missed chunks = coefficients [chunk, r] x the head's basis slice
//      [r, D], rotated at the chunk's positions (cos/sin tables), written into the slot;
//   4. fetch: values of missed chunks copied from the slow tier into the slot;
//   5. attention of the group's query heads over outlier rows, the slots selected in this
//      step and the exact window, whose last row is the step's own token (written first
//      from own_k/own_v when they are given, else already there).
//
// Invariants the kernel relies on (checked on entry, made true by the Python wrapper):
// - every floating tensor is float32 and contiguous; index tensors are contiguous int64,
//   candidate masks contiguous bool;
// - q [B, heads, D]; landmarks [H, P, D]; slow values [H, P, chunk, D]; cos/sin [N, D]
//   with N >= chunk x (most chunks of a sequence);
// - per sequence b: table [C], candidates [H, C], basis [r, H x D] and coefficients
//   [>= C, chunk, r] (r its own: ranks differ per layer and sequence; float32 or float16,
//   converted to float32 per rebuilt chunk), keys/values buffers
//   [H, R, D], slot ids [H, k]; own_k/own_v [B, H, D] or empty; meta row
//   (slots_start, window_start, rows_used) with
//   slots_start + k x chunk = window_start < rows_used <= R;
// - page ids in the tables are < P; heads is a multiple of H.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "cpu_checks.h"
#include "cpu_simd.h"  // NativeVec (KVFORGE_NATIVE_VEC), dot4, exp_nonpositive_in_place, sum_of

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

// Counters per (sequence, KV head) pair, returned to Python as float64 columns.
enum Counter { kHits = 0, kMisses, kSelectSeconds, kRebuildSeconds, kFetchSeconds, kAttendSeconds, kCounters };

inline double seconds_since(Clock::time_point& mark) {
  const Clock::time_point now = Clock::now();
  const double elapsed = std::chrono::duration<double>(now - mark).count();
  mark = now;
  return elapsed;
}

using kvforge_simd::dot_simd_reduction;
#ifdef KVFORGE_NATIVE_VEC
using kvforge_simd::NativeVec;
#endif

// out[j] = a . rows[j] for four rows at once: with the native vectors (n a multiple of their
// width) one horizontal reduction tree for the four sums instead of one per dot product
// (the reduction, not the FMAs, dominates at D = 64).
inline void dot4(const float* a, const float* const* rows, int64_t n, float* out) {
#ifdef KVFORGE_NATIVE_VEC
  if (n % NativeVec::kLanes == 0) return kvforge_simd::dot4<NativeVec>(a, rows, n, out);
#endif
  for (int j = 0; j < 4; ++j) out[j] = dot_simd_reduction(a, rows[j], n);
}

// scores[g * stride + i] = q_g . rows[i] for G queries [G, D] and n rows.
inline void scores_of(const float* q, int64_t G, const float* const* rows, int64_t n, int64_t D, float* scores,
                      int64_t stride) {
  float four[4];
  int64_t i = 0;
  for (; i + 4 <= n; i += 4)
    for (int64_t g = 0; g < G; ++g) {
      dot4(q + g * D, rows + i, D, four);
      std::memcpy(scores + g * stride + i, four, sizeof(four));
    }
  for (; i < n; ++i)
    for (int64_t g = 0; g < G; ++g) scores[g * stride + i] = dot_simd_reduction(q + g * D, rows[i], D);
}

// y [D] = sum_i w[i] row(i) [D] over n rows. With the native vectors and D a multiple of 4
// of their width (64, 128, 256 in practice), 4 registers of the output are held across all
// rows (4 independent FMA chains); other head dims take plain loops. Every element sums its
// terms in row order, vectorised or not.
template <class RowAt>
inline void combine_rows(const float* w, int64_t n, RowAt row, int64_t D, float* y) {
#ifdef KVFORGE_NATIVE_VEC
  using V = NativeVec;
  constexpr int64_t L = V::kLanes;
  if (D % (4 * L) == 0) {
    for (int64_t d0 = 0; d0 < D; d0 += 4 * L) {
      V a0 = V::zero(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t i = 0; i < n; ++i) {
        const V c = V::broadcast(w[i]);
        const float* x = row(i) + d0;
        a0 = V::fmadd(c, V::load(x), a0);
        a1 = V::fmadd(c, V::load(x + L), a1);
        a2 = V::fmadd(c, V::load(x + 2 * L), a2);
        a3 = V::fmadd(c, V::load(x + 3 * L), a3);
      }
      a0.store(y + d0);
      a1.store(y + d0 + L);
      a2.store(y + d0 + 2 * L);
      a3.store(y + d0 + 3 * L);
    }
    return;
  }
#endif
  std::fill(y, y + D, 0.f);
  for (int64_t i = 0; i < n; ++i) {
    const float c = w[i];
    const float* x = row(i);
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) y[d] += c * x[d];
  }
}

// out[g] = sum_i p[g * stride + i] rows[i] for G weight vectors.
inline void weighted_rows(const float* p, int64_t G, int64_t stride, const float* const* rows, int64_t n,
                          int64_t D, float* out) {
  for (int64_t g = 0; g < G; ++g)
    combine_rows(p + g * stride, n, [rows](int64_t i) { return rows[i]; }, D, out + g * D);
}

// x[t] = coef[t] [r] x basis rows (stride W) [r, D], for T rows t.
inline void low_rank_rows(const float* coef, const float* basis, int64_t T, int64_t r, int64_t W, int64_t D,
                          float* x) {
  for (int64_t t = 0; t < T; ++t)
    combine_rows(coef + t * r, r, [basis, W](int64_t j) { return basis + j * W; }, D, x + t * D);
}

struct Layer {
  const float* landmarks;    // [H, P, D]
  const float* slow_values;  // [H, P, chunk, D]
  const float* cos;          // [N, D]
  const float* sin;
  int64_t pages, chunk, dim, kv_heads, group;
  float scale;
  bool reuse;
};

struct Sequence {
  const float* q;  // [heads, D] of this sequence
  const int64_t* table;
  const bool* candidates;  // [H, C]
  const float* basis;         // [r, H x D]
  const void* coefficients;  // [>= C, chunk, r]: chunk c at row c, float or c10::Half
  bool half_coefficients;
  int64_t rank;  // r of this sequence and layer
  float* keys;             // [H, R, D]
  float* values;
  int64_t* slot_ids;  // [H, k]
  int64_t chunks, rows, k, slots_start, window_start, rows_used;
  float* out;  // [heads, D]
  const float* own_k;  // [H, D] the step's token, written to row rows_used - 1; or null
  const float* own_v;
};

struct Scratch {
  std::vector<int64_t> order;        // candidate chunks of the head, ascending
  std::vector<const float*> rows;    // their landmark rows, then the attended key rows
  std::vector<const float*> vrows;   // attended value rows
  std::vector<float> query;          // [group, D] queries x scale
  std::vector<float> logits;         // [group, n] scores, then probabilities
  std::vector<float> score;          // [n] selection score per candidate
  std::vector<uint64_t> ranked;      // (score bits, ~position) keys for top-k
  std::vector<int64_t> picks, misses, miss_slot, new_ids;
  std::vector<char> kept;
  std::vector<float> pre;            // [chunk, D] rebuilt pre-RoPE keys
  std::vector<float> coef;           // [chunk, r] float16 coefficients widened
};

void scaled_queries(const Layer& L, const Sequence& s, int64_t h, Scratch& w) {
  const int64_t D = L.dim, G = L.group;
  w.query.resize(G * D);
  // q x scale first, then the dot products, like the reference
  for (int64_t i = 0; i < G * D; ++i) w.query[i] = s.q[h * G * D + i] * L.scale;
}

// In place softmax of each of the G rows [n] (stride n) of x; returns nothing, x holds
// probabilities. Every row has a finite maximum (n >= 1, finite inputs).
void softmax_rows(float* x, int64_t G, int64_t n) {
  for (int64_t g = 0; g < G; ++g) {
    float* l = x + g * n;
    float top = l[0];
    for (int64_t i = 1; i < n; ++i) top = std::max(top, l[i]);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) l[i] -= top;
    kvforge_simd::exp_nonpositive_in_place(l, n);
    const float inv = 1.f / kvforge_simd::sum_of(l, n);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) l[i] *= inv;
  }
}

// Step 1: the chunks of KV head h to attend this step, best first (picks).
void select_chunks(const Layer& L, const Sequence& s, int64_t h, Scratch& w) {
  const int64_t C = s.chunks, D = L.dim, G = L.group;
  const bool* allowed = s.candidates + h * C;
  const float* lm = L.landmarks + h * L.pages * D;
  w.order.clear();
  w.rows.clear();
  for (int64_t c = 0; c < C; ++c)
    if (allowed[c]) {
      w.order.push_back(c);
      w.rows.push_back(lm + s.table[c] * D);
    }
  const int64_t n = static_cast<int64_t>(w.order.size());
  w.picks.clear();
  if (n == 0) return;
  scaled_queries(L, s, h, w);
  w.logits.resize(G * n);
  scores_of(w.query.data(), G, w.rows.data(), n, D, w.logits.data(), n);
  softmax_rows(w.logits.data(), G, n);
  w.score.assign(w.logits.begin(), w.logits.begin() + n);
  for (int64_t g = 1; g < G; ++g) {
    const float* p = w.logits.data() + g * n;
    for (int64_t i = 0; i < n; ++i) w.score[i] = std::max(w.score[i], p[i]);
  }
  // top-k by (score descending, chunk ascending). Scores are >= 0, so their float bits
  // order like their values; the low half holds ~position, so ties prefer earlier chunks.
  const int64_t k = std::min(s.k, n);
  w.ranked.resize(n);
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, &w.score[i], sizeof(bits));
    w.ranked[i] = (static_cast<uint64_t>(bits) << 32) | static_cast<uint32_t>(~static_cast<uint32_t>(i));
  }
  auto greater = [](uint64_t a, uint64_t b) { return a > b; };
  if (k < n) std::nth_element(w.ranked.begin(), w.ranked.begin() + k, w.ranked.end(), greater);
  std::sort(w.ranked.begin(), w.ranked.begin() + k, greater);
  for (int64_t i = 0; i < k; ++i)
    w.picks.push_back(w.order[~static_cast<uint32_t>(w.ranked[i] & 0xFFFFFFFFu)]);
}

// Step 2: hits stay in their slot; misses[m] goes to miss_slot[m]; new_ids the slot ids
// after the step (-1: no chunk selected in this step).
void match_slots(const Layer& L, const Sequence& s, int64_t h, Scratch& w, double* counters) {
  const int64_t k = s.k;
  int64_t* held = s.slot_ids + h * k;
  w.kept.assign(k, 0);
  w.misses.clear();
  for (int64_t c : w.picks) {
    int64_t found = -1;
    if (L.reuse)
      for (int64_t j = 0; j < k; ++j)
        if (held[j] == c) {
          found = j;
          break;
        }
    if (found >= 0)
      w.kept[found] = 1;
    else
      w.misses.push_back(c);
  }
  w.new_ids.assign(k, -1);
  for (int64_t j = 0; j < k; ++j)
    if (w.kept[j]) w.new_ids[j] = held[j];
  w.miss_slot.clear();
  int64_t next = 0;
  for (int64_t c : w.misses) {
    while (w.kept[next]) ++next;  // misses <= free slots: the picks are at most k
    w.miss_slot.push_back(next);
    w.new_ids[next] = c;
    ++next;
  }
  std::copy(w.new_ids.begin(), w.new_ids.end(), held);
  counters[kHits] += static_cast<double>(w.picks.size() - w.misses.size());
  counters[kMisses] += static_cast<double>(w.misses.size());
}

// Step 3: keys of the missed chunks, rebuilt and rotated into their slots.
void rebuild_keys(const Layer& L, const Sequence& s, int64_t h, Scratch& w) {
  const int64_t D = L.dim, T = L.chunk, r = s.rank, W = L.kv_heads * D, half = D / 2;
  const float* basis = s.basis + h * D;  // row j of the head's slice: basis + j * W
  w.pre.resize(T * D);
  for (size_t m = 0; m < w.misses.size(); ++m) {
    const int64_t c = w.misses[m];
    const float* coef;
    if (s.half_coefficients) {  // widen the chunk's T x r coefficients once
      const c10::Half* src = static_cast<const c10::Half*>(s.coefficients) + c * T * r;
      w.coef.resize(T * r);
      for (int64_t i = 0; i < T * r; ++i) w.coef[i] = static_cast<float>(src[i]);
      coef = w.coef.data();
    } else {
      coef = static_cast<const float*>(s.coefficients) + c * T * r;
    }
    low_rank_rows(coef, basis, T, r, W, D, w.pre.data());
    float* dst = s.keys + (h * s.rows + s.slots_start + w.miss_slot[m] * T) * D;
    for (int64_t t = 0; t < T; ++t) {
      const float* x = w.pre.data() + t * D;
      const float* cs = L.cos + (c * T + t) * D;
      const float* sn = L.sin + (c * T + t) * D;
      float* y = dst + t * D;
      // rotate_half(x) = (-x[half:], x[:half])
#pragma omp simd
      for (int64_t d = 0; d < half; ++d) y[d] = x[d] * cs[d] - x[d + half] * sn[d];
#pragma omp simd
      for (int64_t d = half; d < D; ++d) y[d] = x[d] * cs[d] + x[d - half] * sn[d];
    }
  }
}

// Step 4: values of the missed chunks from the slow tier.
void fetch_values(const Layer& L, const Sequence& s, int64_t h, const Scratch& w) {
  const int64_t D = L.dim, T = L.chunk;
  for (size_t m = 0; m < w.misses.size(); ++m) {
    const float* src = L.slow_values + ((h * L.pages + s.table[w.misses[m]]) * T) * D;
    float* dst = s.values + (h * s.rows + s.slots_start + w.miss_slot[m] * T) * D;
    std::memcpy(dst, src, sizeof(float) * T * D);
  }
}

// Step 5: softmax attention of the group's query heads over the rows in use.
void attend(const Layer& L, const Sequence& s, int64_t h, Scratch& w) {
  const int64_t D = L.dim, T = L.chunk, G = L.group;
  const float* keys = s.keys + h * s.rows * D;
  const float* values = s.values + h * s.rows * D;
  w.rows.clear();
  w.vrows.clear();
  auto use = [&](int64_t row) {
    w.rows.push_back(keys + row * D);
    w.vrows.push_back(values + row * D);
  };
  for (int64_t row = 0; row < s.slots_start; ++row) use(row);  // outliers
  for (int64_t j = 0; j < s.k; ++j)
    if (w.new_ids[j] >= 0)
      for (int64_t t = 0; t < T; ++t) use(s.slots_start + j * T + t);
  for (int64_t row = s.window_start; row < s.rows_used; ++row) use(row);
  const int64_t n = static_cast<int64_t>(w.rows.size());
  scaled_queries(L, s, h, w);
  w.logits.resize(G * n);
  scores_of(w.query.data(), G, w.rows.data(), n, D, w.logits.data(), n);
  softmax_rows(w.logits.data(), G, n);
  weighted_rows(w.logits.data(), G, n, w.vrows.data(), n, D, s.out + h * G * D);
}


std::tuple<at::Tensor, at::Tensor> shadowkv_decode(const at::Tensor& q, const at::Tensor& landmarks,
                                                   const at::Tensor& slow_values, const at::Tensor& cos,
                                                   const at::Tensor& sin, at::TensorList tables,
                                                   at::TensorList candidates, at::TensorList bases,
                                                   at::TensorList coefficients, at::TensorList keys,
                                                   at::TensorList values,
                                                   at::TensorList slot_ids, const at::Tensor& own_k,
                                                   const at::Tensor& own_v, const at::Tensor& meta, double scale,
                                                   bool reuse) {
  constexpr const char* kOpName = "shadowkv_decode";
  kvforge_checks::cpu(kOpName, {&q, &landmarks, &slow_values, &cos, &sin, &own_k, &own_v, &meta});
  kvforge_checks::contiguous_of(kOpName, "q, landmarks, slow values, cos and sin", at::kFloat,
                                {&q, &landmarks, &slow_values, &cos, &sin});
  kvforge_checks::contiguous_of(kOpName, "meta", at::kLong, {&meta});
  TORCH_CHECK(q.dim() == 3 && landmarks.dim() == 3 && slow_values.dim() == 4,
              "q [B, heads, D], landmarks [H, P, D], values [H, P, chunk, D]");
  const int64_t B = q.size(0), heads = q.size(1), D = q.size(2);
  const int64_t H = landmarks.size(0), P = landmarks.size(1);
  TORCH_CHECK(landmarks.size(2) == D, "head geometry mismatch");
  kvforge_checks::gqa(kOpName, heads, H);
  TORCH_CHECK(slow_values.size(0) == H && slow_values.size(1) == P && slow_values.size(3) == D,
              "store geometry mismatch");
  TORCH_CHECK(cos.dim() == 2 && cos.size(1) == D && sin.sizes() == cos.sizes(), "cos/sin must be [N, D]");
  TORCH_CHECK(static_cast<int64_t>(tables.size()) == B && static_cast<int64_t>(candidates.size()) == B &&
                  static_cast<int64_t>(bases.size()) == B && static_cast<int64_t>(coefficients.size()) == B &&
                  static_cast<int64_t>(keys.size()) == B &&
                  static_cast<int64_t>(values.size()) == B && static_cast<int64_t>(slot_ids.size()) == B,
              "one table, candidate mask, basis, buffer pair and slot-id tensor per sequence");
  TORCH_CHECK(meta.dim() == 2 && meta.size(0) == B && meta.size(1) == 3, "meta must be [B, 3]");
  const bool own = own_k.numel() > 0;
  if (own) {
    kvforge_checks::contiguous_of(kOpName, "own_k and own_v", at::kFloat, {&own_k, &own_v});
    TORCH_CHECK(own_k.dim() == 3 && own_k.size(0) == B && own_k.size(1) == H && own_k.size(2) == D &&
                    own_v.sizes() == own_k.sizes(),
                "own_k/own_v must be [B, H, D]");
  }

  Layer L{landmarks.data_ptr<float>(), slow_values.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(),
          P, slow_values.size(2), D, H, heads / H, static_cast<float>(scale), reuse};
  at::Tensor out = at::empty({B, heads, D}, q.options());
  const int64_t* m = meta.data_ptr<int64_t>();
  std::vector<Sequence> seqs(B);
  for (int64_t b = 0; b < B; ++b) {
    kvforge_checks::cpu(kOpName, {&tables[b], &bases[b], &coefficients[b], &keys[b], &values[b], &slot_ids[b],
                                  &candidates[b]});
    kvforge_checks::contiguous_of(kOpName, "table and slot ids", at::kLong, {&tables[b], &slot_ids[b]});
    kvforge_checks::contiguous_of(kOpName, "basis and buffers", at::kFloat, {&bases[b], &keys[b], &values[b]});
    const bool half = coefficients[b].scalar_type() == at::kHalf;
    kvforge_checks::contiguous_of(kOpName, "coefficients", half ? at::kHalf : at::kFloat, {&coefficients[b]});
    kvforge_checks::contiguous_of(kOpName, "candidates", at::kBool, {&candidates[b]});
    const int64_t C = tables[b].numel(), R = keys[b].size(1), k = slot_ids[b].size(1);
    TORCH_CHECK(candidates[b].dim() == 2 && candidates[b].size(0) == H && candidates[b].size(1) == C,
                "candidates must be [H, C]");
    const int64_t rank = bases[b].size(0);
    TORCH_CHECK(bases[b].dim() == 2 && bases[b].size(1) == H * D, "basis must be [r, H x D]");
    TORCH_CHECK(coefficients[b].dim() == 3 && coefficients[b].size(0) >= C && coefficients[b].size(1) == L.chunk &&
                    coefficients[b].size(2) == rank,
                "coefficients must be [>= C, chunk, r] with the basis' r");
    TORCH_CHECK(keys[b].dim() == 3 && keys[b].size(0) == H && keys[b].size(2) == D &&
                    values[b].sizes() == keys[b].sizes(),
                "buffers must be [H, R, D]");
    TORCH_CHECK(slot_ids[b].dim() == 2 && slot_ids[b].size(0) == H, "slot ids must be [H, k]");
    const int64_t slots_start = m[b * 3], window_start = m[b * 3 + 1], rows_used = m[b * 3 + 2];
    TORCH_CHECK(slots_start >= 0 && slots_start + k * L.chunk == window_start && window_start < rows_used &&
                    rows_used <= R,
                "buffer rows out of order");
    TORCH_CHECK(C * L.chunk <= cos.size(0), "cos/sin tables shorter than the sequence");
    const int64_t* table = tables[b].data_ptr<int64_t>();
    for (int64_t c = 0; c < C; ++c) TORCH_CHECK(table[c] >= 0 && table[c] < P, "page id out of range");
    seqs[b] = Sequence{q.data_ptr<float>() + b * heads * D, table, candidates[b].data_ptr<bool>(),
                       bases[b].data_ptr<float>(), coefficients[b].data_ptr(), half, rank,
                       keys[b].data_ptr<float>(), values[b].data_ptr<float>(),
                       slot_ids[b].data_ptr<int64_t>(), C, R, k, slots_start, window_start, rows_used,
                       out.data_ptr<float>() + b * heads * D,
                       own ? own_k.data_ptr<float>() + b * H * D : nullptr,
                       own ? own_v.data_ptr<float>() + b * H * D : nullptr};
  }
  at::Tensor counters = at::zeros({B * H, kCounters}, q.options().dtype(at::kDouble));
  double* cp = counters.data_ptr<double>();
  // Pairs write disjoint rows of their sequence's buffers, slot ids and output heads.
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    Scratch w;
    for (int64_t pair = begin; pair < end; ++pair) {
      const Sequence& s = seqs[pair / H];
      const int64_t h = pair % H;
      double* c = cp + pair * kCounters;
      if (s.own_k != nullptr) {
        const int64_t row = (h * s.rows + s.rows_used - 1) * L.dim;
        std::memcpy(s.keys + row, s.own_k + h * L.dim, sizeof(float) * L.dim);
        std::memcpy(s.values + row, s.own_v + h * L.dim, sizeof(float) * L.dim);
      }
      Clock::time_point mark = Clock::now();
      select_chunks(L, s, h, w);
      c[kSelectSeconds] += seconds_since(mark);
      match_slots(L, s, h, w, c);
      rebuild_keys(L, s, h, w);
      c[kRebuildSeconds] += seconds_since(mark);
      fetch_values(L, s, h, w);
      c[kFetchSeconds] += seconds_since(mark);
      attend(L, s, h, w);
      c[kAttendSeconds] += seconds_since(mark);
    }
  });
  return {out, counters};
}

}  // namespace

TORCH_LIBRARY(kvforge_cpu_shadowkv, m) {
  m.def("shadowkv_decode(Tensor q, Tensor landmarks, Tensor slow_values, Tensor cos, Tensor sin, "
        "Tensor[] tables, Tensor[] candidates, Tensor[] bases, Tensor[] coefficients, Tensor(a!)[] keys, "
        "Tensor(b!)[] values, Tensor(c!)[] slot_ids, Tensor own_k, Tensor own_v, Tensor meta, float scale, "
        "bool reuse) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(kvforge_cpu_shadowkv, CPU, m) {
  m.impl("shadowkv_decode", &shadowkv_decode);
}
