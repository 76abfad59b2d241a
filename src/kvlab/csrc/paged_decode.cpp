// Compiled by kvlab.native.build (see attention.kernels); one module per op set.
#include "vec_prelude.h"
#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

static inline float hsum(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v);
}

// How many blocks ahead a walk fetches the K (or V) lines it will read: the blocks of a table are scattered, so
// the hardware prefetcher stops at every block's end (distance measured, docs/performance.md "Decode attention").
static constexpr int64_t AHEAD = 2;

// One KV head's values in each slot of a block (head_bytes at stride row), fetched into L2.
template <typename CT>
static inline void prefetch_head(const CT* first, int64_t BS, int64_t row, int64_t head_bytes) {
  for (int64_t i = 0; i < BS; ++i)
    for (int64_t b = 0; b < head_bytes; b += 64)
      __builtin_prefetch(reinterpret_cast<const char*>(first + i * row) + b, 0, 2);
}

// Each head's scores s[g * len + t] turned into exp(score - max) in place; inv: 1 / their sum, lse: log-sum-exp.
template <int GS>
static inline void softmax_rows(float* s, int64_t len, float* inv, float* lse) {
  for (int g = 0; g < GS; ++g) {
    float* sg = s + g * len;
    const float m = at::vec::reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, sg, len);
    at::vec::map([m](Vec x) { return (x - Vec(m)).exp(); }, sg, sg, len);
    const float sum = at::vec::reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, sg, len);
    inv[g] = 1.f / sum;
    lse[g] = m + std::log(sum);
  }
}

// The weighted sums acc normalised into out [GS][D]; with po and plse (the heads' attention over a prefix before
// these slots: normalised output [GS][D], log-sum-exp [GS]) the two merged by their log-sum-exp.
template <int NV, int GS>
static inline void finish(const Vec (&acc)[GS][NV], const float* inv, const float* lse, const float* po,
                          const float* plse, float* out) {
  constexpr int64_t D = NV * W;
  for (int g = 0; g < GS; ++g) {
    if (po == nullptr) {
      for (int c = 0; c < NV; ++c) (acc[g][c] * Vec(inv[g])).store(out + g * D + c * W);
      continue;
    }
    const float top = std::max(lse[g], plse[g]);
    const float own = std::exp(lse[g] - top), prefix = std::exp(plse[g] - top), norm = 1.f / (own + prefix);
    const Vec a(inv[g] * own * norm), b(prefix * norm);
    for (int c = 0; c < NV; ++c)
      at::vec::fmadd(acc[g][c], a, Vec::loadu(po + g * D + c * W) * b).store(out + g * D + c * W);
  }
}

