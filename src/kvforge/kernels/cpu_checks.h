// Argument checks every kvforge CPU kernel makes, in one place (included by the kernels'
// sources; CppKernel puts this directory on the include path and hashes this file into the
// build fingerprint). Each check names the op and the tensors it refuses.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <initializer_list>

namespace kvforge_checks {

using Tensors = std::initializer_list<const at::Tensor*>;

// Every tensor on the CPU (the kernels read raw pointers).
inline void cpu(const char* op, Tensors tensors) {
  for (const at::Tensor* t : tensors) TORCH_CHECK(t->device().is_cpu(), op, ": CPU tensors only");
}

// Every tensor of `dtype` and contiguous; `names` words the message.
inline void contiguous_of(const char* op, const char* names, at::ScalarType dtype, Tensors tensors) {
  for (const at::Tensor* t : tensors) {
    TORCH_CHECK(t->scalar_type() == dtype && t->is_contiguous(), op, ": ", names, " must be contiguous ",
                c10::toString(dtype));
  }
}

// Grouped-query attention: each KV head serves heads / kv_heads query heads.
inline void gqa(const char* op, int64_t heads, int64_t kv_heads) {
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, op, ": heads (", heads, ") must be a multiple of kv_heads (",
              kv_heads, ")");
}

// One entry per sequence of the batch.
inline void per_sequence(const char* op, const char* names, int64_t batch, Tensors tensors) {
  for (const at::Tensor* t : tensors) TORCH_CHECK(t->dim() == 1 && t->size(0) == batch, op, ": ", names, " must be [B]");
}

}  // namespace kvforge_checks
