"""What the engine reports about itself: ``EngineStats`` (``Engine.stats()``, ``LLM.stats()``, the server's
/metrics), ``StepPhases`` (the last step's two runner phases, for ``kvlab bench step``) and ``StepWork`` (what one
step computed and read, for the floor of a run: ``kvlab.bench.studies.floor``)."""

from __future__ import annotations

from dataclasses import dataclass

from kvlab.engine.scheduler import ScheduledBatch


@dataclass(frozen=True)
class EngineStats:
    """Counters named as vLLM names them (the server's /metrics exports these names)."""

    prefix_cache_queries: int  # prompt tokens looked up
    prefix_cache_hits: int  # of which found in the cache
    kv_cache_usage_perc: float  # 0-100
    num_preemptions: int
    cow_copies: int
    evictions: int
    num_requests_running: int
    num_requests_waiting: int
    num_free_blocks: int  # free blocks, cached-but-evictable ones included
    num_evictable_blocks: int  # of which still hold a findable prefix
    num_failed_requests: int  # finished with "error" by a fault inside a step
    steps: int
    prefix_cache_hits_public: int = 0  # of prefix_cache_hits, those in public blocks (shared across salts)
    # Speculative decoding (vLLM's vllm:spec_decode_* counters): drafts verified, their tokens, those accepted.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    # per draft position 0 .. num_speculative_tokens - 1 (empty: speculation off)
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


@dataclass(frozen=True)
class StepPhases:
    """Wall time of the last step's two runner phases (``kvlab bench step`` compares them to the step)."""

    prepare_s: float  # scheduler output -> tensors and metadata
    forward_s: float  # the model over the paged cache


@dataclass(frozen=True)
class StepWork:
    """What one step's forward pass did, in the units its cost grows with (``Engine.work_log``)."""

    query_tokens: int  # rows through every linear
    sampled_rows: int  # rows through the LM head
    attention_pairs: int  # (query row, key) pairs attended, per layer and head: each row reads its context
    context_tokens: int  # K/V positions read, per layer: each request's context once

    @classmethod
    def of(cls, batch: ScheduledBatch, sampled_rows: int) -> StepWork:
        pairs = context = 0
        for s in batch.scheduled:
            n, start = s.num_tokens, s.start
            pairs += n * start + n * (n + 1) // 2  # query i of the chunk reads start + i + 1 keys
            context += start + n
        return cls(batch.num_tokens, sampled_rows, pairs, context)
