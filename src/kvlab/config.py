"""Frozen, validated configuration objects.

Every config validates itself on construction and names the offending field and its allowed range,
so a bad knob fails where it is set rather than deep inside a forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal, get_args

HASH_ALGOS = ("sha256", "xxh64", "weak")
LAYOUTS = ("NHD", "HND")
GRANULARITIES = ("token", "block")
# auto: the model's dtype; fp8 is fp8_e4m3, as in vLLM (scale 1: vLLM's without calibrated scales)
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")
COW_CHECKS = ("write", "allocate")  # when copy-on-write copies are decided (KVCacheManager docstring)
# Which cached free block goes first (CacheConfig.eviction, kv.blocks); the CLI's choices are the Literal.
Eviction = Literal["lru", "fair"]
EVICTIONS: tuple[str, ...] = get_args(Eviction)
# The engine's modes (ModeConfig; docs/architecture.md, "Fast modes"): every front end validates against these.
# Quantised linears (kvlab.model.quant): weight-only int8/int4/gguf, and int8 weights with int8 activations
# (vLLM's "INT8 W8A8"); int8-w8a8-head: the same with the LM head quantised too (kvlab's own opt-in: vLLM's methods
# leave the head in the model's dtype); None: none.
QUANTIZATION_MODES = ("int8", "int4", "gguf", "int8-w8a8", "int8-w8a8-head")
ATTENTION_BACKENDS = ("reference", "cpp")  # gather + SDPA | the compiled CPU kernels (in-place attention, fused ops)


class ConfigError(ValueError):
    """A configuration field is outside its allowed range."""


class ChoiceError(ConfigError):
    """A field holds none of its allowed values (``check_choice``). It says which field (``field``), what it
    allows (``allowed``) and what it got (``value``), so that a front end can word the same refusal in its own
    vocabulary (a command-line flag) without a list of its own."""

    def __init__(self, message: str, field: str, allowed: tuple[Any, ...], value: Any) -> None:
        super().__init__(message)
        self.field = field
        self.allowed = allowed
        self.value = value


def check_int(owner: str, name: str, value: Any, lo: int, hi: int | None = None) -> None:
    """ConfigError naming ``owner.name`` and the allowed range unless ``value`` is an int in [lo, hi]."""
    # bool is an int subclass; True layers is a typo, not a shape.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{owner}.{name} must be an int, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ConfigError(f"{owner}.{name} must be {rng}, got {value}")


def check_kv_heads(owner: str, num_heads: int, num_kv_heads: int) -> None:
    """ConfigError unless every KV head serves the same number of query heads (MHA, GQA or MQA)."""
    check_int(owner, "num_kv_heads", num_kv_heads, 1, num_heads)
    if num_heads % num_kv_heads:
        divisors = [d for d in range(1, num_heads + 1) if num_heads % d == 0]
        raise ConfigError(
            f"{owner}.num_kv_heads must divide num_heads={num_heads} (allowed: {divisors}), got {num_kv_heads}"
        )


def attention_kind(num_heads: int, num_kv_heads: int) -> str:
    if num_kv_heads == num_heads:
        return "MHA"
    return "MQA" if num_kv_heads == 1 else "GQA"


def check_field_int(obj: Any, name: str, lo: int, hi: int | None = None) -> None:
    """``check_int`` on the field ``name`` of the dataclass ``obj`` (its class names the owner)."""
    check_int(type(obj).__name__, name, getattr(obj, name), lo, hi)


def _check_float(obj: Any, name: str, lo: float, lo_open: bool = True) -> None:
    value = getattr(obj, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{type(obj).__name__}.{name} must be a number, got {value!r}")
    if value < lo or (lo_open and value == lo):
        op = ">" if lo_open else ">="
        raise ConfigError(f"{type(obj).__name__}.{name} must be {op} {lo}, got {value}")


def check_choice(owner: str, name: str, value: Any, choices: tuple[str, ...], optional: bool = False) -> None:
    """ChoiceError (a ConfigError) naming ``owner.name`` and the allowed values unless ``value`` is one of
    ``choices`` (or None, when ``optional``)."""
    if value in choices or (optional and value is None):
        return
    text = f"{owner}.{name} must be one of {list(choices)}{' or None' if optional else ''}, got {value!r}"
    raise ChoiceError(text, name, (*choices, None) if optional else choices, value)


def _check_choice(obj: Any, name: str, choices: tuple[str, ...], optional: bool = False) -> None:
    check_choice(type(obj).__name__, name, getattr(obj, name), choices, optional)


def _check_bool(obj: Any, name: str) -> None:
    value = getattr(obj, name)
    if not isinstance(value, bool):
        raise ConfigError(f"{type(obj).__name__}.{name} must be a bool, got {value!r}")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        check_field_int(self, "vocab_size", 1)
        check_field_int(self, "hidden_size", 1)
        check_field_int(self, "num_layers", 1)
        check_field_int(self, "num_heads", 1)
        check_kv_heads("ModelConfig", self.num_heads, self.num_kv_heads)
        check_field_int(self, "head_dim", 2)
        if self.head_dim % 2:
            raise ConfigError(f"ModelConfig.head_dim must be even (RoPE rotates pairs), got {self.head_dim}")
        check_field_int(self, "intermediate_size", 1)
        _check_float(self, "rope_theta", 0.0)
        _check_float(self, "rms_norm_eps", 0.0)
        check_field_int(self, "max_position_embeddings", 1)
        _check_bool(self, "tie_word_embeddings")

    @property
    def attention_kind(self) -> str:
        return attention_kind(self.num_heads, self.num_kv_heads)

    def replace(self, **changes: Any) -> ModelConfig:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return ModelConfig(**values)


def blocks_for(tokens: int, block_size: int) -> int:
    """The blocks that hold ``tokens`` tokens, the last one partial: every block count in kvlab is this one."""
    return -(-tokens // block_size)


def admission_blocks(tokens: int, block_size: int, n: int = 1) -> int:
    """The most blocks a request of ``tokens`` tokens per sequence and ``n`` sequences can hold at once: each
    sequence's blocks, plus one for the copy-on-write of a shared partial block (a write into it briefly needs
    the copy beside the original). The engine refuses a request whose bound exceeds the pool; a pool of
    exactly this many blocks admits it."""
    return n * (blocks_for(tokens, block_size) + 1)


@dataclass(frozen=True)
class CacheConfig:
    """Knobs of the paged KV cache (docs/architecture.md, "Knobs").

    The unsafe settings exist to reproduce isolation failures; any of them requires ``unsafe=True``.
    """

    block_size: int = 16
    num_blocks: int = 256
    share_prefix: bool = True
    copy_on_write: bool = True
    reference_counting: bool = True
    prefix_granularity: str = "token"
    hash_algo: str = "sha256"
    verify_tokens: bool = True
    layout: str = "NHD"
    kv_cache_dtype: str = "auto"
    cow_check: str = "write"  # "allocate": copy shared blocks a request will write at admission/fork
    # K: a block chain that K distinct tenants (never salts) computed becomes public (kv.promotion); None: never.
    promote_after: int | None = None
    # Which cached free block is evicted first: "lru" (the least recently freed), "fair" (the least recently freed
    # of the tenant holding the most cached free blocks: kv.blocks); with one tenant both are the same order.
    eviction: str = "lru"
    sanitize: bool = False
    unsafe: bool = False

    def __post_init__(self) -> None:
        check_field_int(self, "block_size", 1, 1024)
        check_field_int(self, "num_blocks", 1)
        for name in (
            "share_prefix",
            "copy_on_write",
            "reference_counting",
            "verify_tokens",
            "sanitize",
            "unsafe",
        ):
            _check_bool(self, name)
        _check_choice(self, "prefix_granularity", GRANULARITIES)
        _check_choice(self, "hash_algo", HASH_ALGOS)
        _check_choice(self, "layout", LAYOUTS)
        _check_choice(self, "kv_cache_dtype", KV_CACHE_DTYPES)
        _check_choice(self, "cow_check", COW_CHECKS)
        _check_choice(self, "eviction", EVICTIONS)
        if self.promote_after is not None:
            check_field_int(self, "promote_after", 2)  # K = 1 would make every block public: that is no salt at all
        if self.unsafe_settings and not self.unsafe:
            raise ConfigError(
                f"CacheConfig has unsafe settings {self.unsafe_settings}; they break isolation and are "
                "refused unless unsafe=True (they exist only to reproduce failures)"
            )

    @property
    def unsafe_settings(self) -> list[str]:
        bad = []
        if self.share_prefix and not self.copy_on_write:
            bad.append("copy_on_write=False")
        if not self.reference_counting:
            bad.append("reference_counting=False")
        if self.hash_algo == "weak":
            bad.append("hash_algo='weak'")
        if not self.verify_tokens:
            bad.append("verify_tokens=False")
        return bad


@dataclass(frozen=True)
class ModeConfig:
    """How the engine runs its model (docs/architecture.md, "Fast modes"); the defaults are the reference mode.

    ``quantization``: quantised linears (``kvlab.model.quant``: weight-only int8, int4, the GGUF's own Q4_1 codes;
    ``int8-w8a8``, int8 weights times int8 activations quantised per token), None for the model's own weights.
    ``attention_backend``: "reference" (gather + SDPA) or "cpp", the compiled CPU
    kernels as a set (paged attention reading K/V in place, fused norms, RoPE, SiLU); where they cannot be built
    or do not apply the reference serves. ``packed_weights``: oneDNN-prepacked linears (``kvlab.model.packed``):
    True every linear, None those large enough to gain, False none.

    The model's dtype is the loaded model's; the KV cache's is ``CacheConfig.kv_cache_dtype`` (a property of the
    storage: it sizes the pool and its blocks, whatever computes over them). ``kvlab.model.modes.engine_model``
    builds the model a mode runs.
    """

    quantization: str | None = None
    attention_backend: str = "reference"
    packed_weights: bool | None = None

    def __post_init__(self) -> None:
        _check_choice(self, "quantization", QUANTIZATION_MODES, optional=True)
        _check_choice(self, "attention_backend", ATTENTION_BACKENDS)
        if self.packed_weights is not None and not isinstance(self.packed_weights, bool):
            raise ConfigError(f"ModeConfig.packed_weights must be a bool or None, got {self.packed_weights!r}")

    @property
    def compiled_kernels(self) -> bool:
        """Whether the mode asks for the compiled CPU kernels (the in-place paged attention and the fused ops)."""
        return self.attention_backend == "cpp"

    @classmethod
    def resolve(cls, mode: ModeConfig | None = None, **loose: Any) -> ModeConfig:
        """``mode``, or the mode of the loose keyword arguments the front ends still take (``quantization=``,
        ``attention_backend=``, ``packed_weights=``; None: the default). Both at once is refused."""
        given = {k: v for k, v in loose.items() if v is not None}
        if mode is None:
            return cls(**given)
        if given:
            raise ConfigError(f"give the mode as mode= or as {sorted(given)}, not both")
        return mode


SPECULATIVE_METHODS = ("ngram",)  # vLLM's speculative_config "method" values kvlab runs
# vLLM's speculative_config keys that kvlab maps (SpeculativeConfig.from_vllm refuses any other).
SPECULATIVE_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding by prompt lookup (vLLM's ``ngram`` method; docs/speculative.md).

    A greedy request's next ``num_speculative_tokens`` tokens are drafted from its own context: the tokens that
    followed the most recent earlier occurrence of its last n tokens, for the longest n in
    [``prompt_lookup_min``, ``prompt_lookup_max``]; one forward pass verifies them. A rejected draft's K/V was
    written into a slot of the request's block but never becomes its tokens: the prefix index never records
    it (``KVCacheManager.append_slots``, ``num_draft``).

    ``commit_rejected`` (unsafe): drafts are recorded as the request's tokens when written, and rejected ones are
    only taken back from the request's table, not from the prefix index: they stay findable. It exists to show
    that the sanitizer and ``kvlab fuzz`` catch it."""

    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 1
    commit_rejected: bool = False
    unsafe: bool = False

    def __post_init__(self) -> None:
        _check_choice(self, "method", SPECULATIVE_METHODS)
        check_field_int(self, "num_speculative_tokens", 1, 64)
        check_field_int(self, "prompt_lookup_min", 1)
        check_field_int(self, "prompt_lookup_max", self.prompt_lookup_min)
        _check_bool(self, "commit_rejected")
        _check_bool(self, "unsafe")
        if self.commit_rejected and not self.unsafe:
            raise ConfigError(
                "SpeculativeConfig.commit_rejected=True leaves rejected draft tokens findable in the prefix "
                "cache; it is refused unless unsafe=True (it exists only to reproduce the failure)"
            )

    @classmethod
    def from_vllm(cls, config: Any) -> SpeculativeConfig:
        """vLLM's ``speculative_config`` dict (``LLM(speculative_config=...)``, ``--speculative-config``), with
        vLLM's defaults: ``num_speculative_tokens`` is required; of the two lookup bounds, one given stands for
        both, neither gives 5 and 5."""
        if not isinstance(config, dict):
            raise ConfigError(f"speculative_config must be a dict, got {type(config).__name__}")
        unknown = sorted(set(config) - set(SPECULATIVE_KEYS))
        if unknown:
            raise ConfigError(
                f"speculative_config keys {unknown} are not supported; kvlab takes {list(SPECULATIVE_KEYS)}"
            )
        if "num_speculative_tokens" not in config:
            raise ConfigError("speculative_config needs 'num_speculative_tokens'")
        method = config.get("method", "ngram")
        if method == "[ngram]":  # vLLM's older spelling of the same method
            method = "ngram"
        lo, hi = config.get("prompt_lookup_min"), config.get("prompt_lookup_max")
        given = [v for v in (lo, hi) if v is not None]
        one = given[0] if given else 5  # one bound given stands for both; neither gives 5 and 5
        return cls(
            method=method,
            num_speculative_tokens=config["num_speculative_tokens"],
            prompt_lookup_max=one if hi is None else hi,
            prompt_lookup_min=one if lo is None else lo,
        )

    def to_vllm(self) -> dict[str, Any]:
        """The same setting as vLLM's ``speculative_config`` dict (``from_vllm`` reads it back)."""
        return {key: getattr(self, key) for key in SPECULATIVE_KEYS}


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous-batching limits."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 128
    enable_chunked_prefill: bool = True
    filter_empty: bool = True
    speculative: SpeculativeConfig | None = None  # None: one token per request and step
    unsafe: bool = False

    def __post_init__(self) -> None:
        check_field_int(self, "max_num_seqs", 1)
        check_field_int(self, "max_num_batched_tokens", 1)
        check_field_int(self, "max_model_len", 1)
        _check_bool(self, "enable_chunked_prefill")
        _check_bool(self, "filter_empty")
        _check_bool(self, "unsafe")
        if self.speculative is not None and not isinstance(self.speculative, SpeculativeConfig):
            raise ConfigError(f"SchedulerConfig.speculative must be a SpeculativeConfig, got {self.speculative!r}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                f"SchedulerConfig.max_num_batched_tokens must be >= max_model_len={self.max_model_len} "
                f"when enable_chunked_prefill=False, got {self.max_num_batched_tokens}"
            )
        if not self.filter_empty and not self.unsafe:
            raise ConfigError(
                "SchedulerConfig.filter_empty=False lets a zero-length request into a batch; it is refused "
                "unless unsafe=True (it exists only to reproduce the neighbour leak)"
            )
