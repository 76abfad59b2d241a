"""`kvlab memory`: exact sizes, paged vs contiguous, prefix sharing, and the bad-input messages."""

from __future__ import annotations

import json
import re
from fractions import Fraction
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from kvlab.cli.memory import memory_cli
from kvlab.memory import (
    MODEL_SHAPES,
    KVShape,
    MemoryInputError,
    PagingComparison,
    PrefixSharing,
    attention_variants,
    dtype_bytes,
    get_preset,
    human_bytes,
    kv_bytes_per_token,
    kv_cache_bytes,
    load_hf_config,
    parse_lengths,
    resolve_shape,
)

GiB = 2**30
SEED_SHAPE = KVShape(num_layers=32, num_heads=32, num_kv_heads=32, head_dim=128)


# ------------------------------------------------------------------------------------------ sizes


def test_seed_figures_are_exactly_1_gib_and_32_gib() -> None:
    assert kv_cache_bytes(SEED_SHAPE, seq_len=2048, batch=1, dtype="fp16") == GiB
    assert kv_cache_bytes(SEED_SHAPE, seq_len=2048, batch=32, dtype="fp16") == 32 * GiB
    assert kv_cache_bytes(MODEL_SHAPES["llama-2-7b"], seq_len=2048, batch=1, dtype="fp16") == GiB


def test_llama_2_70b_gqa_is_exactly_one_eighth_of_mha() -> None:
    variants = attention_variants(get_preset("llama-2-70b"))
    mha, gqa, mqa = (kv_cache_bytes(shape, 4096, 8, "fp16") for _, shape in variants)
    assert Fraction(gqa, mha) == Fraction(1, 8)
    assert Fraction(mqa, mha) == Fraction(1, 64)
    # 2 x 80 layers x 8 kv_heads x 128 dims x 2 bytes, worked out by hand.
    assert kv_bytes_per_token(get_preset("llama-2-70b"), "fp16") == 327_680
    assert gqa == 327_680 * 4096 * 8 == 10 * GiB


def test_attention_variants_keep_everything_but_kv_heads() -> None:
    variants = attention_variants(get_preset("smollm2-135m"))
    assert [label for label, _ in variants] == ["MHA", "GQA (this model)", "MQA"]
    assert [s.num_kv_heads for _, s in variants] == [9, 3, 1]
    assert {(s.num_layers, s.num_heads, s.head_dim) for _, s in variants} == {(30, 9, 64)}


