// Shared by kvlab's C++ op sets (kvlab.native.source puts it in place of its #include): picks at::vec's
// instruction set from what the compiler targets -- AVX512 or AVX2 where this CPU has them, the portable
// fallback elsewhere -- and gives every op set the same fp32 vector loads and stores of fp32 or bf16
// storage. It comes before any ATen header.
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
