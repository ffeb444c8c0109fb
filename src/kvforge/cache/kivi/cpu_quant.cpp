// C++ source of KIVI's group quantisation on the CPU (see cpu_quant.py).
//
//   quantize_groups(x [R, n] float32 | bfloat16 | float16, contiguous, bits in {2, 4, 8},
//                   group dividing n, n a multiple of 8 / bits)
//     -> (packed uint8 [R, n * bits / 8], scale float16 [R, n / group], zero float16 [R, n / group])
//
// INVARIANT: bit for bit `quant.quantize_reference`, the PyTorch definition. Per group of
// `group` consecutive elements of a row, with f = float32 of the input:
//   low, high = min and max of f;
//   zero  = float16 of low, rounded to nearest even, then one float16 step down if that
//           rounded above low;
//   scale = float16 of (high - float(zero)) / levels (a float32 division), rounded to
//           nearest even, then one step up if that rounded below;
//   code  = clamp(nearbyint((f - float(zero)) / s), 0, levels), s = float(scale), or 1
//           where scale is 0 (a float32 subtraction and division: the build passes
//           -ffp-contract=off so no FMA merges them); nearbyint rounds half to even, as
//           torch.round does;
// codes packed little-end-first, 8 / bits per byte, along the row. Inputs are finite
// (the reference's NaN handling is not reproduced).
// Rows are independent and split over threads whole.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "cpu_checks.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kMinChunkElements = 64 * 1024;  // smaller parallel chunks cost more than they save

// The next float16 toward -inf / +inf (torch.nextafter on float16 bits; +-0 step to the
// smallest subnormal of the direction's sign).
uint16_t half_step_down(uint16_t bits) {
  if ((bits & 0x7FFF) == 0) return 0x8001;
  return (bits & 0x8000) ? bits + 1 : bits - 1;
}

uint16_t half_step_up(uint16_t bits) {
  if ((bits & 0x7FFF) == 0) return 0x0001;
  return (bits & 0x8000) ? bits - 1 : bits + 1;
}

// float16 at or below (down) / at or above (up) `target`.
c10::Half half_toward(float target, bool down) {
  c10::Half rounded(target);
  const float back = static_cast<float>(rounded);
  if (down ? back > target : back < target) {
    rounded = c10::Half(down ? half_step_down(rounded.x) : half_step_up(rounded.x), c10::Half::from_bits());
  }
  return rounded;
}

// One row of n elements: its groups' scales and zeros and its packed codes (f, codes:
// scratch of n elements each).
template <typename T>
inline void quantize_row(const T* src, int64_t n, int bits, int64_t group, float* f, uint8_t* codes, uint8_t* packed,
                         c10::Half* scale, c10::Half* zero) {
  const float levels = static_cast<float>((1 << bits) - 1);
  const int64_t per_byte = 8 / bits, groups = n / group, packed_n = n / per_byte;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) f[i] = static_cast<float>(src[i]);
  for (int64_t gi = 0; gi < groups; ++gi) {
    const float* g = f + gi * group;
    float low = std::numeric_limits<float>::infinity(), high = -low;
#pragma omp simd reduction(min : low) reduction(max : high)
    for (int64_t i = 0; i < group; ++i) {
      low = std::min(low, g[i]);
      high = std::max(high, g[i]);
    }
    const c10::Half z = half_toward(low, true);
    const float zf = static_cast<float>(z);
    const c10::Half s = half_toward((high - zf) / levels, false);
    const float sf = static_cast<float>(s);
    const float safe = sf > 0.f ? sf : 1.f;
    uint8_t* out = codes + gi * group;
#pragma omp simd
    for (int64_t i = 0; i < group; ++i) {
      const float c = std::nearbyint((g[i] - zf) / safe);
      out[i] = static_cast<uint8_t>(std::min(std::max(c, 0.f), levels));
    }
    scale[gi] = s;
    zero[gi] = z;
  }
  for (int64_t j = 0; j < packed_n; ++j) {
    uint8_t byte = 0;
    for (int64_t i = 0; i < per_byte; ++i) byte |= static_cast<uint8_t>(codes[j * per_byte + i] << (i * bits));
    packed[j] = byte;
  }
}