@pytest.mark.parametrize(
    ("dtype", "expected"), [("fp32", 2 * GiB), ("bf16", GiB), ("int8", GiB // 2), ("fp8", GiB // 2)]
)
def test_dtype_scales_the_size(dtype: str, expected: int) -> None:
    assert kv_cache_bytes(SEED_SHAPE, 2048, 1, dtype) == expected


@pytest.mark.parametrize(
    ("num_bytes", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.00 KiB"),
        (1536, "1.50 KiB"),
        (327_680, "320.00 KiB"),
        (160 * 2**20, "160.00 MiB"),
        (GiB, "1.00 GiB"),
        (GiB - 1, "1024.00 MiB"),
        (32 * GiB, "32.00 GiB"),
        (2**60, "1024.00 PiB"),
    ],
)
def test_human_bytes(num_bytes: int, text: str) -> None:
    assert human_bytes(num_bytes) == text


# ------------------------------------------------------------------------------ paged vs contiguous


def test_paged_vs_contiguous_hand_computed_mix() -> None:
    # Blocks: ceil(17/16)=2, ceil(100/16)=7, ceil(3/16)=1, ceil(64/16)=4 -> 14 blocks, 224 slots.
    cmp = PagingComparison(lengths=(17, 100, 3, 64), block_size=16, max_seq_len=128)
    assert cmp.used_slots == 184
    assert cmp.contiguous_slots == 4 * 128 == 512
    assert cmp.contiguous_waste == 328
    assert cmp.contiguous_utilisation == Fraction(184, 512)
    assert cmp.paged_blocks == 14
    assert cmp.paged_slots == 224
    assert cmp.paged_waste == 40
    assert cmp.paged_utilisation == Fraction(184, 224)


def test_paged_waste_is_zero_on_block_multiples_and_below_one_block_per_sequence() -> None:
    assert PagingComparison((16, 32, 128), block_size=16, max_seq_len=128).paged_waste == 0
    worst = PagingComparison((1, 17, 33), block_size=16, max_seq_len=128)
    assert worst.paged_waste == 3 * 15


@pytest.mark.parametrize(
    ("lengths", "block_size", "max_seq_len", "needle"),
    [
        ((17, 200), 16, 128, "lengths[1] must be an int in [1, max_seq_len=128], got 200"),
        ((0,), 16, 128, "lengths[0] must be an int in [1, max_seq_len=128], got 0"),
        ((), 16, 128, "lengths must be a non-empty tuple"),
        ((4,), 0, 128, "PagingComparison.block_size must be >= 1, got 0"),
        ((4,), 16, 0, "PagingComparison.max_seq_len must be >= 1, got 0"),
    ],
)
def test_paging_rejects_bad_input(lengths: tuple[int, ...], block_size: int, max_seq_len: int, needle: str) -> None:
    with pytest.raises(MemoryInputError) as err:
        PagingComparison(lengths, block_size, max_seq_len)
    assert needle in str(err.value)


def test_parse_lengths() -> None:
    assert parse_lengths("17,100,3,64") == (17, 100, 3, 64)
    assert parse_lengths(" 5, 6 ") == (5, 6)
    for bad in ("17,x", "", "1,,2", "-3"):
        with pytest.raises(MemoryInputError, match="comma-separated positive integers"):
            parse_lengths(bad)


# ---------------------------------------------------------------------------------- prefix sharing


def test_prefix_sharing_saves_n_minus_one_prefixes() -> None:
    share = PrefixSharing(requests=4, prefix_len=500, block_size=16)
    assert share.tokens_unshared == 2000
    assert share.tokens_shared == 500
    assert share.saved_tokens == 3 * 500
    # 500 // 16 = 31 whole blocks stay shared; the 4-token tail is copied on write.
    assert share.saved_blocks == 3 * 31
    assert share.saved_block_tokens == 1488
    assert PrefixSharing(requests=1, prefix_len=500).saved_tokens == 0


def test_prefix_sharing_rejects_bad_input() -> None:
    with pytest.raises(MemoryInputError, match=r"PrefixSharing\.requests must be >= 1, got 0"):
        PrefixSharing(requests=0, prefix_len=10)
    with pytest.raises(MemoryInputError, match=r"PrefixSharing\.prefix_len must be >= 1, got 0"):
        PrefixSharing(requests=2, prefix_len=0)


# ------------------------------------------------------------------------------ shapes and presets


def test_kv_shape_validation_names_field_and_allowed_values() -> None:
    divisors = r"\(allowed: \[1, 2, 4, 8, 16, 32\]\)"
    with pytest.raises(MemoryInputError, match=rf"num_kv_heads must divide num_heads=32 {divisors}, got 5"):
        KVShape(num_layers=2, num_heads=32, num_kv_heads=5, head_dim=64)
    with pytest.raises(MemoryInputError, match=r"KVShape\.num_kv_heads must be in \[1, 4\], got 8"):
        KVShape(num_layers=2, num_heads=4, num_kv_heads=8, head_dim=64)
    with pytest.raises(MemoryInputError, match=r"KVShape\.num_layers must be >= 1, got 0"):
        KVShape(num_layers=0, num_heads=4, num_kv_heads=4, head_dim=64)
    with pytest.raises(MemoryInputError, match=r"KVShape\.head_dim must be an int, got True"):
        KVShape(num_layers=2, num_heads=4, num_kv_heads=4, head_dim=True)


def test_seq_len_batch_and_dtype_are_checked() -> None:
    with pytest.raises(MemoryInputError, match=r"seq_len must be >= 1, got 0"):
        kv_cache_bytes(SEED_SHAPE, seq_len=0)
    with pytest.raises(MemoryInputError, match=r"batch must be >= 1, got -1"):
        kv_cache_bytes(SEED_SHAPE, seq_len=8, batch=-1)
    with pytest.raises(MemoryInputError) as err:
        dtype_bytes("fp4")
    assert "dtype must be one of ['fp32', 'fp16', 'bf16', 'int8', 'fp8'], got 'fp4'" in str(err.value)


def test_unknown_preset_names_the_allowed_presets() -> None:
    with pytest.raises(MemoryInputError) as err:
        get_preset("llama-3")
    assert err.value.field == "preset"
    allowed = "allowed presets: llama-2-7b, llama-2-70b, smollm2-135m, mini"
    assert f"unknown preset 'llama-3'; {allowed}" in str(err.value)


def test_explicit_values_override_the_preset() -> None:
    shape = resolve_shape(preset="llama-2-70b", kv_heads=1, layers=40)
    assert (shape.num_layers, shape.num_heads, shape.num_kv_heads, shape.head_dim) == (40, 64, 1, 128)
    assert resolve_shape(preset="mini") == MODEL_SHAPES["mini"]


def test_shape_from_flags_alone_defaults_to_mha_and_needs_the_rest() -> None:
    assert resolve_shape(layers=32, heads=32, head_dim=128) == SEED_SHAPE
    with pytest.raises(MemoryInputError, match=r"missing: --layers --head-dim"):
        resolve_shape(heads=8)


def test_preset_and_config_together_are_refused(tmp_path: Path) -> None:
    with pytest.raises(MemoryInputError, match="give --preset or --config, not both"):
        resolve_shape(preset="mini", config=tmp_path / "config.json")


# --------------------------------------------------------------------------------- HF config.json

# The fields of HuggingFaceTB/SmolLM2-135M-Instruct's config.json that size the cache.
SMOLLM2_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 576,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "num_hidden_layers": 30,
    "intermediate_size": 1536,
    "vocab_size": 49152,
}
GPT2_CONFIG = {
    "architectures": ["GPT2LMHeadModel"],
    "model_type": "gpt2",
    "n_layer": 12,
    "n_head": 12,
    "n_embd": 768,
}


def _write_config(directory: Path, cfg: dict) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "config.json"
    path.write_text(json.dumps(cfg))
    return path


def _dims(shape: KVShape) -> tuple[int, int, int, int]:
    return shape.num_layers, shape.num_heads, shape.num_kv_heads, shape.head_dim


def test_config_json_of_smollm2_matches_the_preset(tmp_path: Path) -> None:
    path = _write_config(tmp_path / "SmolLM2-135M-Instruct", SMOLLM2_CONFIG)
    shape = load_hf_config(path)
    assert _dims(shape) == _dims(MODEL_SHAPES["smollm2-135m"])
    assert shape.name == "SmolLM2-135M-Instruct"
    # A model directory works as well as the file inside it.
    assert load_hf_config(path.parent) == shape


def test_config_json_head_dim_and_kv_heads_defaults(tmp_path: Path) -> None:
    # Qwen3 states head_dim, and it is not hidden_size / heads (1024 / 16 = 64).
    qwen3 = {
        "model_type": "qwen3",
        "hidden_size": 1024,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "num_hidden_layers": 28,
        "head_dim": 128,
    }
    assert _dims(load_hf_config(_write_config(tmp_path / "q", qwen3))) == (28, 16, 8, 128)
    # No num_key_value_heads (older Llama configs) means MHA; head_dim null means hidden / heads.
    old = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "head_dim": None,
    }
    assert _dims(load_hf_config(_write_config(tmp_path / "l", old))) == _dims(SEED_SHAPE)


