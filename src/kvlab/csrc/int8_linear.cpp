// int8-w8a8's linear (kvlab.model.int8_linear): int8 activation codes times int8 weight codes, summed exactly in
// int32, then scaled back to fp32 as float(sum) * row_scale * column_scale -- the same operations, in the same
// order, as the torch path (torch._int_mm, then two multiplications), so the two agree bit for bit.
//
// Where the CPU has AVX2 and no VNNI, the exact way to multiply int8 is in int16: each pair of codes is widened
// (vpmovsxbw) and vpmaddwd multiplies two pairs and adds them into an int32 lane (|127 x 127 x 2| fits; the
// byte-wise vpmaddubsw saturates at int16, which is why it is not used). The weights stay int8 in memory -- a
// quarter of fp32's bytes, which is what a decode step is bound by -- and are widened in registers.
//
// Where the CPU has AVX512-VNNI, w8a8_vnni (the end of this file) serves every size. Where it has VNNI without
// that kernel, torch._int_mm is oneDNN's VNNI GEMM, and what costs is the way to it: a token's codes and scales
// in eight torch ops, and the scaling back in three, per linear. w8a8_mm does all three steps in one call -- the
// same operations as kvlab.model.quant.quantize_tokens and the torch path, so the same bits.
#include "vec_prelude.h"
#include <immintrin.h>
#include <memory>
#include <vector>

static constexpr int64_t COLS = 16;  // output columns per packed block: two 8-lane int32 accumulators per row

bool has_avx2() {
#if defined(__AVX2__)
  return true;
#else
  return false;
#endif
}

#if defined(__AVX2__)
// Rows r0 .. r0 + R of one block: x pairs xp [M][KP] (two int16 codes in an int32), the block's weights
// w [KP][16][2] int8; out [M][n] fp32.
template <int R>
static inline void block_rows(const int32_t* xp, int64_t KP, const int8_t* w, const float* sx, const float* sw,
                              float* out, int64_t n, int64_t col0) {
  __m256i acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
  for (int64_t p = 0; p < KP; ++p) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * 32));
    const __m256i w0 = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(raw));       // columns 0-7, both codes
    const __m256i w1 = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(raw, 1));  // columns 8-15
    for (int r = 0; r < R; ++r) {
      const __m256i a = _mm256_set1_epi32(xp[r * KP + p]);
      acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(a, w0));
      acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(a, w1));
    }
  }
  const int64_t cols = std::min<int64_t>(COLS, n - col0);
  const __m256 s0 = _mm256_loadu_ps(sw), s1 = _mm256_loadu_ps(sw + 8);
  for (int r = 0; r < R; ++r) {
    const __m256 rs = _mm256_set1_ps(sx[r]);
    alignas(32) float y[COLS];
    _mm256_store_ps(y, _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(acc[r][0]), rs), s0));
    _mm256_store_ps(y + 8, _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(acc[r][1]), rs), s1));
    std::copy(y, y + cols, out + r * n + col0);
  }
}
#endif

