"""A compiled paged decode attention that reads K/V where they lie in the pool (opt-in).

The reference decode path gathers every request's whole context into a new ``[B, ctx, Hkv, D]`` tensor each
step (``index_select``) and runs SDPA on it. This kernel walks each request's block table instead and reads
each slot's K and V in place. One task per request walks its blocks front to back, each a contiguous run of
``block_size`` slots holding every KV head, which the hardware prefetcher streams (tasks per head, striding
through the same cache lines, measured slower once the cache is cold, as it is between layers); the inner
products run over ``head_dim`` as SIMD loops. Scores are kept in a small per-thread buffer, then
softmax and the weighted sum of V, all accumulated in fp32 whatever the storage dtype.

It is a small C++ op built with ``torch.utils.cpp_extension`` on first use and cached on disk by torch
(``TORCH_EXTENSIONS_DIR``); where no compiler (or ninja) exists, the engine falls back to the reference with
one log line. Queries in fp32 or bf16, caches in fp32 or bf16, the NHD layout; anything else, and any step
with attention capture on, takes the reference path. The build targets this CPU (``-march=native``), so the
module name carries a digest of the CPU's flags: a cache directory shared with another CPU never loads code
that machine cannot run.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

KERNEL_DTYPES = (torch.float32, torch.bfloat16)

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

// Widening loads: a bf16 value is the top half of an fp32 one, so a shift widens it exactly (and vectorises).
static inline float widen(float x) { return x; }
static inline float widen(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

template <typename QT, typename CT>
static void paged_decode_impl(const QT* qp, const CT* kp, const CT* vp, const int64_t* tp, const int64_t* lp,
                              QT* op, int64_t B, int64_t H, int64_t D, int64_t BS, int64_t HKV, int64_t MB,
                              float scale) {
  const int64_t G = H / HKV;
  const int64_t row = HKV * D;  // one slot: every KV head, contiguous (NHD)
  // One task per request: its blocks are read front to back, each a contiguous run of block_size slots with
  // all KV heads, which the hardware prefetcher streams; per-head tasks would stride through the same lines.
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(H * D), acc(H * D), scores, inv(H);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t len = lp[b];
      const int64_t* table = tp + b * MB;
      for (int64_t i = 0; i < H * D; ++i) qf[i] = widen(qp[b * H * D + i]) * scale;
      scores.resize(H * len);
      for (int64_t t0 = 0; t0 < len; t0 += BS) {
        const CT* k = kp + table[t0 / BS] * BS * row;
        const int64_t n = std::min(BS, len - t0);
        for (int64_t i = 0; i < n; ++i, k += row) {
          for (int64_t h = 0; h < H; ++h) {
            const float* qh = qf.data() + h * D;
            const CT* kh = k + (h / G) * D;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < D; ++d) dot += qh[d] * widen(kh[d]);
            scores[h * len + t0 + i] = dot;
          }
        }
      }
      for (int64_t h = 0; h < H; ++h) {
        float* s = scores.data() + h * len;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < len; ++t) m = s[t] > m ? s[t] : m;
        float total = 0.f;
        for (int64_t t = 0; t < len; ++t) {
          s[t] = std::exp(s[t] - m);
          total += s[t];
        }
        inv[h] = 1.f / total;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t0 = 0; t0 < len; t0 += BS) {
        const CT* v = vp + table[t0 / BS] * BS * row;
        const int64_t n = std::min(BS, len - t0);
        for (int64_t i = 0; i < n; ++i, v += row) {
          for (int64_t h = 0; h < H; ++h) {
            const float w = scores[h * len + t0 + i];
            const CT* vh = v + (h / G) * D;
            float* a = acc.data() + h * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) a[d] += w * widen(vh[d]);
          }
        }
      }
      for (int64_t h = 0; h < H; ++h)
        for (int64_t d = 0; d < D; ++d) op[(b * H + h) * D + d] = static_cast<QT>(acc[h * D + d] * inv[h]);
    }
  });
}

// q [B, H, D]; caches [num_blocks, block_size, Hkv, D] (NHD); tables [B, max_blocks]; lens [B] (int64).
// Query head h reads KV head h / (H / Hkv). Output in q's dtype.
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor lens, double scale) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_decode: contiguous caches");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "paged_decode: K and V caches of one dtype");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && q.size(2) == k_cache.size(3) && q.size(1) % k_cache.size(2) == 0,
              "paged_decode: q [B, H, D] and caches [blocks, block_size, Hkv, D] with H a multiple of Hkv");
  auto qc = q.contiguous();
  auto tables = block_tables.to(torch::kInt64).contiguous();
  auto lc = lens.to(torch::kInt64).contiguous();
  const int64_t B = qc.size(0), H = qc.size(1), D = qc.size(2);
  const int64_t BS = k_cache.size(1), HKV = k_cache.size(2), MB = tables.size(1);
  auto out = torch::empty_like(qc);
  const float sc = static_cast<float>(scale);
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lc.data_ptr<int64_t>();
#define KVLAB_RUN(QT, CT)                                                                                     \
  paged_decode_impl<QT, CT>(qc.data_ptr<QT>(), k_cache.data_ptr<CT>(), v_cache.data_ptr<CT>(), tp, lp,        \
                            out.data_ptr<QT>(), B, H, D, BS, HKV, MB, sc)
  const bool qf = qc.scalar_type() == torch::kFloat32, qb = qc.scalar_type() == torch::kBFloat16;
  const bool cf = k_cache.scalar_type() == torch::kFloat32, cb = k_cache.scalar_type() == torch::kBFloat16;
  if (qf && cf) KVLAB_RUN(float, float);
  else if (qf && cb) KVLAB_RUN(float, c10::BFloat16);
  else if (qb && cf) KVLAB_RUN(c10::BFloat16, float);
  else if (qb && cb) KVLAB_RUN(c10::BFloat16, c10::BFloat16);
  else TORCH_CHECK(false, "paged_decode: float32 or bfloat16 queries and caches only");
#undef KVLAB_RUN
  return out;
}
"""

PagedDecode = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


def _cpu_digest() -> str:
    """A short digest of what ``-march=native`` compiles for: the architecture and the CPU's feature flags."""
    try:
        flags = next(
            (line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith(("flags", "Features"))),
            "",
        )
    except OSError:
        flags = ""
    return hashlib.sha1(f"{platform.machine()} {flags}".encode()).hexdigest()[:10]


@functools.cache
def paged_decode_kernel() -> PagedDecode | None:
    """The compiled op, built once per process (and cached on disk by torch); None, after one log line, where
    it cannot be built."""
    try:
        from torch.utils import cpp_extension

        t0 = time.perf_counter()
        module = cpp_extension.load_inline(
            name=f"kvlab_paged_decode_v4_{_cpu_digest()}",
            cpp_sources=[_SOURCE],
            functions=["paged_decode"],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, no headers: the reference path serves
        log.warning("paged decode kernel unavailable (%s: %s); using the reference attention", type(exc).__name__, exc)
        return None
    seconds = time.perf_counter() - t0
    log.info("paged decode kernel ready in %.1f s (compiled, or loaded from torch's extension cache)", seconds)
    op: PagedDecode = module.paged_decode
    return op