// GS query heads of one KV head against its slots: scores, softmax, weighted sum of V, all in fp32. Each slot's K
// and V are loaded once for the GS heads (a GQA group shares them). NV (head_dim / W) and GS are compile-time
// constants so that the queries and the output accumulators live in registers across the walk. q: the queries
// times the scale, fp32 [GS][D]; s: room for GS x len scores.
template <int NV, int GS, typename CT>
static void attend_group(const float* __restrict q, const CT* __restrict kh, const CT* __restrict vh,
                         const int64_t* __restrict table, const int64_t len, const int64_t BS, const int64_t row,
                         float* __restrict s, float* __restrict out, const float* po, const float* plse) {
  constexpr int64_t D = NV * W;
  Vec qv[GS][NV];
  for (int g = 0; g < GS; ++g)
    for (int c = 0; c < NV; ++c) qv[g][c] = Vec::loadu(q + g * D + c * W);
  const int64_t blocks = (len + BS - 1) / BS;
  for (int64_t t0 = 0; t0 < len; t0 += BS) {
    const CT* k = kh + table[t0 / BS] * BS * row;
    const int64_t n = std::min(BS, len - t0);
    if (t0 / BS + AHEAD < blocks) prefetch_head(kh + table[t0 / BS + AHEAD] * BS * row, BS, row, D * sizeof(CT));
    for (int64_t i = 0; i < n; ++i, k += row) {
      Vec kv[NV];
      for (int c = 0; c < NV; ++c) kv[c] = load_f(k + c * W);
      for (int g = 0; g < GS; ++g) {
        Vec dot = qv[g][0] * kv[0];
        for (int c = 1; c < NV; ++c) dot = at::vec::fmadd(qv[g][c], kv[c], dot);
        s[g * len + t0 + i] = hsum(dot);
      }
    }
  }
  float inv[GS], lse[GS];
  softmax_rows<GS>(s, len, inv, lse);
  Vec acc[GS][NV];
  for (int g = 0; g < GS; ++g)
    for (int c = 0; c < NV; ++c) acc[g][c] = Vec(0.f);
  for (int64_t t0 = 0; t0 < len; t0 += BS) {
    const CT* v = vh + table[t0 / BS] * BS * row;
    const int64_t n = std::min(BS, len - t0);
    if (t0 / BS + AHEAD < blocks) prefetch_head(vh + table[t0 / BS + AHEAD] * BS * row, BS, row, D * sizeof(CT));
    for (int64_t i = 0; i < n; ++i, v += row) {
      Vec vv[NV];
      for (int c = 0; c < NV; ++c) vv[c] = load_f(v + c * W);
      for (int g = 0; g < GS; ++g) {
        const Vec w(s[g * len + t0 + i]);
        for (int c = 0; c < NV; ++c) acc[g][c] = at::vec::fmadd(w, vv[c], acc[g][c]);
      }
    }
  }
  finish<NV, GS>(acc, inv, lse, po, plse, out);
}

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
#define KVLAB_BF16_PAIRS 1
// Four vectors' sums within each 128-bit lane: lane 4j + i of the result sums v[i]'s lanes 4j .. 4j + 3.
static inline __m512 sums_of_four(const __m512* v) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(v[0], v[1]), _mm512_unpackhi_ps(v[0], v[1]));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(v[2], v[3]), _mm512_unpackhi_ps(v[2], v[3]));
  const __m512d x = _mm512_castps_pd(ab), y = _mm512_castps_pd(cd);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
}

