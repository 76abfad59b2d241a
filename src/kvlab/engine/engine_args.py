"""vLLM's engine arguments, as ``LLM(...)`` receives them from code written for vLLM.

One table (``VLLM_ENGINE_ARGS``) says, for every argument of vLLM's ``LLM``/``EngineArgs`` that kvlab knows, what
vLLM does with it and what kvlab does: an argument that means something on one CPU is mapped; one that cannot
apply here (several GPUs, CUDA graphs, a hub) is accepted only at the values where it changes nothing, so a
script written for vLLM runs unchanged and a script that asks for more is told why not. An argument the table
does not name is refused by ``LLM`` with the list of what it takes. docs/vllm-users.md prints the table (a test
keeps the two the same).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvlab.config import ConfigError, SpeculativeConfig

# vLLM's names for kvlab's cache and scheduler knobs: same meaning, another spelling.
RENAMED = {"enable_prefix_caching": "share_prefix", "num_gpu_blocks_override": "num_blocks"}
# vLLM's prefix-caching hashes; the CBOR variants differ from the plain ones only in how a block is serialised.
HASHES = {"sha256": "sha256", "sha256_cbor": "sha256", "xxhash": "xxh64", "xxhash_cbor": "xxh64"}


def _one(value: Any) -> bool:
    return value == 1 and not isinstance(value, bool)


def _none(value: Any) -> bool:
    return value is None


def _boolean(value: Any) -> bool:
    return isinstance(value, bool)


def _zero(value: Any) -> bool:
    return value == 0 and not isinstance(value, bool)


def _non_negative(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0


@dataclass(frozen=True)
class EngineArg:
    """One vLLM argument: ``vllm`` what it does there, ``kvlab`` what it does here. ``accepts`` (no-op
    arguments only): the values that change nothing here, ``accepted`` the same in words."""

    name: str
    vllm: str
    kvlab: str
    accepts: Callable[[Any], bool] | None = None
    accepted: str = ""

    @property
    def is_noop(self) -> bool:
        return self.accepts is not None


VLLM_ENGINE_ARGS: tuple[EngineArg, ...] = (
    EngineArg(
        "model", "HF name or local path", "`mini`, `mini-gqa`, `mini-mqa`, `smollm2`, a local HF directory or .gguf"
    ),
    EngineArg(
        "tokenizer",
        "HF name or path of another tokenizer",
        "a local directory with tokenizer.json; the model's own name or path is the default; never downloaded",
    ),
    EngineArg(
        "dtype",
        "weights' dtype (`auto`, `half`, `bfloat16`, `float32`)",
        "`auto` (= `float32`, the reference) or `bfloat16`; `half`/`float16` refused: this CPU build serves no fp16",
    ),
    EngineArg(
        "seed",
        "seeds sampling (requests without a seed of their own)",
        "the same: one generator for the engine's unseeded requests (default 0, as vLLM's)",
    ),
    EngineArg("max_model_len", "longest prompt + output", "the same"),
    EngineArg("max_num_seqs", "most sequences in one step", "the same"),
    EngineArg("max_num_batched_tokens", "most tokens in one step", "the same"),
    EngineArg("block_size", "tokens per KV block", "the same"),
    EngineArg("enable_prefix_caching", "share cached prefix blocks", "`share_prefix`"),
    EngineArg("enable_chunked_prefill", "split long prompts across steps", "the same"),
    EngineArg(
        "kv_cache_dtype",
        "K/V storage dtype",
        "`auto`, `float32`, `bfloat16`, `fp8` (= `fp8_e4m3`) or `fp8_e5m2`: fp8 unscaled, as vLLM's without "
        "calibrated scales (docs/performance.md)",
    ),
    EngineArg(
        "prefix_caching_hash_algo",
        "block hash (`sha256`, `sha256_cbor`, `xxhash`, `xxhash_cbor`)",
        "`hash_algo`: sha256 or xxh64 (the CBOR variants key the same blocks)",
    ),
    EngineArg(
        "quantization",
        "weight quantisation method",
        "weight-only `int8`, `int4`, `gguf`; `int8-w8a8`, `int8-w8a8-head` (the LM head too) (docs/performance.md)",
    ),
    EngineArg(
        "gpu_memory_utilization",
        "share of the device's memory for the engine (on CPU: of the node's RAM)",
        "share of the KV budget: `num_blocks` (given, or the default) is the whole budget, the pool keeps "
        "floor(share x num_blocks) blocks",
    ),
    EngineArg(
        "kv_cache_memory_bytes",
        "KV cache size in bytes (overrides the utilisation)",
        "the same: as many whole blocks as fit (a block's bytes from the model, block_size and kv_cache_dtype)",
    ),
    EngineArg("num_gpu_blocks_override", "KV blocks, whatever memory says", "`num_blocks`"),
    EngineArg(
        "speculative_config",
        "speculative decoding (`method`, `num_speculative_tokens`, `prompt_lookup_max`, ...)",
        "`ngram` (prompt lookup), for greedy requests: `SchedulerConfig.speculative` (docs/speculative.md)",
    ),
    EngineArg("tensor_parallel_size", "GPUs a layer is split across", "one CPU process", _one, "1"),
    EngineArg("pipeline_parallel_size", "GPUs the layers are split across", "one CPU process", _one, "1"),
    EngineArg("data_parallel_size", "engine replicas", "one engine", _one, "1"),
    EngineArg(
        "distributed_executor_backend",
        "`mp`, `ray`, `uni` workers",
        "one process",
        lambda v: v in (None, "uni", "mp"),
        "None, `uni`, `mp`",
    ),
    EngineArg(
        "enforce_eager", "no CUDA graphs", "kvlab never captures graphs: eager either way", _boolean, "True, False"
    ),
    EngineArg(
        "trust_remote_code",
        "may run a checkpoint's Python code",
        "kvlab never runs a checkpoint's code",
        _boolean,
        "True, False",
    ),
    EngineArg("disable_custom_all_reduce", "GPU all-reduce kernel", "no all-reduce", _boolean, "True, False"),
    EngineArg(
        "disable_log_stats",
        "no periodic stats log",
        "kvlab logs none; `llm.stats()` as always",
        _boolean,
        "True, False",
    ),
    EngineArg(
        "swap_space",
        "vLLM V0's CPU swap (GiB) for preempted sequences; 0.32 refuses it",
        "preemption recomputes, as vLLM V1's",
        _non_negative,
        "any number >= 0",
    ),
    EngineArg("cpu_offload_gb", "weights kept in CPU memory", "the weights are in CPU memory already", _zero, "0"),
    EngineArg(
        "compilation_config",
        "torch.compile / CUDA-graph settings",
        'compiled kernels are `attention_backend="cpp"`',
        _none,
        "None",
    ),
    EngineArg(
        "tokenizer_mode",
        "`auto`, `slow`, `mistral`, ...",
        "fast HF tokenizers only",
        lambda v: v in ("auto", "hf"),
        "`auto`, `hf`",
    ),
    EngineArg(
        "skip_tokenizer_init",
        "token ids in and out only",
        "the tokenizer is always loaded",
        lambda v: v is False,
        "False",
    ),
    EngineArg("revision", "hub revision of the model", "never downloads", _none, "None"),
    EngineArg("tokenizer_revision", "hub revision of the tokenizer", "never downloads", _none, "None"),
    EngineArg("download_dir", "where hub files go", "never downloads", _none, "None"),
    EngineArg("hf_token", "hub token", "never downloads", _none, "None"),
    EngineArg("load_format", "weights' file format", "found from the path", lambda v: v == "auto", "`auto`"),
    EngineArg("hf_overrides", "config.json overrides", "the checkpoint's config as it is", _none, "None"),
)

BY_NAME = {arg.name: arg for arg in VLLM_ENGINE_ARGS}


@dataclass(frozen=True)
class KVBudget:
    """How big the pool is asked to be: ``share`` of the blocks (``gpu_memory_utilization``) or ``nbytes``
    (``kv_cache_memory_bytes``), which needs the model to know what a block weighs."""

    share: float | None = None
    nbytes: int | None = None

    def __post_init__(self) -> None:
        if self.share is not None and not (
            isinstance(self.share, (int, float)) and not isinstance(self.share, bool) and 0 < self.share <= 1
        ):
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.share!r}")
        if self.nbytes is not None and (
            not isinstance(self.nbytes, int) or isinstance(self.nbytes, bool) or self.nbytes <= 0
        ):
            raise ConfigError(f"kv_cache_memory_bytes must be a positive int, got {self.nbytes!r}")

    def num_blocks(self, budget_blocks: int, block_nbytes: int) -> int:
        """The pool's blocks: ``budget_blocks`` is the whole budget (num_blocks given or the default)."""
        if self.nbytes is not None:
            blocks = self.nbytes // block_nbytes
            if blocks < 1:
                raise ConfigError(
                    f"kv_cache_memory_bytes={self.nbytes} holds no block: one block of this model takes "
                    f"{block_nbytes} bytes"
                )
            return blocks
        if self.share is not None:
            return max(1, math.floor(self.share * budget_blocks))
        return budget_blocks