template <typename T>
void quantize_rows(const T* x, int64_t rows, int64_t n, int bits, int64_t group, uint8_t* packed,
                   c10::Half* scale, c10::Half* zero) {
  const int64_t groups = n / group, packed_n = n * bits / 8;
  const int64_t grain = std::max<int64_t>(1, kMinChunkElements / std::max<int64_t>(1, n));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> f(n);
    std::vector<uint8_t> codes(n);
    for (int64_t r = begin; r < end; ++r) {
      quantize_row(x + r * n, n, bits, group, f.data(), codes.data(), packed + r * packed_n, scale + r * groups,
                   zero + r * groups);
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_groups(const at::Tensor& x, int64_t bits, int64_t group) {
  constexpr const char* kOpName = "quantize_groups";
  kvforge_checks::cpu(kOpName, {&x});
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), kOpName, ": x must be contiguous [R, n]");
  TORCH_CHECK(bits == 2 || bits == 4 || bits == 8, kOpName, ": bits must be 2, 4 or 8, got ", bits);
  const int64_t rows = x.size(0), n = x.size(1), per_byte = 8 / bits;
  TORCH_CHECK(group > 0 && n % group == 0, kOpName, ": group (", group, ") must divide n (", n, ")");
  TORCH_CHECK(n % per_byte == 0, kOpName, ": n (", n, ") must be a multiple of ", per_byte);
  at::Tensor packed = at::empty({rows, n / per_byte}, x.options().dtype(at::kByte));
  at::Tensor scale = at::empty({rows, n / group}, x.options().dtype(at::kHalf));
  at::Tensor zero = at::empty({rows, n / group}, x.options().dtype(at::kHalf));
  uint8_t* p = packed.data_ptr<uint8_t>();
  c10::Half* s = scale.data_ptr<c10::Half>();
  c10::Half* z = zero.data_ptr<c10::Half>();
  switch (x.scalar_type()) {
    case at::kFloat:
      quantize_rows(x.data_ptr<float>(), rows, n, static_cast<int>(bits), group, p, s, z);
      break;
    case at::kBFloat16:
      quantize_rows(x.data_ptr<c10::BFloat16>(), rows, n, static_cast<int>(bits), group, p, s, z);
      break;
    case at::kHalf:
      quantize_rows(x.data_ptr<c10::Half>(), rows, n, static_cast<int>(bits), group, p, s, z);
      break;
    default:
      TORCH_CHECK(false, kOpName, ": x must be float32, bfloat16 or float16, got ", x.scalar_type());
  }
  return {packed, scale, zero};
}

// ---- a decode step's writes (step_writes.py) -------------------------------------------
// Both ops write every layer of the step in one call, in place; each is bit for bit the
// PyTorch expression it replaces (step_writes.py), which stays the reference.

// Calls fn with T = the C++ type of a float32 / bfloat16 / float16 tensor's elements.
template <typename Fn>
void with_float_type(at::ScalarType dtype, const char* op, Fn&& fn) {
  switch (dtype) {
    case at::kFloat:
      return fn(float{});
    case at::kBFloat16:
      return fn(c10::BFloat16{});
    case at::kHalf:
      return fn(c10::Half{});
    default:
      TORCH_CHECK(false, op, ": expected float32, bfloat16 or float16, got ", dtype);
  }
}