// Sixteen vectors' sums, lane i the sum of vector i, from sums_of_four of each four (p[0]: vectors 0-3, ...).
static inline __m512 sums_of_sixteen(const __m512* p) {
  constexpr int even = _MM_SHUFFLE(2, 0, 2, 0), odd = _MM_SHUFFLE(3, 1, 3, 1);
  const __m512 pq = _mm512_add_ps(_mm512_shuffle_f32x4(p[0], p[1], even), _mm512_shuffle_f32x4(p[0], p[1], odd));
  const __m512 rs = _mm512_add_ps(_mm512_shuffle_f32x4(p[2], p[3], even), _mm512_shuffle_f32x4(p[2], p[3], odd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(pq, rs, even), _mm512_shuffle_f32x4(pq, rs, odd));
}

// One slot's dot products with the GS heads' queries, as vdpbf16ps leaves them: 16 lanes of partial sums each.
template <int P, int GS>
static inline void slot_dots(const __m512bh (&qb)[GS][P], const c10::BFloat16* k, __m512* dot, int stride) {
  __m512bh kb[P];
  for (int c = 0; c < P; ++c) kb[c] = (__m512bh)_mm512_loadu_si512(k + c * 32);
  for (int g = 0; g < GS; ++g) {
    __m512 d = _mm512_dpbf16_ps(_mm512_setzero_ps(), qb[g][0], kb[0]);
    for (int c = 1; c < P; ++c) d = _mm512_dpbf16_ps(d, qb[g][c], kb[c]);
    dot[g * stride] = d;
  }
}

// attend_group for bf16 queries over a bf16 cache, in the bf16 pairs AVX512-BF16 multiplies (vdpbf16ps: two
// products a lane, exact in fp32, added in fp32) instead of widening every value to fp32 first. Scores: the
// unscaled queries against the keys, times the scale after the sum; 16 slots' sums reduced by one shuffle tree
// instead of one horizontal sum a slot. Weights: rounded to bf16 before the product with V, as torch's bf16
// attention rounds them before its own; two slots a vdpbf16ps (their V interleaved, a weight pair broadcast).
// The tolerance this keeps against the fp32 reference is tests/engine/test_paged_kernel.py's for bf16 queries.
template <int NV, int GS>
static void attend_group_pairs(const c10::BFloat16* __restrict q, float scale, const c10::BFloat16* __restrict kh,
                               const c10::BFloat16* __restrict vh, const int64_t* __restrict table, const int64_t len,
                               const int64_t BS, const int64_t row, float* __restrict s,
                               c10::BFloat16* __restrict wb,
                               float* __restrict out, const float* po, const float* plse) {
  constexpr int P = NV / 2;  // 32 bf16 values a register
  constexpr int64_t D = NV * W;
  __m512bh qb[GS][P];
  for (int g = 0; g < GS; ++g)
    for (int c = 0; c < P; ++c) qb[g][c] = (__m512bh)_mm512_loadu_si512(q + g * D + c * 32);
  const __m512 vscale = _mm512_set1_ps(scale);
  const int64_t blocks = (len + BS - 1) / BS;
  for (int64_t t0 = 0; t0 < len; t0 += BS) {
    const c10::BFloat16* k = kh + table[t0 / BS] * BS * row;
    const int64_t n = std::min(BS, len - t0);
    if (t0 / BS + AHEAD < blocks) prefetch_head(kh + table[t0 / BS + AHEAD] * BS * row, BS, row, D * 2);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
      __m512 part[GS][4];
      for (int quad = 0; quad < 4; ++quad) {
        __m512 dot[GS][4];
        for (int j = 0; j < 4; ++j, k += row) slot_dots<P, GS>(qb, k, &dot[0][j], 4);
        for (int g = 0; g < GS; ++g) part[g][quad] = sums_of_four(dot[g]);
      }
      for (int g = 0; g < GS; ++g)
        _mm512_storeu_ps(s + g * len + t0 + i, _mm512_mul_ps(sums_of_sixteen(part[g]), vscale));
    }
    for (; i < n; ++i, k += row) {
      __m512 dot[GS];
      slot_dots<P, GS>(qb, k, dot, 1);
      for (int g = 0; g < GS; ++g) s[g * len + t0 + i] = _mm512_reduce_add_ps(dot[g]) * scale;
    }
  }
  float inv[GS], lse[GS];
  softmax_rows<GS>(s, len, inv, lse);
  int64_t t = 0;  // every head's weights at once: s and wb are both [GS][len]
  for (; t + W <= GS * len; t += W) store_f(wb + t, Vec::loadu(s + t));
  for (; t < GS * len; ++t) wb[t] = c10::BFloat16(s[t]);
  // Slot pairs within a block: lo's lane 4L + j gathers dimension 8L + j of a register's 32, hi's 8L + 4 + j.
  __m512 lo[GS][P], hi[GS][P];
  for (int g = 0; g < GS; ++g)
    for (int c = 0; c < P; ++c) lo[g][c] = hi[g][c] = _mm512_setzero_ps();
  for (int64_t t0 = 0; t0 < len; t0 += BS) {
    const c10::BFloat16* v = vh + table[t0 / BS] * BS * row;
    const int64_t n = std::min(BS, len - t0);
    if (t0 / BS + AHEAD < blocks) prefetch_head(vh + table[t0 / BS + AHEAD] * BS * row, BS, row, D * 2);
    for (int64_t i = 0; i < n; i += 2, v += 2 * row) {
      const bool alone = i + 1 == n;  // a block's odd last slot: paired with a zero weight and zero values
      __m512i a[P], b[P];
      for (int c = 0; c < P; ++c) {
        const __m512i x = _mm512_loadu_si512(v + c * 32);
        const __m512i y = alone ? _mm512_setzero_si512() : _mm512_loadu_si512(v + row + c * 32);
        a[c] = _mm512_unpacklo_epi16(x, y);
        b[c] = _mm512_unpackhi_epi16(x, y);
      }
      for (int g = 0; g < GS; ++g) {
        const c10::BFloat16* w = wb + g * len + t0 + i;
        const uint32_t pair = alone ? w[0].x : (uint32_t(w[1].x) << 16 | w[0].x);
        const __m512bh wp = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
        for (int c = 0; c < P; ++c) {
          lo[g][c] = _mm512_dpbf16_ps(lo[g][c], wp, (__m512bh)a[c]);
          hi[g][c] = _mm512_dpbf16_ps(hi[g][c], wp, (__m512bh)b[c]);
        }
      }
    }
  }
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  Vec acc[GS][NV];
  for (int g = 0; g < GS; ++g)
    for (int c = 0; c < P; ++c) {
      acc[g][2 * c] = Vec(_mm512_permutex2var_ps(lo[g][c], first, hi[g][c]));
      acc[g][2 * c + 1] = Vec(_mm512_permutex2var_ps(lo[g][c], second, hi[g][c]));
    }
  finish<NV, GS>(acc, inv, lse, po, plse, out);
}
#endif