def test_config_json_written_by_transformers(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        hidden_size=8192,
        num_attention_heads=64,
        num_key_value_heads=8,
        num_hidden_layers=80,
        intermediate_size=28672,
    )
    cfg.save_pretrained(tmp_path)
    assert _dims(load_hf_config(tmp_path)) == _dims(MODEL_SHAPES["llama-2-70b"])


def test_config_of_unsupported_architecture_is_refused(tmp_path: Path) -> None:
    path = _write_config(tmp_path / "gpt2", GPT2_CONFIG)
    with pytest.raises(MemoryInputError) as err:
        load_hf_config(path)
    msg = str(err.value)
    assert "unsupported architecture (model_type='gpt2', architectures=['GPT2LMHeadModel'])" in msg
    assert "model_type one of ['llama', 'mistral', 'mixtral', 'qwen2', 'qwen3']" in msg


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object, got list"),
        ({"num_hidden_layers": None}, "config.num_hidden_layers must be an int, got None"),
        ({"num_attention_heads": 0}, "config.num_attention_heads must be >= 1, got 0"),
        ({"num_key_value_heads": 2}, "KVShape.num_kv_heads must divide num_heads=9"),
        ({"hidden_size": 577}, "hidden_size=577 is not divisible by num_attention_heads=9"),
    ],
)
def test_broken_config_json_is_refused(tmp_path: Path, content: str | dict, needle: str) -> None:
    path = tmp_path / "config.json"
    # A dict is a change to an otherwise valid SmolLM2 config.
    path.write_text(content if isinstance(content, str) else json.dumps({**SMOLLM2_CONFIG, **content}))
    with pytest.raises(MemoryInputError) as err:
        load_hf_config(path)
    assert err.value.field == "config"
    assert needle in str(err.value)


