// int8-w8a8's linear (kvlab.model.int8_linear): int8 activation codes times int8 weight codes, summed exactly in
// int32, then scaled back to fp32 as float(sum) * row_scale * column_scale -- the same operations, in the same
// order, as the torch path (torch._int_mm, then two multiplications), so the two agree bit for bit.
//
// Where the CPU has AVX2 and no VNNI, the exact way to multiply int8 is in int16: each pair of codes is widened
// (vpmovsxbw) and vpmaddwd multiplies two pairs and adds them into an int32 lane (|127 x 127 x 2| fits; the
// byte-wise vpmaddubsw saturates at int16, which is why it is not used). The weights stay int8 in memory -- a
// quarter of fp32's bytes, which is what a decode step is bound by -- and are widened in registers.
#include "vec_prelude.h"
#include <immintrin.h>
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
