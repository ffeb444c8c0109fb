// C++ source of the fused elementwise CPU ops of a decoder layer, and the greedy argmax of
// a decode step's logits (see cpu_fused.py).
//
// In eager PyTorch an RMSNorm is ~8 ops and a rotary embedding ~6, each a dispatch, an
// allocation and a pass over memory; at decode (one row per sequence) the dispatches
// dominate (docs/benchmarks.md, 'Measurements behind design choices'). Each op here is one
// call and one pass.
//
//   rms_norm(x [R, H], w [H], eps, gemma) -> [R, H], x's dtype
//     r = 1 / sqrt(mean(float(x)^2) + eps) per row;
//     Llama (gemma = false): y = T(float(w) * float(T(float(x) * r)))   (HF's two roundings)
//     Gemma (gemma = true):  y = T(float(x) * r * (1 + float(w)))
//   rope_rotate(x [R, heads, D], cos [R, D], sin [R, D]) -> [R, heads, D], x's dtype; x's rows
//     may sit apart (a slice of a packed q/k/v projection: each row's heads contiguous)
//     y[d] = T(float(x[d]) * float(cos[d]) + float(rot[d]) * float(sin[d])),
//     rot = (-x[D/2:], x[:D/2]) (rotate-half); computed in float, rounded once.
//   silu_mul(gate [R, F], up [R, F]) -> [R, F], gate's dtype: a gated MLP's act(gate) * up;
//     2-D gate and up may have rows that sit apart (the halves of a packed gate/up projection)
//     with the eager expression's two roundings: s = T(silu(float(g))), y = T(float(s) * float(u)),
//     silu(v) = v / (1 + exp(-v)) computed as v / (1 + e) (v >= 0) or v e / (1 + e) (v < 0)
//     with e = exp(-|v|) <= 1, so nothing overflows; e below float's normal range is taken as 0.
//     One pass instead of two ops (silu, then mul) and their intermediate tensor. The exp is
//     not ATen's, so results may differ from F.silu(g) * u in the last bit of s: GatedMLP and
//     the fused decode layer both call this op, so they stay bitwise equal to each other.
//   argmax_rows(x [R, V]) -> int64 [R]: torch.argmax(x, dim=-1), the index of the first
//     maximum of each row; a row holding NaN gives its first NaN (argmax orders NaN above
//     every number). Compares x's own values (widening to float is exact), so no float32
//     copy of the logits is made.
//
// INVARIANTS: every output row depends only on its own input row (rows are split over
// threads whole, and each row's sums run in one fixed order), so a row's result does not
// depend on the batch it is in. For float32 the RoPE arithmetic is exactly PyTorch's
// `x * cos + rotate_half(x) * sin` (two rounded products, one rounded sum: the build uses
// -ffp-contract=off so no FMA fuses them); the RMSNorm differs from PyTorch's only in the
// order of the sum of squares (last-bit differences in r).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "cpu_bf16_attention.h"  // exp_nonpositive16 (with AVX512-BF16: KVFORGE_BF16_DOT)
#include "cpu_bf16_round.h"
#include "cpu_simd.h"  // NativeVec, widen_bf16

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kMinChunkElements = 16 * 1024;  // smaller parallel chunks cost more than they save

int64_t grain_rows(int64_t row_elements) {
  return std::max<int64_t>(1, kMinChunkElements / std::max<int64_t>(1, row_elements));
}

template <typename T>
void rms_norm_rows(const T* x, const T* w, T* y, int64_t rows, int64_t h, float eps, bool gemma) {
  at::parallel_for(0, rows, grain_rows(h), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * h;
      T* yr = y + r * h;
      // Eight partial sums in a fixed order, then a fixed tree: deterministic and vectorisable.
      float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      int64_t i = 0;
      for (; i + 8 <= h; i += 8) {
        for (int j = 0; j < 8; ++j) {
          const float v = static_cast<float>(xr[i + j]);
          part[j] += v * v;
        }
      }
      for (int j = 0; i < h; ++i, ++j) {
        const float v = static_cast<float>(xr[i]);
        part[j] += v * v;
      }
      const float sum = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
      const float inv = 1.0f / std::sqrt(sum / static_cast<float>(h) + eps);
      if (gemma) {
        for (int64_t k = 0; k < h; ++k) {
          yr[k] = static_cast<T>(static_cast<float>(xr[k]) * inv * (1.0f + static_cast<float>(w[k])));
        }
      } else {
        for (int64_t k = 0; k < h; ++k) {
          const T normed = static_cast<T>(static_cast<float>(xr[k]) * inv);
          yr[k] = static_cast<T>(static_cast<float>(w[k]) * static_cast<float>(normed));
        }
      }
    }
  });
}

