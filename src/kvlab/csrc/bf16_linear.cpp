// Compiled by kvlab.native.build (see model.bf16_linear); one module per op set.
#include "vec_prelude.h"
#include <immintrin.h>
#include <memory>

bool has_bf16_dot() {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
// MT rows' fp32 sums for a block's 64 columns, rounded to bf16 once (nearest even) and stored (the first cols).
template <int MT>
static inline void store_rows(const __m512 (&acc)[MT][4], uint16_t* const* outr, int64_t cols) {
  for (int r = 0; r < MT; ++r) {
    for (int j = 0; j < 4; ++j) {
      const int64_t c0 = 16 * j;
      if (c0 >= cols) break;
      const __m256i v = (__m256i)_mm512_cvtneps_pbh(acc[r][j]);
      if (c0 + 16 <= cols) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(outr[r] + c0), v);
      } else {
        const __mmask16 m = static_cast<__mmask16>((1u << (cols - c0)) - 1u);
        _mm256_mask_storeu_epi16(outr[r] + c0, m, v);
      }
    }
  }
}

// MT rows of x against one packed block of 64 columns: acc[r][j] holds columns 16j..16j+15 of row r. Meanwhile
// the cache lines [pf_first, pf_first + pf_count) of pf are prefetched into L2, spread over the walk.
template <int MT, bool PF>
static inline void block_rows(const int32_t* const* xr, const __m512i* w, int64_t kp_count, uint16_t* const* outr,
                              int64_t cols, const __m512i* pf, int64_t pf_first, int64_t pf_count) {
  __m512 acc[MT][4];
  for (int r = 0; r < MT; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  SpreadPrefetch prefetch(pf + pf_first, pf_count, kp_count);
  for (int64_t kp = 0; kp < kp_count; ++kp, w += 4) {
    if constexpr (PF) prefetch.step();  // a template constant: without it the loop is the plain walk
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + 1);
    const __m512bh w2 = (__m512bh)_mm512_loadu_si512(w + 2);
    const __m512bh w3 = (__m512bh)_mm512_loadu_si512(w + 3);
    for (int r = 0; r < MT; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(xr[r][kp]);  // the row's two inputs kp*2, kp*2+1
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, w1);
      acc[r][2] = _mm512_dpbf16_ps(acc[r][2], a, w2);
      acc[r][3] = _mm512_dpbf16_ps(acc[r][3], a, w3);
    }
  }
  store_rows<MT>(acc, outr, cols);
}

template <int MT>
static inline void block_pass(const int32_t* const* xr, const __m512i* w, int64_t kp_count, uint16_t* const* outr,
                              int64_t cols, const __m512i* pf, int64_t pf_first, int64_t pf_count) {
  if (pf_count)
    block_rows<MT, true>(xr, w, kp_count, outr, cols, pf, pf_first, pf_count);
  else
    block_rows<MT, false>(xr, w, kp_count, outr, cols, pf, 0, 0);
}

// A pass's row pointers: rows m0 .. m0 + mt - 1 of x [M, K] (as pairs of bf16), and their outputs at block b.
static inline void pass_rows(const int32_t* xp, int64_t K, uint16_t* op, int64_t n, int64_t b, int64_t m0, int mt,
                             const int32_t** xr, uint16_t** outr) {
  for (int r = 0; r < mt; ++r) {
    xr[r] = xp + (m0 + r) * (K / 2);
    outr[r] = op + (m0 + r) * n + b * 64;
  }
}

// Passes over a block for M rows: up to 6 rows a pass.
static inline int64_t passes_for(int64_t M) { return (M + 5) / 6; }

// Passes [first, stop) of M rows of x [M, K] against block b (64 columns of weights w), of passes_for(M) in all;
// with next set, that block's lines are prefetched into L2, spread over these passes.
static inline void block_passes(const int32_t* xp, int64_t K, int64_t M, uint16_t* op, int64_t n, int64_t b,
                                const __m512i* w, int64_t KP, const __m512i* next, int64_t first, int64_t stop) {
  const int64_t lines = KP * 4;  // a block is KP * 4 cache lines
  const int64_t cols = std::min<int64_t>(64, n - b * 64);
  const int64_t passes = passes_for(M);
  for (int64_t pass = first; pass < stop; ++pass) {
    const int64_t m0 = pass_row(pass, passes, M), pf_first = (pass - first) * lines / (stop - first);
    const int64_t pf_count = next ? (pass + 1 - first) * lines / (stop - first) - pf_first : 0;
    const int mt = static_cast<int>(pass_row(pass + 1, passes, M) - m0);
    const int32_t* xr[6];
    uint16_t* outr[6];
    pass_rows(xp, K, op, n, b, m0, mt, xr, outr);
    switch (mt) {
      case 6: block_pass<6>(xr, w, KP, outr, cols, next, pf_first, pf_count); break;
      case 5: block_pass<5>(xr, w, KP, outr, cols, next, pf_first, pf_count); break;
      case 4: block_pass<4>(xr, w, KP, outr, cols, next, pf_first, pf_count); break;
      case 3: block_pass<3>(xr, w, KP, outr, cols, next, pf_first, pf_count); break;
      case 2: block_pass<2>(xr, w, KP, outr, cols, next, pf_first, pf_count); break;
      default: block_pass<1>(xr, w, KP, outr, cols, next, pf_first, pf_count); break;
    }
  }
}
#endif

