// Compiled by kvlab.native.build (see attention.flash); one module per op set.
#include "vec_prelude.h"
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>
#include <immintrin.h>

#if defined(CPU_CAPABILITY_AVX512)
// Where a call packs (bf16) or copies (fp32) its context's K and V: kept from call to call on the calling thread,
// grown to the longest context seen (one layer's K and V of it). A fresh buffer each call paid its page faults
// each time: half the time of a decode step's attention over a 2,048-slot shared prefix (docs/performance.md).
static std::pair<void*, void*> scratch(size_t bytes_each) {
  static thread_local std::vector<__m512> k, v;  // 64-byte aligned: the packing stores are aligned
  const size_t n = (bytes_each + 63) / 64;
  if (k.size() < n) {
    k.resize(n);
    v.resize(n);
  }
  return {k.data(), v.data()};
}
#endif

bool has_bf16_dot() {
#if defined(__AVX512BF16__) && defined(CPU_CAPABILITY_AVX512)
  return true;
#else
  return false;
#endif
}

#if defined(__AVX512BF16__) && defined(CPU_CAPABILITY_AVX512)
static constexpr int64_t BQ = 8;   // queries per tile: 8 x 2 score vectors in registers
static constexpr int64_t BK = 32;  // keys per tile

// The BQ = 8 rows' horizontal reductions at once (op: max or add), where one per row would take 8 shuffles each:
// 128-bit chunks halved, then pairs of rows interleaved. Row r's result lands at lane lane_of(r).
template <typename Op>
static inline __m512 reduce_rows(const __m512 (&v)[BQ], Op op) {
  __m512 w[4];
  for (int i = 0; i < 4; ++i)
    w[i] = op(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44), _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  const __m512 u0 = op(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
  const __m512 u1 = op(_mm512_shuffle_f32x4(w[2], w[3], 0x88), _mm512_shuffle_f32x4(w[2], w[3], 0xDD));
  const __m512 c = op(_mm512_unpacklo_ps(u0, u1), _mm512_unpackhi_ps(u0, u1));
  return op(c, _mm512_permute_ps(c, 0x4E));
}
static constexpr int lane_of(int r) { return r < 4 ? 4 * r : 4 * (r - 4) + 1; }

// 16 values of a cache row as 16 bf16 (a bf16 cache as it is, an fp32 one rounded to nearest even).
static inline __m256i load16_bf16(const c10::BFloat16* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
static inline __m256i load16_bf16(const float* p) { return (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(p)); }

// 32 values of a cache row as 32 bf16, 16 pairs (as load16_bf16).
static inline __m512i load32_bf16(const c10::BFloat16* p) { return _mm512_loadu_si512(p); }
static inline __m512i load32_bf16(const float* p) {
  return (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(p + 16), _mm512_loadu_ps(p));
}

// An fp8 cache's values widened (exactly: every fp8 value is a bf16 one).
template <typename F8, typename = std::enable_if_t<is_fp8_v<F8>>>
static inline __m256i load16_bf16(const F8* p) {
  return (__m256i)_mm512_cvtneps_pbh(__m512(load_f(p)));
}
template <typename F8, typename = std::enable_if_t<is_fp8_v<F8>>>
static inline __m512i load32_bf16(const F8* p) {
  return (__m512i)_mm512_cvtne2ps_pbh(__m512(load_f(p + 16)), __m512(load_f(p)));
}

// r[i][c] = r[c][i] for 16 vectors of 16 dwords, in 64 shuffles (gathering the columns took ~4x longer).
static inline void transpose16(__m512i (&r)[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {  // lane L of t[2i]: r[2i][4L], r[2i+1][4L], r[2i][4L+1], r[2i+1][4L+1]
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // lane L of r[4i+k]: column 4L + k of rows 4i .. 4i+3
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int k = 0; k < 4; ++k) {  // column 4L + k: lane L of r[k], r[4+k], r[8+k], r[12+k]
    const __m512i a = _mm512_shuffle_i32x4(r[k], r[4 + k], 0x88), b = _mm512_shuffle_i32x4(r[k], r[4 + k], 0xDD);
    const __m512i c = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0x88);
    const __m512i d = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0xDD);
    t[k] = _mm512_shuffle_i32x4(a, c, 0x88);
    t[k + 4] = _mm512_shuffle_i32x4(b, d, 0x88);
    t[k + 8] = _mm512_shuffle_i32x4(a, c, 0xDD);
    t[k + 12] = _mm512_shuffle_i32x4(b, d, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// K and V of KV head j, key tile kb, packed: kt [D/2][BK][2], vt [BK/2][D][2]; zeros past the context.
template <int NV, typename CT>
static void pack_tile(const CT* kc, const CT* vc, const int64_t* slots, int64_t ctx, int64_t kb, int64_t j,
                      int64_t HKV, int32_t* kt, __m512i* vt) {
  constexpr int64_t D = 16 * NV, DP = D / 2;
  const __m256i zero = _mm256_setzero_si256();
  if constexpr (DP % 16 == 0) {
    // kt[t][s] = pair t of key s: 16 keys' 16 pairs at a time, loaded as rows and transposed in registers.
    for (int64_t h = 0; h < BK; h += 16)
      for (int64_t tb = 0; tb < DP / 16; ++tb) {
        __m512i r[16];
        for (int i = 0; i < 16; ++i) {
          const int64_t key = kb * BK + h + i;
          r[i] = key < ctx ? load32_bf16(kc + (slots[key] * HKV + j) * D + 32 * tb) : _mm512_setzero_si512();
        }
        transpose16(r);
        for (int i = 0; i < 16; ++i) _mm512_store_si512(kt + (16 * tb + i) * BK + h, r[i]);
      }
  } else {
    alignas(64) int32_t rows[BK * DP];  // the tile's K rows side by side, as pairs of bf16
    for (int64_t s = 0; s < BK; ++s) {
      const int64_t key = kb * BK + s;
      const CT* kr = key < ctx ? kc + (slots[key] * HKV + j) * D : nullptr;
      for (int c = 0; c < NV; ++c)
        _mm256_store_si256(reinterpret_cast<__m256i*>(rows + s * DP + 8 * c), kr ? load16_bf16(kr + 16 * c) : zero);
    }
    // kt[t][s] = rows[s][t]: one gather of 16 keys' pair t at a time (a row of 8 pairs is too short to transpose).
    const __m512i stride = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(DP));
    for (int64_t t = 0; t < DP; ++t)
      for (int64_t h = 0; h < BK; h += 16)
        _mm512_store_si512(kt + t * BK + h, _mm512_i32gather_epi32(stride, rows + h * DP + t, 4));
  }
  // vt[u][d] = (V[2u][d], V[2u+1][d]): two rows' 16 dimensions interleaved by one permute.
  const __m512i interleave = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7,
                                              38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  for (int64_t u = 0; u < BK / 2; ++u) {
    const int64_t k0 = kb * BK + 2 * u, k1 = k0 + 1;
    const CT* v0 = k0 < ctx ? vc + (slots[k0] * HKV + j) * D : nullptr;
    const CT* v1 = k1 < ctx ? vc + (slots[k1] * HKV + j) * D : nullptr;
    for (int c = 0; c < NV; ++c) {
      const __m512i a = _mm512_castsi256_si512(v0 ? load16_bf16(v0 + 16 * c) : zero);
      const __m512i b = _mm512_castsi256_si512(v1 ? load16_bf16(v1 + 16 * c) : zero);
      _mm512_store_si512(vt + u * NV + c, _mm512_permutex2var_epi16(a, interleave, b));
    }
  }
}

// How many key tiles ahead of its packing a thread fetches the cache rows it will pack. The packing is where a call
// reads the cache, and a decode step's shared prefix arrives cold (a long document's K and V of 30 layers do not
// stay in cache): fetched ahead, those reads overlap the packing's shuffles (docs/performance.md, "The shared
// prefix's reads fetched ahead").
static constexpr int64_t PACK_AHEAD = 4;

// One tile of BQ queries of one head (qr: each query's D/2 pairs of bf16) against key tiles 0 .. nkb-1 of its
// KV head; limit[r]: the last key row r sees. Writes the normalised output, fp32 [BQ][D], and each row's
// log-sum-exp of its scaled scores (lse[r]) where lse is given.
template <int NV>
static void query_tile(const int32_t* const* qr, const __m512i* kpack, const __m512i* vpack, int64_t nkb,
                       const int64_t* limit, float scale, float* out, float* lse) {
  constexpr int64_t D = 16 * NV, DP = D / 2;
  constexpr int RG = NV >= 4 ? 16 / NV : static_cast<int>(BQ);  // rows per PV pass: <= 16 accumulators
  const float neg_inf = -std::numeric_limits<float>::infinity();
  __m512 m = _mm512_set1_ps(neg_inf), l = _mm512_setzero_ps();  // each row's at lane_of(row)
  alignas(64) float alpha_row[16];
  alignas(64) float o[BQ][D];
  alignas(64) uint16_t p[BQ][BK];
  std::memset(o, 0, sizeof(o));
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i iota16 = _mm512_add_epi32(iota, _mm512_set1_epi32(16));
  const __m512 vscale = _mm512_set1_ps(scale), vneg_inf = _mm512_set1_ps(neg_inf);
  for (int64_t kb = 0; kb < nkb; ++kb) {
    const __m512i* kt = kpack + kb * DP * 2;  // DP pairs x 32 keys: two vectors a pair
    __m512 s[BQ][2];
    for (int r = 0; r < BQ; ++r) s[r][0] = s[r][1] = _mm512_setzero_ps();
    for (int64_t t = 0; t < DP; ++t) {
      const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kt + 2 * t);
      const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kt + 2 * t + 1);
      for (int r = 0; r < BQ; ++r) {
        const __m512bh a = (__m512bh)_mm512_set1_epi32(qr[r][t]);
        s[r][0] = _mm512_dpbf16_ps(s[r][0], a, k0);
        s[r][1] = _mm512_dpbf16_ps(s[r][1], a, k1);
      }
    }
    const int64_t base = kb * BK;
    __m512 rmax[BQ];
    for (int r = 0; r < BQ; ++r) {
      if (base + BK - 1 > limit[r]) {  // the causal edge (or the context's end) runs through this tile
        const __m512i lim = _mm512_set1_epi32(static_cast<int32_t>(limit[r] - base));
        s[r][0] = _mm512_mask_mov_ps(vneg_inf, _mm512_cmple_epi32_mask(iota, lim), s[r][0]);
        s[r][1] = _mm512_mask_mov_ps(vneg_inf, _mm512_cmple_epi32_mask(iota16, lim), s[r][1]);
      }
      rmax[r] = _mm512_max_ps(s[r][0], s[r][1]);
    }
    // The maxima of the unscaled scores, then scaled (scale > 0: the same order), so that each score's scaling
    // and shift are one fused multiply-subtract. Every row sees key 0, so its maximum is finite from the first
    // tile on (and alpha there exp(-inf) = 0).
    const auto vmax = [](__m512 a, __m512 b) { return _mm512_max_ps(a, b); };
    const __m512 mnew = _mm512_max_ps(m, _mm512_mul_ps(vscale, reduce_rows(rmax, vmax)));
    const __m512 alpha = Vec(_mm512_sub_ps(m, mnew)).exp_u20();
    m = mnew;
    alignas(64) float mrow[16];
    _mm512_store_ps(mrow, mnew);
    _mm512_store_ps(alpha_row, alpha);
    __m512 rsum[BQ];
    for (int r = 0; r < BQ; ++r) {
      const __m512 vm = _mm512_set1_ps(mrow[lane_of(r)]);
      const __m512 p0 = Vec(_mm512_fmsub_ps(s[r][0], vscale, vm)).exp_u20();
      const __m512 p1 = Vec(_mm512_fmsub_ps(s[r][1], vscale, vm)).exp_u20();
      rsum[r] = _mm512_add_ps(p0, p1);
      _mm512_store_si512(reinterpret_cast<__m512i*>(p[r]), (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
    }
    l = _mm512_fmadd_ps(l, alpha, reduce_rows(rsum, [](__m512 a, __m512 b) { return _mm512_add_ps(a, b); }));
    const __m512i* vt = vpack + kb * (BK / 2) * NV;  // 16 key pairs x D dimensions: NV vectors a pair
    for (int r0 = 0; r0 < BQ; r0 += RG) {
      __m512 acc[RG][NV];
      for (int rr = 0; rr < RG; ++rr) {
        const __m512 a = _mm512_set1_ps(alpha_row[lane_of(r0 + rr)]);
        for (int c = 0; c < NV; ++c) acc[rr][c] = _mm512_mul_ps(_mm512_load_ps(o[r0 + rr] + 16 * c), a);
      }
      for (int64_t t = 0; t < BK / 2; ++t) {
        __m512bh vv[NV];
        for (int c = 0; c < NV; ++c) vv[c] = (__m512bh)_mm512_loadu_si512(vt + t * NV + c);
        for (int rr = 0; rr < RG; ++rr) {
          const int32_t pair = reinterpret_cast<const int32_t*>(p[r0 + rr])[t];
          const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
          for (int c = 0; c < NV; ++c) acc[rr][c] = _mm512_dpbf16_ps(acc[rr][c], a, vv[c]);
        }
      }
      for (int rr = 0; rr < RG; ++rr)
        for (int c = 0; c < NV; ++c) _mm512_store_ps(o[r0 + rr] + 16 * c, acc[rr][c]);
    }
  }
  alignas(64) float lrow[16], mrow[16];
  _mm512_store_ps(lrow, l);
  _mm512_store_ps(mrow, m);
  for (int r = 0; r < BQ; ++r) {
    const __m512 inv = _mm512_set1_ps(1.f / lrow[lane_of(r)]);
    for (int c = 0; c < NV; ++c)
      _mm512_storeu_ps(out + r * D + 16 * c, _mm512_mul_ps(_mm512_load_ps(o[r] + 16 * c), inv));
    if (lse) lse[r] = mrow[lane_of(r)] + std::log(lrow[lane_of(r)]);
  }
}

// out [L, H, D] in bf16 (a prefill chunk) or fp32 (a shared prefix's partial result, merged later); lse [L, H]
// where given.
template <int NV, typename CT, typename OT>
static void flash_impl(const c10::BFloat16* q, const CT* kc, const CT* vc, const int64_t* slots, OT* out, float* lse,
                       int64_t L, int64_t H, int64_t HKV, int64_t ctx, int64_t start, float scale) {
  constexpr int64_t D = 16 * NV, DP = D / 2;
  const int64_t G = H / HKV, NKB = (ctx + BK - 1) / BK, NQT = (L + BQ - 1) / BQ;
  const int64_t tile = DP * BK * 2;  // bf16 values in one packed K (or V) tile
  const std::pair<void*, void*> packs = scratch(HKV * NKB * tile * sizeof(uint16_t));
  uint16_t* kp = static_cast<uint16_t*>(packs.first);
  uint16_t* vp = static_cast<uint16_t*>(packs.second);
  at::parallel_for(0, HKV * NKB, 1, [&](int64_t begin, int64_t end) {
    for (int64_t x = begin; x < end; ++x) {  // key tile-major: a slot's heads are copied one after another
      if (x % HKV == 0 && x + PACK_AHEAD * HKV < end) {  // every KV head's rows of the tile PACK_AHEAD on
        const int64_t ahead = x / HKV + PACK_AHEAD;
        for (int64_t key = ahead * BK; key < std::min(ctx, ahead * BK + BK); ++key) {
          const char* kr = reinterpret_cast<const char*>(kc + slots[key] * HKV * D);
          const char* vr = reinterpret_cast<const char*>(vc + slots[key] * HKV * D);
          for (int64_t b = 0; b < static_cast<int64_t>(HKV * D * sizeof(CT)); b += 64) {
            _mm_prefetch(kr + b, _MM_HINT_T0);
            _mm_prefetch(vr + b, _MM_HINT_T0);
          }
        }
      }
      const int64_t kb = x / HKV, j = x % HKV, at = (j * NKB + kb) * tile;
      pack_tile<NV, CT>(kc, vc, slots, ctx, kb, j, HKV, reinterpret_cast<int32_t*>(kp + at),
                        reinterpret_cast<__m512i*>(vp + at));
    }
  });
  const int32_t* qw = reinterpret_cast<const int32_t*>(q);
  at::parallel_for(0, H * NQT, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float res[BQ * D];
    float res_lse[BQ];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / NQT, i0 = (task % NQT) * BQ, rows = std::min(BQ, L - i0), j = h / G;
      const int32_t* qr[BQ];
      int64_t limit[BQ];
      for (int64_t r = 0; r < BQ; ++r) {
        const int64_t i = i0 + std::min(r, rows - 1);  // rows past the chunk repeat its last query, unused
        qr[r] = qw + (i * H + h) * DP;
        limit[r] = std::min(start + i, ctx - 1);
      }
      const int64_t nkb = limit[BQ - 1] / BK + 1;
      const __m512i* kt = reinterpret_cast<const __m512i*>(kp + j * NKB * tile);
      const __m512i* vt = reinterpret_cast<const __m512i*>(vp + j * NKB * tile);
      query_tile<NV>(qr, kt, vt, nkb, limit, scale, res, lse ? res_lse : nullptr);
      for (int64_t r = 0; r < rows; ++r) {
        OT* dst = out + ((i0 + r) * H + h) * D;
        for (int c = 0; c < NV; ++c) {
          const __m512 x = _mm512_loadu_ps(res + r * D + 16 * c);
          if constexpr (std::is_same_v<OT, float>)
            _mm512_storeu_ps(dst + 16 * c, x);
          else
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16 * c), (__m256i)_mm512_cvtneps_pbh(x));
        }
        if (lse) lse[(i0 + r) * H + h] = res_lse[r];
      }
    }
  });
}
#endif