template <typename T>
void rope_rows(const T* x, int64_t x_row_stride, const T* cos, const T* sin, T* y, int64_t rows, int64_t heads,
               int64_t d) {
  const int64_t half = d / 2;
  at::parallel_for(0, rows, grain_rows(heads * d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* c = cos + r * d;
      const T* s = sin + r * d;
      for (int64_t hd = 0; hd < heads; ++hd) {
        const T* xr = x + r * x_row_stride + hd * d;
        T* yr = y + (r * heads + hd) * d;
        for (int64_t k = 0; k < half; ++k) {
          const float a = static_cast<float>(xr[k]) * static_cast<float>(c[k]);
          const float b = -static_cast<float>(xr[k + half]) * static_cast<float>(s[k]);
          yr[k] = static_cast<T>(a + b);
        }
        for (int64_t k = half; k < d; ++k) {
          const float a = static_cast<float>(xr[k]) * static_cast<float>(c[k]);
          const float b = static_cast<float>(xr[k - half]) * static_cast<float>(s[k]);
          yr[k] = static_cast<T>(a + b);
        }
      }
    }
  });
}

// Below this, exp(-|v|) is under float's normal range: silu_mul takes it as 0 (the vector
// exp clamps its input there instead of underflowing).
constexpr float kExpFloor = -87.f;

inline float silu_of(float v) {
  const float m = -std::fabs(v);
  const float e = m < kExpFloor ? 0.f : std::exp(m);
  return v >= 0.f ? v / (1.f + e) : v * e / (1.f + e);
}

#ifdef KVFORGE_BF16_DOT
// 16 elements of a row (lanes past `mask` read as 0) widened to float, and back: bf16 by
// c10::BFloat16's rule (nearest even, NaN -> 0x7FC0), so the vector and scalar roundings agree.
template <typename T>
inline __m512 load16_masked(const T* p, __mmask16 mask) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_maskz_loadu_ps(mask, p);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return kvforge_simd::widen_bf16(_mm256_maskz_loadu_epi16(mask, p));
  } else {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p));
  }
}

// The vector silu_of: the same expression, with exp_nonpositive16 for the exp.
inline __m512 silu16(__m512 v) {
  const __m512 m = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(v));
  const __m512 e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(m, _mm512_set1_ps(kExpFloor), _CMP_GE_OQ),
                                       kvforge_bf16::exp_nonpositive16(m));
  const __m512 denominator = _mm512_add_ps(_mm512_set1_ps(1.f), e);
  const __m512 numerator = _mm512_mask_mul_ps(v, _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_LT_OQ), v, e);
  return _mm512_div_ps(numerator, denominator);
}
#endif

// y = T(float(T(silu(g))) * float(u)) for one row of f elements. bf16 and float32 rows run
// 16 at a time, the last partial step masked, so every element of a row goes through the
// same arithmetic wherever it sits; float16 rows, and CPUs without AVX512-BF16, use silu_of.
template <typename T>
void silu_mul_row(const T* g, const T* u, T* y, int64_t f) {
#ifdef KVFORGE_BF16_DOT
  if constexpr (std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, float>) {
    for (int64_t i = 0; i < f; i += 16) {
      const __mmask16 mask = f - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (f - i)) - 1);
      const __m512 s = silu16(load16_masked(g + i, mask));
      if constexpr (std::is_same_v<T, float>) {
        _mm512_mask_storeu_ps(y + i, mask, _mm512_mul_ps(s, load16_masked(u + i, mask)));
      } else {
        using kvforge_bf16_round::bits16;
        const __m512 s_rounded = kvforge_simd::widen_bf16(bits16(s));
        _mm256_mask_storeu_epi16(y + i, mask, bits16(_mm512_mul_ps(s_rounded, load16_masked(u + i, mask))));
      }
    }
    return;
  }
