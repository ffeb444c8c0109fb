// C++ source of the fused decode step of a run of Llama-family decoder layers (see
// cpu_decode_layer.py).
//
// Why: at batch 1 a decode step of a 30-layer model spends a large part of its time in Python
// (module calls, eligibility checks, cache planning lookups, ~20 tensor ops per layer
// dispatched from Python; docs/benchmarks.md, 'Measurements behind design choices'). This
// op runs consecutive layers with the same ATen and kvforge ops in the same order,
// dispatched from C++, so the whole run costs one Python call.
//
//   llama_decode_layers(hidden [B, H], ...) -> hidden after the run; per layer:
//     x  = rms_norm(hidden, input_layernorm.w)
//     q  = rope(linear(x, Wq, bq) as [B, heads, D]); k = rope(linear(x, Wk, bk)); v = linear(x, Wv, bv)
//                                        (the three in one small_m_linear_many call, as gate/up)
//     k_pages/v_pages[:, write_slots] = k/v (head-major, in the pages' dtype; rows copied
//                                        directly when the dtypes match, index_copy_ else)
//     a  = paged_decode_attention(q, k, v, pages, plan)        (the full cache's CPU kernel)
//     h  = hidden + linear(a as [B, heads * D], Wo, bo)
//     y  = rms_norm(h, post_attention_layernorm.w)
//     out = h + linear(silu_mul(linear(y, Wg, bg), linear(y, Wu, bu)), Wd, bd)   (GatedMLP's op)
//   llama_decode_layers_kivi(...) -> (hidden, keys, values): the same layers over a `kivi`
//     cache; instead of the page stores each layer's k (after RoPE) and v are returned for
//     the cache's end_step, and a = kivi_decode_attention(q, k, v, ...) in q's dtype (the
//     KIVI cache's CPU kernel, as cache/kivi/cpu_decode.py calls it).
//
// INVARIANT: every step is the op the eager path (models/layers.py, models/llama.py,
// cache/full/method.py, cache/kivi/method.py) calls for a decode-only step, with the same
// inputs, so the result is bitwise equal to it (tests/kernels/test_cpu_decode_layer.py).
// The kvforge ops it calls (small_m_linear, rms_norm, rope_rotate, silu_mul,
// paged_decode_attention, kivi_decode_attention) are looked up in the dispatcher at the
// first call: their libraries must be loaded first (cpu_decode_layer.py checks that they
// are available before using this op).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

namespace {

using OptTensor = std::optional<at::Tensor>;

using LinearMany = std::vector<at::Tensor>(const at::Tensor&, at::TensorList, const c10::List<OptTensor>&);

struct Ops {
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&, bool)> linear;
  c10::TypedOperatorHandle<LinearMany> linear_many;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, double, bool)> rms_norm;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)> rope;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&)> silu_mul;
};

const Ops& ops() {
  // Looked up once (thread-safe static init); throws a clear error if a library is not loaded.
  static const Ops handles{
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("kvforge_cpu_linear::small_m_linear", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&, bool)>(),
      c10::Dispatcher::singleton().findSchemaOrThrow("kvforge_cpu_linear::small_m_linear_many", "").typed<LinearMany>(),
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("kvforge_cpu_fused::rms_norm", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, double, bool)>(),
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("kvforge_cpu_fused::rope_rotate", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)>(),
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("kvforge_cpu_fused::silu_mul", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&)>(),
  };
  return handles;
}

// Each cache method's attention is looked up at its first call only: a step over one
// method's storage never needs the other method's library (the method offers its fused
// target only once its own kernel is loaded).

// The full cache's paged decode attention (cache/full/cpu_decode.cpp).
using FullAttention = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                 const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                 const at::Tensor&, double, const at::Tensor&, const at::Tensor&);

const c10::TypedOperatorHandle<FullAttention>& full_attention() {
  static const c10::TypedOperatorHandle<FullAttention> handle =
      c10::Dispatcher::singleton().findSchemaOrThrow("kvforge_cpu::paged_decode_attention", "").typed<FullAttention>();
  return handle;
}

// KIVI's CPU decode attention (cache/kivi/cpu_decode.cpp).
using KiviAttention = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                 const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                 const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                 const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                                 int64_t, const OptTensor&, const OptTensor&, int64_t, const OptTensor&,
                                 const OptTensor&, int64_t, int64_t);