#if defined(CPU_CAPABILITY_AVX512)
bool has_avx512() { return true; }

// fp32: the queries are the vector lanes and the keys broadcast, so that nothing is transposed but one tile of
// queries. A call first copies each KV head's context K and V into rows [ctx][D] of fp32 (the cache's slots are
// scattered; a bf16 cache is widened here, exactly), then each task walks 16 queries of one head over tiles of
// 16 keys: 16 score vectors (one a key, a lane a query), the online softmax lane-wise without a horizontal
// reduction, and the output accumulated transposed, [D][16 queries], in L1.
static constexpr int64_t FQ = 16;  // queries per tile: the lanes
static constexpr int64_t FK = 16;  // keys per tile: 16 score vectors

template <int NV, typename CT>
static void copy_rows_f32(const CT* cache, const int64_t* slots, int64_t ctx, int64_t HKV, int64_t j, int64_t k0,
                          int64_t k1, float* dst) {
  constexpr int64_t D = 16 * NV;
  for (int64_t key = k0; key < k1; ++key)
    for (int c = 0; c < NV; ++c)
      _mm512_storeu_ps(dst + key * D + 16 * c,
                       key < ctx ? __m512(load_f(cache + (slots[key] * HKV + j) * D + 16 * c)) : _mm512_setzero_ps());
}

