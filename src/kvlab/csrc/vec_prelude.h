// Shared by kvlab's C++ op sets (kvlab.native.source puts it in place of its #include): picks at::vec's
// instruction set from what the compiler targets -- AVX512 or AVX2 where this CPU has them, the portable
// fallback elsewhere -- and gives every op set the same fp32 vector loads and stores of fp32 or bf16
// storage, and the packed linears the same way to share their work among threads. It comes before any ATen header.
#pragma once
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__) && defined(__FMA__)
#define CPU_CAPABILITY_AVX512
#define CPU_CAPABILITY AVX512
#elif defined(__AVX2__) && defined(__FMA__)
#define CPU_CAPABILITY_AVX2
#define CPU_CAPABILITY AVX2
#endif
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <limits>
#include <numeric>
#include <type_traits>

using Vec = at::vec::Vectorized<float>;
static constexpr int64_t W = Vec::size();

// W values at p widened to fp32, and W fp32 values stored rounded to the storage type (round to nearest even,
// as c10's conversion).
static inline Vec load_f(const float* p) { return Vec::loadu(p); }
static inline Vec load_f(const c10::BFloat16* p) {
  Vec out;
  at::vec::load_fp32_from_bf16(p, out);
  return out;
}
static inline void store_f(float* p, const Vec& v) { v.store(p); }
static inline void store_f(c10::BFloat16* p, const Vec& v) {
#if defined(CPU_CAPABILITY_AVX512)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), at::vec::cvtfp32_bf16(__m512(v)));
#else
  float tmp[W];
  v.store(tmp);
  for (int64_t i = 0; i < W; ++i) p[i] = static_cast<c10::BFloat16>(tmp[i]);
#endif
}

// The two fp8 storage types, for overloads that take either.
template <typename T>
inline constexpr bool is_fp8_v = std::is_same_v<T, c10::Float8_e4m3fn> || std::is_same_v<T, c10::Float8_e5m2>;

// fp8 storage (kv_cache_dtype fp8_e4m3 / fp8_e5m2, vLLM's scale of 1): loads widen exactly; stores round as c10's
// conversions do (to nearest even; e4m3 saturates at +-448, e5m2 overflows to inf; NaN stays NaN), the same integer
// steps lane by lane, so a kernel writes the very bytes KVStorage.write's `.to()` would (tested over every bf16).
#if defined(CPU_CAPABILITY_AVX512)
static inline Vec load_f(const c10::Float8_e5m2* p) {
  // e5m2 is the top byte of an fp16: shifted into place, the hardware widens it (subnormals, inf and NaN included).
  const __m256i h = _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 8);
  return _mm512_cvtph_ps(h);
}
static inline Vec load_f(const c10::Float8_e4m3fn* p) {
  // e4m3's exponent and mantissa placed in an fp16's read as the value times 2^(7 - 15); NaN (0x7F) has no fp16 twin.
  const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i mag = _mm256_and_si256(w, _mm256_set1_epi16(0x7F));
  const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8);
  const __m256i half = _mm256_or_si256(_mm256_slli_epi16(mag, 7), sign);
  const __m512 f = _mm512_mul_ps(_mm512_cvtph_ps(half), _mm512_set1_ps(256.f));
  const __mmask16 nan = _mm256_cmpeq_epi16_mask(mag, _mm256_set1_epi16(0x7F));
  return _mm512_mask_mov_ps(f, nan, _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN()));
}
// The constants of c10's fp8eXmY_from_fp32_value for either format.
struct E4M3 {
  static constexpr int shift = 20;                      // fp32 mantissa bits dropped
  static constexpr uint32_t rebias = (uint32_t)(7 - 127) << 23;
  static constexpr uint32_t normal_min = 121u << 23;    // 2^-6
  static constexpr uint32_t denorm = 141u << 23;        // adding it rounds a subnormal into the low bits
  static constexpr uint32_t overflow = 1087u << 20;     // 480
  static constexpr uint32_t saturated = 0x7E;           // 448
  static constexpr bool no_nan_by_carry = true;         // a carry into 0x7F (NaN) saturates instead
};
struct E5M2 {
  static constexpr int shift = 21;
  static constexpr uint32_t rebias = (uint32_t)(15 - 127) << 23;
  static constexpr uint32_t normal_min = 113u << 23;    // 2^-14
  static constexpr uint32_t denorm = 134u << 23;
  static constexpr uint32_t overflow = 143u << 23;      // 65536
  static constexpr uint32_t saturated = 0x7C;           // inf
  static constexpr bool no_nan_by_carry = false;
};
template <typename F>
static inline __m128i fp8_bits(const __m512 x) {
  const __m512i all = _mm512_castps_si512(x);
  const __m512i sign = _mm512_and_si512(all, _mm512_set1_epi32(static_cast<int>(0x80000000u)));
  const __m512i b = _mm512_xor_si512(all, sign);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, F::shift), _mm512_set1_epi32(1));
  const __m512i bias = _mm512_set1_epi32(static_cast<int>(F::rebias + ((1u << (F::shift - 1)) - 1)));
  __m512i normal = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(b, bias), odd), F::shift);
  if constexpr (F::no_nan_by_carry) normal = _mm512_min_epu32(normal, _mm512_set1_epi32(0x7E));
  const __m512i dm = _mm512_set1_epi32(static_cast<int>(F::denorm));
  const __m512i denormal = _mm512_sub_epi32(
      _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(b), _mm512_castsi512_ps(dm))), dm);
  __m512i r = _mm512_mask_blend_epi32(_mm512_cmplt_epu32_mask(b, _mm512_set1_epi32(F::normal_min)), normal, denormal);
  r = _mm512_mask_mov_epi32(r, _mm512_cmpge_epu32_mask(b, _mm512_set1_epi32(F::overflow)),
                            _mm512_set1_epi32(F::saturated));
  r = _mm512_mask_mov_epi32(r, _mm512_cmpgt_epu32_mask(b, _mm512_set1_epi32(0x7F800000)), _mm512_set1_epi32(0x7F));
  return _mm512_cvtepi32_epi8(_mm512_or_si512(r, _mm512_srli_epi32(sign, 24)));
}
static inline void store_f(c10::Float8_e4m3fn* p, const Vec& v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), fp8_bits<E4M3>(__m512(v)));
}
static inline void store_f(c10::Float8_e5m2* p, const Vec& v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), fp8_bits<E5M2>(__m512(v)));
}
#else
template <typename F8, typename = std::enable_if_t<is_fp8_v<F8>>>
static inline Vec load_f(const F8* p) {
  float tmp[W];
  for (int64_t i = 0; i < W; ++i) tmp[i] = static_cast<float>(p[i]);
  return Vec::loadu(tmp);
}
template <typename F8, typename = std::enable_if_t<is_fp8_v<F8>>>
static inline void store_f(F8* p, const Vec& v) {
  float tmp[W];
  v.store(tmp);
  for (int64_t i = 0; i < W; ++i) p[i] = static_cast<F8>(tmp[i]);
}
#endif

