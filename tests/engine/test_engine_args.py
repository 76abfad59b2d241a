"""vLLM's engine arguments in ``LLM(...)``: a script written for vLLM runs unchanged, each argument does what
docs/vllm-users.md says it does here, and one that cannot apply is refused naming itself."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, pre_tokenizers

from kvlab import LLM, SamplingParams
from kvlab.config import CacheConfig, ConfigError
from kvlab.engine.engine_args import VLLM_ENGINE_ARGS, KVBudget
from kvlab.engine.sizing import kv_block_nbytes
from kvlab.model.loader import ModelLoadError, load_model
from oracle_cache import oracle

PROMPTS = ["The passphrase of the day is", "Hello, my name is"]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
SAMPLED = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)
DOC = Path(__file__).resolve().parents[2] / "docs" / "vllm-users.md"


def _tokens(llm: LLM, params: SamplingParams) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_a_vllm_script_with_its_common_engine_arguments_runs_unchanged() -> None:
    llm = LLM(
        model="mini",
        tensor_parallel_size=1,
        gpu_memory_utilization=0.9,
        enforce_eager=True,
        trust_remote_code=False,
        tokenizer="mini",
        swap_space=4,
        seed=0,
        max_model_len=512,
        enable_prefix_caching=True,
        disable_log_stats=True,
    )
    assert _tokens(llm, GREEDY) == [list(oracle("mini", tuple(p.encode()), 6)) for p in PROMPTS]
    assert llm.engine.cache_config.num_blocks == int(0.9 * CacheConfig.num_blocks)


def test_seed_makes_unseeded_sampling_reproducible_as_vllms_does() -> None:
    first = _tokens(LLM(model="mini", seed=7), SAMPLED)
    assert _tokens(LLM(model="mini", seed=7), SAMPLED) == first
    assert _tokens(LLM(model="mini", seed=8), SAMPLED) != first
    # A request's own seed still wins over the engine's: the same tokens under any engine seed.
    own = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, seed=3)
    assert _tokens(LLM(model="mini", seed=7), own) == _tokens(LLM(model="mini", seed=8), own)


def test_seed_none_gives_each_unseeded_request_a_generator_of_its_own() -> None:
    """No shared stream (the server's default: one tenant's sampling never moves another's): torch's global
    generator is not moved, two runs differ, and requests sampled in one step hold generators of their own."""
    llm = LLM(model="mini", seed=None)
    torch.manual_seed(11)
    state = torch.get_rng_state()
    first = _tokens(llm, SAMPLED)
    assert torch.equal(torch.get_rng_state(), state), "the global generator moved"
    torch.manual_seed(11)
    assert _tokens(llm, SAMPLED) != first
    ids = [llm.engine.add_request(p, SAMPLED) for p in PROMPTS]
    llm.engine.advance()
    generators = [llm.engine.scheduler.running[i].generator for i in range(len(ids))]
    assert all(g is not None for g in generators) and generators[0] is not generators[1]
    assert llm.engine.generator is None


def test_the_engine_seed_does_not_change_the_weights_the_weights_seed_does() -> None:
    assert _tokens(LLM(model="mini", seed=5), GREEDY) == _tokens(LLM(model="mini", seed=6), GREEDY)
    a = LLM(model="mini", weights_seed=1).model.model.state_dict()
    b = LLM(model="mini").model.model.state_dict()
    assert any(not torch.equal(a[k], b[k]) for k in a)


@settings(max_examples=30, deadline=None)
@given(share=st.floats(min_value=0.001, max_value=1.0), budget=st.integers(min_value=1, max_value=4096))
def test_gpu_memory_utilization_keeps_that_share_of_the_blocks(share: float, budget: int) -> None:
    blocks = KVBudget(share=share).num_blocks(budget, block_nbytes=1024)
    assert blocks == max(1, int(share * budget))
    assert 1 <= blocks <= budget


@pytest.mark.parametrize(("knobs", "blocks"), [({"gpu_memory_utilization": 0.5, "num_blocks": 100}, 50), ({}, 256)])
def test_gpu_memory_utilization_sizes_the_pool(knobs: dict[str, Any], blocks: int) -> None:
    llm = LLM(model="mini", **knobs)
    assert llm.engine.cache_config.num_blocks == llm.engine.storage.num_blocks == blocks


@pytest.mark.parametrize(
    ("model", "knobs"),
    [("mini", {}), ("mini-gqa", {"block_size": 32}), ("mini", {"kv_cache_dtype": "bfloat16"})],
)
def test_kv_cache_memory_bytes_holds_as_many_whole_blocks_as_fit(model: str, knobs: dict[str, Any]) -> None:
    loaded = load_model(model)
    one = kv_block_nbytes(loaded, CacheConfig(**knobs))
    llm = LLM(loaded, kv_cache_memory_bytes=10 * one + one - 1, **knobs)
    assert llm.engine.cache_config.num_blocks == 10
    storage = llm.engine.storage
    assert storage.nbytes() == 10 * one  # the size known before the pool is built is what its tensors take
    assert _tokens(llm, GREEDY)[0] == list(oracle(model, tuple(PROMPTS[0].encode()), 6))


def test_a_budget_smaller_than_one_block_is_refused_with_a_blocks_size() -> None:
    with pytest.raises(ConfigError, match=r"kv_cache_memory_bytes=100 holds no block: one block of this model takes"):
        LLM(model="mini", kv_cache_memory_bytes=100)


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        ({"gpu_memory_utilization": 0}, r"gpu_memory_utilization must be in \(0, 1\], got 0"),
        ({"gpu_memory_utilization": 1.5}, r"gpu_memory_utilization must be in \(0, 1\], got 1.5"),
        ({"kv_cache_memory_bytes": -1}, r"kv_cache_memory_bytes must be a positive int, got -1"),
        ({"kv_cache_memory_bytes": 1 << 20, "num_blocks": 8}, "both size the pool: give one"),
        ({"num_blocks": 8, "num_gpu_blocks_override": 9}, "name the same thing: give one"),
        ({"prefix_caching_hash_algo": "md5"}, "prefix_caching_hash_algo must be one of"),
    ],
)
def test_a_pool_asked_for_two_ways_or_out_of_range_is_refused(knobs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(model="mini", **knobs)


def test_vllms_names_for_kvlabs_knobs() -> None:
    llm = LLM(model="mini", num_gpu_blocks_override=40, prefix_caching_hash_algo="xxhash_cbor")
    assert llm.engine.cache_config.num_blocks == 40
    assert llm.engine.cache_config.hash_algo == "xxh64"


NOOPS = [arg for arg in VLLM_ENGINE_ARGS if arg.is_noop]
REFUSED = {
    "tensor_parallel_size": 2,
    "pipeline_parallel_size": 2,
    "data_parallel_size": 4,
    "distributed_executor_backend": "ray",
    "enforce_eager": "yes",
    "trust_remote_code": 1,
    "disable_custom_all_reduce": None,
    "disable_log_stats": "no",
    "swap_space": -1,
    "cpu_offload_gb": 4,
    "compilation_config": {"level": 3},
    "tokenizer_mode": "slow",
    "skip_tokenizer_init": True,
    "revision": "main",
    "tokenizer_revision": "v1",
    "download_dir": "/tmp/hub",
    "hf_token": "hf_x",
    "load_format": "pt",
    "hf_overrides": {"num_hidden_layers": 2},
}


def test_every_noop_argument_has_a_refused_value_here() -> None:
    assert sorted(REFUSED) == sorted(a.name for a in NOOPS)


@pytest.mark.parametrize("arg", NOOPS, ids=lambda a: a.name)
def test_a_noop_argument_outside_its_noop_values_is_refused_naming_it(arg: Any) -> None:
    value = REFUSED[arg.name]
    with pytest.raises(ValueError, match=rf"^{arg.name}={re.escape(repr(value))}: .* so only .* is accepted$"):
        LLM(model="mini", **{arg.name: value})


def test_noop_arguments_at_their_noop_values_change_no_token() -> None:
    noop = {
        "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1,
        "data_parallel_size": 1,
        "distributed_executor_backend": "mp",
        "enforce_eager": False,
        "trust_remote_code": True,
        "disable_custom_all_reduce": True,
        "swap_space": 0,
        "cpu_offload_gb": 0,
        "compilation_config": None,
        "tokenizer_mode": "auto",
        "skip_tokenizer_init": False,
        "revision": None,
        "load_format": "auto",
    }
    assert _tokens(LLM(model="mini", **noop), GREEDY) == _tokens(LLM(model="mini"), GREEDY)


@pytest.mark.parametrize("dtype", ["half", "float16"])
def test_half_is_refused_naming_the_dtypes_served(dtype: str) -> None:
    with pytest.raises(ValueError, match=rf"dtype='{dtype}': this CPU build serves no float16; use 'auto'"):
        LLM(model="mini", dtype=dtype)


def test_an_unknown_argument_is_refused_naming_it_and_what_is_taken() -> None:
    with pytest.raises(TypeError, match=r"unknown engine knob\(s\) \['speculative_model'\].*vLLM engine arguments: "):
        LLM(model="mini", speculative_model="x")


def test_a_hub_tokenizer_is_refused_nothing_is_downloaded() -> None:
    with pytest.raises(ModelLoadError, match="is not a local directory with tokenizer.json"):
        LLM(model="mini", tokenizer="HuggingFaceTB/SmolLM2-135M-Instruct")


def test_a_local_tokenizer_replaces_the_models(tmp_path: Path) -> None:
    vocab = {"[UNK]": 0, "the": 1, "passphrase": 2, "is": 3}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.save(str(tmp_path / "tokenizer.json"))
    llm = LLM(model="mini", tokenizer=str(tmp_path))
    out = llm.generate(["the passphrase is"], GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids == [1, 2, 3]
    assert list(out.outputs[0].token_ids) == list(oracle("mini", (1, 2, 3), 6))


def test_the_docs_table_lists_every_argument_and_what_it_does_here() -> None:
    rows = {
        m.group(1): m.group(0)
        for m in re.finditer(r"^\| `([a-z_]+)` \|.*\|$", DOC.read_text(encoding="utf-8"), flags=re.M)
    }
    for arg in VLLM_ENGINE_ARGS:
        assert arg.name in rows, f"docs/vllm-users.md has no row for {arg.name}"
        assert arg.kvlab in rows[arg.name], f"the row of {arg.name} does not say {arg.kvlab!r}"
        assert arg.accepted in rows[arg.name]