// packed: [NB, K/2, 64, 2] bf16 (pack_weight); x [M, K] bf16, K even; out [M, N] bf16.
torch::Tensor small_linear(torch::Tensor x, torch::Tensor packed, int64_t n) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && packed.scalar_type() == torch::kBFloat16,
              "small_linear: x [M, K] and packed weights in bf16");
  auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), NB = packed.size(0), KP = packed.size(1);
  TORCH_CHECK(K % 2 == 0 && KP * 2 == K && packed.size(2) == 64 && packed.size(3) == 2 && NB * 64 >= n,
              "small_linear: packed weights [N/64, K/2, 64, 2] for this x");
  auto out = torch::empty({M, n}, xc.options());
  const int32_t* xp = reinterpret_cast<const int32_t*>(xc.data_ptr<c10::BFloat16>());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>());
  const __m512i* wp = reinterpret_cast<const __m512i*>(packed.data_ptr<c10::BFloat16>());
  const int64_t passes = passes_for(M);
  // With two passes or more over a block (7 rows or more) the later ones read L2, and memory would sit idle
  // meanwhile: the next block is fetched while this one is computed. One pass is a plain stream, which the
  // hardware prefetcher follows better alone (measured, docs/performance.md "Small-batch linears").
  const bool prefetch = passes >= 2;
  for_each_block_run(NB, passes, [=](int64_t b, int64_t first, int64_t stop, int64_t last) {
    const __m512i* w = wp + b * KP * 4;
    block_passes(xp, K, M, op, n, b, w, KP, b < last && prefetch ? w + KP * 4 : nullptr, first, stop);
  });
  return out;
#else
  TORCH_CHECK(false, "small_linear: built without AVX512-BF16");
  return x;
#endif
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
// One block's int8 codes [K/2][64][2] times their group scales [K/G][64] (fp32, already rounded to bf16), rounded
// to bf16 into w [K/2][64][2]: the weights the bf16 walk then multiplies. The product of an 8-bit code and an
// 8-bit scale is exact in fp32, so the one rounding is the one the dense path's bf16 product makes.
static inline void dequantize_block(const int8_t* q, const float* s, int64_t KP, int64_t G, __m512i* w) {
  const __m512i lo_idx = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  const __m512i hi_idx = _mm512_setr_epi32(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15);
  for (int64_t kp = 0; kp < KP; ++kp) {
    const float* sg = s + ((2 * kp) / G) * 64;
    for (int c = 0; c < 4; ++c) {  // columns 16c .. 16c + 15, two inputs each: 32 codes
      const __m512 sc = _mm512_loadu_ps(sg + 16 * c);
      const int8_t* qc = q + kp * 128 + 32 * c;
      const __m512 lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)qc))),
                                      _mm512_permutexvar_ps(lo_idx, sc));
      const __m512 hi = _mm512_mul_ps(
          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(qc + 16)))),
          _mm512_permutexvar_ps(hi_idx, sc));
      _mm512_store_si512(w + kp * 4 + c, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
  }
}

