// The fp32 small-batch linear (kvlab.model.fp32_linear): out [M, N] = x [M, K] times w [N, K] transposed, for the
// few rows of a decode step, reading the weight where the model keeps it (no packed copy).
//
// A decode step's product is a stream of the weights. Each output column's weights are a contiguous row of w, so
// four columns are four streams walked side by side in 8-lane vectors; each x row's vector is multiplied into
// the four columns' fp32 accumulators (FMA), three rows at a time (12 accumulators). The passes over one
// four-column block after the first read its weights from L1, so memory gives each weight once per call. Each
// accumulator's lanes are summed at the end of the block. Both cores split the four-column blocks.
#include "vec_prelude.h"
#include <immintrin.h>

static constexpr int64_t COLS = 4;  // output columns a tile sums side by side
static constexpr int64_t LANES = 8;

bool has_avx2_fma() {
#if defined(__AVX2__) && defined(__FMA__)
  return true;
#else
  return false;
#endif
}

#if defined(__AVX2__) && defined(__FMA__)
static inline float lane_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Rows x[0 .. R) times the COLS weight rows at w: out[r][0 .. COLS).
template <int R>
static inline void tile(const float* x, const float* w, int64_t K, float* out, int64_t ldo) {
  __m256 acc[R][COLS];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < COLS; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += LANES) {
    __m256 wv[COLS];
    for (int c = 0; c < COLS; ++c) wv[c] = _mm256_loadu_ps(w + c * K + k);
    for (int r = 0; r < R; ++r) {
      const __m256 a = _mm256_loadu_ps(x + r * K + k);
      for (int c = 0; c < COLS; ++c) acc[r][c] = _mm256_fmadd_ps(a, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < COLS; ++c) out[r * ldo + c] = lane_sum(acc[r][c]);
}
#endif

// x [M, K] fp32, w [N, K] fp32 (contiguous: the model's own weight), K a multiple of 8 and N of 4 -> [M, N].
torch::Tensor small_linear_fp32(torch::Tensor x_, torch::Tensor w) {
  TORCH_CHECK(x_.dim() == 2 && w.dim() == 2 && x_.size(1) == w.size(1), "small_linear_fp32: x [M, K], w [N, K]");
  TORCH_CHECK(x_.scalar_type() == torch::kFloat && w.scalar_type() == torch::kFloat && w.is_contiguous(),
              "small_linear_fp32: fp32 operands, the weight contiguous");
  TORCH_CHECK(w.size(1) % LANES == 0 && w.size(0) % COLS == 0, "small_linear_fp32: K a multiple of 8, N of 4");
#if defined(__AVX2__) && defined(__FMA__)
  auto x = x_.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto out = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N / COLS, 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const float* wb = wp + b * COLS * K;
      int64_t r0 = 0;
      for (; r0 + 3 <= M; r0 += 3) tile<3>(xp + r0 * K, wb, K, op + r0 * N + b * COLS, N);
      for (; r0 < M; ++r0) tile<1>(xp + r0 * K, wb, K, op + r0 * N + b * COLS, N);
    }
  });
  return out;
#else
  TORCH_CHECK(false, "small_linear_fp32: built without AVX2 and FMA (kvlab.model.fp32_linear never calls it then)");
  return torch::Tensor();
#endif
}