// qt: the tile's queries transposed and scaled, [D][16]; kr, vr: the KV head's rows [nkeys rounded up][D];
// lane q sees keys 0 .. first + q. Leaves the softmax's state: o [D][16] the output transposed, not yet divided by
// the sum; mo, lo [16] each lane's maximum score and sum of exponentials relative to it.
template <int NV>
static void walk_tile_f32(const float* qt, const float* kr, const float* vr, int64_t nkeys, int64_t first, float* o,
                          float* mo, float* lo) {
  constexpr int64_t D = 16 * NV;
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 m = neg_inf, l = _mm512_setzero_ps();
  std::memset(o, 0, D * FQ * sizeof(float));
  for (int64_t k0 = 0; k0 < nkeys; k0 += FK) {
    const float* kt = kr + k0 * D;
    __m512 sc[FK];
    for (int s = 0; s < FK; ++s) sc[s] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; ++d) {
      const __m512 q = _mm512_load_ps(qt + d * FQ);
      for (int s = 0; s < FK; ++s) sc[s] = _mm512_fmadd_ps(_mm512_set1_ps(kt[s * D + d]), q, sc[s]);
    }
    // The causal edge, or the context's end (a tile of queries past it: every query sees the whole context), runs
    // through this tile.
    if (k0 + FK - 1 > first || k0 + FK > nkeys) {
      for (int s = 0; s < FK; ++s) {
        const int64_t key = k0 + s;
        // lane q sees this key when first + q >= key; keys past the walk are seen by no lane
        const int32_t from = key < nkeys ? static_cast<int32_t>(std::max<int64_t>(key - first, 0)) : 16;
        sc[s] = _mm512_mask_mov_ps(neg_inf, _mm512_cmpge_epi32_mask(lanes, _mm512_set1_epi32(from)), sc[s]);
      }
    }
    __m512 mx = sc[0];
    for (int s = 1; s < FK; ++s) mx = _mm512_max_ps(mx, sc[s]);
    const __m512 mnew = _mm512_max_ps(m, mx);  // finite from the first tile on: every lane sees key 0
    const __m512 alpha = Vec(_mm512_sub_ps(m, mnew)).exp_u20();
    m = mnew;
    __m512 sum = _mm512_setzero_ps();
    for (int s = 0; s < FK; ++s) {
      sc[s] = Vec(_mm512_sub_ps(sc[s], mnew)).exp_u20();
      sum = _mm512_add_ps(sum, sc[s]);
    }
    l = _mm512_fmadd_ps(l, alpha, sum);
    const float* vt = vr + k0 * D;
    for (int64_t d = 0; d < D; d += 4) {
      __m512 acc[4];
      for (int u = 0; u < 4; ++u) acc[u] = _mm512_mul_ps(_mm512_load_ps(o + (d + u) * FQ), alpha);
      for (int s = 0; s < FK; ++s)
        for (int u = 0; u < 4; ++u) acc[u] = _mm512_fmadd_ps(_mm512_set1_ps(vt[s * D + d + u]), sc[s], acc[u]);
      for (int u = 0; u < 4; ++u) _mm512_store_ps(o + (d + u) * FQ, acc[u]);
    }
  }
  _mm512_storeu_ps(mo, m);
  _mm512_storeu_ps(lo, l);
}

