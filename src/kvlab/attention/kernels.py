"""A compiled paged decode attention that reads K/V where they lie in the pool (opt-in).

The reference decode path gathers every request's whole context into a new ``[B, ctx, Hkv, D]`` tensor each
step (``index_select``) and runs SDPA on it. This kernel walks each request's block table instead and reads
each slot's K and V in place: one pass over the context per (request, head), scores kept in a small buffer,
then the softmax and the weighted sum of V. It is a small C++ op built with ``torch.utils.cpp_extension`` on
first use and cached on disk by torch (``TORCH_EXTENSIONS_DIR``); where no compiler (or ninja) exists, the
engine falls back to the reference with one log line. fp32 and the NHD layout only; everything else, and any
step with attention capture on, takes the reference path.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

_SOURCE = r"""
#include <torch/extension.h>
#include <cmath>
#include <limits>
#include <vector>

// q [B, H, D]; caches [num_blocks, block_size, Hkv, D] (NHD); tables [B, max_blocks]; lens [B]. All fp32
// except the int64 tables and lens. Query head h reads KV head h / (H / Hkv) (GQA, MQA).
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor lens, double scale) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && k_cache.scalar_type() == torch::kFloat32 &&
              v_cache.scalar_type() == torch::kFloat32, "paged_decode: float32 only");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_decode: contiguous caches");
  auto qc = q.contiguous();
  auto tables = block_tables.contiguous();
  auto lc = lens.contiguous();
  const int64_t B = qc.size(0), H = qc.size(1), D = qc.size(2);
  const int64_t BS = k_cache.size(1), HKV = k_cache.size(2), MB = tables.size(1);
  const int64_t G = H / HKV;
  auto out = torch::empty_like(qc);
  const float* qp = qc.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lc.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      const float* qv = qp + (b * H + h) * D;
      const int64_t kvh = h / G;
      const int64_t len = lp[b];
      std::vector<float> s(len);
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t t = 0; t < len; ++t) {
        const float* kv = kp + ((tp[b * MB + t / BS] * BS + t % BS) * HKV + kvh) * D;
        float dot = 0.f;
        for (int64_t d = 0; d < D; ++d) dot += qv[d] * kv[d];
        s[t] = dot * sc;
        m = s[t] > m ? s[t] : m;
      }
      float total = 0.f;
      for (int64_t t = 0; t < len; ++t) { s[t] = std::exp(s[t] - m); total += s[t]; }
      float* o = op + (b * H + h) * D;
      for (int64_t d = 0; d < D; ++d) o[d] = 0.f;
      for (int64_t t = 0; t < len; ++t) {
        const float* vv = vp + ((tp[b * MB + t / BS] * BS + t % BS) * HKV + kvh) * D;
        const float w = s[t] / total;
        for (int64_t d = 0; d < D; ++d) o[d] += w * vv[d];
      }
    }
  }
  return out;
}
"""

PagedDecode = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


@functools.cache
def paged_decode_kernel() -> PagedDecode | None:
    """The compiled op, built once per process (and cached on disk by torch); None, after one log line, where
    it cannot be built."""
    try:
        from torch.utils import cpp_extension

        t0 = time.perf_counter()
        module = cpp_extension.load_inline(
            name="kvlab_paged_decode_v1",
            cpp_sources=[_SOURCE],
            functions=["paged_decode"],
            extra_cflags=["-O3", "-fopenmp"],
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