// Every entry of `index` (int64, contiguous, 1-D) in [0, bound).
void check_indices(const char* op, const char* name, const at::Tensor& index, int64_t bound) {
  TORCH_CHECK(index.scalar_type() == at::kLong && index.is_contiguous() && index.dim() == 1, op, ": ", name,
              " must be contiguous int64 [n]");
  const int64_t* p = index.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < index.numel(); ++i) {
    TORCH_CHECK(p[i] >= 0 && p[i] < bound, op, ": ", name, " entry ", p[i], " out of range [0, ", bound, ")");
  }
}

// The values leaving the residual rings, quantised into their page slots (store_value_tokens
// of the ring rows gathered by flush_group): for page layer j < len(res_layers), token
// i < n and head h, row v_res[res_layers[j], slots[order[i]], h, offsets[order[i]], :] is
// quantised per group of `group` channels into row flat_slots[i] of v_codes[j, h] viewed
// [P * G, D * bits / 8] (and of v_scale[j, h], v_zero[j, h] viewed [P * G, D / group]).
void flush_value_tokens(const at::Tensor& v_res, const at::Tensor& res_layers, const at::Tensor& slots,
                        const at::Tensor& offsets, const at::Tensor& order, const at::Tensor& v_codes,
                        const at::Tensor& v_scale, const at::Tensor& v_zero, const at::Tensor& flat_slots,
                        int64_t bits, int64_t group) {
  constexpr const char* kOpName = "flush_value_tokens";
  kvforge_checks::cpu(kOpName, {&v_res, &res_layers, &slots, &offsets, &order, &v_codes, &v_scale, &v_zero,
                                &flat_slots});
  TORCH_CHECK(bits == 2 || bits == 4 || bits == 8, kOpName, ": bits must be 2, 4 or 8, got ", bits);
  TORCH_CHECK(v_res.dim() == 5 && v_res.is_contiguous(), kOpName, ": v_res must be contiguous [L, S, H, R, D]");
  const int64_t heads = v_res.size(2), ring = v_res.size(3), dim = v_res.size(4);
  TORCH_CHECK(group > 0 && dim % group == 0 && dim % (8 / bits) == 0, kOpName, ": group (", group,
              ") must divide the head dim (", dim, "), a multiple of ", 8 / bits);
  kvforge_checks::contiguous_of(kOpName, "v_codes", at::kByte, {&v_codes});
  kvforge_checks::contiguous_of(kOpName, "v_scale and v_zero", at::kHalf, {&v_scale, &v_zero});
  TORCH_CHECK(v_codes.dim() == 5 && v_codes.size(1) == heads && v_codes.size(4) == dim * bits / 8, kOpName,
              ": v_codes must be [layers, H, P, G, D * bits / 8]");
  const int64_t page_layers = v_codes.size(0), page_slots = v_codes.size(2) * v_codes.size(3);
  const int64_t groups = dim / group;
  for (const at::Tensor* t : {&v_scale, &v_zero}) {
    TORCH_CHECK(t->dim() == 5 && t->size(0) == page_layers && t->size(1) == heads &&
                    t->size(2) * t->size(3) == page_slots && t->size(4) == groups,
                kOpName, ": v_scale and v_zero must be [layers, H, P, G, D / group]");
  }
  const int64_t layers = res_layers.numel(), n = flat_slots.numel();
  TORCH_CHECK(layers <= page_layers, kOpName, ": ", layers, " layers, the pages hold ", page_layers);
  TORCH_CHECK(slots.numel() == offsets.numel() && order.numel() == n, kOpName,
              ": slots and offsets must match, order must have one entry per token");
  check_indices(kOpName, "res_layers", res_layers, v_res.size(0));
  check_indices(kOpName, "slots", slots, v_res.size(1));
  check_indices(kOpName, "offsets", offsets, ring);
  check_indices(kOpName, "order", order, slots.numel());
  check_indices(kOpName, "flat_slots", flat_slots, page_slots);
  if (layers == 0 || n == 0) return;
  const int64_t* layer_of = res_layers.const_data_ptr<int64_t>();
  const int64_t* slot_of = slots.const_data_ptr<int64_t>();
  const int64_t* offset_of = offsets.const_data_ptr<int64_t>();
  const int64_t* source = order.const_data_ptr<int64_t>();
  const int64_t* target = flat_slots.const_data_ptr<int64_t>();
  const int64_t row_bytes = dim * bits / 8;
  uint8_t* codes_out = v_codes.data_ptr<uint8_t>();
  c10::Half* scale_out = v_scale.data_ptr<c10::Half>();
  c10::Half* zero_out = v_zero.data_ptr<c10::Half>();
  const int64_t slots_in_res = v_res.size(1);
  with_float_type(v_res.scalar_type(), kOpName, [&](auto type) {
    using T = decltype(type);
    const T* res = reinterpret_cast<const T*>(v_res.const_data_ptr());
    auto source_row = [&](int64_t j, int64_t i, int64_t h) {
      const int64_t e = source[i];
      return res + (((layer_of[j] * slots_in_res + slot_of[e]) * heads + h) * ring + offset_of[e]) * dim;
    };
    // Rows and page slots are scattered (a ring row per sequence, a page slot per token), so
    // each row is a few cache misses: the next token's lines are requested while one is
    // quantised, and layers are split over threads (a decode step has a few rows per layer).
    at::parallel_for(0, layers, 4, [&](int64_t begin, int64_t end) {
      std::vector<float> f(dim);
      std::vector<uint8_t> codes(dim);
      for (int64_t j = begin; j < end; ++j) {
        for (int64_t i = 0; i < n; ++i) {
          if (i + 1 < n) {
            for (int64_t h = 0; h < heads; ++h) {
              const T* next = source_row(j, i + 1, h);
              for (int64_t b = 0; b < dim * static_cast<int64_t>(sizeof(T)); b += 64) {
                __builtin_prefetch(reinterpret_cast<const char*>(next) + b, 0, 1);
              }
              const int64_t dst = (j * heads + h) * page_slots + target[i + 1];
              __builtin_prefetch(codes_out + dst * row_bytes, 1, 1);
              __builtin_prefetch(scale_out + dst * groups, 1, 1);
              __builtin_prefetch(zero_out + dst * groups, 1, 1);
            }
          }
          for (int64_t h = 0; h < heads; ++h) {
            const int64_t dst = (j * heads + h) * page_slots + target[i];
            quantize_row(source_row(j, i, h), dim, static_cast<int>(bits), group, f.data(), codes.data(),
                         codes_out + dst * row_bytes, scale_out + dst * groups, zero_out + dst * groups);
          }
        }
      }
    });
  });
}