// K and V of a context's slots, copied into rows of fp32 per KV head: [HKV][ctx rounded up to FK][D], zeros past it.
template <int NV, typename CT>
static std::pair<float*, float*> context_rows_f32(const CT* kc, const CT* vc, const int64_t* slots, int64_t ctx,
                                                  int64_t HKV, int64_t rows) {
  constexpr int64_t D = 16 * NV;
  const int64_t chunks = rows / FK;
  const std::pair<void*, void*> bufs = scratch(HKV * rows * D * sizeof(float));
  float* kb = static_cast<float*>(bufs.first);
  float* vb = static_cast<float*>(bufs.second);
  at::parallel_for(0, HKV * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t x = begin; x < end; ++x) {  // key tile-major: a slot's heads are copied one after another
      const int64_t j = x % HKV, k0 = (x / HKV) * FK;
      copy_rows_f32<NV, CT>(kc, slots, ctx, HKV, j, k0, k0 + FK, kb + j * rows * D);
      copy_rows_f32<NV, CT>(vc, slots, ctx, HKV, j, k0, k0 + FK, vb + j * rows * D);
    }
  });
  return {kb, vb};
}

template <int NV, typename CT>
static void flash_f32_impl(const float* q, const CT* kc, const CT* vc, const int64_t* slots, float* out, float* lse,
                           int64_t L, int64_t H, int64_t HKV, int64_t ctx, int64_t start, float scale) {
  constexpr int64_t D = 16 * NV;
  const int64_t G = H / HKV, NQT = (L + FQ - 1) / FQ;
  const int64_t rows = (ctx + FK - 1) / FK * FK;
  const std::pair<float*, float*> bufs = context_rows_f32<NV, CT>(kc, vc, slots, ctx, HKV, rows);
  const float* kb = bufs.first;
  const float* vb = bufs.second;
  at::parallel_for(0, H * NQT, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float qt[D * FQ];
    alignas(64) float o[D * FQ];
    float m[FQ], l[FQ];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / NQT, i0 = (task % NQT) * FQ, n = std::min(FQ, L - i0), j = h / G;
      for (int64_t lane = 0; lane < FQ; ++lane) {
        const float* qr = q + ((i0 + std::min(lane, n - 1)) * H + h) * D;  // lanes past the chunk: unused
        for (int64_t d = 0; d < D; ++d) qt[d * FQ + lane] = qr[d] * scale;
      }
      const int64_t first = start + i0, nkeys = std::min(first + n, ctx);
      walk_tile_f32<NV>(qt, kb + j * rows * D, vb + j * rows * D, nkeys, first, o, m, l);
      for (int64_t lane = 0; lane < n; ++lane) {
        float* dst = out + ((i0 + lane) * H + h) * D;
        const float inv = 1.f / l[lane];
        for (int64_t d = 0; d < D; ++d) dst[d] = o[d * FQ + lane] * inv;
        if (lse) lse[(i0 + lane) * H + h] = m[lane] + std::log(l[lane]);
      }
    }
  });
}