// Up to 6 rows in one pass over a block: its codes dequantised in registers as the walk reads them, without the
// scratch (which one or two passes would write and read back for little). The weights are dequantize_block's, bit
// for bit.
template <int MT>
static inline void block_rows_int8(const int32_t* const* xr, const int8_t* q, const float* s, int64_t KP, int64_t G,
                                   uint16_t* const* outr, int64_t cols) {
  const __m512i lo_idx = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  const __m512i hi_idx = _mm512_setr_epi32(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15);
  __m512 acc[MT][4];
  for (int r = 0; r < MT; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  const int64_t group_pairs = G / 2;
  // Up to 3 rows, each group's scales are spread to the pair order once and held in registers; with more rows the
  // accumulators need those registers, and the spread is redone for each pair of inputs.
  constexpr bool hoist = MT <= 3;
  for (int64_t g0 = 0; g0 < KP; g0 += group_pairs, s += 64) {
    __m512 slo[hoist ? 4 : 1], shi[hoist ? 4 : 1];
    if constexpr (hoist) {
      for (int c = 0; c < 4; ++c) {
        const __m512 sc = _mm512_loadu_ps(s + 16 * c);
        slo[c] = _mm512_permutexvar_ps(lo_idx, sc);
        shi[c] = _mm512_permutexvar_ps(hi_idx, sc);
      }
    }
    for (int64_t kp = g0; kp < g0 + group_pairs; ++kp) {
      __m512bh w[4];
      for (int c = 0; c < 4; ++c) {
        const int8_t* qc = q + kp * 128 + 32 * c;
        __m512 sl, sh;
        if constexpr (hoist) {
          sl = slo[c];
          sh = shi[c];
        } else {
          const __m512 sc = _mm512_loadu_ps(s + 16 * c);
          sl = _mm512_permutexvar_ps(lo_idx, sc);
          sh = _mm512_permutexvar_ps(hi_idx, sc);
        }
        const __m512 lo = _mm512_mul_ps(
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)qc))), sl);
        const __m512 hi = _mm512_mul_ps(
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(qc + 16)))), sh);
        w[c] = _mm512_cvtne2ps_pbh(hi, lo);
      }
      for (int r = 0; r < MT; ++r) {
        const __m512bh a = (__m512bh)_mm512_set1_epi32(xr[r][kp]);
        for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], a, w[c]);
      }
    }
  }
  store_rows<MT>(acc, outr, cols);
}
#endif

// codes: [NB, K/2, 64, 2] int8 (pack_weight's order); scales [NB, K/G, 64] fp32; x [M, K] bf16; out [M, N] bf16.
// Each block is dequantised to bf16 once (into this thread's scratch, in L2), then walked like small_linear's.
torch::Tensor small_linear_int8(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, int64_t n, int64_t group) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && codes.scalar_type() == torch::kInt8 &&
                  scales.scalar_type() == torch::kFloat32,
              "small_linear_int8: x [M, K] bf16, int8 codes, fp32 scales");
  auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), NB = codes.size(0), KP = codes.size(1);
  TORCH_CHECK(K % 2 == 0 && KP * 2 == K && codes.size(2) == 64 && codes.size(3) == 2 && NB * 64 >= n &&
                  group % 2 == 0 && K % group == 0 && scales.size(0) == NB && scales.size(1) == K / group &&
                  scales.size(2) == 64,
              "small_linear_int8: codes [N/64, K/2, 64, 2] and scales [N/64, K/G, 64] for this x");
  auto out = torch::empty({M, n}, xc.options());
  const int32_t* xp = reinterpret_cast<const int32_t*>(xc.data_ptr<c10::BFloat16>());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>());
  const int8_t* qp = codes.data_ptr<int8_t>();
  const float* sp = scales.contiguous().data_ptr<float>();
  // Up to two passes (12 rows) dequantise in registers in each pass; from three the block is dequantised once into
  // the scratch and walked from there (measured: docs/performance.md, "Fidelity").
  if (M <= 12) {
    at::parallel_for(0, NB, 1, [=](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        const int8_t* qb = qp + b * KP * 128;
        const float* sb = sp + b * (K / group) * 64;
        const int64_t cols = std::min<int64_t>(64, n - b * 64);
        for (int64_t m0 = 0; m0 < M; m0 += 6) {
          const int mt = static_cast<int>(std::min<int64_t>(6, M - m0));
          const int32_t* xr[6];
          uint16_t* outr[6];
          pass_rows(xp, K, op, n, b, m0, mt, xr, outr);
          switch (mt) {
            case 6: block_rows_int8<6>(xr, qb, sb, KP, group, outr, cols); break;
            case 5: block_rows_int8<5>(xr, qb, sb, KP, group, outr, cols); break;
            case 4: block_rows_int8<4>(xr, qb, sb, KP, group, outr, cols); break;
            case 3: block_rows_int8<3>(xr, qb, sb, KP, group, outr, cols); break;
            case 2: block_rows_int8<2>(xr, qb, sb, KP, group, outr, cols); break;
            default: block_rows_int8<1>(xr, qb, sb, KP, group, outr, cols); break;
          }
        }
      }
    });
    return out;
  }
  at::parallel_for(0, NB, 1, [=](int64_t begin, int64_t end) {
    std::unique_ptr<__m512i[]> w(new __m512i[KP * 4]);  // one block in bf16: K x 64 x 2 bytes
    for (int64_t b = begin; b < end; ++b) {
      dequantize_block(qp + b * KP * 128, sp + b * (K / group) * 64, KP, group, w.get());
      block_passes(xp, K, M, op, n, b, w.get(), KP, nullptr, 0, passes_for(M));
    }
  });
  return out;
#else
  TORCH_CHECK(false, "small_linear_int8: built without AVX512-BF16");
  return x;
#endif
}