#endif
  for (int64_t i = 0; i < f; ++i) {
    const T s = static_cast<T>(silu_of(static_cast<float>(g[i])));
    y[i] = static_cast<T>(static_cast<float>(s) * static_cast<float>(u[i]));
  }
}

template <typename T>
void silu_mul_rows(const T* g, int64_t g_stride, const T* u, int64_t u_stride, T* y, int64_t rows, int64_t f) {
  at::parallel_for(0, rows, grain_rows(f), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) silu_mul_row(g + r * g_stride, u + r * u_stride, y + r * f, f);
  });
}

// Row r of argmax_rows: its maximum (ignoring NaN) and whether it holds a NaN, in one pass;
// then the first index holding that maximum (or the first NaN) in a second pass that stops
// there. Plain loops (any ISA) and, with AVX-512, the same two passes 16 elements a step.
template <typename T>
int64_t argmax_row(const T* row, int64_t v) {
  float top = -std::numeric_limits<float>::infinity();
  bool nan = false;
  int64_t i = 0;
#if defined(__AVX512F__)
  constexpr bool kWide = std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, c10::Half>;
  auto load16 = [&](int64_t at) { return kvforge_simd::NativeVec::load(row + at).v; };
  if constexpr (kWide) {
    __m512 best[4];
    for (auto& b : best) b = _mm512_set1_ps(top);
    __mmask16 unordered = 0;
    for (; i + 64 <= v; i += 64) {
      for (int k = 0; k < 4; ++k) {
        const __m512 x = load16(i + 16 * k);
        best[k] = _mm512_max_ps(x, best[k]);  // a NaN in x leaves best[k] as it was
        unordered |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
      }
    }
    top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(best[0], best[1]), _mm512_max_ps(best[2], best[3])));
    nan = unordered != 0;
  }
#endif
  for (int64_t j = i; j < v; ++j) {
    const float f = static_cast<float>(row[j]);
    top = f > top ? f : top;
    nan = nan || f != f;
  }
  int64_t at = 0;
#if defined(__AVX512F__)
  if constexpr (kWide) {
    const __m512 target = _mm512_set1_ps(top);
    for (; at + 16 <= v; at += 16) {
      const __m512 x = load16(at);
      const __mmask16 hit = nan ? _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q) : _mm512_cmp_ps_mask(x, target, _CMP_EQ_OQ);
      if (hit) return at + __builtin_ctz(hit);
    }
  }
#endif
  for (; at < v; ++at) {
    const float f = static_cast<float>(row[at]);
    if (nan ? f != f : f == top) return at;
  }
  return v;  // not reached: the maximum (or a NaN) is in the row
}

template <typename T>
void argmax_rows_of(const T* x, int64_t rows, int64_t v, int64_t* out) {
  at::parallel_for(0, rows, grain_rows(v), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) out[r] = argmax_row(x + r * v, v);
  });
}

// Whether every dimension of t but the first is contiguous: its rows may sit apart.
bool rows_contiguous(const at::Tensor& t) {
  if (t.is_contiguous()) return true;
  int64_t expected = 1;
  for (int64_t dim = t.dim() - 1; dim >= 1; --dim) {
    if (t.size(dim) != 1 && t.stride(dim) != expected) return false;
    expected *= t.size(dim);
  }
  return t.dim() >= 2;
}

// Every tensor on the CPU, of one float dtype, contiguous; with `strided_rows`, x and the
// others may have rows that sit apart (rows_contiguous).
void check_same(const char* op, const at::Tensor& x, std::initializer_list<const at::Tensor*> others,
                bool strided_rows = false) {
  const auto laid_out = [&](const at::Tensor& t) { return strided_rows ? rows_contiguous(t) : t.is_contiguous(); };
  TORCH_CHECK(x.device().is_cpu() && laid_out(x), op, ": x must be a contiguous CPU tensor");
  const at::ScalarType dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, op,
              ": dtype must be float32, bfloat16 or float16, got ", dtype);
  for (const at::Tensor* t : others) {
    TORCH_CHECK(t->device().is_cpu() && laid_out(*t) && t->scalar_type() == dtype, op,
                ": every tensor must be contiguous, on the CPU and of x's dtype (", dtype, ")");
  }
}