// The heads of a GQA group taken together: as many as keep queries and accumulators in registers (GS x NV <= 16).
static inline int group_size(int64_t G, int NV) {
  for (int gs = 4; gs > 1; --gs)
    if (G % gs == 0 && gs * NV <= 16) return gs;
  return 1;
}

static inline void prefetch_bytes(const void* p, int64_t n) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < n; i += 64) __builtin_prefetch(c + i, 0, 2);
}

// The bf16 pairs path serves bf16 queries over a bf16 cache whose head_dim fills whole 32-value registers.
template <int NV, typename QT, typename CT>
inline constexpr bool kPairs =
    std::is_same_v<QT, c10::BFloat16> && std::is_same_v<CT, c10::BFloat16> && NV % 2 == 0;

// pop, plp: the rows' attention over a prefix before their tables' slots ([B, H, D] and [B, H], fp32), merged
// with theirs; null: none.
template <int NV, typename QT, typename CT>
static void paged_decode_impl(const QT* qp, const CT* kp, const CT* vp, const int64_t* tp, const int64_t* lp,
                              QT* op, const int64_t B, const int64_t H, const int64_t BS, const int64_t HKV,
                              const int64_t MB, const float scale, const float* pop, const float* plp) {
  constexpr int64_t D = NV * W;
  const int64_t G = H / HKV;
  const int64_t row = HKV * D;  // one slot: every KV head, contiguous (NHD)
  // One task per request: the first head's walk brings the request's blocks into this core's cache, where the
  // other heads find them (a request's K and V at SmolLM2's shape are ~0.2 MB in fp32).
  const int GS = group_size(G, NV);
  const int64_t steps = H / GS;  // head groups walked per request
  at::parallel_for(0, B, 1, [=](int64_t begin, int64_t end) {
    std::vector<float> qf(GS * D), scores, out(GS * D);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t len = lp[b];
      scores.resize(GS * len + (GS * len + 1) / 2);  // the scores, then (pairs path) their bf16 weights
      // While this request's heads compute, the next request's first AHEAD blocks are fetched into cache, a
      // share per head group; each walk then fetches its own blocks AHEAD of where it reads.
      const int64_t next_blocks = b + 1 < end ? std::min((lp[b + 1] + BS - 1) / BS, AHEAD) : 0;
      for (int64_t st = 0; st < steps; ++st) {
        for (int64_t nb = st * next_blocks / steps; nb < (st + 1) * next_blocks / steps; ++nb) {
          const int64_t block = tp[(b + 1) * MB + nb];
          prefetch_bytes(kp + block * BS * row, BS * row * sizeof(CT));
          prefetch_bytes(vp + block * BS * row, BS * row * sizeof(CT));
        }
        const int64_t h0 = st * GS;  // GS consecutive query heads, all of KV head h0 / G
        const QT* qh = qp + (b * H + h0) * D;
        const int64_t j = h0 / G;
        const CT* kj = kp + j * D;
        const CT* vj = vp + j * D;
        const int64_t* tb = tp + b * MB;
        const float* po = pop ? pop + (b * H + h0) * D : nullptr;
        const float* pl = plp ? plp + b * H + h0 : nullptr;
        float* s = scores.data();
        float* o = out.data();
#if defined(KVLAB_BF16_PAIRS)
        if constexpr (kPairs<NV, QT, CT>) {
          auto* wb = reinterpret_cast<c10::BFloat16*>(s + GS * len);
          switch (GS) {
            case 4: attend_group_pairs<NV, 4>(qh, scale, kj, vj, tb, len, BS, row, s, wb, o, po, pl); break;
            case 3: attend_group_pairs<NV, 3>(qh, scale, kj, vj, tb, len, BS, row, s, wb, o, po, pl); break;
            case 2: attend_group_pairs<NV, 2>(qh, scale, kj, vj, tb, len, BS, row, s, wb, o, po, pl); break;
            default: attend_group_pairs<NV, 1>(qh, scale, kj, vj, tb, len, BS, row, s, wb, o, po, pl); break;
          }
        } else
#endif
        {
          for (int64_t d = 0; d < GS * D; ++d) qf[d] = static_cast<float>(qh[d]) * scale;
          switch (GS) {
            case 4: attend_group<NV, 4, CT>(qf.data(), kj, vj, tb, len, BS, row, s, o, po, pl); break;
            case 3: attend_group<NV, 3, CT>(qf.data(), kj, vj, tb, len, BS, row, s, o, po, pl); break;
            case 2: attend_group<NV, 2, CT>(qf.data(), kj, vj, tb, len, BS, row, s, o, po, pl); break;
            default: attend_group<NV, 1, CT>(qf.data(), kj, vj, tb, len, BS, row, s, o, po, pl); break;
          }
        }
        QT* oh = op + (b * H + h0) * D;
        for (int64_t d = 0; d < GS * D; ++d) oh[d] = static_cast<QT>(out[d]);
      }
    }
  });
}

