"""``ModeConfig``: the engine's mode in one frozen, validated config; its one error text wherever a mode is
checked; the model a mode runs (``kvlab.model.modes.engine_model``); bench's mode names parsing into it."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from kvlab import LLM
from kvlab.bench.modes import Mode, parse_mode
from kvlab.config import (
    ATTENTION_BACKENDS,
    KV_CACHE_DTYPES,
    QUANTIZATION_MODES,
    ChoiceError,
    ConfigError,
    ModeConfig,
)
from kvlab.engine.engine import Engine
from kvlab.experiment.harness import ExperimentConfig
from kvlab.fuzz.case import FuzzConfig
from kvlab.model.modes import engine_model
from kvlab.model.packed import PackedLinear, packing_available
from kvlab.model.quant import Int8Linear, quantized_model
from oracle_cache import mini

QUANT_ERROR = "quantization must be one of ['int8', 'int4', 'gguf', 'int8-w8a8', 'int8-w8a8-head'] or None, got 'fp8'"
BACKEND_ERROR = "attention_backend must be one of ['reference', 'cpp'], got 'flash'"


def test_the_default_is_the_reference_mode_and_it_is_frozen() -> None:
    mode = ModeConfig()
    assert (mode.quantization, mode.attention_backend, mode.packed_weights) == (None, "reference", None)
    assert not mode.compiled_kernels and ModeConfig(attention_backend="cpp").compiled_kernels
    with pytest.raises(dataclasses.FrozenInstanceError):
        mode.quantization = "int8"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("knobs", "text", "field", "allowed"),
    [
        ({"quantization": "fp8"}, f"ModeConfig.{QUANT_ERROR}", "quantization", (*QUANTIZATION_MODES, None)),
        ({"attention_backend": "flash"}, f"ModeConfig.{BACKEND_ERROR}", "attention_backend", ATTENTION_BACKENDS),
        ({"packed_weights": "yes"}, "ModeConfig.packed_weights must be a bool or None, got 'yes'", None, None),
    ],
)
def test_errors_name_the_field_and_the_allowed_values(knobs: dict, text: str, field: str | None, allowed) -> None:
    with pytest.raises(ConfigError) as err:
        ModeConfig(**knobs)
    assert str(err.value) == text
    if field is not None:  # a refused choice says, for a front end to word it (the CLI names the flag)
        assert isinstance(err.value, ChoiceError)
        assert (err.value.field, err.value.allowed, err.value.value) == (field, allowed, next(iter(knobs.values())))


def test_every_front_end_refuses_a_mode_with_the_same_text() -> None:
    """Engine, LLM, the experiment and the fuzzer validate with the config's own check: one text, whose owner
    is the config the value was given to."""
    for make in (
        lambda: Engine(mini(), quantization="fp8"),
        lambda: Engine(mini(), mode=ModeConfig(quantization="fp8")),
        lambda: LLM(mini(), quantization="fp8"),
    ):
        with pytest.raises(ConfigError) as err:
            make()
        assert str(err.value) == f"ModeConfig.{QUANT_ERROR}"
    with pytest.raises(ConfigError) as err:
        LLM(mini(), attention_backend="flash")
    assert str(err.value) == f"ModeConfig.{BACKEND_ERROR}"
    with pytest.raises(ConfigError) as err:
        ExperimentConfig(quantization="fp8")
    assert str(err.value) == f"ExperimentConfig.{QUANT_ERROR}"
    with pytest.raises(ConfigError) as err:
        FuzzConfig(attention_backend="flash")
    assert str(err.value) == f"FuzzConfig.{BACKEND_ERROR}"
    with pytest.raises(ConfigError) as err:
        Mode("float32", "fp8")
    assert str(err.value) == f"ModeConfig.{QUANT_ERROR}"


def test_the_loose_keywords_and_mode_are_one_mode_never_both() -> None:
    assert ModeConfig.resolve(None, quantization="int8", attention_backend=None) == ModeConfig(quantization="int8")
    assert ModeConfig.resolve(ModeConfig(attention_backend="cpp")) == ModeConfig(attention_backend="cpp")
    with pytest.raises(ConfigError, match="not both"):
        Engine(mini(), mode=ModeConfig(), quantization="int8")
    eng = LLM(mini(), quantization="int8").engine
    assert eng.mode == ModeConfig(quantization="int8") and eng.quantization == "int8"
    assert LLM(mini(), mode=ModeConfig(quantization="int8")).engine.mode == eng.mode
    assert ExperimentConfig(quantization="int4").mode == ModeConfig(quantization="int4")
    assert FuzzConfig(attention_backend="cpp").mode == ModeConfig(attention_backend="cpp")


def test_engine_model_stacks_the_twins_of_the_mode() -> None:
    loaded = mini()
    assert engine_model(loaded, ModeConfig()) is loaded.model  # the mini model is too small to pack
    quant = engine_model(loaded, ModeConfig(quantization="int8"))
    assert quant is quantized_model(loaded, "int8") and any(isinstance(m, Int8Linear) for m in quant.modules())
    assert Engine(loaded, mode=ModeConfig(quantization="int8")).model is quant
    if packing_available():
        packed = engine_model(loaded, ModeConfig(packed_weights=True))
        assert any(isinstance(m, PackedLinear) for m in packed.modules())
        assert not any(isinstance(m, PackedLinear) for m in loaded.model.modules())


def _all_modes() -> list[Mode]:
    quant = [None, *QUANTIZATION_MODES]
    return [Mode(*m) for m in itertools.product(("float32", "bfloat16"), quant, ATTENTION_BACKENDS, KV_CACHE_DTYPES)]


@pytest.mark.parametrize("mode", _all_modes(), ids=lambda m: m.name)
def test_bench_mode_names_round_trip(mode: Mode) -> None:
    assert parse_mode(mode.name) == mode
    assert mode.config == ModeConfig(quantization=mode.quantization, attention_backend=mode.attention_backend)


def test_bench_mode_words_come_from_the_configs() -> None:
    for q in QUANTIZATION_MODES:
        assert parse_mode(q).config == ModeConfig(quantization=q)
    for b in ATTENTION_BACKENDS[1:]:
        assert parse_mode(b).config == ModeConfig(attention_backend=b)
    assert parse_mode("bf16+int4+cpp+kv-bf16") == Mode("bfloat16", "int4", "cpp", "bfloat16")
    with pytest.raises(ConfigError, match="unknown or repeated word 'fp8'"):
        parse_mode("fp32+fp8")