#else
bool has_avx512() { return false; }
#endif

// One loop for each query dtype, head_dim / 16 and cache dtype; out in q's dtype or fp32, lse [L, H] or null.
template <typename QT, int NV, typename CT>
static void run_loop(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                     const torch::Tensor& slots, torch::Tensor& out, float* lse, int64_t start, float scale) {
  const int64_t L = q.size(0), H = q.size(1), HKV = k_cache.size(-2), ctx = slots.size(0);
  const CT* kc = k_cache.data_ptr<CT>();
  const CT* vc = v_cache.data_ptr<CT>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  if constexpr (std::is_same_v<QT, float>) {
#if defined(CPU_CAPABILITY_AVX512)
    flash_f32_impl<NV, CT>(q.data_ptr<float>(), kc, vc, sp, out.data_ptr<float>(), lse, L, H, HKV, ctx, start, scale);
    return;
#endif
  } else {
#if defined(__AVX512BF16__) && defined(CPU_CAPABILITY_AVX512)
    const c10::BFloat16* qp = q.data_ptr<c10::BFloat16>();
    if (out.scalar_type() == torch::kFloat32)
      flash_impl<NV, CT, float>(qp, kc, vc, sp, out.data_ptr<float>(), lse, L, H, HKV, ctx, start, scale);
    else
      flash_impl<NV, CT, c10::BFloat16>(qp, kc, vc, sp, out.data_ptr<c10::BFloat16>(), lse, L, H, HKV, ctx, start,
                                        scale);
    return;
#endif
  }
  TORCH_CHECK(false, "flash_prefill: this CPU's build lacks the loop for these queries (AVX-512, AVX512-BF16)");
}