// qx [M, K] int8 (K even), sx [M] fp32, packed [NB, K/2, 16, 2] int8, sw [NB * 16] fp32 (zero past n) -> [M, n].
torch::Tensor w8a8_linear(torch::Tensor qx, torch::Tensor sx, torch::Tensor packed, torch::Tensor sw, int64_t n) {
  TORCH_CHECK(qx.dim() == 2 && qx.scalar_type() == torch::kChar && packed.scalar_type() == torch::kChar &&
                  sx.scalar_type() == torch::kFloat && sw.scalar_type() == torch::kFloat,
              "w8a8_linear: int8 codes and fp32 scales");
  auto x = qx.contiguous();
  const int64_t M = x.size(0), K = x.size(1), NB = packed.size(0), KP = packed.size(1);
  TORCH_CHECK(K % 2 == 0 && KP * 2 == K && packed.size(2) == COLS && packed.size(3) == 2 && NB * COLS >= n &&
                  sw.numel() == NB * COLS && sx.numel() == M && packed.is_contiguous() && sw.is_contiguous(),
              "w8a8_linear: packed weights [N/16, K/2, 16, 2] and scales for this x");
  auto row_scales = sx.contiguous();  // held here: a temporary's data pointer would dangle
  auto out = torch::empty({M, n}, x.options().dtype(torch::kFloat));
  const int8_t* xq = x.data_ptr<int8_t>();
  // Each row's codes as int16 pairs in an int32, the operand vpmaddwd broadcasts.
  std::vector<int32_t> pairs(M * KP);
  for (int64_t i = 0; i < M * KP; ++i) {
    pairs[i] = static_cast<int32_t>(static_cast<uint16_t>(static_cast<int16_t>(xq[2 * i]))) |
               (static_cast<int32_t>(static_cast<int16_t>(xq[2 * i + 1])) << 16);
  }
  const int32_t* xp = pairs.data();
  const int8_t* wp = packed.data_ptr<int8_t>();
  const float* sxp = row_scales.data_ptr<float>();
  const float* swp = sw.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, NB, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int8_t* w = wp + b * KP * COLS * 2;
#if defined(__AVX2__)
      for (int64_t r0 = 0; r0 < M; r0 += 6) {
        const int32_t* xr = xp + r0 * KP;
        float* outr = op + r0 * n;
        switch (std::min<int64_t>(6, M - r0)) {
          case 6: block_rows<6>(xr, KP, w, sxp + r0, swp + b * COLS, outr, n, b * COLS); break;
          case 5: block_rows<5>(xr, KP, w, sxp + r0, swp + b * COLS, outr, n, b * COLS); break;
          case 4: block_rows<4>(xr, KP, w, sxp + r0, swp + b * COLS, outr, n, b * COLS); break;
          case 3: block_rows<3>(xr, KP, w, sxp + r0, swp + b * COLS, outr, n, b * COLS); break;
          case 2: block_rows<2>(xr, KP, w, sxp + r0, swp + b * COLS, outr, n, b * COLS); break;
          default: block_rows<1>(xr, KP, w, sxp + r0, swp + b * COLS, outr, n, b * COLS); break;
        }
      }
#else
      for (int64_t m = 0; m < M; ++m) {
        for (int64_t c = 0; c < COLS && b * COLS + c < n; ++c) {
          int32_t acc = 0;
          for (int64_t k = 0; k < K; ++k) acc += int32_t(xq[m * K + k]) * int32_t(w[(k / 2) * COLS * 2 + c * 2 + k % 2]);
          op[m * n + b * COLS + c] = (static_cast<float>(acc) * sxp[m]) * swp[b * COLS + c];
        }
      }
#endif
    }
  });
  return out;
}

#if defined(__AVX512F__)
// The first `left` of 16 lanes (all 16 from 16 on).
static inline __mmask16 lanes(int64_t left) { return left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1); }

// bf16 values widened to fp32 exactly: bf16 is fp32's top half.
static inline __m512 widen_bf16(__m256i v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

// 16 values of x from p (the lanes of m; zero elsewhere) as fp32 in a register.
static inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
#if defined(__AVX512BW__)
static inline __m512 load16(const c10::BFloat16* p, __mmask16 m) { return widen_bf16(_mm256_maskz_loadu_epi16(m, p)); }
#endif
#endif

// One row's codes: scale = max(max |x| / 127, 1e-30), q = clamp(round-to-nearest-even(x / scale), -127, 127),
// each stored plus SHIFT (128 for the VNNI kernel's unsigned operand: q + 128 as a byte), read from x's own dtype
// in registers.
template <int SHIFT = 0, typename T>
static inline float quantize_row(const T* x, int64_t K, int8_t* q) {
  float peak = 0.f;
  int64_t k = 0;
#if defined(__AVX512F__)
  __m512 vpeak = _mm512_setzero_ps();
  for (; k < K; k += 16) vpeak = _mm512_max_ps(vpeak, _mm512_abs_ps(load16(x + k, lanes(K - k))));
  peak = _mm512_reduce_max_ps(vpeak);
#else
  for (; k < K; ++k) peak = std::max(peak, std::fabs(static_cast<float>(x[k])));
#endif
  const float scale = std::max(peak / 127.f, 1e-30f);
  k = 0;
#if defined(__AVX512F__)
  const __m512 vs = _mm512_set1_ps(scale), lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
  const __m512i shift = _mm512_set1_epi32(SHIFT);
  for (; k < K; k += 16) {
    const __mmask16 m = lanes(K - k);
    __m512 v = _mm512_div_ps(load16(x + k, m), vs);
    v = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v = _mm512_min_ps(hi, _mm512_max_ps(lo, v));
    _mm512_mask_cvtepi32_storeu_epi8(q + k, m, _mm512_add_epi32(_mm512_cvtps_epi32(v), shift));
  }
#else
  for (; k < K; ++k) {
    const float code = std::min(127.f, std::max(-127.f, std::nearbyint(static_cast<float>(x[k]) / scale)));
    q[k] = static_cast<int8_t>(static_cast<uint8_t>(static_cast<int>(code) + SHIFT));
  }
#endif
  return scale;
}

// One row of the product scaled back: out[n] = (float(acc[n]) x row_scale) x col_scale[n].
static inline void scale_row(const int32_t* acc, float row_scale, const float* col_scale, int64_t N, float* out) {
  int64_t n = 0;
#if defined(__AVX512F__)
  const __m512 rs = _mm512_set1_ps(row_scale);
  for (; n < N; n += 16) {
    const __mmask16 m = lanes(N - n);
    const __m512 a = _mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(m, acc + n));
    _mm512_mask_storeu_ps(out + n, m, _mm512_mul_ps(_mm512_mul_ps(a, rs), _mm512_maskz_loadu_ps(m, col_scale + n)));
  }
#else
  for (; n < N; ++n) out[n] = (static_cast<float>(acc[n]) * row_scale) * col_scale[n];
#endif
}

