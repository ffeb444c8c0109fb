// Float views of the small 16-bit tensors a kernel takes per call (queries, activations, a
// bias), shared by the kernels' sources (on the include path of every CppKernel build and in
// its fingerprint). Widening bf16/f16 to float is exact; rounding back happens once.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <vector>

namespace kvforge_convert {

// A contiguous float32, bfloat16 or float16 tensor as floats: float32 is read in place,
// 16-bit elements are widened into `buffer`. Done in C++ rather than with ATen casts from
// Python: these tensors are small, and a cast op dispatch per call would cost more than the copy.
inline const float* floats_of(const at::Tensor& t, std::vector<float>& buffer) {
  if (t.scalar_type() == at::kFloat) return t.const_data_ptr<float>();
  buffer.resize(static_cast<size_t>(t.numel()));
  if (t.scalar_type() == at::kBFloat16) {
    const c10::BFloat16* src = t.const_data_ptr<c10::BFloat16>();
    for (size_t i = 0; i < buffer.size(); ++i) buffer[i] = static_cast<float>(src[i]);
  } else {
    TORCH_CHECK(t.scalar_type() == at::kHalf, "floats_of: float32, bfloat16 or float16 only, got ", t.scalar_type());
    const c10::Half* src = t.const_data_ptr<c10::Half>();
    for (size_t i = 0; i < buffer.size(); ++i) buffer[i] = static_cast<float>(src[i]);
  }
  return buffer.data();
}

// out[i] = T(values[i]), each rounded once (to nearest even).
template <typename T>
inline void store_rounded(const std::vector<float>& values, T* out) {
  for (size_t i = 0; i < values.size(); ++i) out[i] = static_cast<T>(values[i]);
}

}  // namespace kvforge_convert