// Both ops; prefix_out and prefix_lse undefined: no prefix.
static torch::Tensor run(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                         const torch::Tensor& block_tables, const torch::Tensor& lens, double scale,
                         const torch::Tensor& prefix_out, const torch::Tensor& prefix_lse) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_decode: contiguous caches");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "paged_decode: K and V caches of one dtype");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && q.size(2) == k_cache.size(3) && q.size(1) % k_cache.size(2) == 0,
              "paged_decode: q [B, H, D] and caches [blocks, block_size, Hkv, D] with H a multiple of Hkv");
  TORCH_CHECK(q.size(2) % W == 0, "paged_decode: head_dim a multiple of ", W);
  auto qc = q.contiguous();
  auto tables = block_tables.to(torch::kInt64).contiguous();
  auto lc = lens.to(torch::kInt64).contiguous();
  const int64_t B = qc.size(0), H = qc.size(1), D = qc.size(2);
  const int64_t BS = k_cache.size(1), HKV = k_cache.size(2), MB = tables.size(1);
  auto out = torch::empty_like(qc);
  const float sc = static_cast<float>(scale);
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lc.data_ptr<int64_t>();
  const float* pop = prefix_out.defined() ? prefix_out.data_ptr<float>() : nullptr;
  const float* plp = prefix_lse.defined() ? prefix_lse.data_ptr<float>() : nullptr;
  for (int64_t b = 0; pop && b < lc.size(0); ++b)
    TORCH_CHECK(lp[b] >= 1, "paged_decode_after_prefix: every row reads at least one slot after the prefix");