// x [M, K] fp32, codes [N, K] int8, sw [N] fp32 -> [M, N] fp32: each row quantised with its own scale
// (quantize_row), multiplied by torch._int_mm over the codes' transposed view, and scaled back (scale_row).
torch::Tensor w8a8_mm(torch::Tensor x_, torch::Tensor codes, torch::Tensor sw) {
  TORCH_CHECK(x_.dim() == 2 && codes.dim() == 2 && x_.size(1) == codes.size(1) &&
                  x_.scalar_type() == torch::kFloat && codes.scalar_type() == torch::kChar &&
                  sw.scalar_type() == torch::kFloat && sw.numel() == codes.size(0),
              "w8a8_mm: fp32 x [M, K], int8 codes [N, K] and fp32 column scales [N]");
  auto x = x_.contiguous();
  auto col_scales = sw.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  auto q = torch::empty({M, K}, x.options().dtype(torch::kChar));
  std::vector<float> row_scales(M);
  const float* xp = x.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  at::parallel_for(0, M, 64, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) row_scales[m] = quantize_row(xp + m * K, K, qp + m * K);
  });
  auto acc = at::_int_mm(q, codes.t());
  auto out = torch::empty({M, N}, x.options());
  const int32_t* ap = acc.data_ptr<int32_t>();
  const float* cp = col_scales.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) scale_row(ap + m * N, row_scales[m], cp, N, op + m * N);
  });
  return out;
}

// ---- The VNNI kernel (vpdpbusd), kvlab.model.int8_linear's "vnni" layout. ----
// vpdpbusd multiplies unsigned bytes by signed bytes, four at a time into an int32 lane. The activation codes are
// signed, so each is stored shifted by 128 (q ^ 0x80 is q + 128 as a byte) and the shift is taken back exactly:
// sum((q + 128) w) - 128 sum(w), with 128 sum(w) per column computed once at packing ("offsets"). The int32 sums
// are then sum(q w) exactly, scaled as the torch path scales them, so this kernel gives torch._int_mm's bits
// without its int32 [M, N] matrix written and read back, and writes the activations' dtype directly.

bool has_vnni_kernel() {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
static constexpr int64_t VNNI_COLS = 64;  // output columns per packed block: four 16-lane accumulators a row
static constexpr int VNNI_ROWS = 6;       // rows a pass: 24 accumulators and 4 weight vectors of 32 registers
// With two passes or more over a block (7 rows or more) the next block is fetched into L2 meanwhile: the later
// passes read this one from cache and memory would sit idle; one pass is a plain stream the hardware prefetcher
// follows (measured: docs/performance.md, "int8-w8a8's own VNNI kernel").
static constexpr int64_t PF_MIN_PASSES = 2;

// vpdpbusd through inline assembly: GCC 12's intrinsic ties the accumulator so that with 16 or more of them it
// copies every one between two register sets each step and spills some (seen in the object code), which halved
// the kernel's rate.
static inline __m512i dot_u8s8(__m512i acc, __m512i u8, __m512i s8) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u8), "v"(s8));
  return acc;
}

