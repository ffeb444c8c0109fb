// C++ source of the CPU KIVI decode attention kernel (see cpu_kivi_attention.py).
//
// Registers `torch.ops.kvforge_cpu_kivi.kivi_decode_attention` through TORCH_LIBRARY; only
// ATen/c10 core headers, no pybind11.
//
// Layout (one cache layer; /work/notes/kivi_layout.md): k_codes uint8 [H, P, D, G*b/8] keys
// per channel over a page's G tokens; k_scale/k_zero fp16 [H, P, D]; v_codes uint8
// [H, P, G, D*b/8] values per token over groups of G channels; v_scale/v_zero fp16
// [H, P, G, D/G]; k_res/v_res [S, H, R, D] (f32/bf16/f16), token t at offset t % R of the
// sequence's slot. Codes are packed low bits first, 8/b per byte.
//
// For a sequence holding n tokens: nk = (n / R) * R, nv = max(0, n - R); stored token t in
// [visible_from, n) is visible; its key is quantised iff t < nk, its value iff t < nv.
// page_table row b lists the pages of tokens [first_page_position[b], nk).
//
// Invariants relied on (checked on entry): every tensor contiguous; q, k_self, v_self
// float32; heads % H == 0; D % G == 0; bits in {2, 4, 8}.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

// Tokens of the residual handled per softmax update.
constexpr int64_t kResidualTile = 32;

struct Problem {
  int64_t batch, kv_heads, group, dim, g, residual, pages, table_width, slots;
  float scale;
  const float *q, *k_self, *v_self;
  const uint8_t *k_codes, *v_codes;
  const c10::Half *k_scale, *k_zero, *v_scale, *v_zero;
  const int64_t *page_table, *first, *from, *lengths, *slot_of;
};

// Byte -> its 8/BITS codes as floats (low bits first): unpacking is one table copy per byte.
template <int BITS>
struct CodeTable {
  static constexpr int kPer = 8 / BITS;
  float entry[256][kPer];
  CodeTable() {
    for (int byte = 0; byte < 256; ++byte) {
      for (int i = 0; i < kPer; ++i) entry[byte][i] = static_cast<float>((byte >> (i * BITS)) & ((1 << BITS) - 1));
    }
  }
};

// Codes [0, n) of a packed row as floats.
template <int BITS>
inline void unpack(const uint8_t* packed, int64_t n, float* out) {
  static const CodeTable<BITS> table;
  constexpr int kPer = 8 / BITS;
  for (int64_t byte = 0; byte < n / kPer; ++byte) {
    std::memcpy(out + byte * kPer, table.entry[packed[byte]], sizeof(float) * kPer);
  }
}

// e^x for x <= 0, in a loop compilers vectorise: x = k ln2 + r with |r| <= ln2 / 2 (ln2
// split in two parts for accuracy), e^r by a degree-6 polynomial, 2^k assembled in the
// exponent bits. The integer k comes from the float magic-number trick (adding 1.5 * 2^23
// rounds to an integer in the low mantissa bits), avoiding float-to-int conversions that
// block vectorisation. Below -87 the result would be denormal; clamping gives ~1e-38, far
// below what a softmax whose largest term is 1 can resolve. Relative error ~1e-7.
inline void exp_nonpositive(float* x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i] < -87.0f ? -87.0f : x[i];
    const float magic = v * 1.44269504088896341f + 12582912.0f;
    const float k = magic - 12582912.0f;
    const float r = (v - k * 0.693359375f) + k * 2.12194440e-4f;
    float poly = 1.9875691500e-4f;
    poly = poly * r + 1.3981999507e-3f;
    poly = poly * r + 8.3334519073e-3f;
    poly = poly * r + 4.1665795894e-2f;
    poly = poly * r + 1.6666665459e-1f;
    poly = poly * r + 5.0000001201e-1f;
    poly = poly * r * r + r + 1.0f;
    int32_t k_bits;
    std::memcpy(&k_bits, &magic, sizeof(k_bits));
    const int32_t exponent = (k_bits - 0x4B400000 + 127) << 23;
    float two_k;
    std::memcpy(&two_k, &exponent, sizeof(two_k));
    x[i] = poly * two_k;
  }
}

