"""A fuzz case: one engine configuration and the requests run against it, as a small replayable JSON file.

A case is concrete (token ids, absolute steps, the pool size in blocks), not the choices that drew it: a
saved case replays the same way after the generator changes.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from kvlab.config import (
    ATTENTION_BACKENDS,
    GRANULARITIES,
    HASH_ALGOS,
    KV_CACHE_DTYPES,
    LAYOUTS,
    ConfigError,
    ModeConfig,
    SpeculativeConfig,
    check_choice,
    check_int,
)
from kvlab.engine.sampling import InvalidRequestError, SamplingParams

CASE_FORMAT = 1  # bumped when the JSON layout changes; a replay refuses files of another format
ALPHABET = (97, 98, 99)  # the prompts' tokens by default: "abc" in the byte tokenizer (WorkloadBounds.alphabet)
# What a trial computes in. "fp32": the model's own weights, on the reference or the compiled kernels, judged by the
# dense oracle. ROW_INVARIANT: bf16 weights, int8-w8a8 linears and LM head, the compiled kernels -- a mode that
# computes every row on its own (docs/serving.md, "What changes an answer"), judged by each request run alone in it.
ROW_INVARIANT = "bf16+int8-w8a8-head"
PRECISIONS = ("fp32", ROW_INVARIANT)
PRECISION_DTYPES = {"fp32": torch.float32, ROW_INVARIANT: torch.bfloat16}  # the weights each computes with


@dataclass(frozen=True)
class FuzzConfig:
    """The knobs a trial draws; everything else is the engine's default (or the unsafe strategy's)."""

    block_size: int = 4
    num_blocks: int = 16
    max_num_seqs: int = 4
    max_num_batched_tokens: int = 2048
    layout: str = "NHD"
    prefix_granularity: str = "token"
    hash_algo: str = "sha256"
    attention_backend: str = "reference"  # "cpp": the compiled kernels (paged attention in place, fused ops)
    promote_after: int | None = None  # CacheConfig.promote_after: chains K salts computed become public
    # Speculative decoding by prompt lookup (SpeculativeConfig): draft tokens a step (0: off); the unsafe
    # commit_rejected_drafts leaves rejected drafts findable, which the sanitizer must catch.
    speculative_tokens: int = 0
    commit_rejected_drafts: bool = False
    # CacheConfig.kv_cache_dtype: "auto" stores the model's fp32; bf16 and fp8 caches round K/V as they store them
    # (the oracle rounds alike: Oracle, kv_dtype).
    kv_cache_dtype: str = "auto"
    precision: str = "fp32"  # PRECISIONS; ROW_INVARIANT needs the compiled kernels (attention_backend="cpp")

    def __post_init__(self) -> None:
        check_int("FuzzConfig", "block_size", self.block_size, 1, 1024)
        check_int("FuzzConfig", "num_blocks", self.num_blocks, 1)
        check_int("FuzzConfig", "max_num_seqs", self.max_num_seqs, 1)
        check_int("FuzzConfig", "max_num_batched_tokens", self.max_num_batched_tokens, 1)
        check_choice("FuzzConfig", "layout", self.layout, LAYOUTS)
        check_choice("FuzzConfig", "prefix_granularity", self.prefix_granularity, GRANULARITIES)
        check_choice("FuzzConfig", "hash_algo", self.hash_algo, HASH_ALGOS)
        check_choice("FuzzConfig", "attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        if self.promote_after is not None:
            check_int("FuzzConfig", "promote_after", self.promote_after, 2)
        check_int("FuzzConfig", "speculative_tokens", self.speculative_tokens, 0, 64)
        if self.commit_rejected_drafts and not self.speculative_tokens:
            raise ConfigError("FuzzConfig.commit_rejected_drafts needs speculative_tokens > 0")
        check_choice("FuzzConfig", "kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        check_choice("FuzzConfig", "precision", self.precision, PRECISIONS)
        if self.precision == ROW_INVARIANT and self.attention_backend != "cpp":
            raise ConfigError(f"FuzzConfig.precision={ROW_INVARIANT!r} runs on the compiled kernels: needs 'cpp'")

    @property
    def mode(self) -> ModeConfig:
        """The engine mode a trial runs in (its model's dtype: ``model_dtype``)."""
        quantization = "int8-w8a8-head" if self.precision == ROW_INVARIANT else None
        return ModeConfig(quantization=quantization, attention_backend=self.attention_backend)

    @property
    def model_dtype(self) -> torch.dtype:
        return PRECISION_DTYPES[self.precision]

    def cache_kwargs(self) -> dict[str, Any]:
        return {
            "block_size": self.block_size,
            "num_blocks": self.num_blocks,
            "layout": self.layout,
            "prefix_granularity": self.prefix_granularity,
            "hash_algo": self.hash_algo,
            "promote_after": self.promote_after,
            "kv_cache_dtype": self.kv_cache_dtype,
            "sanitize": True,  # every trial runs with the sanitizer: a foreign read is a failure even if unseen
        }

    def scheduler_kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = {"max_num_seqs": self.max_num_seqs, "max_num_batched_tokens": self.max_num_batched_tokens}
        if self.speculative_tokens:
            kw["speculative"] = SpeculativeConfig(
                num_speculative_tokens=self.speculative_tokens,
                prompt_lookup_min=1,
                prompt_lookup_max=3,
                commit_rejected=self.commit_rejected_drafts,
                unsafe=self.commit_rejected_drafts,
            )
        return kw


@dataclass(frozen=True)
class FuzzRequest:
    """One request: greedy, EOS ignored (so its length is ``max_tokens`` unless aborted)."""

    prompt: tuple[int, ...]
    arrival: int = 0  # engine step at which it is added
    max_tokens: int = 1
    n: int = 1
    abort_at: int | None = None  # engine step at which it is aborted (>= arrival), if any
    salt: str | None = None
    # The full blocks among the first this many prompt tokens are public: shared across salts (0: none).
    public_prefix_tokens: int = 0
    # Sampling (temperature 0: greedy). A sampled request draws from its own generator (``seed``; fork i from seed + i),
    # which only the row-invariant precision's judge replays: FuzzCase refuses one in fp32.
    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt", tuple(int(t) for t in self.prompt))
        check_int("FuzzRequest", "arrival", self.arrival, 0)
        check_int("FuzzRequest", "max_tokens", self.max_tokens, 1)
        check_int("FuzzRequest", "n", self.n, 1)
        if self.abort_at is not None:
            check_int("FuzzRequest", "abort_at", self.abort_at, self.arrival)
        if self.salt is not None and not isinstance(self.salt, str):
            raise ConfigError(f"FuzzRequest.salt must be a string or None, got {self.salt!r}")
        check_int("FuzzRequest", "public_prefix_tokens", self.public_prefix_tokens, 0, len(self.prompt))
        try:
            self.params()  # the sampling knobs, checked as the engine checks them
        except InvalidRequestError as exc:
            raise ConfigError(f"FuzzRequest: {exc}") from exc
        if self.sampled and self.seed is None:
            raise ConfigError(
                "FuzzRequest: a sampled request (temperature > 0) needs a seed, so that a rerun draws alike"
            )

    def params(self) -> SamplingParams:
        """What the engine is asked: greedy or drawn from the request's own seed, EOS ignored, so that its output is
        fully determined by the request and a judge can hold it to its tokens."""
        return SamplingParams(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            seed=self.seed,
            max_tokens=self.max_tokens,
            n=self.n,
            ignore_eos=True,
        )

    @property
    def sampled(self) -> bool:
        return self.temperature > 0


# A greedy request's sampling fields, as FuzzRequest declares them (left out of a case's JSON).
SAMPLING_DEFAULTS: dict[str, Any] = {
    f.name: f.default for f in fields(FuzzRequest) if f.name in ("temperature", "top_k", "top_p", "seed")
}


@dataclass(frozen=True)
class FuzzCase:
    config: FuzzConfig
    requests: tuple[FuzzRequest, ...]
    model: str = "mini"
    model_seed: int = 0
    strategy: str | None = None  # an experiment strategy applied over ``config`` (the unsafe ones)
    # What the fuzzer saw when it saved the case (informational: a replay judges the case afresh).
    note: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.config, FuzzConfig):
            raise ConfigError(f"FuzzCase.config must be a FuzzConfig, got {type(self.config).__name__}")
        object.__setattr__(self, "requests", tuple(self.requests))
        if not self.requests:
            raise ConfigError("FuzzCase.requests must hold at least one request")
        if self.config.precision != ROW_INVARIANT and any(r.sampled for r in self.requests):
            raise ConfigError(
                f"FuzzCase: sampled requests need precision {ROW_INVARIANT!r}, whose judge replays a draw"
            )

    @staticmethod
    def request_id(i: int) -> str:
        return f"r{i}"

    def to_dict(self) -> dict[str, Any]:
        reqs = [{**asdict(r), "prompt": list(r.prompt)} for r in self.requests]
        for r in reqs:  # a case without public prefixes reads (and digests) as it did before they existed
            if not r["public_prefix_tokens"]:
                del r["public_prefix_tokens"]
            for name, default in SAMPLING_DEFAULTS.items():  # and a greedy request as before sampling was drawn
                if r[name] == default:
                    del r[name]
        config = asdict(self.config)
        if config["promote_after"] is None:  # likewise a case without promotion
            del config["promote_after"]
        for name in ("speculative_tokens", "commit_rejected_drafts"):  # and without speculation
            if not config[name]:
                del config[name]
        if config["kv_cache_dtype"] == "auto":  # and over the model's own dtype
            del config["kv_cache_dtype"]
        if config["precision"] == "fp32":  # and in fp32
            del config["precision"]
        out = {
            "format": CASE_FORMAT,
            "model": self.model,
            "model_seed": self.model_seed,
            "strategy": self.strategy,
            "config": config,
            "requests": reqs,
        }
        if self.note:
            out["note"] = self.note
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FuzzCase:
        if d.get("format") != CASE_FORMAT:
            raise ConfigError(f"fuzz case format must be {CASE_FORMAT}, got {d.get('format')!r}")
        return cls(
            config=FuzzConfig(**d["config"]),
            requests=tuple(FuzzRequest(**r) for r in d["requests"]),
            model=d.get("model", "mini"),
            model_seed=d.get("model_seed", 0),
            strategy=d.get("strategy"),
            note=d.get("note", {}),
        )

    def to_json(self) -> str:
        # One request per line: a minimal case should read at a glance in a diff or an issue.
        d = self.to_dict()
        reqs = ",\n    ".join(json.dumps(r) for r in d.pop("requests"))
        head = json.dumps(d, indent=2)[:-2]
        return f'{head},\n  "requests": [\n    {reqs}\n  ]\n}}\n'

    @classmethod
    def load(cls, path: str | Path) -> FuzzCase:
        return cls.from_dict(json.loads(Path(path).read_text(encoding="utf-8")))

    def save(self, path: str | Path) -> Path:
        p = Path(path)
        p.write_text(self.to_json(), encoding="utf-8")
        return p

    def digest(self) -> str:
        """Identity of the workload (the note excluded): equal digests mean the same trial was run."""
        d = self.to_dict()
        d.pop("note", None)
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

    def size(self) -> tuple[int, int, int]:
        """What shrinking minimises, most important first: requests, prompt tokens, output tokens."""
        return (
            len(self.requests),
            sum(len(r.prompt) for r in self.requests),
            sum(r.max_tokens * r.n for r in self.requests),
        )