const c10::TypedOperatorHandle<KiviAttention>& kivi_attention() {
  static const c10::TypedOperatorHandle<KiviAttention> handle =
      c10::Dispatcher::singleton().findSchemaOrThrow("kvforge_cpu_kivi::kivi_decode_attention", "").typed<KiviAttention>();
  return handle;
}

// pages [kv_heads, num_pages, block, D] (unit stride along D): rows [B, kv_heads, D]
// (contiguous) stored at flat slots [B] (page * block + offset), as FullCache._store_rows
// does. Same dtype: each row is copied (bitwise what index_copy_ stores); else index_copy_
// of the converted rows, exactly as the eager path.
void store_rows(const at::Tensor& pages, const at::Tensor& rows, const int64_t* slots) {
  const int64_t heads = pages.size(0);
  const int64_t block = pages.size(2);
  const int64_t dim = pages.size(3);
  const int64_t count = rows.size(0);
  TORCH_CHECK(pages.dim() == 4 && rows.dim() == 3 && rows.size(1) == heads && rows.size(2) == dim,
              "llama_decode_layers: K/V rows [B, ", heads, ", ", dim, "] expected for the cache's pages, got ",
              rows.sizes());
  for (int64_t b = 0; b < count; ++b) {
    TORCH_CHECK(slots[b] >= 0 && slots[b] < pages.size(1) * block, "llama_decode_layers: slot ", slots[b],
                " outside the pages");
  }
  if (pages.scalar_type() != rows.scalar_type() || pages.stride(3) != 1 || !rows.is_contiguous()) {
    const at::Tensor index = at::from_blob(const_cast<int64_t*>(slots), {count}, at::TensorOptions().dtype(at::kLong));
    pages.view({heads, -1, dim}).index_copy_(1, index, rows.transpose(0, 1).to(pages.scalar_type()));
    return;
  }
  const int64_t item = static_cast<int64_t>(pages.element_size());
  char* base = static_cast<char*>(pages.data_ptr());
  const char* source = static_cast<const char*>(rows.const_data_ptr());
  for (int64_t b = 0; b < count; ++b) {
    const int64_t page = slots[b] / block;
    const int64_t offset = slots[b] % block;
    for (int64_t h = 0; h < heads; ++h) {
      char* target = base + (h * pages.stride(0) + page * pages.stride(1) + offset * pages.stride(2)) * item;
      std::memcpy(target, source + (b * heads + h) * dim * item, static_cast<size_t>(dim * item));
    }
  }
}

// What every layer of a run shares: RoPE tables, norm eps and the attention geometry.
struct Shape {
  const at::Tensor& cos;
  const at::Tensor& sin;
  double eps;
  int64_t num_heads, num_kv_heads, head_dim;
};

// The full cache's decode plan of the run's layer group.
struct Plan {
  const int64_t* write_slots;
  const at::Tensor& page_table;
  const at::Tensor& first_page_position;
  const at::Tensor& visible_from;
  const at::Tensor& visible_to;
  double scale;
};

constexpr size_t kWeightsPerLayer = 9;  // input norm, post norm, q, k, v, o, gate, up, down
constexpr size_t kBiasesPerLayer = 7;   // q, k, v, o, gate, up, down

// The rest of a layer once its attention output a [B, heads, D] is known: o projection,
// residual, post norm, gated MLP, residual. w: o, gate, up, down weights; biases[b0 ..
// b0 + 3]: theirs; post_norm: post_attention_layernorm's weight.
at::Tensor layer_tail(const at::Tensor& hidden, const at::Tensor& attended, const at::Tensor& post_norm,
                      const at::Tensor* w, const c10::List<OptTensor>& biases, size_t b0, const Shape& shape) {
  const Ops& op = ops();
  const int64_t rows = hidden.size(0);
  auto bias = [&](size_t i) -> OptTensor { return biases.get(b0 + i); };
  const at::Tensor h =
      hidden + op.linear.call(attended.reshape({rows, shape.num_heads * shape.head_dim}), w[0], bias(0), false);
  const at::Tensor y = op.rms_norm.call(h, post_norm, shape.eps, false);
  const std::vector<at::Tensor> gate_up = op.linear_many.call(y, {w[1], w[2]}, c10::List<OptTensor>({bias(1), bias(2)}));
  return h + op.linear.call(op.silu_mul.call(gate_up[0], gate_up[1]), w[3], bias(3), false);
}