// Per-pair state of the online softmax for the `group` queries sharing a kv head.
struct State {
  std::vector<float> m, l, acc;  // [group], [group], [group * dim]
  // sum_t p_t zero(t, cg) of quantised values, per query and channel group [group * D/G]:
  // added to every channel of the group at the end (the pre-scaling algebra for values).
  std::vector<float> zacc;
};

// Softmax update of one tile: scores[g * stride + i] for i < n become probabilities
// relative to the new running max; accumulators are rescaled. Hidden entries hold -inf.
inline void update(State& s, float* scores, int64_t stride, int64_t n, int64_t group, int64_t dim) {
  for (int64_t g = 0; g < group; ++g) {
    float* row = scores + g * stride;
    float top = s.m[g];
    for (int64_t i = 0; i < n; ++i) top = std::max(top, row[i]);
    const float correction = std::exp(s.m[g] - top);
    for (int64_t i = 0; i < n; ++i) row[i] -= top;
    exp_nonpositive(row, n);
    float sum = 0.f;
    for (int64_t i = 0; i < n; ++i) sum += row[i];
    s.l[g] = s.l[g] * correction + sum;
    s.m[g] = top;
    if (correction != 1.f) {
      float* a = s.acc.data() + g * dim;
      for (int64_t d = 0; d < dim; ++d) a[d] *= correction;
      const int64_t groups = static_cast<int64_t>(s.zacc.size()) / static_cast<int64_t>(s.m.size());
      for (int64_t cg = 0; cg < groups; ++cg) s.zacc[g * groups + cg] *= correction;
    }
  }
}

// scores[i] += sum_c w[c] * codes[c * G + i] for the G tokens of a page (codes [D, G]).
// GT = G known at compile time keeps the G running scores in registers; GT = 0 is the
// general loop.
template <int GT>
inline void score_page(const float* w, const float* codes, int64_t dim, float* scores, int64_t g_runtime = GT) {
  if constexpr (GT > 0) {
    float acc[GT];
    for (int i = 0; i < GT; ++i) acc[i] = scores[i];
    for (int64_t c = 0; c < dim; ++c) {
      const float wc = w[c];
      const float* row = codes + c * GT;
#pragma omp simd
      for (int i = 0; i < GT; ++i) acc[i] += wc * row[i];
    }
    for (int i = 0; i < GT; ++i) scores[i] = acc[i];
  } else {
    for (int64_t c = 0; c < dim; ++c) {
      const float wc = w[c];
      const float* row = codes + c * g_runtime;
      for (int64_t i = 0; i < g_runtime; ++i) scores[i] += wc * row[i];
    }
  }
}

template <typename scalar_t>
inline void to_float(const scalar_t* src, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(src[i]);
}