static inline void store16(float* out, __mmask16 m, __m512 v) { _mm512_mask_storeu_ps(out, m, v); }
static inline void store16(c10::BFloat16* out, __mmask16 m, __m512 v) {
  // Round to nearest even, as c10's conversion (and so the torch path's cast back) does.
  _mm256_mask_storeu_epi16(out, m, at::vec::cvtfp32_bf16(v));
}

// A row's 64 columns (the first cols of them) in the output's dtype.
template <typename T>
static inline void store_row(const __m512* v, T* out, int64_t cols) {
  for (int j = 0; j < 4 && 16 * j < cols; ++j) {
    const int64_t left = cols - 16 * j;
    store16(out + 16 * j, lanes(left), v[j]);
  }
}

// What a block's 64 columns are and what is stored of them. PLAIN: 64 output columns. HALVES: the layer's output
// is two halves (gate and up of an MLP, [rows, 2 x inter]); a block holds 32 columns of each, the same 32 of
// both (int8_linear.pack_vnni_halves), and stores each in its half. SILU_MUL: the same blocks, and what is stored
// is silu(gate) x up [rows, inter] -- fused.cpp's silu_mul of the HALVES output, the same operations on the same
// rounded values, so the same bits without the [rows, 2 x inter] tensor written and read back.
enum Epilogue : int { PLAIN = 0, HALVES = 1, SILU_MUL = 2 };

// v as a tensor of T holds it: rounded to nearest even and widened back (bf16), or itself (fp32).
static inline __m512 as_stored(__m512 v, const float*) { return v; }
static inline __m512 as_stored(__m512 v, const c10::BFloat16*) { return widen_bf16(at::vec::cvtfp32_bf16(v)); }

// MT rows (their shifted codes as int32 quads, xr[r][kq]) against one block w [KQ][64][4]; each row's output
// (float(sum - offset) * row scale) * column scale, stored at outr[r] as EPI says (the up half `up` further on).
// Meanwhile the cache lines [pf_first, pf_first + pf_count) of pf are prefetched into L2, spread over the walk.
template <int MT, bool PF, int EPI, typename T>
static inline void vnni_block_rows(const int32_t* const* xr, const __m512i* w, int64_t KQ, const int32_t* offsets,
                                   const float* col_scales, const float* row_scales, T* const* outr, int64_t cols,
                                   int64_t up, const __m512i* pf, int64_t pf_first, int64_t pf_count) {
  __m512i acc[MT][4];
  for (int r = 0; r < MT; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_si512();
  SpreadPrefetch prefetch(pf + pf_first, pf_count, KQ);
  for (int64_t kq = 0; kq < KQ; ++kq, w += 4) {
    if constexpr (PF) prefetch.step();  // a template constant: the plain walk carries no prefetch arithmetic
    const __m512i w0 = _mm512_loadu_si512(w), w1 = _mm512_loadu_si512(w + 1);
    const __m512i w2 = _mm512_loadu_si512(w + 2), w3 = _mm512_loadu_si512(w + 3);
    for (int r = 0; r < MT; ++r) {
      const __m512i a = _mm512_set1_epi32(xr[r][kq]);
      acc[r][0] = dot_u8s8(acc[r][0], a, w0);
      acc[r][1] = dot_u8s8(acc[r][1], a, w1);
      acc[r][2] = dot_u8s8(acc[r][2], a, w2);
      acc[r][3] = dot_u8s8(acc[r][3], a, w3);
    }
  }
  for (int r = 0; r < MT; ++r) {
    const __m512 rs = _mm512_set1_ps(row_scales[r]);
    __m512 v[4];
    for (int j = 0; j < 4; ++j) {
      const __m512i exact = _mm512_sub_epi32(acc[r][j], _mm512_loadu_si512(offsets + 16 * j));
      v[j] = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(exact), rs), _mm512_loadu_ps(col_scales + 16 * j));
    }
    if constexpr (EPI == PLAIN) {
      store_row(v, outr[r], cols);
    } else if constexpr (EPI == HALVES) {
      for (int j = 0; j < 2 && 16 * j < cols; ++j) {
        store16(outr[r] + 16 * j, lanes(cols - 16 * j), v[j]);
        store16(outr[r] + up + 16 * j, lanes(cols - 16 * j), v[j + 2]);
      }
    } else {
      for (int j = 0; j < 2 && 16 * j < cols; ++j) {
        const Vec g(as_stored(v[j], outr[r])), u(as_stored(v[j + 2], outr[r]));
        store16(outr[r] + 16 * j, lanes(cols - 16 * j), g / (Vec(1.f) + g.neg().exp_u20()) * u);
      }
    }
  }
}