// One layer: w = its kWeightsPerLayer weights, b0 = index of its first bias in `biases`;
// attend(q, k, v) (q and k after RoPE) stores K/V as the cache's `write` would and returns
// what its `attend` would, [B, heads, D] in q's dtype.
template <typename Attend>
at::Tensor layer_forward(const at::Tensor& hidden, const at::Tensor* w, const c10::List<OptTensor>& biases,
                         size_t b0, const Shape& shape, Attend&& attend) {
  const Ops& op = ops();
  const int64_t rows = hidden.size(0);
  auto bias = [&](size_t i) -> OptTensor { return biases.get(b0 + i); };
  const at::Tensor x = op.rms_norm.call(hidden, w[0], shape.eps, false);
  // q, k and v in one call (each output bitwise what its own small_m_linear gives)
  const std::vector<at::Tensor> qkv = op.linear_many.call(x, {w[2], w[3], w[4]}, c10::List<OptTensor>({bias(0), bias(1), bias(2)}));
  at::Tensor q = qkv[0].view({rows, shape.num_heads, shape.head_dim});
  at::Tensor k = qkv[1].view({rows, shape.num_kv_heads, shape.head_dim});
  const at::Tensor v = qkv[2].view({rows, shape.num_kv_heads, shape.head_dim});
  k = op.rope.call(k, shape.cos, shape.sin);
  q = op.rope.call(q, shape.cos, shape.sin);
  return layer_tail(hidden, attend(q, k, v), w[1], w + 5, biases, b0 + 3, shape);
}

void check_run(const at::Tensor& hidden, at::TensorList weights, const c10::List<OptTensor>& biases, size_t layers) {
  TORCH_CHECK(weights.size() == kWeightsPerLayer * layers && biases.size() == kBiasesPerLayer * layers,
              "llama_decode_layers: per layer 9 weights and 7 biases");
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(), "llama_decode_layers: hidden must be contiguous [B, H]");
}

// Layers i = 0 .. n-1 in order: weights[9 i .. 9 i + 8], biases[7 i .. 7 i + 6], k_pages[i],
// v_pages[i]; every layer shares the step's plan (one cache layer group) and RoPE tables.
at::Tensor llama_decode_layers(const at::Tensor& hidden, at::TensorList weights, const c10::List<OptTensor>& biases,
                               double eps, const at::Tensor& cos, const at::Tensor& sin, at::TensorList k_pages,
                               at::TensorList v_pages, const at::Tensor& write_slots, const at::Tensor& page_table,
                               const at::Tensor& first_page_position, const at::Tensor& visible_from,
                               const at::Tensor& visible_to, double scale, int64_t num_heads, int64_t num_kv_heads,
                               int64_t head_dim) {
  const size_t layers = k_pages.size();
  TORCH_CHECK(v_pages.size() == layers, "llama_decode_layers: k and v pages per layer");
  check_run(hidden, weights, biases, layers);
  TORCH_CHECK(write_slots.scalar_type() == at::kLong && write_slots.is_contiguous() &&
                  write_slots.numel() == hidden.size(0),
              "llama_decode_layers: write_slots must be contiguous int64 [B]");
  const Shape shape{cos, sin, eps, num_heads, num_kv_heads, head_dim};
  const Plan plan{write_slots.const_data_ptr<int64_t>(), page_table, first_page_position, visible_from, visible_to,
                  scale};
  const at::Tensor no_scales = at::empty({0}, hidden.options().dtype(at::kFloat));
  at::Tensor h = hidden;
  for (size_t i = 0; i < layers; ++i) {
    h = layer_forward(h, weights.data() + kWeightsPerLayer * i, biases, kBiasesPerLayer * i, shape,
                      [&](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
                        store_rows(k_pages[i], k, plan.write_slots);
                        store_rows(v_pages[i], v, plan.write_slots);
                        return full_attention().call(q, k, v, k_pages[i], v_pages[i], plan.page_table,
                                                    plan.first_page_position, plan.visible_from, plan.visible_to,
                                                    plan.scale, no_scales, no_scales);
                      });
  }
  return h;
}