template <int BITS, typename res_t>
void run_pair(int64_t pair, const Problem& p, const res_t* k_res, const res_t* v_res, float* out) {
  const int64_t b = pair / p.kv_heads, h = pair % p.kv_heads;
  const int64_t group = p.group, dim = p.dim, G = p.g, R = p.residual;
  const int64_t k_row_bytes = G * BITS / 8, v_row_bytes = dim * BITS / 8, channel_groups = dim / G;
  const int64_t n = p.lengths[b];
  const int64_t nk = (n / R) * R, nv = std::max<int64_t>(0, n - R);
  const int64_t visible_from = std::max<int64_t>(0, p.from[b]);
  const int64_t slot = p.slot_of[b];
  TORCH_CHECK(n == 0 || (slot >= 0 && slot < p.slots), "kivi_decode_attention: slot ", slot, " out of range");

  std::vector<float> qs(group * dim), qsc(group * dim), scores(group * std::max(G, kResidualTile));
  std::vector<float> codes(dim), row(dim), page_codes(dim * G), scale_f(dim), zero_f(dim);
  const float* q_rows = p.q + (b * p.kv_heads * group + h * group) * dim;
  for (int64_t i = 0; i < group * dim; ++i) qs[i] = q_rows[i] * p.scale;

  // Seed with the step's own token, always visible: the running max is finite from the start.
  State s{std::vector<float>(group), std::vector<float>(group, 1.f), std::vector<float>(group * dim),
          std::vector<float>(group * channel_groups, 0.f)};
  const float* ks = p.k_self + (b * p.kv_heads + h) * dim;
  const float* vs = p.v_self + (b * p.kv_heads + h) * dim;
  for (int64_t g = 0; g < group; ++g) {
    float dot = 0.f;
    for (int64_t d = 0; d < dim; ++d) dot += qs[g * dim + d] * ks[d];
    s.m[g] = dot;
    std::memcpy(s.acc.data() + g * dim, vs, dim * sizeof(float));
  }
  const res_t* k_ring = k_res + (slot * p.kv_heads + h) * R * dim;
  const res_t* v_ring = v_res + (slot * p.kv_heads + h) * R * dim;

  // Quantised keys: pages of tokens [first, nk), from the page holding visible_from.
  const int64_t first = p.first[b];
  const int64_t* table = p.page_table + b * p.table_width;
  const int64_t lo = std::max(visible_from, first);
  for (int64_t column = (lo - first) / G; first + column * G < nk; ++column) {
    TORCH_CHECK(column < p.table_width, "kivi_decode_attention: page table too short");
    const int64_t page = table[column];
    TORCH_CHECK(page >= 0 && page < p.pages, "kivi_decode_attention: page id ", page, " out of range");
    const int64_t t0 = first + column * G;
    const int64_t skip = std::max<int64_t>(0, lo - t0);  // hidden tokens at the start of the page
    const int64_t base = (h * p.pages + page);
    // Pre-scaled queries for this page: q.k_hat(t) = sum_c q_c zero_c + sum_c (q_c scale_c) code(t, c).
    const c10::Half* kscale = p.k_scale + base * dim;
    const c10::Half* kzero = p.k_zero + base * dim;
    for (int64_t c = 0; c < dim; ++c) {
      scale_f[c] = static_cast<float>(kscale[c]);
      zero_f[c] = static_cast<float>(kzero[c]);
    }
    for (int64_t g = 0; g < group; ++g) {
      float z = 0.f;
      for (int64_t c = 0; c < dim; ++c) {
        qsc[g * dim + c] = qs[g * dim + c] * scale_f[c];
        z += qs[g * dim + c] * zero_f[c];
      }
      std::fill(scores.begin() + g * G, scores.begin() + (g + 1) * G, z);
    }
    // The page's key codes [D, G] unpacked once, then a rank-1 update per channel.
    unpack<BITS>(p.k_codes + base * dim * k_row_bytes, dim * G, page_codes.data());
    for (int64_t g = 0; g < group; ++g) {
      if (G == 32) {
        score_page<32>(qsc.data() + g * dim, page_codes.data(), dim, scores.data() + g * G);
      } else {
        score_page<0>(qsc.data() + g * dim, page_codes.data(), dim, scores.data() + g * G, G);
      }
    }
    for (int64_t g = 0; g < group; ++g) {
      for (int64_t i = 0; i < skip; ++i) scores[g * G + i] = -std::numeric_limits<float>::infinity();
    }
    update(s, scores.data(), G, G, group, dim);
    // Values: quantised per token (t < nv) or still in the ring.
    const uint8_t* vc = p.v_codes + base * G * v_row_bytes;
    const c10::Half* vscale = p.v_scale + base * G * channel_groups;
    const c10::Half* vzero = p.v_zero + base * G * channel_groups;
    for (int64_t i = skip; i < G; ++i) {
      const int64_t t = t0 + i;
      if (t < nv) {
        // sum_t p_t v_hat(t) = sum_t p_t zero(t) + sum_t (p_t scale(t)) code(t).
        unpack<BITS>(vc + i * v_row_bytes, dim, codes.data());
        for (int64_t cg = 0; cg < channel_groups; ++cg) {
          scale_f[cg] = static_cast<float>(vscale[i * channel_groups + cg]);
          zero_f[cg] = static_cast<float>(vzero[i * channel_groups + cg]);
        }
        for (int64_t g = 0; g < group; ++g) {
          const float prob = scores[g * G + i];
          float* a = s.acc.data() + g * dim;
          for (int64_t cg = 0; cg < channel_groups; ++cg) {
            const float w = prob * scale_f[cg];
            s.zacc[g * channel_groups + cg] += prob * zero_f[cg];
            const float* code = codes.data() + cg * G;
            float* ac = a + cg * G;
            for (int64_t c = 0; c < G; ++c) ac[c] += w * code[c];
          }
        }
      } else {
        to_float(v_ring + (t % R) * dim, dim, row.data());
        for (int64_t g = 0; g < group; ++g) {
          const float prob = scores[g * G + i];
          float* a = s.acc.data() + g * dim;
          for (int64_t d = 0; d < dim; ++d) a[d] += prob * row[d];
        }
      }
    }
  }

  // Residual tokens [max(nk, visible_from), n): keys and values at offset t % R.
  for (int64_t start = std::max(nk, visible_from); start < n; start += kResidualTile) {
    const int64_t count = std::min(kResidualTile, n - start);
    for (int64_t i = 0; i < count; ++i) {
      to_float(k_ring + ((start + i) % R) * dim, dim, row.data());
      for (int64_t g = 0; g < group; ++g) {
        float dot = 0.f;
        for (int64_t d = 0; d < dim; ++d) dot += qs[g * dim + d] * row[d];
        scores[g * kResidualTile + i] = dot;
      }
    }
    update(s, scores.data(), kResidualTile, count, group, dim);
    for (int64_t i = 0; i < count; ++i) {
      to_float(v_ring + ((start + i) % R) * dim, dim, row.data());
      for (int64_t g = 0; g < group; ++g) {
        const float prob = scores[g * kResidualTile + i];
        float* a = s.acc.data() + g * dim;
        for (int64_t d = 0; d < dim; ++d) a[d] += prob * row[d];
      }
    }
  }

  // pair = b * kv_heads + h; its query heads h * group + g are contiguous in out.
  for (int64_t g = 0; g < group; ++g) {
    float* dst = out + (pair * group + g) * dim;
    const float inv = 1.f / s.l[g];
    for (int64_t d = 0; d < dim; ++d) dst[d] = (s.acc[g * dim + d] + s.zacc[g * channel_groups + d / G]) * inv;
  }
}