// The step's rows that stay in a residual ring (write_residuals): for layer j < len(rows)
// and entry i < n, ring[res_layers[j], slots[i], :, offsets[i], :] = rows[j][src[i]] in the
// ring's dtype (rounded to nearest even, as Tensor.to does; a NaN's bit pattern may differ).
// rows[j]: contiguous [B, H, D].
void write_ring_rows(const at::Tensor& ring, const at::Tensor& res_layers, at::TensorList rows,
                     const at::Tensor& src, const at::Tensor& slots, const at::Tensor& offsets) {
  constexpr const char* kOpName = "write_ring_rows";
  kvforge_checks::cpu(kOpName, {&ring, &res_layers, &src, &slots, &offsets});
  TORCH_CHECK(ring.dim() == 5 && ring.is_contiguous(), kOpName, ": ring must be contiguous [L, S, H, R, D]");
  const int64_t heads = ring.size(2), depth = ring.size(3), dim = ring.size(4);
  const int64_t layers = res_layers.numel(), n = src.numel();
  TORCH_CHECK(static_cast<int64_t>(rows.size()) == layers, kOpName, ": one rows tensor per layer");
  TORCH_CHECK(slots.numel() == n && offsets.numel() == n, kOpName, ": src, slots and offsets must match");
  const at::ScalarType row_dtype = layers ? rows[0].scalar_type() : ring.scalar_type();
  const int64_t batch = layers && rows[0].dim() == 3 ? rows[0].size(0) : 0;
  for (const at::Tensor& r : rows) {
    TORCH_CHECK(r.device().is_cpu() && r.is_contiguous() && r.scalar_type() == row_dtype && r.dim() == 3 &&
                    r.size(0) == batch && r.size(1) == heads && r.size(2) == dim,
                kOpName, ": rows must be contiguous CPU [B, H, D] tensors of one dtype and shape");
  }
  check_indices(kOpName, "res_layers", res_layers, ring.size(0));
  check_indices(kOpName, "src", src, batch);
  check_indices(kOpName, "slots", slots, ring.size(1));
  check_indices(kOpName, "offsets", offsets, depth);
  if (layers == 0 || n == 0) return;
  const int64_t* layer_of = res_layers.const_data_ptr<int64_t>();
  const int64_t* row_of = src.const_data_ptr<int64_t>();
  const int64_t* slot_of = slots.const_data_ptr<int64_t>();
  const int64_t* offset_of = offsets.const_data_ptr<int64_t>();
  const int64_t ring_slots = ring.size(1);
  with_float_type(ring.scalar_type(), kOpName, [&](auto to_type) {
    using To = decltype(to_type);
    To* out = reinterpret_cast<To*>(ring.data_ptr());
    auto target_row = [&](int64_t j, int64_t i, int64_t h) {
      return out + (((layer_of[j] * ring_slots + slot_of[i]) * heads + h) * depth + offset_of[i]) * dim;
    };
    with_float_type(row_dtype, kOpName, [&](auto from_type) {
      using From = decltype(from_type);
      // Scattered destinations, as in flush_value_tokens: the next entry's lines are
      // requested while one is written, and layers are split over threads.
      at::parallel_for(0, layers, 4, [&](int64_t begin, int64_t end) {
        for (int64_t j = begin; j < end; ++j) {
          const From* in = reinterpret_cast<const From*>(rows[j].const_data_ptr());
          for (int64_t i = 0; i < n; ++i) {
            for (int64_t h = 0; i + 1 < n && h < heads; ++h) {
              const char* next = reinterpret_cast<const char*>(target_row(j, i + 1, h));
              for (int64_t b = 0; b < dim * static_cast<int64_t>(sizeof(To)); b += 64) __builtin_prefetch(next + b, 1, 1);
            }
            for (int64_t h = 0; h < heads; ++h) {
              const From* a = in + (row_of[i] * heads + h) * dim;
              To* b = target_row(j, i, h);
              if constexpr (std::is_same_v<From, To>) {
                std::memcpy(b, a, dim * sizeof(To));
              } else {
                for (int64_t d = 0; d < dim; ++d) b[d] = static_cast<To>(static_cast<float>(a[d]));
              }
            }
          }
        }
      });
    });
  });
}

}  // namespace

TORCH_LIBRARY(kvforge_kivi_quant, m) {
  m.def("quantize_groups(Tensor x, int bits, int group) -> (Tensor, Tensor, Tensor)");
  m.def("flush_value_tokens(Tensor v_res, Tensor res_layers, Tensor slots, Tensor offsets, Tensor order, "
        "Tensor(a!) v_codes, Tensor(b!) v_scale, Tensor(c!) v_zero, Tensor flat_slots, int bits, int group) -> ()");
  m.def("write_ring_rows(Tensor(a!) ring, Tensor res_layers, Tensor[] rows, Tensor src, Tensor slots, "
        "Tensor offsets) -> ()");
}

TORCH_LIBRARY_IMPL(kvforge_kivi_quant, CPU, m) {
  m.impl("quantize_groups", &quantize_groups);
  m.impl("flush_value_tokens", &flush_value_tokens);
  m.impl("write_ring_rows", &write_ring_rows);
}
