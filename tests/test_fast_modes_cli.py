"""The fast modes through every entry point: ``generate``, ``serve`` and ``experiment`` take ``--quantization``
(and the first two ``--attention-backend``), refuse unknown values before any model loads, and give what the
Python API gives in the same mode."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from cli_output import words
from kvlab import LLM, SamplingParams
from kvlab.attention.kernels import paged_attention_kernel
from kvlab.cli import app

runner = CliRunner()


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["generate", "hi", "--quantization", "fp8"], "'fp8' is not one of 'int8', 'int4', 'gguf'"),
        (["generate", "hi", "--attention-backend", "flash"], "'flash' is not one of 'reference', 'cpp'"),
        (["serve", "mini", "--quantization", "int2", "--port", "0"], "'int2' is not one of"),
        (["serve", "mini", "--attention-backend", "cuda", "--port", "0"], "'cuda' is not one of 'reference', 'cpp'"),
        (["serve", "mini", "--kv-cache-dtype", "fp8_e4m3fnuz", "--port", "0"], "'fp8_e4m3fnuz' is not one of 'auto',"),
        (["experiment", "--quantization", "q8_0"], "'q8_0' is not one of"),
        (["experiment", "--kv-cache-dtype", "int4"], "'int4' is not one of 'auto',"),
    ],
)
def test_unknown_modes_are_refused_before_any_model_loads(monkeypatch, args: list[str], error: str) -> None:
    import kvlab.model as model_pkg
    import kvlab.model.loader as loader
    import kvlab.server.serve  # noqa: F401  imported now, so that it never binds the refusing stand-in below

    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the arguments were checked")

    monkeypatch.setattr(loader, "load_model", refuse)
    monkeypatch.setattr(model_pkg, "load_model", refuse)
    res = runner.invoke(app, args)
    assert res.exit_code == 2, res.output
    assert "Invalid value for '--" in words(res.output) and error in words(res.output)


@pytest.mark.parametrize(
    "knobs", [{"quantization": "int8"}, {"attention_backend": "cpp"}, {"kv_cache_dtype": "fp8_e5m2"}]
)
def test_generate_in_a_mode_prints_what_the_api_gives(knobs: dict) -> None:
    if knobs.get("attention_backend") == "cpp" and paged_attention_kernel() is None:
        pytest.skip("no C++ toolchain")
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in knobs.items()]
    res = runner.invoke(app, ["generate", "kvlab", "--max-tokens", "6", *flags])
    assert res.exit_code == 0, res.output
    params = SamplingParams(temperature=0, max_tokens=6)  # as the command samples
    out = LLM("mini", **knobs).generate(["kvlab"], params, use_tqdm=False)[0]
    assert out.text.strip()  # something to compare: an empty text would match any output
    assert res.output.startswith(out.text)


def test_generate_dense_rounds_kv_as_the_engines_cache_does() -> None:
    """``--dense --kv-cache-dtype fp8`` is the oracle of the engine's fp8 cache: both print the engine's text; the
    plain oracle's differs here (the check can fail)."""
    prompt = "hello world"  # its first token already differs with the plain oracle on the mini model
    params = SamplingParams(temperature=0, max_tokens=16)
    want = LLM("mini", kv_cache_dtype="fp8").generate([prompt], params, use_tqdm=False)[0].text
    args = ["generate", prompt, "--max-tokens", "16"]
    engine, dense, plain = (
        runner.invoke(app, [*args, *extra])
        for extra in (["--kv-cache-dtype", "fp8"], ["--dense", "--kv-cache-dtype", "fp8"], ["--dense"])
    )
    assert engine.exit_code == dense.exit_code == plain.exit_code == 0, engine.output + dense.output
    assert want.strip() and engine.output.startswith(want) and dense.output.startswith(want)
    assert not plain.output.startswith(want)


def test_generate_gguf_on_a_model_without_a_gguf_file_is_a_clear_error() -> None:
    res = runner.invoke(app, ["generate", "hi", "--quantization", "gguf"])
    assert res.exit_code == 2 and "gguf" in res.output and "Traceback" not in res.output


def test_the_server_builds_its_engine_in_the_mode() -> None:
    from kvlab.server.serve import ServerConfig, build_engine

    eng = build_engine(ServerConfig(quantization="int8", attention_backend="cpp", cache={"kv_cache_dtype": "fp8"}))
    assert eng.quantization == "int8" and eng.storage.dtype == torch.float8_e4m3fn
    assert (eng.runner.attention_kernel is not None) == (paged_attention_kernel() is not None)


def test_experiment_with_quantised_weights_keeps_its_verdicts(tmp_path) -> None:
    """int8 linears run bf16 activations: a safe strategy may drift by rounding but is never contaminated,
    and the unsafe one is still caught (--check exits 0 only when both hold)."""
    out = tmp_path / "e.json"
    args = ["experiment", "--trials", "6", "--strategies", "isolated,shared-no-cow", "--quantization", "int8"]
    res = runner.invoke(app, [*args, "--check", "--json", str(out)])
    assert res.exit_code == 0, res.output
    summary = json.loads(out.read_text())["summary"]
    assert summary["isolated"]["contaminated_trials"] == 0
    assert summary["shared-no-cow"]["contaminated_trials"] > 0


def test_experiment_on_an_fp8_cache_keeps_its_verdicts(tmp_path) -> None:
    """An fp8 cache rounds K/V that differ in their last fp32 bits between a batch and a lone run: a safe strategy
    may drift, never be contaminated, and the unsafe one is still caught; the config records the cache's dtype."""
    out = tmp_path / "e.json"
    args = ["experiment", "--trials", "6", "--strategies", "isolated,shared-no-cow", "--kv-cache-dtype", "fp8"]
    res = runner.invoke(app, [*args, "--check", "--json", str(out)])
    assert res.exit_code == 0, res.output
    payload = json.loads(out.read_text())
    assert payload["config"]["kv_cache_dtype"] == "fp8"
    assert payload["summary"]["isolated"]["contaminated_trials"] == 0
    assert payload["summary"]["shared-no-cow"]["contaminated_trials"] > 0