#define KVLAB_NV(NV, QT, CT)                                                                              \
  case NV:                                                                                                \
    paged_decode_impl<NV, QT, CT>(qc.data_ptr<QT>(), k_cache.data_ptr<CT>(), v_cache.data_ptr<CT>(), tp, lp, \
                                  out.data_ptr<QT>(), B, H, BS, HKV, MB, sc, pop, plp);                             \
    break;
#define KVLAB_RUN(QT, CT)                                                                                 \
  do { switch (D / W) {                                                                                        \
    KVLAB_NV(1, QT, CT) KVLAB_NV(2, QT, CT) KVLAB_NV(4, QT, CT) KVLAB_NV(8, QT, CT) KVLAB_NV(16, QT, CT)   \
    default: TORCH_CHECK(false, "paged_decode: head_dim / ", W, " must be 1, 2, 4, 8 or 16");             \
  } } while (0)
  const bool qf = qc.scalar_type() == torch::kFloat32, qb = qc.scalar_type() == torch::kBFloat16;
  const auto ct = k_cache.scalar_type();
  TORCH_CHECK(qf || qb, "paged_decode: float32 or bfloat16 queries only");
#define KVLAB_CACHE(CT)                       \
  do {                                        \
    if (qf) KVLAB_RUN(float, CT);             \
    else KVLAB_RUN(c10::BFloat16, CT);        \
  } while (0)
  if (ct == torch::kFloat32) KVLAB_CACHE(float);
  else if (ct == torch::kBFloat16) KVLAB_CACHE(c10::BFloat16);
  else if (ct == torch::kFloat8_e4m3fn) KVLAB_CACHE(c10::Float8_e4m3fn);
  else if (ct == torch::kFloat8_e5m2) KVLAB_CACHE(c10::Float8_e5m2);
  else TORCH_CHECK(false, "paged_decode: float32, bfloat16 or fp8 (e4m3fn, e5m2) caches only");
#undef KVLAB_CACHE
#undef KVLAB_RUN
#undef KVLAB_NV
  return out;
}

// q [B, H, D]; caches [num_blocks, block_size, Hkv, D] (NHD); tables [B, max_blocks]; lens [B] (int64).
// Query head h reads KV head h / (H / Hkv). Output in q's dtype.
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor lens, double scale) {
  return run(q, k_cache, v_cache, block_tables, lens, scale, torch::Tensor(), torch::Tensor());
}

// As paged_decode over each row's slots after a prefix all rows share, merged with the rows' attention over that
// prefix: prefix_out [B, H, D] (normalised) and prefix_lse [B, H], fp32 (flash_prefix's result).
torch::Tensor paged_decode_after_prefix(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                        torch::Tensor block_tables, torch::Tensor lens, double scale,
                                        torch::Tensor prefix_out, torch::Tensor prefix_lse) {
  TORCH_CHECK(prefix_out.scalar_type() == torch::kFloat32 && prefix_lse.scalar_type() == torch::kFloat32 &&
                  prefix_out.sizes() == q.sizes() && prefix_lse.dim() == 2 && prefix_lse.size(0) == q.size(0) &&
                  prefix_lse.size(1) == q.size(1),
              "paged_decode_after_prefix: prefix_out [B, H, D] and prefix_lse [B, H] in fp32");
  return run(q, k_cache, v_cache, block_tables, lens, scale, prefix_out.contiguous(), prefix_lse.contiguous());
}

// One token's n values rounded into an fp8 cache row (as `.to()` rounds them: vec_prelude.h's store_f).
template <typename ST, typename CT>
static inline void round_row(CT* dst, const ST* src, int64_t n) {
  int64_t i = 0;
  for (; i + W <= n; i += W) store_f(dst + i, load_f(src + i));
  for (; i < n; ++i) dst[i] = static_cast<CT>(static_cast<float>(src[i]));
}

