// Compiled by kvlab.native.build (see model.fused); one module per op set.
#include "vec_prelude.h"
#include <cmath>
#include <limits>
#include <vector>

template <typename T> static inline float f32(T x) { return static_cast<float>(x); }

// Rows are few at decode and many at prefill: small batches stay on the calling thread (parallel_for runs a
// range below its grain inline), large ones split.
static inline int64_t grain(int64_t row_elems) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, row_elems)); }

template <typename T>
static void add_rms_norm_impl(T* h, const T* delta, const T* w, T* out, int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, grain(n), [=](int64_t begin, int64_t end) {
    std::vector<float> x(n);
    for (int64_t r = begin; r < end; ++r) {
      T* hr = h + r * n;
      const T* dr = delta != nullptr ? delta + r * n : nullptr;
      Vec acc(0.f);
      float ss = 0.f;
      int64_t i = 0;
      for (; i + W <= n; i += W) {
        Vec v = load_f(hr + i);
        if (dr != nullptr) {
          store_f(hr + i, v + load_f(dr + i));  // the stream, rounded to T as h + delta is
          v = load_f(hr + i);
        }
        v.store(x.data() + i);
        acc = at::vec::fmadd(v, v, acc);
      }
      for (; i < n; ++i) {
        float v = f32(hr[i]);
        if (dr != nullptr) {
          hr[i] = static_cast<T>(v + f32(dr[i]));
          v = f32(hr[i]);
        }
        x[i] = v;
        ss += v * v;
      }
      ss += at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc);
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
      T* o = out + r * n;
      // normed = x * inv, rounded to T; then times the weight, rounded again (in fp32 both roundings are exact).
      i = 0;
      for (; i + W <= n; i += W) {
        store_f(o + i, Vec::loadu(x.data() + i) * Vec(inv));
        store_f(o + i, load_f(o + i) * load_f(w + i));
      }
      for (; i < n; ++i) o[i] = static_cast<T>(f32(w[i]) * f32(static_cast<T>(x[i] * inv)));
    }
  });
}

template <typename T>
static void rope_impl(T* qkv, const T* cos, const T* sin, int64_t rows, int64_t row_stride, int64_t heads,
                      int64_t d) {
  const int64_t half = d / 2;
  at::parallel_for(0, rows, grain(heads * d), [=](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* c = cos + r * d;
      const T* s = sin + r * d;
      for (int64_t hd = 0; hd < heads; ++hd) {
        T* x = qkv + r * row_stride + hd * d;
        int64_t i = 0;
        for (; i + W <= half; i += W) {
          const Vec x1 = load_f(x + i), x2 = load_f(x + half + i);
          store_f(x + i, x1 * load_f(c + i) - x2 * load_f(s + i));
          store_f(x + half + i, x2 * load_f(c + half + i) + x1 * load_f(s + half + i));
        }
        for (; i < half; ++i) {
          const float x1 = f32(x[i]), x2 = f32(x[i + half]);
          x[i] = static_cast<T>(x1 * f32(c[i]) - x2 * f32(s[i]));
          x[i + half] = static_cast<T>(x2 * f32(c[i + half]) + x1 * f32(s[i + half]));
        }
      }
    }
  });
}

template <typename T>
static void silu_mul_impl(const T* gu, T* out, int64_t rows, int64_t inter) {
  at::parallel_for(0, rows, grain(2 * inter), [=](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gu + r * 2 * inter;
      const T* u = g + inter;
      T* o = out + r * inter;
      int64_t i = 0;
      for (; i + W <= inter; i += W) {
        const Vec x = load_f(g + i);
        // exp_u20 (SLEEF's 2-ulp exp) where torch's silu takes exp (1 ulp): the exp is most of the op's time, and
        // the bf16 outputs measured the same (docs/performance.md, "The LM head in int8, and what else was tried").
        store_f(o + i, x / (Vec(1.f) + x.neg().exp_u20()) * load_f(u + i));
      }
      for (; i < inter; ++i) {
        const float x = f32(g[i]);
        o[i] = static_cast<T>(x / (1.f + std::exp(-x)) * f32(u[i]));
      }
    }
  });
}

#define KVLAB_DISPATCH(t, NAME, ...)                                                     \
  if ((t).scalar_type() == torch::kFloat32) { using T = float; __VA_ARGS__; }            \
  else if ((t).scalar_type() == torch::kBFloat16) { using T = c10::BFloat16; __VA_ARGS__; } \
  else TORCH_CHECK(false, NAME ": float32 or bfloat16 only");

// h [rows, n] contiguous (updated in place when delta is given); delta like h; w [n]. Returns the normed rows.
torch::Tensor add_rms_norm(torch::Tensor h, c10::optional<torch::Tensor> delta, torch::Tensor w, double eps) {
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous() && w.dim() == 1 && w.size(0) == h.size(1),
              "add_rms_norm: h [rows, n], w [n]");
  TORCH_CHECK(w.scalar_type() == h.scalar_type(), "add_rms_norm: h and w of one dtype");
  torch::Tensor d;
  if (delta.has_value()) {
    d = delta->contiguous();
    TORCH_CHECK(d.sizes() == h.sizes() && d.scalar_type() == h.scalar_type(), "add_rms_norm: delta like h");
  }
  auto wc = w.contiguous();
  auto out = torch::empty_like(h);
  KVLAB_DISPATCH(h, "add_rms_norm",
                 add_rms_norm_impl<T>(h.data_ptr<T>(), d.defined() ? d.data_ptr<T>() : nullptr, wc.data_ptr<T>(),
                                      out.data_ptr<T>(), h.size(0), h.size(1), static_cast<float>(eps)));
  return out;
}

