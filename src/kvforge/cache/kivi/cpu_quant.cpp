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
#include <limits>
#include <tuple>
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

template <typename T>
void quantize_rows(const T* x, int64_t rows, int64_t n, int bits, int64_t group, uint8_t* packed,
                   c10::Half* scale, c10::Half* zero) {
  const float levels = static_cast<float>((1 << bits) - 1);
  const int64_t per_byte = 8 / bits, groups = n / group, packed_n = n / per_byte;
  const int64_t grain = std::max<int64_t>(1, kMinChunkElements / std::max<int64_t>(1, n));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> f(n);
    std::vector<uint8_t> codes(n);
    for (int64_t r = begin; r < end; ++r) {
      const T* src = x + r * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) f[i] = static_cast<float>(src[i]);
      for (int64_t gi = 0; gi < groups; ++gi) {
        const float* g = f.data() + gi * group;
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
        uint8_t* out = codes.data() + gi * group;
#pragma omp simd
        for (int64_t i = 0; i < group; ++i) {
          const float c = std::nearbyint((g[i] - zf) / safe);
          out[i] = static_cast<uint8_t>(std::min(std::max(c, 0.f), levels));
        }
        scale[r * groups + gi] = s;
        zero[r * groups + gi] = z;
      }
      uint8_t* dst = packed + r * packed_n;
      for (int64_t j = 0; j < packed_n; ++j) {
        uint8_t byte = 0;
        for (int64_t i = 0; i < per_byte; ++i) byte |= static_cast<uint8_t>(codes[j * per_byte + i] << (i * bits));
        dst[j] = byte;
      }
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

}  // namespace

TORCH_LIBRARY(kvforge_kivi_quant, m) {
  m.def("quantize_groups(Tensor x, int bits, int group) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(kvforge_kivi_quant, CPU, m) {
  m.impl("quantize_groups", &quantize_groups);
}
