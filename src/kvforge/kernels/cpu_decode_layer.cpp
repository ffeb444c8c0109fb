// C++ source of the fused decode step of one Llama-family decoder layer (see cpu_decode_layer.py).
//
// Why: at batch 1 a decode step of a 30-layer model spends about 5 ms in Python (module
// calls, eligibility checks, cache planning lookups, ~20 tensor ops per layer dispatched
// from Python). This op runs one whole layer with the same ATen and kvforge ops in the
// same order, dispatched from C++, so a layer costs one Python call.
//
//   llama_decode_layer(hidden [B, H], ...) -> hidden' [B, H]
//     x  = rms_norm(hidden, input_layernorm.w)
//     q  = rope(linear(x, Wq, bq) as [B, heads, D]); k = rope(linear(x, Wk, bk)); v = linear(x, Wv, bv)
//     k_pages/v_pages[:, write_slots] = k/v (head-major, in the pages' dtype)
//     a  = paged_decode_attention(q, k, v, pages, plan)        (the full cache's CPU kernel)
//     h  = hidden + linear(a as [B, heads * D], Wo, bo)
//     y  = rms_norm(h, post_attention_layernorm.w)
//     out = h + linear(silu(linear(y, Wg, bg)) * linear(y, Wu, bu), Wd, bd)
//
// INVARIANT: every step is the op the eager path (models/layers.py, models/llama.py,
// cache/full/method.py) calls for a decode-only step, with the same inputs, in the same
// order, so the result is bitwise equal to it (tests/kernels/test_cpu_decode_layer.py).
// The kvforge ops it calls (small_m_linear, rms_norm, rope_rotate, paged_decode_attention)
// are looked up in the dispatcher at the first call: their libraries must be loaded first
// (cpu_decode_layer.py checks that they are available before using this op).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>

namespace {

using OptTensor = std::optional<at::Tensor>;

struct Ops {
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&, bool)> linear;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, double, bool)> rms_norm;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)> rope;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      const at::Tensor&, double, const at::Tensor&, const at::Tensor&)>
      attention;
};

const Ops& ops() {
  // Looked up once (thread-safe static init); throws a clear error if a library is not loaded.
  static const Ops handles{
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("kvforge_cpu_linear::small_m_linear", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&, bool)>(),
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("kvforge_cpu_fused::rms_norm", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, double, bool)>(),
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("kvforge_cpu_fused::rope_rotate", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)>(),
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("kvforge_cpu::paged_decode_attention", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, double, const at::Tensor&, const at::Tensor&)>(),
  };
  return handles;
}

// pages [kv_heads, num_pages, block, D]: rows [B, kv_heads, D] stored at flat slots [B]
// (page * block + offset), as FullCache._store_rows does.
void store_rows(const at::Tensor& pages, const at::Tensor& rows, const at::Tensor& slots) {
  const int64_t heads = pages.size(0);
  const int64_t dim = pages.size(3);
  pages.view({heads, -1, dim}).index_copy_(1, slots, rows.transpose(0, 1).to(pages.scalar_type()));
}

at::Tensor llama_decode_layer(const at::Tensor& hidden, const at::Tensor& input_norm, const at::Tensor& post_norm,
                              double eps, at::TensorList weights, const c10::List<OptTensor>& biases,
                              const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_pages,
                              const at::Tensor& v_pages, const at::Tensor& write_slots,
                              const at::Tensor& page_table, const at::Tensor& first_page_position,
                              const at::Tensor& visible_from, const at::Tensor& visible_to, double scale,
                              int64_t num_heads, int64_t num_kv_heads, int64_t head_dim) {
  // weights/biases: q, k, v, o, gate, up, down (nn.Linear layout [out, in]).
  TORCH_CHECK(weights.size() == 7 && biases.size() == 7, "llama_decode_layer: 7 weights and 7 biases expected");
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(), "llama_decode_layer: hidden must be contiguous [B, H]");
  const Ops& op = ops();
  const int64_t rows = hidden.size(0);
  const at::Tensor no_scales = at::empty({0}, hidden.options().dtype(at::kFloat));
  auto bias = [&](size_t i) -> OptTensor { return biases.get(i); };

  const at::Tensor x = op.rms_norm.call(hidden, input_norm, eps, false);
  at::Tensor q = op.linear.call(x, weights[0], bias(0), false).view({rows, num_heads, head_dim});
  at::Tensor k = op.linear.call(x, weights[1], bias(1), false).view({rows, num_kv_heads, head_dim});
  const at::Tensor v = op.linear.call(x, weights[2], bias(2), false).view({rows, num_kv_heads, head_dim});
  k = op.rope.call(k, cos, sin);
  store_rows(k_pages, k, write_slots);
  store_rows(v_pages, v, write_slots);
  q = op.rope.call(q, cos, sin);
  const at::Tensor attended = op.attention.call(q, k, v, k_pages, v_pages, page_table, first_page_position,
                                                visible_from, visible_to, scale, no_scales, no_scales);
  const at::Tensor h =
      hidden + op.linear.call(attended.reshape({rows, num_heads * head_dim}), weights[3], bias(3), false);
  const at::Tensor y = op.rms_norm.call(h, post_norm, eps, false);
  const at::Tensor gate = op.linear.call(y, weights[4], bias(4), false);
  const at::Tensor up = op.linear.call(y, weights[5], bias(5), false);
  return h + op.linear.call(at::silu(gate) * up, weights[6], bias(6), false);
}

}  // namespace

TORCH_LIBRARY(kvforge_cpu_layer, m) {
  m.def("llama_decode_layer(Tensor hidden, Tensor input_norm, Tensor post_norm, float eps, Tensor[] weights, "
        "Tensor?[] biases, Tensor cos, Tensor sin, Tensor(a!) k_pages, Tensor(b!) v_pages, Tensor write_slots, "
        "Tensor page_table, Tensor first_page_position, Tensor visible_from, Tensor visible_to, float scale, "
        "int num_heads, int num_kv_heads, int head_dim) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvforge_cpu_layer, CPU, m) {
  m.impl("llama_decode_layer", &llama_decode_layer);
}