template <typename ST, typename CT>
static void write_rounded(const torch::Tensor& k_cache, const torch::Tensor& v_cache, const int64_t* sp,
                          const torch::Tensor& k, const torch::Tensor& v) {
  const int64_t T = k.size(0), n = k.size(1) * k.size(2), ks = k.stride(0), vs = v.stride(0);
  CT* kc = k_cache.data_ptr<CT>();
  CT* vc = v_cache.data_ptr<CT>();
  const ST* kp = k.data_ptr<ST>();
  const ST* vp = v.data_ptr<ST>();
  // As kv_write's copy, a decode step's few rows stay on the calling thread; rounding costs more a value than a
  // copy, so a task takes fewer of them (64K values against the copy's 256 KB).
  at::parallel_for(0, T, std::max<int64_t>(1, (1 << 16) / (2 * n)), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      round_row(kc + sp[t] * n, kp + t * ks, n);
      round_row(vc + sp[t] * n, vp + t * vs, n);
    }
  });
}

// K and V of T new tokens, [T, Hkv, D] each (rows at any stride, a row's heads contiguous, as the fused projection's
// views are), stored at their slots of one layer's caches [num_blocks, block_size, Hkv, D] (NHD, contiguous):
// KVStorage.write's two index_copy_ calls in one. The caches are in k's dtype, or fp8 (k and v fp32 or bf16, rounded
// on the way in). Every slot is checked before anything is written, so a bad one raises and leaves the caches as
// they were.
void kv_write(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots, torch::Tensor k, torch::Tensor v) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous(),
              "kv_write: contiguous K and V caches [blocks, block_size, Hkv, D] of one shape");
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.size(1) == k_cache.size(2) && k.size(2) == k_cache.size(3),
              "kv_write: k and v [T, Hkv, D] with the caches' Hkv and D");
  const auto ct = k_cache.scalar_type(), st = k.scalar_type();
  const bool fp8 = ct == torch::kFloat8_e4m3fn || ct == torch::kFloat8_e5m2;
  TORCH_CHECK(v.scalar_type() == st && v_cache.scalar_type() == ct &&
                  (st == ct || (fp8 && (st == torch::kFloat32 || st == torch::kBFloat16))),
              "kv_write: k and v in the caches' dtype, or fp32 / bf16 into fp8 caches");
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == k.size(2) && v.stride(2) == 1 && v.stride(1) == v.size(2),
              "kv_write: each token's heads contiguous in k and v");
  TORCH_CHECK(slots.dim() == 1 && slots.scalar_type() == torch::kInt64 && slots.size(0) == k.size(0),
              "kv_write: slots [T] (int64), one a token");
  const auto sc = slots.contiguous();
  const int64_t T = k.size(0), nslots = k_cache.size(0) * k_cache.size(1);
  const int64_t* sp = sc.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < nslots, "kv_write: slot ", sp[t], " of token ", t, " outside [0, ", nslots, ")");
  if (st != ct) {
#define KVLAB_ROUND(ST)                                                                      \
  if (ct == torch::kFloat8_e4m3fn) write_rounded<ST, c10::Float8_e4m3fn>(k_cache, v_cache, sp, k, v); \
  else write_rounded<ST, c10::Float8_e5m2>(k_cache, v_cache, sp, k, v);
    if (st == torch::kFloat32) { KVLAB_ROUND(float) }
    else { KVLAB_ROUND(c10::BFloat16) }
#undef KVLAB_ROUND
    return;
  }
  const int64_t es = k.element_size(), bytes = k.size(1) * k.size(2) * es;
  const int64_t ks = k.stride(0) * es, vs = v.stride(0) * es;
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  // A decode step's few rows are copied by the calling thread: waking the pool would cost more than the copy.
  at::parallel_for(0, T, std::max<int64_t>(1, (1 << 18) / (2 * bytes)), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      std::memcpy(kc + sp[t] * bytes, kp + t * ks, bytes);
      std::memcpy(vc + sp[t] * bytes, vp + t * vs, bytes);
    }
  });
}