def test_missing_config_path_is_refused(tmp_path: Path) -> None:
    with pytest.raises(MemoryInputError, match=r"config file not found: .*nope\.json"):
        load_hf_config(tmp_path / "nope.json")
    # An existing directory without a config.json in it.
    with pytest.raises(MemoryInputError, match=r"config file not found: .*config\.json"):
        load_hf_config(tmp_path)


# ------------------------------------------------------------------------------------------- CLI

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _app() -> typer.Typer:
    app = typer.Typer()

    # A callback makes this a group, so `memory` is a subcommand as in kvlab's own CLI.
    @app.callback()
    def main() -> None:
        pass

    app.command("memory")(memory_cli)
    return app


def _run(*args: str) -> tuple[int, str]:
    # Wide columns so table rows are not wrapped; colour forced by CI variables is stripped below.
    result = CliRunner().invoke(_app(), ["memory", *args], env={"COLUMNS": "200"})
    return result.exit_code, _ANSI.sub("", result.output)


def _row(output: str, label: str) -> list[str]:
    """The cells of the first table row whose first cell is ``label``."""
    for line in output.splitlines():
        cells = [c.strip() for c in re.split(r"[│┃]", line)]
        if len(cells) > 2 and cells[1] == label:
            return cells[2:-1]
    raise AssertionError(f"no row {label!r} in:\n{output}")


def _flat(output: str) -> str:
    """Error panels wrap and frame their text; undo that so a message can be matched whole."""
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", output).split())


def test_cli_seed_figures() -> None:
    code, out = _run("--layers", "32", "--heads", "32", "--head-dim", "128", "--seq-len", "2048", "--batch", "32")
    assert code == 0, out
    assert _row(out, "per sequence (2048 tok)")[0] == "1.00 GiB"
    assert _row(out, "batch of 32")[0] == "32.00 GiB"
    assert _row(out, "bytes")[0] == f"{32 * GiB:,}"
    assert _row(out, "kv_heads") == ["32", "32", "1"]


