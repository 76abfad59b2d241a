// The fp32 small-batch linear (kvlab.model.fp32_linear): out [M, N] = x [M, K] times w [N, K] transposed, for the
// few rows of a decode step, reading the weight where the model keeps it (no packed copy).
//
// A decode step's product is a stream of the weights. Each output column's weights are a contiguous row of w, so
// four columns are four streams walked side by side in 8-lane vectors; each x row's vector is multiplied into
// the four columns' fp32 accumulators (FMA), up to three rows at once (12 accumulators, four weight vectors and
// one of x: the 16 AVX2 registers). The three-row passes over one four-column block read its weights from L1/L2,
// so memory gives each weight once per call. The four columns' sums are reduced across lanes together (hadd).
// Both cores split the four-column blocks.
#include "vec_prelude.h"
#include <immintrin.h>

bool has_avx2_fma() {
#if defined(__AVX2__) && defined(__FMA__)
  return true;
#else
  return false;
#endif
}

#if defined(__AVX2__) && defined(__FMA__)
static constexpr int64_t COLS = 4;  // output columns a tile sums side by side
static constexpr int MAX_TILE_ROWS = 3;

// The lane sums of four accumulators, in column order.
static inline __m128 lane_sums(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

// Rows x[0 .. R) times the four weight rows at w: out[r][0 .. 4). K8 = K rounded down to 8; the rest is scalar.
template <int R>
static inline void tile(const float* x, const float* w, int64_t K, float* out, int64_t ldo) {
  const int64_t K8 = K & ~int64_t{7};
  __m256 acc[R][COLS];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < COLS; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K8; k += 8) {
    const __m256 w0 = _mm256_loadu_ps(w + k), w1 = _mm256_loadu_ps(w + K + k);
    const __m256 w2 = _mm256_loadu_ps(w + 2 * K + k), w3 = _mm256_loadu_ps(w + 3 * K + k);
    for (int r = 0; r < R; ++r) {
      const __m256 a = _mm256_loadu_ps(x + r * K + k);
      acc[r][0] = _mm256_fmadd_ps(a, w0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(a, w1, acc[r][1]);
      acc[r][2] = _mm256_fmadd_ps(a, w2, acc[r][2]);
      acc[r][3] = _mm256_fmadd_ps(a, w3, acc[r][3]);
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(16) float sums[COLS];
    _mm_store_ps(sums, lane_sums(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
    for (int c = 0; c < COLS; ++c) {
      for (int64_t k = K8; k < K; ++k) sums[c] += x[r * K + k] * w[c * K + k];
      out[r * ldo + c] = sums[c];
    }
  }
}

// One output column past the last whole block of four (N not a multiple of 4), every row.
static inline void column(const float* x, const float* w, int64_t M, int64_t K, float* out, int64_t ldo) {
  for (int64_t r = 0; r < M; ++r) {
    float sum = 0.f;
    for (int64_t k = 0; k < K; ++k) sum += x[r * K + k] * w[k];
    out[r * ldo] = sum;
  }
}
#endif

// x [M, K] fp32, w [N, K] fp32 (contiguous: the model's own weight) -> [M, N].
torch::Tensor small_linear_fp32(torch::Tensor x_, torch::Tensor w) {
  TORCH_CHECK(x_.dim() == 2 && w.dim() == 2 && x_.size(1) == w.size(1), "small_linear_fp32: x [M, K], w [N, K]");
  TORCH_CHECK(x_.scalar_type() == torch::kFloat && w.scalar_type() == torch::kFloat && w.is_contiguous(),
              "small_linear_fp32: fp32 operands, the weight contiguous");
#if defined(__AVX2__) && defined(__FMA__)
  auto x = x_.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), NB = N / COLS;
  auto out = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, NB + (N % COLS ? 1 : 0), 8, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      if (b == NB) {  // the last N % 4 columns, one at a time
        for (int64_t c = NB * COLS; c < N; ++c) column(xp, wp + c * K, M, K, op + c, N);
        continue;
      }
      const float* wb = wp + b * COLS * K;
      for (int64_t r0 = 0; r0 < M; r0 += MAX_TILE_ROWS) {
        const float* xr = xp + r0 * K;
        float* o = op + r0 * N + b * COLS;
        switch (std::min<int64_t>(MAX_TILE_ROWS, M - r0)) {
          case 3: tile<3>(xr, wb, K, o, N); break;
          case 2: tile<2>(xr, wb, K, o, N); break;
          default: tile<1>(xr, wb, K, o, N); break;
        }
      }
    }
  });
  return out;
#else
  TORCH_CHECK(false, "small_linear_fp32: built without AVX2 and FMA (kvlab.model.fp32_linear never calls it then)");
  return torch::Tensor();
#endif
}