#define KVFORGE_DISPATCH(dtype, CALL)             \
  switch (dtype) {                                \
    case at::kBFloat16: {                         \
      using T = c10::BFloat16;                    \
      CALL;                                       \
      break;                                      \
    }                                             \
    case at::kHalf: {                             \
      using T = c10::Half;                        \
      CALL;                                       \
      break;                                      \
    }                                             \
    default: {                                    \
      using T = float;                            \
      CALL;                                       \
      break;                                      \
    }                                             \
  }

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool gemma) {
  check_same("rms_norm", x, {&weight});
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 1 && weight.size(0) == x.size(-1),
              "rms_norm: weight must be [H] with H = x.size(-1)");
  at::Tensor y = at::empty(x.sizes(), x.options());
  const int64_t h = x.size(-1);
  if (x.numel() == 0 || h == 0) return y;
  const int64_t rows = x.numel() / h;
  KVFORGE_DISPATCH(x.scalar_type(),
                   rms_norm_rows<T>(reinterpret_cast<const T*>(x.const_data_ptr()),
                                    reinterpret_cast<const T*>(weight.const_data_ptr()),
                                    reinterpret_cast<T*>(y.data_ptr()), rows, h, static_cast<float>(eps), gemma))
  return y;
}

at::Tensor rope_rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.device().is_cpu(), "rope_rotate: x must be a CPU tensor");
  check_same("rope_rotate", cos, {&sin});
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == cos.scalar_type() && rows_contiguous(x),
              "rope_rotate: x must be [rows, heads, head_dim] of cos's dtype, each row's heads contiguous");
  const int64_t rows = x.size(0), heads = x.size(1), d = x.size(2);
  TORCH_CHECK(d % 2 == 0, "rope_rotate: head_dim must be even, got ", d);
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == rows && cos.size(1) == d && sin.sizes() == cos.sizes(),
              "rope_rotate: cos and sin must be [rows, head_dim]");
  at::Tensor y = at::empty(x.sizes(), x.options());
  if (x.numel() == 0) return y;
  KVFORGE_DISPATCH(x.scalar_type(),
                   rope_rows<T>(reinterpret_cast<const T*>(x.const_data_ptr()), x.stride(0),
                                reinterpret_cast<const T*>(cos.const_data_ptr()),
                                reinterpret_cast<const T*>(sin.const_data_ptr()),
                                reinterpret_cast<T*>(y.data_ptr()), rows, heads, d))
  return y;
}

at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up) {
  const bool contiguous = gate.is_contiguous() && up.is_contiguous();
  check_same("silu_mul", gate, {&up}, /*strided_rows=*/gate.dim() == 2 && up.dim() == 2);
  TORCH_CHECK(gate.dim() >= 1 && up.sizes() == gate.sizes(), "silu_mul: gate and up must have one shape, got ",
              gate.sizes(), " and ", up.sizes());
  at::Tensor y = at::empty(gate.sizes(), gate.options());
  const int64_t f = gate.size(-1);
  if (gate.numel() == 0) return y;
  // contiguous: rows of f one after the other; else 2-D rows at their own strides
  const int64_t g_stride = contiguous ? f : gate.stride(0), u_stride = contiguous ? f : up.stride(0);
  KVFORGE_DISPATCH(gate.scalar_type(), silu_mul_rows<T>(reinterpret_cast<const T*>(gate.const_data_ptr()), g_stride,
                                                        reinterpret_cast<const T*>(up.const_data_ptr()), u_stride,
                                                        reinterpret_cast<T*>(y.data_ptr()), gate.numel() / f, f))
  return y;
}

at::Tensor argmax_rows(const at::Tensor& x) {
  check_same("argmax_rows", x, {});
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0, "argmax_rows: x must be [rows, V] with V > 0");
  at::Tensor out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  if (x.size(0) == 0) return out;
  KVFORGE_DISPATCH(x.scalar_type(), argmax_rows_of<T>(reinterpret_cast<const T*>(x.const_data_ptr()), x.size(0),
                                                       x.size(1), out.data_ptr<int64_t>()))
  return out;
}

#undef KVFORGE_DISPATCH

}  // namespace

TORCH_LIBRARY(kvforge_cpu_fused, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, bool gemma) -> Tensor");
  m.def("rope_rotate(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("silu_mul(Tensor gate, Tensor up) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvforge_cpu_fused, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("rope_rotate", &rope_rotate);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("silu_mul", &silu_mul);
}