template <typename QT, typename CT>
static void run_dim(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                    const torch::Tensor& slots, torch::Tensor& out, float* lse, int64_t start, float scale) {
  switch (q.size(2)) {
    case 16: run_loop<QT, 1, CT>(q, k_cache, v_cache, slots, out, lse, start, scale); break;
    case 32: run_loop<QT, 2, CT>(q, k_cache, v_cache, slots, out, lse, start, scale); break;
    case 64: run_loop<QT, 4, CT>(q, k_cache, v_cache, slots, out, lse, start, scale); break;
    case 128: run_loop<QT, 8, CT>(q, k_cache, v_cache, slots, out, lse, start, scale); break;
    default: TORCH_CHECK(false, "flash_prefill: head_dim must be 16, 32, 64 or 128");
  }
}

// Checks the arguments of either op, then runs the loop for their dtypes into out (and lse where given).
static void run_checked(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                        const torch::Tensor& slots, torch::Tensor& out, float* lse, int64_t start, double scale) {
  const bool qf = q.scalar_type() == torch::kFloat32;
  const auto ct = k_cache.scalar_type();
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && ct == v_cache.scalar_type(),
              "flash_prefill: contiguous K and V caches of one dtype");
  TORCH_CHECK(ct == torch::kFloat32 || ct == torch::kBFloat16 || ct == torch::kFloat8_e4m3fn ||
                  ct == torch::kFloat8_e5m2,
              "flash_prefill: float32, bfloat16 or fp8 (e4m3fn, e5m2) caches only");
  const int64_t L = q.size(0), H = q.size(1), D = q.size(2), HKV = k_cache.size(-2), ctx = slots.size(0);
  TORCH_CHECK(k_cache.size(-1) == D && H % HKV == 0, "flash_prefill: caches [..., Hkv, D], H a multiple of Hkv");
  TORCH_CHECK(L >= 1 && start >= 0 && start < ctx, "flash_prefill: queries after start < ctx");
  TORCH_CHECK(scale > 0, "flash_prefill: scale > 0");
  auto sc = slots.to(torch::kInt64).contiguous();
  const float scl = static_cast<float>(scale);
