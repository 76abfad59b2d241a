"""Measured KV memory: the real block manager driven through a workload, next to what the calculator
(``kvlab.memory``) predicts and what a contiguous max-length cache would reserve.

* mixed lengths: N sequences of random prompt and output lengths run to completion side by side
  (prompt in one step, then one token per step, as the engine does); the peak of blocks in use is
  measured and compared with a contiguous cache reserving ``max_seq_len`` slots per sequence;
* prefix sharing: N requests with one P-token prefix, admitted one after another with sharing on and
  off; the blocks saved are measured and set against the ideal (N - 1) x P tokens.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from kvlab.bench.table import ResultTable, result_table
from kvlab.config import CacheConfig, admission_blocks, blocks_for
from kvlab.kv import KVCacheManager, check_invariants
from kvlab.memory import KVShape, PagingComparison, PrefixSharing, human_bytes, kv_bytes_per_token


@dataclass(frozen=True)
class PagingMeasurement:
    sequences: int
    block_size: int
    max_seq_len: int
    used_tokens: int  # tokens the sequences hold at the end
    peak_blocks: int  # measured: blocks in use when every sequence is at full length
    predicted_blocks: int  # the calculator's sum of ceil(len / block_size)
    contiguous_slots: int  # sequences x max_seq_len
    bytes_per_token: int

    @property
    def paged_utilisation(self) -> float:
        return self.used_tokens / (self.peak_blocks * self.block_size)

    @property
    def contiguous_utilisation(self) -> float:
        return self.used_tokens / self.contiguous_slots

    @property
    def paged_bytes(self) -> int:
        return self.peak_blocks * self.block_size * self.bytes_per_token

    @property
    def contiguous_bytes(self) -> int:
        return self.contiguous_slots * self.bytes_per_token

    def as_dict(self) -> dict:
        return asdict(self) | {
            "paged_utilisation": round(self.paged_utilisation, 4),
            "contiguous_utilisation": round(self.contiguous_utilisation, 4),
            "paged_bytes": self.paged_bytes,
            "contiguous_bytes": self.contiguous_bytes,
        }


@dataclass(frozen=True)
class SharingMeasurement:
    requests: int
    prefix_len: int
    suffix_len: int
    block_size: int
    blocks_unshared: int  # measured with share_prefix=False
    blocks_shared: int  # measured with share_prefix=True
    predicted_saved_blocks: int  # (N - 1) x floor(P / block_size)
    ideal_saved_tokens: int  # (N - 1) x P

    @property
    def saved_blocks(self) -> int:
        return self.blocks_unshared - self.blocks_shared

    @property
    def saved_tokens(self) -> int:
        return self.saved_blocks * self.block_size

    def as_dict(self) -> dict:
        return asdict(self) | {"saved_blocks": self.saved_blocks, "saved_tokens": self.saved_tokens}


def paging_table(m: PagingMeasurement, shape: str, dtype: str) -> ResultTable:
    """Paged vs contiguous on the mixed lengths of ``m``, ``shape`` (a preset's name) in ``dtype``."""
    return result_table(
        f"paged vs contiguous: {m.sequences} sequences of mixed length, {shape} {dtype}",
        ("cache", "slots reserved", "bytes", "utilisation", "note"),
        [
            (
                "contiguous",
                str(m.contiguous_slots),
                human_bytes(m.contiguous_bytes),
                f"{m.contiguous_utilisation:.1%}",
                f"max_seq_len={m.max_seq_len} per sequence",
            ),
            (
                "paged (measured)",
                str(m.peak_blocks * m.block_size),
                human_bytes(m.paged_bytes),
                f"{m.paged_utilisation:.1%}",
                f"peak {m.peak_blocks} blocks; calculator predicts {m.predicted_blocks}",
            ),
        ],
        notes=[
            f"{m.used_tokens} tokens held; the paged pool needs "
            f"{m.contiguous_bytes / m.paged_bytes:.2f}x less memory than contiguous preallocation"
        ],
    )


def sharing_table(shares: Sequence[SharingMeasurement], block_size: int) -> ResultTable:
    """The prefix-sharing cases, measured with sharing off and on, against the ideal (N-1) x P."""
    columns = ("N", "P", "S", "blocks unshared", "blocks shared", "saved blocks", "predicted", "saved tokens")
    return result_table(
        f"prefix sharing (block size {block_size}), measured with share_prefix off and on",
        (*columns, "ideal"),
        [
            (
                *map(str, (m.requests, m.prefix_len, m.suffix_len, m.blocks_unshared, m.blocks_shared)),
                str(m.saved_blocks),
                str(m.predicted_saved_blocks),
                str(m.saved_tokens),
                f"{m.ideal_saved_tokens} = (N-1) x P",
            )
            for m in shares
        ],
        notes=["saved tokens fall short of (N-1) x P by the partial last block of the prefix: it is copied on write"],
    )


def mixed_lengths(sequences: int, max_seq_len: int, seed: int = 0, min_len: int = 16) -> list[tuple[int, int]]:
    """(prompt, output) lengths: prompts uniform in [min_len, max_seq_len/2], outputs in [min_len,
    max_seq_len/4], a chat-like mix where most sequences end far below the maximum."""
    rng = random.Random(seed)
    return [(rng.randint(min_len, max_seq_len // 2), rng.randint(min_len, max_seq_len // 4)) for _ in range(sequences)]


def measure_paging(
    lengths: list[tuple[int, int]], block_size: int, max_seq_len: int, shape: KVShape, dtype: str = "fp16"
) -> PagingMeasurement:
    total = [p + o for p, o in lengths]
    cfg = CacheConfig(block_size=block_size, num_blocks=sum(blocks_for(t, block_size) for t in total) + 1)
    kv = KVCacheManager(cfg)
    rng = random.Random(1)
    for i, (prompt, _) in enumerate(lengths):
        rid, tokens = f"s{i}", [rng.randrange(50_000) for _ in range(prompt)]
        if not kv.allocate(rid, tokens).ok:
            raise RuntimeError(f"pool too small for sequence {i}")
    kv.commit_writes()
    peak = cfg.num_blocks - kv.num_free_blocks()
    for step in range(max(o for _, o in lengths)):
        for i, (_, out) in enumerate(lengths):
            if step < out and not kv.append_slots(f"s{i}", [rng.randrange(50_000)]).ok:
                raise RuntimeError("pool too small while decoding")
        kv.commit_writes()
        peak = max(peak, cfg.num_blocks - kv.num_free_blocks())
    check_invariants(kv)
    return PagingMeasurement(
        sequences=len(lengths),
        block_size=block_size,
        max_seq_len=max_seq_len,
        used_tokens=sum(total),
        peak_blocks=peak,
        predicted_blocks=PagingComparison(tuple(total), block_size, max_seq_len).paged_blocks,
        contiguous_slots=len(lengths) * max_seq_len,
        bytes_per_token=kv_bytes_per_token(shape, dtype),
    )


def measure_sharing(requests: int, prefix_len: int, suffix_len: int, block_size: int = 16) -> SharingMeasurement:
    rng = random.Random(2)
    prefix = [rng.randrange(50_000) for _ in range(prefix_len)]
    prompts = [prefix + [rng.randrange(50_000) for _ in range(suffix_len)] for _ in range(requests)]
    used = {}
    for share in (False, True):
        blocks = admission_blocks(prefix_len + suffix_len, block_size, requests)
        cfg = CacheConfig(block_size=block_size, num_blocks=blocks, share_prefix=share)
        kv = KVCacheManager(cfg)
        for i, prompt in enumerate(prompts):
            if not kv.allocate(f"r{i}", prompt).ok:
                raise RuntimeError("pool too small")
            kv.commit_writes()  # one request per step, so each later one finds the prefix written
        check_invariants(kv)
        used[share] = cfg.num_blocks - kv.num_free_blocks()
    predicted = PrefixSharing(requests, prefix_len, block_size)
    return SharingMeasurement(
        requests=requests,
        prefix_len=prefix_len,
        suffix_len=suffix_len,
        block_size=block_size,
        blocks_unshared=used[False],
        blocks_shared=used[True],
        predicted_saved_blocks=predicted.saved_blocks,
        ideal_saved_tokens=predicted.saved_tokens,
    )
