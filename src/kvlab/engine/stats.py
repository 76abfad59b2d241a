"""What the engine reports about itself: ``EngineStats`` (``Engine.stats()``, ``LLM.stats()``, the server's
/metrics) and ``StepPhases`` (the last step's two runner phases, for ``kvlab bench step``)."""

from __future__ import annotations

from dataclasses import dataclass


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