template <bool PF, int EPI, typename T>
static inline void vnni_pass(int mt, const int32_t* const* xr, const __m512i* w, int64_t KQ, const int32_t* off,
                             const float* cs, const float* rs, T* const* outr, int64_t cols, int64_t up,
                             const __m512i* pf, int64_t pf_first, int64_t pf_count) {
  switch (mt) {
    case 6: vnni_block_rows<6, PF, EPI>(xr, w, KQ, off, cs, rs, outr, cols, up, pf, pf_first, pf_count); break;
    case 5: vnni_block_rows<5, PF, EPI>(xr, w, KQ, off, cs, rs, outr, cols, up, pf, pf_first, pf_count); break;
    case 4: vnni_block_rows<4, PF, EPI>(xr, w, KQ, off, cs, rs, outr, cols, up, pf, pf_first, pf_count); break;
    case 3: vnni_block_rows<3, PF, EPI>(xr, w, KQ, off, cs, rs, outr, cols, up, pf, pf_first, pf_count); break;
    case 2: vnni_block_rows<2, PF, EPI>(xr, w, KQ, off, cs, rs, outr, cols, up, pf, pf_first, pf_count); break;
    default: vnni_block_rows<1, PF, EPI>(xr, w, KQ, off, cs, rs, outr, cols, up, pf, pf_first, pf_count); break;
  }
}

// n: the layer's output features (both halves where EPI is not PLAIN).
template <int EPI, typename T>
static void vnni_product(const int32_t* xq, const float* row_scales, int64_t M, int64_t KQ, const __m512i* wp,
                         const int32_t* offsets, const float* col_scales, int64_t NB, T* op, int64_t n) {
  const int64_t passes = (M + VNNI_ROWS - 1) / VNNI_ROWS, lines = KQ * 4;
  // A block's columns of one half, a half's width (the up half starts there), and the output's row stride.
  constexpr int64_t step = EPI == PLAIN ? VNNI_COLS : VNNI_COLS / 2;
  const int64_t width = EPI == PLAIN ? n : n / 2, ld = EPI == SILU_MUL ? n / 2 : n;
  for_each_block_run(NB, passes, [=](int64_t b, int64_t first, int64_t stop, int64_t last) {
    const __m512i* w = wp + b * KQ * 4;
    const int64_t cols = std::min<int64_t>(step, width - b * step);
    const __m512i* next = b < last && passes >= PF_MIN_PASSES ? w + KQ * 4 : nullptr;
    for (int64_t pass = first; pass < stop; ++pass) {
      const int64_t m0 = pass_row(pass, passes, M), pf_first = (pass - first) * lines / (stop - first);
      const int64_t pf_count = next ? (pass + 1 - first) * lines / (stop - first) - pf_first : 0;
      const int mt = static_cast<int>(pass_row(pass + 1, passes, M) - m0);
      const int32_t* xr[VNNI_ROWS];
      T* outr[VNNI_ROWS];
      for (int r = 0; r < mt; ++r) {
        xr[r] = xq + (m0 + r) * KQ;
        outr[r] = op + (m0 + r) * ld + b * step;
      }
      const int32_t* off = offsets + b * VNNI_COLS;
      const float* cs = col_scales + b * VNNI_COLS;
      const float* rs = row_scales + m0;
      if (pf_count)
        vnni_pass<true, EPI>(mt, xr, w, KQ, off, cs, rs, outr, cols, width, next, pf_first, pf_count);
      else
        vnni_pass<false, EPI>(mt, xr, w, KQ, off, cs, rs, outr, cols, width, next, 0, 0);
    }
  });
}