// The first of the M rows that pass `pass` of `passes` walks (the next pass's first ends it): the rows shared out
// evenly, 8 rows in two passes 4 and 4 rather than 6 and 2, whose short pass leaves its loads and the accumulators'
// latency exposed (docs/performance.md, "the passes over a packed block share the rows out evenly").
static inline int64_t pass_row(int64_t pass, int64_t passes, int64_t M) { return pass * M / passes; }

// A packed linear's work: NB blocks of output columns, each walked in `passes` passes of a few rows. Whole blocks go
// to the threads where they share out evenly; else each block is cut into runs of its passes, as many as make the
// runs share out (SmolLM2's 576 columns are 9 blocks of 64: on two threads one would do 5 while the other waited
// after 4). fn(block, first pass, end pass, last block) runs on the thread that owns the run; the last block is the
// last one that thread walks (the one after this block is worth prefetching only up to it).
template <typename F>
static inline void for_each_block_run(int64_t NB, int64_t passes, const F& fn) {
  const int64_t threads = at::get_num_threads();
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(passes, threads / std::gcd(NB, threads)));
  at::parallel_for(0, NB * parts, 1, [&](int64_t begin, int64_t end) {
    const int64_t last = (end - 1) / parts;
    for (int64_t u = begin; u < end; ++u) {
      const int64_t b = u / parts, part = u % parts;
      fn(b, part * passes / parts, (part + 1) * passes / parts, last);
    }
  });
}

// `count` cache lines from `line` prefetched into L2, spread evenly over `steps` calls of step(): count / steps
// lines a step and one more where a running remainder says (the division a step this replaces cost more than the
// prefetch saved).
struct SpreadPrefetch {
  const char* line;
  int64_t per, rem, steps, due = 0;
  SpreadPrefetch(const void* first, int64_t count, int64_t steps_)
      : line(static_cast<const char*>(first)), per(count / steps_), rem(count % steps_), steps(steps_) {}
  inline void step() {
    for (int64_t i = 0; i < per; ++i, line += 64) _mm_prefetch(line, _MM_HINT_T1);
    if ((due += rem) >= steps) {
      due -= steps;
      _mm_prefetch(line, _MM_HINT_T1);
      line += 64;
    }
  }
};