constexpr size_t kGivenKvWeightsPerLayer = 7;  // input norm, post norm, q, o, gate, up, down
constexpr size_t kGivenKvBiasesPerLayer = 5;   // q, o, gate, up, down

// Layers whose K/V the step already wrote to their cache layer (SwiftKV's later layers: the
// model's fused K/V GEMM wrote them before the layers run). Layer i = 0 .. n-1:
// weights[7 i .. 7 i + 6], biases[5 i .. 5 i + 4], k_pages[i], v_pages[i], and the step's
// post-RoPE rows k_rows[i], v_rows[i] [B, kv_heads, D] of its cache layer (AcrossKV: the
// layers of a group name the same ones). No K/V projection and no store: the pages are only
// read, and attention is the full cache's kernel on (q, the given rows, the pages), as the
// cache's attend_rows calls it for a decode-only step whose rows are all the step's rows.
at::Tensor llama_decode_layers_given_kv(const at::Tensor& hidden, at::TensorList weights,
                                        const c10::List<OptTensor>& biases, double eps, const at::Tensor& cos,
                                        const at::Tensor& sin, at::TensorList k_pages, at::TensorList v_pages,
                                        at::TensorList k_rows, at::TensorList v_rows, const at::Tensor& page_table,
                                        const at::Tensor& first_page_position, const at::Tensor& visible_from,
                                        const at::Tensor& visible_to, double scale, int64_t num_heads,
                                        int64_t num_kv_heads, int64_t head_dim) {
  const size_t layers = k_pages.size();
  TORCH_CHECK(v_pages.size() == layers && k_rows.size() == layers && v_rows.size() == layers,
              "llama_decode_layers_given_kv: k and v pages and k and v rows per layer");
  TORCH_CHECK(weights.size() == kGivenKvWeightsPerLayer * layers && biases.size() == kGivenKvBiasesPerLayer * layers,
              "llama_decode_layers_given_kv: per layer 7 weights and 5 biases");
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(),
              "llama_decode_layers_given_kv: hidden must be contiguous [B, H]");
  const Ops& op = ops();
  const Shape shape{cos, sin, eps, num_heads, num_kv_heads, head_dim};
  const at::Tensor no_scales = at::empty({0}, hidden.options().dtype(at::kFloat));
  const int64_t rows = hidden.size(0);
  at::Tensor h = hidden;
  for (size_t i = 0; i < layers; ++i) {
    const at::Tensor* w = weights.data() + kGivenKvWeightsPerLayer * i;
    const size_t b0 = kGivenKvBiasesPerLayer * i;
    TORCH_CHECK(k_rows[i].dim() == 3 && k_rows[i].size(0) == rows && v_rows[i].sizes() == k_rows[i].sizes(),
                "llama_decode_layers_given_kv: K/V rows [B, kv_heads, D] per layer, got ", k_rows[i].sizes());
    const at::Tensor x = op.rms_norm.call(h, w[0], shape.eps, false);
    const at::Tensor q =
        op.rope.call(op.linear.call(x, w[2], biases.get(b0), false).view({rows, num_heads, head_dim}), cos, sin);
    const at::Tensor attended =
        full_attention().call(q, k_rows[i].contiguous(), v_rows[i].contiguous(), k_pages[i], v_pages[i], page_table,
                              first_page_position, visible_from, visible_to, scale, no_scales, no_scales);
    h = layer_tail(h, attended, w[1], w + 3, biases, b0 + 1, shape);
  }
  return h;
}

constexpr size_t kKiviTensorsPerLayer = 8;  // k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_res, v_res

