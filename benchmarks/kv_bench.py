"""Micro-benchmarks of the paged KV cache manager (pure Python, no model).

    .venv/bin/python benchmarks/kv_bench.py [--quick]

1. allocate / append / free throughput, without and with a shared system prompt;
2. prefix lookup time against prompt length: it should grow linearly (constant time per block);
3. a pool holding 10,000 live requests at once, with token and with block prefix granularity;
4. storage writes and gathers in both layouts.
"""

from __future__ import annotations

import argparse
import gc
import random
import time

import torch

from kvlab.config import CacheConfig
from kvlab.kv import KVCacheManager, KVStorage, check_invariants

BS = 16


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def throughput(num_requests: int, shared_prefix: int, decode_tokens: int) -> dict[str, float]:
    """Engine-like steps: each step one request arrives and prefills a 128-token prompt in one chunk,
    every live request decodes one token, and requests leave after ``decode_tokens`` tokens."""
    rng = random.Random(0)
    m = KVCacheManager(CacheConfig(block_size=BS, num_blocks=256))
    system = [rng.randrange(32000) for _ in range(shared_prefix)]
    prompts = [system + [rng.randrange(32000) for _ in range(128 - shared_prefix)] for _ in range(num_requests)]
    t_lookup = t_alloc = t_decode = t_free = 0.0
    live: dict[str, int] = {}  # request -> decode tokens left
    decode_calls = 0
    for i, prompt in enumerate(prompts):
        rid = f"r{i}"
        t0 = time.perf_counter()
        assert m.lookup(prompt) >= 0
        t1 = time.perf_counter()
        assert m.allocate(rid, prompt).ok
        t2 = time.perf_counter()
        t_lookup, t_alloc = t_lookup + t1 - t0, t_alloc + t2 - t1
        live[rid] = decode_tokens
        t0 = time.perf_counter()
        for r in live:
            assert m.append_slots(r, [rng.randrange(32000)]).ok
            decode_calls += 1
        m.commit_writes()
        t_decode += time.perf_counter() - t0
        for r in [r for r in live if live[r] == 1]:
            del live[r]
            t_free += timed(lambda r=r: m.free(r))
        for r in live:
            live[r] -= 1
    for rid in live:
        t_free += timed(lambda rid=rid: m.free(rid))
    check_invariants(m)
    return {
        "lookup/s": num_requests / t_lookup,
        "allocate (prefill)/s": num_requests / t_alloc,
        "decode append/s": decode_calls / t_decode,
        "free/s": num_requests / t_free,
        "hit rate": m.stats.prefix_hit_rate,
        "evictions": m.stats.evictions,
    }


def lookup_scaling(lengths: list[int], repeats: int) -> list[tuple[int, float, float]]:
    """Time of allocate() when the whole prompt but its last token is cached, against prompt length."""
    rng = random.Random(1)
    rows = []
    for n in lengths:
        m = KVCacheManager(CacheConfig(block_size=BS, num_blocks=n // BS + 8))
        prompt = [rng.randrange(32000) for _ in range(n)]
        m.allocate("warm", prompt)
        m.commit_writes()
        m.free("warm")
        query = [*prompt, 7]
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            assert m.allocate("q", query).num_cached_tokens == n
            best = min(best, time.perf_counter() - t0)
            m.free("q")
        rows.append((n, best * 1e6, best * 1e6 / (n // BS)))
    return rows


def many_live(num_requests: int, granularity: str) -> dict[str, float]:
    """num_requests requests alive at once: 32-token shared system prompt + 16 own tokens + 8 decoded."""
    rng = random.Random(2)
    config = CacheConfig(block_size=BS, num_blocks=num_requests * 3 + 16, prefix_granularity=granularity)
    m = KVCacheManager(config)
    system = [rng.randrange(32000) for _ in range(32)]
    objects0 = len(gc.get_objects())
    t0 = time.perf_counter()
    for i in range(num_requests):
        prompt = system + [rng.randrange(32000) for _ in range(16)]
        assert m.allocate(f"r{i}", prompt).ok
        if i % 256 == 255:
            m.commit_writes()
    m.commit_writes()
    t_admit = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(8):
        for i in range(num_requests):
            assert m.append_slots(f"r{i}", [rng.randrange(32000)]).ok
        m.commit_writes()
    t_decode = time.perf_counter() - t0
    stats = {
        "live requests": float(len(m.request_ids())),
        "blocks in use": m.usage() * m.num_blocks,
        "peak refcount": float(m.stats.peak_refcount),
        "admit+prefill s": t_admit,
        "decode step ms": t_decode / 8 * 1e3,
        "check_invariants s": timed(lambda: check_invariants(m)),
        # Objects the cyclic GC must traverse: token granularity keeps a trie node per cached token.
        "GC-tracked objects": float(len(gc.get_objects()) - objects0),
    }
    stats["free all s"] = timed(lambda: [m.free(f"r{i}") for i in range(num_requests)])
    assert m.num_free_blocks() == m.num_blocks
    return stats


def layouts(num_tokens: int, repeats: int) -> list[tuple[str, float, float]]:
    """One layer's write of a decode batch and gather of its contexts, per layout."""
    rows = []
    for layout in ("NHD", "HND"):
        st = KVStorage(1, 1024, BS, 8, 64, layout=layout)
        slots = torch.randperm(1024 * BS)[:num_tokens]
        k = torch.randn(num_tokens, 8, 64)
        ctx = torch.randint(0, 1024 * BS, (64, 512))
        t_w = min(timed(lambda st=st, slots=slots, k=k: st.write(0, slots, k, k)) for _ in range(repeats))
        t_g = min(timed(lambda st=st, ctx=ctx: st.gather(0, ctx)) for _ in range(repeats))
        rows.append((layout, t_w * 1e6, t_g * 1e3))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    # One torch thread by default: on a small shared machine, a second thread spinning at OpenMP barriers
    # while another process holds the other core makes these small ops ~40x slower.
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads for the storage part")
    args = ap.parse_args()
    q = args.quick
    torch.set_num_threads(args.threads)

    print("== allocate / append / free throughput (block 16, 256 blocks, 128-token prompts, 16 decoded each)")
    for shared in (0, 64):
        res = throughput(200 if q else 1000, shared, 16)
        print(f"  shared prefix {shared:3d} tokens: " + ", ".join(f"{k} {v:,.2f}" for k, v in res.items()))

    print("== prefix lookup (allocate with a full hit) against prompt length")
    print(f"  {'tokens':>7} {'blocks':>7} {'us':>10} {'us/block':>9}")
    lengths = [256, 1024, 4096] if q else [256, 512, 1024, 2048, 4096, 8192, 16384]
    for n, us, per_block in lookup_scaling(lengths, 5 if q else 20):
        print(f"  {n:7d} {n // BS:7d} {us:10.1f} {per_block:9.2f}")

    n = 1000 if q else 10_000
    for granularity in ("token", "block"):
        print(f"== {n:,} live requests (48-token prompts sharing 32, then 8 decode steps), {granularity} granularity")
        for k, v in many_live(n, granularity).items():
            print(f"  {k:>20}: {v:,.2f}")

    print(
        f"== storage ({args.threads} thread), one layer, 8 KV heads x 64 dims: "
        "write 256 tokens / gather 64 x 512-token contexts"
    )
    for layout, w_us, g_ms in layouts(256, 5 if q else 20):
        print(f"  {layout}: write {w_us:8.1f} us   gather {g_ms:6.2f} ms")


if __name__ == "__main__":
    main()