// Each row of x [M, K] quantised (quantize_row, shifted to unsigned), then the product, scaled back into out
// [M, n] in x's dtype. The codes' buffers are left uninitialised: every byte is written before it is read.
template <int EPI, typename T>
static void vnni_linear(const T* x, int64_t M, int64_t K, const torch::Tensor& packed, const torch::Tensor& offsets,
                        const torch::Tensor& col_scales, T* out, int64_t n) {
  std::unique_ptr<int8_t[]> q(new int8_t[M * K]);
  std::unique_ptr<float[]> row_scales(new float[M]);
  int8_t* qp = q.get();
  float* sp = row_scales.get();
  at::parallel_for(0, M, 16, [=](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) sp[m] = quantize_row<128>(x + m * K, K, qp + m * K);
  });
  vnni_product<EPI>(reinterpret_cast<const int32_t*>(qp), sp, M, K / 4,
               reinterpret_cast<const __m512i*>(packed.data_ptr<int8_t>()), offsets.data_ptr<int32_t>(),
               col_scales.data_ptr<float>(), packed.size(0), out, n);
}
#endif

// x [M, K] fp32 or bf16 (K a multiple of 4), packed [NB, K/4, 64, 4] int8, offsets [NB * 64] int32 (128 x each
// column's code sum), col_scales [NB * 64] fp32 (both zero past the layer's columns), n the layer's output
// features -> [M, n] in x's dtype (epilogue PLAIN or HALVES) or [M, n / 2] (SILU_MUL): each row quantised as
// quantize_row does, the product exact in int32, scaled as the torch path scales.
torch::Tensor w8a8_vnni(torch::Tensor x_, torch::Tensor packed, torch::Tensor offsets, torch::Tensor col_scales,
                        int64_t n, int64_t epilogue) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
  TORCH_CHECK(x_.dim() == 2 && (x_.scalar_type() == torch::kFloat || x_.scalar_type() == torch::kBFloat16) &&
                  packed.scalar_type() == torch::kChar && offsets.scalar_type() == torch::kInt &&
                  col_scales.scalar_type() == torch::kFloat,
              "w8a8_vnni: fp32 or bf16 x [M, K], int8 packed codes, int32 offsets, fp32 column scales");
  TORCH_CHECK(epilogue == PLAIN || epilogue == HALVES || epilogue == SILU_MUL, "w8a8_vnni: epilogue 0, 1 or 2");
  auto x = x_.contiguous();
  const int64_t M = x.size(0), K = x.size(1), NB = packed.size(0), KQ = packed.size(1);
  // |sum((q + 128) w)| <= K x 255 x 127 must fit int32 for the sums to be exact.
  TORCH_CHECK(K <= 65536, "w8a8_vnni: at most 65,536 input features (int32 sums)");
  TORCH_CHECK(K % 4 == 0 && KQ * 4 == K && packed.dim() == 4 && packed.size(2) == VNNI_COLS && packed.size(3) == 4 &&
                  NB * VNNI_COLS >= n && offsets.numel() == NB * VNNI_COLS &&
                  col_scales.numel() == NB * VNNI_COLS && packed.is_contiguous() && offsets.is_contiguous() &&
                  col_scales.is_contiguous(),
              "w8a8_vnni: packed codes [N/64, K/4, 64, 4] and offsets, scales [N/64 * 64] for this x");
  TORCH_CHECK(epilogue == PLAIN || n % 2 == 0, "w8a8_vnni: two halves of an even number of output features");
  auto out = torch::empty({M, epilogue == SILU_MUL ? n / 2 : n}, x.options());
  auto run = [&](auto* xp, auto* yp) {
    if (epilogue == PLAIN)
      vnni_linear<PLAIN>(xp, M, K, packed, offsets, col_scales, yp, n);
    else if (epilogue == HALVES)
      vnni_linear<HALVES>(xp, M, K, packed, offsets, col_scales, yp, n);
    else
      vnni_linear<SILU_MUL>(xp, M, K, packed, offsets, col_scales, yp, n);
  };
  if (x.scalar_type() == torch::kBFloat16)
    run(x.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>());
  else
    run(x.data_ptr<float>(), out.data_ptr<float>());
  return out;
#else
  TORCH_CHECK(false, "w8a8_vnni: built without AVX512-VNNI");
  return x_;
#endif
}