// The same layers over a `kivi` cache (post-RoPE keys, no rotation, the C++ decode kernel):
// per layer the step's keys and values are returned for the cache's end_step (what its
// `write` keeps), and attention is `kivi_decode_attention` on q, k, v (of one 16/32-bit
// dtype as they are, else widened to float32) with its output in q's dtype, as
// cache/kivi/cpu_decode.py calls it. Layer i's storage:
// kivi[8 i .. 8 i + 7], sinks[2 i], sinks[2 i + 1].
std::tuple<at::Tensor, std::vector<at::Tensor>, std::vector<at::Tensor>> llama_decode_layers_kivi(
    const at::Tensor& hidden, at::TensorList weights, const c10::List<OptTensor>& biases, double eps,
    const at::Tensor& cos, const at::Tensor& sin, at::TensorList kivi, const c10::List<OptTensor>& sinks,
    const at::Tensor& page_table, const at::Tensor& first_page_position, const at::Tensor& visible_from,
    const at::Tensor& lengths, const at::Tensor& slots, double scale, int64_t bits, int64_t value_bits,
    int64_t key_dot, int64_t value_dot, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim) {
  const size_t layers = kivi.size() / kKiviTensorsPerLayer;
  TORCH_CHECK(kivi.size() == kKiviTensorsPerLayer * layers && sinks.size() == 2 * layers,
              "llama_decode_layers_kivi: per layer 8 storage tensors and 2 optional sinks");
  check_run(hidden, weights, biases, layers);
  const Shape shape{cos, sin, eps, num_heads, num_kv_heads, head_dim};
  // As cache/kivi/cpu_decode.py passes them: q, k, v of one dtype as they are (the kernel
  // widens 16-bit ones itself and returns q's dtype), else widened to float32.
  auto io_dtype = [](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
    const at::ScalarType d = q.scalar_type();
    const bool native = (d == at::kFloat || d == at::kBFloat16 || d == at::kHalf) && k.scalar_type() == d &&
                        v.scalar_type() == d;
    return native ? d : at::kFloat;
  };
  auto as = [](const at::Tensor& t, at::ScalarType dtype) {
    return t.scalar_type() == dtype && t.is_contiguous() ? t : t.to(dtype).contiguous();
  };
  std::vector<at::Tensor> keys, values;
  at::Tensor h = hidden;
  for (size_t i = 0; i < layers; ++i) {
    const at::Tensor* s = kivi.data() + kKiviTensorsPerLayer * i;
    h = layer_forward(h, weights.data() + kWeightsPerLayer * i, biases, kBiasesPerLayer * i, shape,
                      [&](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
                        keys.push_back(k);
                        values.push_back(v);
                        const at::ScalarType io = io_dtype(q, k, v);
                        const at::Tensor out = kivi_attention().call(
                            as(q, io), as(k, io), as(v, io), s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7],
                            page_table, first_page_position, visible_from, lengths, slots, scale, bits,
                            sinks.get(2 * i), sinks.get(2 * i + 1), value_bits, std::nullopt, std::nullopt, key_dot,
                            value_dot);
                        return out.scalar_type() == q.scalar_type() ? out : out.to(q.scalar_type());
                      });
  }
  return {h, keys, values};
}

}  // namespace

TORCH_LIBRARY(kvforge_cpu_layer, m) {
  m.def("llama_decode_layers(Tensor hidden, Tensor[] weights, Tensor?[] biases, float eps, Tensor cos, Tensor sin, "
        "Tensor(a!)[] k_pages, Tensor(b!)[] v_pages, Tensor write_slots, Tensor page_table, "
        "Tensor first_page_position, Tensor visible_from, Tensor visible_to, float scale, int num_heads, "
        "int num_kv_heads, int head_dim) -> Tensor");
  m.def("llama_decode_layers_kivi(Tensor hidden, Tensor[] weights, Tensor?[] biases, float eps, Tensor cos, "
        "Tensor sin, Tensor[] kivi, Tensor?[] sinks, Tensor page_table, Tensor first_page_position, "
        "Tensor visible_from, Tensor lengths, Tensor slots, float scale, int bits, int value_bits, int key_dot, "
        "int value_dot, int num_heads, int num_kv_heads, int head_dim) -> (Tensor, Tensor[], Tensor[])");
  m.def("llama_decode_layers_given_kv(Tensor hidden, Tensor[] weights, Tensor?[] biases, float eps, Tensor cos, "
        "Tensor sin, Tensor[] k_pages, Tensor[] v_pages, Tensor[] k_rows, Tensor[] v_rows, Tensor page_table, "
        "Tensor first_page_position, Tensor visible_from, Tensor visible_to, float scale, int num_heads, "
        "int num_kv_heads, int head_dim) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvforge_cpu_layer, CPU, m) {
  m.impl("llama_decode_layers", &llama_decode_layers);
  m.impl("llama_decode_layers_kivi", &llama_decode_layers_kivi);
  m.impl("llama_decode_layers_given_kv", &llama_decode_layers_given_kv);
}