// qkv [rows, width] contiguous; cos, sin [rows, d] (any leading shape of rows * d elements) in qkv's dtype.
void rope_(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t heads, int64_t d) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && heads * d <= qkv.size(1) && d % 2 == 0,
              "rope_: qkv [rows, >= heads * d]");
  auto c = cos.contiguous(), s = sin.contiguous();
  TORCH_CHECK(c.numel() == qkv.size(0) * d && s.numel() == c.numel(), "rope_: cos, sin of rows * d");
  TORCH_CHECK(c.scalar_type() == qkv.scalar_type() && s.scalar_type() == qkv.scalar_type(), "rope_: one dtype");
  KVLAB_DISPATCH(qkv, "rope_",
                 rope_impl<T>(qkv.data_ptr<T>(), c.data_ptr<T>(), s.data_ptr<T>(), qkv.size(0), qkv.size(1), heads, d));
}

// gate_up [rows, 2 * inter] contiguous -> silu(gate) * up [rows, inter].
torch::Tensor silu_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "silu_mul: gate_up [rows, 2 * inter]");
  const int64_t inter = gate_up.size(1) / 2;
  auto out = torch::empty({gate_up.size(0), inter}, gate_up.options());
  KVLAB_DISPATCH(gate_up, "silu_mul",
                 silu_mul_impl<T>(gate_up.data_ptr<T>(), out.data_ptr<T>(), gate_up.size(0), inter));
  return out;
}
#undef KVLAB_DISPATCH

// Row r's first index of its largest value. A NaN counts as the largest, its first one wins: torch.argmax's rule.
static int64_t first_max(const float* x, int64_t n) {
  Vec top(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + W <= n; i += W) top = at::vec::maximum(top, Vec::loadu(x + i));  // propagates NaN
  float m = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, top);
  for (; i < n; ++i) m = (std::isnan(x[i]) || x[i] > m) ? x[i] : m;
  if (std::isnan(m)) {
    for (int64_t j = 0; j < n; ++j)
      if (std::isnan(x[j])) return j;
  }
  // The row (~200 KB at a 49k vocabulary) is in L2 from the pass above.
  const Vec vm(m);
  for (i = 0; i + W <= n; i += W) {
    const int equal = ~(Vec::loadu(x + i) == vm).zero_mask() & ((1 << W) - 1);
    if (equal) return i + __builtin_ctz(static_cast<unsigned>(equal));
  }
  for (; i < n; ++i)
    if (x[i] == m) return i;
  return 0;  // unreachable: m is one of the row's values
}

// logits [rows, n] fp32 -> [rows] int64: torch.argmax(logits, dim=-1) in one pass to find each row's maximum and
// one to find its first occurrence, a row per task. ATen's reduction keeps the index beside the value in every
// step, ~10x slower than its plain maximum over the same row (a 64-row step of a 49k vocabulary: ~1 ms).
torch::Tensor argmax_rows(torch::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat && logits.size(1) > 0,
              "argmax_rows: fp32 logits [rows, n] with n >= 1");
  auto x = logits.contiguous();
  const int64_t rows = x.size(0), n = x.size(1);
  auto out = torch::empty({rows}, x.options().dtype(torch::kLong));
  const float* p = x.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [=](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) o[r] = first_max(p + r * n, n);
  });
  return out;
}

// Row x's m largest values (finite rows), in descending order, with an index of each: a buffer of the m largest so
// far, and one compare a vector against its smallest, which after the first few vectors lets almost every vector
// pass untouched. The values are torch.topk's (copies of the row's entries, the same multiset); among equal values
// the indices may be others than topk's, so the caller reads an index set only where the m-th value is unique.
static void top_of_row(const float* x, int64_t n, int64_t m, float* val, int64_t* idx) {
  int64_t c = 0;
  auto insert = [&](float v, int64_t i) {
    int64_t j = c < m ? c++ : m - 1;  // the slot the new value may take: a free one, or the smallest kept
    for (; j > 0 && val[j - 1] < v; --j) {
      val[j] = val[j - 1];
      idx[j] = idx[j - 1];
    }
    val[j] = v;
    idx[j] = i;
  };
  int64_t i = 0;
  for (; i < n && c < m; ++i) insert(x[i], i);
  for (; i + W <= n; i += W) {
    int above = (Vec::loadu(x + i) > Vec(val[m - 1])).zero_mask() ^ ((1 << W) - 1);
    for (; above; above &= above - 1) {
      const int64_t at = i + __builtin_ctz(static_cast<unsigned>(above));
      if (x[at] > val[m - 1]) insert(x[at], at);  // the smallest kept may have risen since the compare
    }
  }
  for (; i < n; ++i)
    if (x[i] > val[m - 1]) insert(x[i], i);
}

// logits [rows, n] fp32, finite; 1 <= m <= n -> (values [rows, m] descending, indices [rows, m] int64):
// torch.topk(logits, m)'s values, a row per task. ATen's topk sorts a partial selection per row: ~1.3 ms for m = 2
// over 64 rows of a 49k vocabulary, most of a sampled step's sampling.
std::vector<torch::Tensor> topk_rows(torch::Tensor logits, int64_t m) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat && m >= 1 && m <= logits.size(1),
              "topk_rows: fp32 logits [rows, n] and 1 <= m <= n");
  auto x = logits.contiguous();
  const int64_t rows = x.size(0), n = x.size(1);
  auto values = torch::empty({rows, m}, x.options());
  auto indices = torch::empty({rows, m}, x.options().dtype(torch::kLong));
  const float* p = x.data_ptr<float>();
  float* v = values.data_ptr<float>();
  int64_t* ix = indices.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [=](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) top_of_row(p + r * n, n, m, v + r * m, ix + r * m);
  });
  return {values, indices};
}