def test_cli_70b_side_by_side_paging_and_sharing() -> None:
    code, out = _run(
        "--preset",
        "llama-2-70b",
        "--seq-len",
        "4096",
        "--batch",
        "8",
        "--lengths",
        "17,100,3,64",
        "--block-size",
        "16",
        "--max-seq-len",
        "128",
        "--shared-prefix",
        "500",
        "--num-requests",
        "4",
    )
    assert code == 0, out
    assert _row(out, "kv_heads") == ["64", "8", "1"]
    assert _row(out, "per token") == ["2.50 MiB", "320.00 KiB", "40.00 KiB"]
    assert _row(out, "batch of 8") == ["80.00 GiB", "10.00 GiB", "1.25 GiB"]
    assert _row(out, "vs MHA") == ["1", "1/8", "1/64"]
    # Paging rows, at 320 KiB per token: 512 vs 224 slots reserved, 328 vs 40 wasted.
    assert _row(out, "reserved slots") == ["512", "224"]
    assert _row(out, "wasted slots") == ["328", "40"]
    assert _row(out, "utilisation") == ["35.94%", "82.14%"]
    assert _row(out, "reserved memory") == ["160.00 MiB", "70.00 MiB"]
    assert _row(out, "wasted memory") == ["102.50 MiB", "12.50 MiB"]
    assert _row(out, "saved ((N-1) x P)") == ["1500", "468.75 MiB"]
    assert _row(out, "saved, whole blocks (93 blocks)") == ["1488", "465.00 MiB"]


def test_cli_only_prints_the_tables_asked_for() -> None:
    code, out = _run("--preset", "mini")
    assert code == 0, out
    assert "KV cache: mini" in out
    assert "Paged vs contiguous" not in out
    assert "Prefix sharing" not in out


def test_cli_explicit_flag_overrides_preset() -> None:
    code, out = _run("--preset", "llama-2-70b", "--layers", "40")
    assert code == 0, out
    assert _row(out, "per token")[1] == "160.00 KiB"


def test_cli_max_seq_len_defaults_to_seq_len() -> None:
    code, out = _run("--preset", "mini", "--seq-len", "64", "--lengths", "17,100")
    assert code == 2
    assert "lengths[1] must be an int in [1, max_seq_len=64], got 100" in _flat(out)


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (
            ["--preset", "llama-3"],
            [
                "Invalid value for --preset",
                "unknown preset 'llama-3'",
                "allowed presets: llama-2-7b, llama-2-70b, smollm2-135m, mini",
            ],
        ),
        (
            ["--preset", "mini", "--kv-heads", "3"],
            ["for --kv-heads", "num_kv_heads must divide num_heads=4 (allowed: [1, 2, 4]), got 3"],
        ),
        (["--preset", "mini", "--dtype", "fp4"], ["Invalid value for --dtype", "dtype must be one of"]),
        (["--preset", "mini", "--lengths", "3,a"], ["for --lengths", "comma-separated positive integers"]),
        (["--preset", "mini", "--num-requests", "3"], ["for --num-requests", "only meaningful with --shared-prefix"]),
        (["--preset", "mini", "--max-seq-len", "3"], ["for --max-seq-len", "only meaningful with --lengths"]),
        (["--heads", "8"], ["no model shape", "missing: --layers --head-dim"]),
    ],
)
def test_cli_bad_input(args: list[str], needles: list[str]) -> None:
    code, out = _run(*args)
    assert code == 2, out
    flat = _flat(out)
    for needle in needles:
        assert needle in flat, flat


def test_cli_config_path_that_does_not_exist(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model" / "config.json"
    code, out = _run("--config", str(missing))
    assert code == 2, out
    assert "Invalid value for --config" in _flat(out)
    assert "config file not found" in _flat(out)
    assert "no-such-model" in _flat(out)


def test_cli_config_of_unsupported_architecture(tmp_path: Path) -> None:
    path = _write_config(tmp_path / "gpt2", GPT2_CONFIG)
    code, out = _run("--config", str(path))
    assert code == 2, out
    flat = _flat(out)
    assert "Invalid value for --config" in flat
    assert "unsupported architecture" in flat
    assert "'gpt2'" in flat and "GPT2LMHeadModel" in flat


def test_cli_config_of_llama_family(tmp_path: Path) -> None:
    path = _write_config(tmp_path / "SmolLM2-135M-Instruct", SMOLLM2_CONFIG)
    code, out = _run("--config", str(path), "--seq-len", "8192")
    assert code == 0, out
    # 2 x 30 x 3 x 64 x 2 B = 23,040 B per token; x 8192 = 180 MiB.
    assert _row(out, "per sequence (8192 tok)") == ["540.00 MiB", "180.00 MiB", "60.00 MiB"]