template <int BITS, typename res_t>
void run_all(const Problem& p, const at::Tensor& k_res, const at::Tensor& v_res, float* out) {
  const res_t* kr = k_res.data_ptr<res_t>();
  const res_t* vr = v_res.data_ptr<res_t>();
  at::parallel_for(0, p.batch * p.kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t pair = begin; pair < end; ++pair) run_pair<BITS, res_t>(pair, p, kr, vr, out);
  });
}

template <int BITS>
void dispatch_residual(const Problem& p, const at::Tensor& k_res, const at::Tensor& v_res, float* out) {
  switch (k_res.scalar_type()) {
    case at::kFloat:
      return run_all<BITS, float>(p, k_res, v_res, out);
    case at::kHalf:
      return run_all<BITS, c10::Half>(p, k_res, v_res, out);
    case at::kBFloat16:
      return run_all<BITS, c10::BFloat16>(p, k_res, v_res, out);
    default:
      TORCH_CHECK(false, "kivi_decode_attention: residual dtype must be float32, float16 or bfloat16");
  }
}

at::Tensor kivi_decode_attention(const at::Tensor& q, const at::Tensor& k_self, const at::Tensor& v_self,
                                 const at::Tensor& k_codes, const at::Tensor& k_scale, const at::Tensor& k_zero,
                                 const at::Tensor& v_codes, const at::Tensor& v_scale, const at::Tensor& v_zero,
                                 const at::Tensor& k_res, const at::Tensor& v_res, const at::Tensor& page_table,
                                 const at::Tensor& first_page_position, const at::Tensor& visible_from,
                                 const at::Tensor& lengths, const at::Tensor& slots, double scale, int64_t bits) {
  for (const at::Tensor* t : {&q, &k_self, &v_self, &k_codes, &k_scale, &k_zero, &v_codes, &v_scale, &v_zero,
                              &k_res, &v_res, &page_table, &first_page_position, &visible_from, &lengths,
                              &slots}) {
    TORCH_CHECK(t->device().is_cpu() && t->is_contiguous(), "kivi_decode_attention: contiguous CPU tensors only");
  }
  for (const at::Tensor* t : {&q, &k_self, &v_self}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 3, "q, k_self, v_self must be float32 [B, *, D]");
  }
  for (const at::Tensor* t : {&page_table, &first_page_position, &visible_from, &lengths, &slots}) {
    TORCH_CHECK(t->scalar_type() == at::kLong, "page table, positions and slots must be int64");
  }
  TORCH_CHECK(k_codes.scalar_type() == at::kByte && v_codes.scalar_type() == at::kByte, "codes must be uint8");
  for (const at::Tensor* t : {&k_scale, &k_zero, &v_scale, &v_zero}) {
    TORCH_CHECK(t->scalar_type() == at::kHalf, "scales and zero points must be float16");
  }
  TORCH_CHECK(bits == 2 || bits == 4 || bits == 8, "bits must be 2, 4 or 8");
  TORCH_CHECK(k_res.sizes() == v_res.sizes() && k_res.scalar_type() == v_res.scalar_type() && k_res.dim() == 4,
              "k_res, v_res must be [S, H, R, D] of one dtype");
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = k_self.size(1);
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "heads must be a multiple of kv_heads");
  TORCH_CHECK(k_codes.dim() == 4 && k_codes.size(0) == kv_heads && k_codes.size(2) == dim, "k_codes shape");
  const int64_t pages = k_codes.size(1);
  const int64_t g = v_codes.size(2);
  TORCH_CHECK(g > 0 && dim % g == 0 && k_codes.size(3) == g * bits / 8, "k_codes must be [H, P, D, G*b/8]");
  TORCH_CHECK(v_codes.dim() == 4 && v_codes.size(1) == pages && v_codes.size(3) == dim * bits / 8,
              "v_codes must be [H, P, G, D*b/8]");
  TORCH_CHECK(k_scale.numel() == kv_heads * pages * dim && k_zero.numel() == k_scale.numel(), "k_scale shape");
  TORCH_CHECK(v_scale.numel() == kv_heads * pages * dim && v_zero.numel() == v_scale.numel(), "v_scale shape");
  TORCH_CHECK(k_res.size(1) == kv_heads && k_res.size(3) == dim, "residual shape");
  TORCH_CHECK(page_table.dim() == 2 && page_table.size(0) == batch, "page_table must be [B, W]");
  for (const at::Tensor* t : {&first_page_position, &visible_from, &lengths, &slots}) {
    TORCH_CHECK(t->numel() == batch, "positions and slots must be [B]");
  }
  const Problem problem{batch, kv_heads, heads / kv_heads, dim, g, k_res.size(2), pages, page_table.size(1),
                        k_res.size(0), static_cast<float>(scale), q.data_ptr<float>(), k_self.data_ptr<float>(),
                        v_self.data_ptr<float>(), k_codes.data_ptr<uint8_t>(), v_codes.data_ptr<uint8_t>(),
                        k_scale.data_ptr<c10::Half>(), k_zero.data_ptr<c10::Half>(),
                        v_scale.data_ptr<c10::Half>(), v_zero.data_ptr<c10::Half>(),
                        page_table.data_ptr<int64_t>(), first_page_position.data_ptr<int64_t>(),
                        visible_from.data_ptr<int64_t>(), lengths.data_ptr<int64_t>(), slots.data_ptr<int64_t>()};
  at::Tensor out = at::empty({batch, heads, dim}, q.options());
  float* op = out.data_ptr<float>();
  switch (bits) {
    case 2:
      dispatch_residual<2>(problem, k_res, v_res, op);
      break;
    case 4:
      dispatch_residual<4>(problem, k_res, v_res, op);
      break;
    default:
      dispatch_residual<8>(problem, k_res, v_res, op);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(kvforge_cpu_kivi, m) {
  m.def("kivi_decode_attention(Tensor q, Tensor k_self, Tensor v_self, Tensor k_codes, Tensor k_scale, "
        "Tensor k_zero, Tensor v_codes, Tensor v_scale, Tensor v_zero, Tensor k_res, Tensor v_res, "
        "Tensor page_table, Tensor first_page_position, Tensor visible_from, Tensor lengths, Tensor slots, "
        "float scale, int bits) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvforge_cpu_kivi, CPU, m) {
  m.impl("kivi_decode_attention", &kivi_decode_attention);
}