@dataclass(frozen=True)
class Translated:
    """vLLM's arguments in kvlab's terms: ``knobs`` for ``CacheConfig``/``SchedulerConfig``, ``tokenizer`` a
    path to load another tokenizer from (None: the model's), ``budget`` the pool's size, ``noop`` the arguments
    accepted at a value that changes nothing."""

    knobs: dict[str, Any]
    tokenizer: str | None
    budget: KVBudget
    noop: tuple[str, ...]


def translate(kwargs: dict[str, Any], *, model: str | None) -> Translated:
    """Split ``LLM``'s keyword arguments into kvlab's knobs and vLLM's arguments; a vLLM argument outside the
    values it can take here raises ``ValueError`` naming it, the value and what kvlab accepts."""
    knobs: dict[str, Any] = {}
    noop: list[str] = []
    tokenizer: str | None = None
    budget = KVBudget()
    for name, value in kwargs.items():
        arg = BY_NAME.get(name)
        if arg is None:
            knobs[name] = value  # kvlab's own knob (or unknown: split_knobs names it)
        elif arg.accepts is not None:
            if not arg.accepts(value):
                raise ValueError(
                    f"{name}={value!r}: {arg.vllm} in vLLM; here {arg.kvlab}, so only {arg.accepted} is accepted"
                )
            noop.append(name)
        elif name in RENAMED:
            knobs[RENAMED[name]] = value
        elif name == "prefix_caching_hash_algo":
            if value not in HASHES:
                raise ValueError(f"prefix_caching_hash_algo must be one of {list(HASHES)}, got {value!r}")
            knobs["hash_algo"] = HASHES[value]
        elif name == "tokenizer":
            if value is not None and value != model:
                if not isinstance(value, str):
                    raise ValueError(f"tokenizer must be a path (str), got {type(value).__name__}")
                tokenizer = value
        elif name == "gpu_memory_utilization":
            budget = KVBudget(share=value, nbytes=budget.nbytes)
        elif name == "speculative_config":
            if value is not None:
                knobs["speculative"] = (
                    value if isinstance(value, SpeculativeConfig) else SpeculativeConfig.from_vllm(value)
                )
        elif name == "kv_cache_memory_bytes":
            if value is not None:
                budget = KVBudget(share=budget.share, nbytes=value)
        else:
            knobs[name] = value  # same name, same meaning (max_model_len, block_size, ...)
    if "num_blocks" in kwargs and "num_gpu_blocks_override" in kwargs:
        raise ValueError("num_blocks and num_gpu_blocks_override name the same thing: give one")
    if budget.nbytes is not None and ("num_blocks" in kwargs or "num_gpu_blocks_override" in kwargs):
        raise ValueError("kv_cache_memory_bytes and num_blocks both size the pool: give one")
    return Translated(knobs, tokenizer, budget, tuple(noop))


__all__ = [
    "BY_NAME",
    "HASHES",
    "RENAMED",
    "VLLM_ENGINE_ARGS",
    "EngineArg",
    "KVBudget",
    "Translated",
    "translate",
]
