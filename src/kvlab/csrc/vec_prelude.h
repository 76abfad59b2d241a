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
#include <numeric>

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