#define KVLAB_CACHE(CT)                                                                             \
  do {                                                                                              \
    if (qf) run_dim<float, CT>(q, k_cache, v_cache, sc, out, lse, start, scl);                      \
    else run_dim<c10::BFloat16, CT>(q, k_cache, v_cache, sc, out, lse, start, scl);                 \
  } while (0)
  if (ct == torch::kFloat32) KVLAB_CACHE(float);
  else if (ct == torch::kBFloat16) KVLAB_CACHE(c10::BFloat16);
  else if (ct == torch::kFloat8_e4m3fn) KVLAB_CACHE(c10::Float8_e4m3fn);
  else KVLAB_CACHE(c10::Float8_e5m2);
#undef KVLAB_CACHE
}

static torch::Tensor checked_queries(const torch::Tensor& q) {
  TORCH_CHECK(q.dim() == 3 && (q.scalar_type() == torch::kFloat32 || q.scalar_type() == torch::kBFloat16),
              "flash_prefill: q [L, H, D] in fp32 or bf16");
  return q.contiguous();
}

// q [L, H, D] fp32 or bf16; caches [..., Hkv, D] (NHD: a slot's heads contiguous) fp32, bf16 or fp8; slots [ctx], the
// context's slots in order; query i sees keys 0 .. start + i. Output [L, H, D] in q's dtype.
torch::Tensor flash_prefill(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots,
                            int64_t start, double scale) {
  auto qc = checked_queries(q);
  auto out = torch::empty_like(qc);
  run_checked(qc, k_cache, v_cache, slots, out, nullptr, start, scale);
  return out;
}

// Every query against every one of slots [P] (a prefix that rows share, each row one query): each query's
// normalised output [R, H, D] and log-sum-exp of its scaled scores [R, H], both fp32, for a merge with the
// rest of its context (paged_decode_after_prefix).
std::tuple<torch::Tensor, torch::Tensor> flash_prefix(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                                      torch::Tensor slots, double scale) {
  auto qc = checked_queries(q);
  auto out = torch::empty(qc.sizes(), qc.options().dtype(torch::kFloat32));
  auto lse = torch::empty({qc.size(0), qc.size(1)}, qc.options().dtype(torch::kFloat32));
  run_checked(qc, k_cache, v_cache, slots, out, lse.data_ptr<float>(), slots.size(0) - 1, scale);
  return {out, lse};
}
