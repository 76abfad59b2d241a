"""Smoke tests of ``kvlab bench``: tiny sizes, the mini model, real measurements checked for consistency
(never for speed: no wall-clock threshold here)."""

from __future__ import annotations

import json
from typing import ClassVar

import pytest
from typer.testing import CliRunner

from cli_output import words
from kvlab.bench.studies.memory_use import measure_paging, measure_sharing, mixed_lengths
from kvlab.bench.studies.sweep import SweepPoint, find_knee, percentile
from kvlab.bench.studies.throughput import compare_throughput, llama_cpp_available
from kvlab.bench.workloads import shared_prefix_prompts
from kvlab.cli import app
from kvlab.memory import get_preset
from oracle_cache import mini

runner = CliRunner()


def invoke(*args: str) -> str:
    res = runner.invoke(app, ["bench", *args])
    assert res.exit_code == 0, res.output
    return res.output


def test_throughput_runs_every_peer_and_checks_tokens(tmp_path) -> None:
    out = tmp_path / "t.json"
    text = invoke(
        "throughput", "--model", "mini", "--requests", "3", "--max-tokens", "4", "--threads", "1", "--json", str(out)
    )
    rows = json.loads(out.read_text())
    assert [r["peer"] for r in rows] == ["kvlab float32", "hf-generate", "hf-generate-batch"]
    assert all(r["output_tokens"] == 12 for r in rows)
    # Same weights, greedy, fp32: the peers must agree with kvlab token for token.
    assert [r["identical_outputs"] for r in rows[1:]] == [3, 3]
    assert all(r["kvlab_speedup"] > 0 for r in rows)
    # The baseline is HF generate: its own ratio is 1, kvlab's is the inverse of its speed-up over it.
    assert rows[1]["speed_vs_baseline"] == 1.0
    assert rows[0]["speed_vs_baseline"] == pytest.approx(rows[1]["kvlab_speedup"], rel=2e-3)
    assert rows[0]["resident_mib"] > 0 and rows[1]["resident_mib"] is None
    # The limits kvlab's floor was priced at, measured in this run, in the title and with the row.
    priced = rows[0]["floor_priced_at"]
    assert priced["memory_gbps"] > 0 and set(priced["matmul_peak_gflops"]) == {"float32"}
    assert rows[1]["floor_priced_at"] is None
    assert f"floors priced at matmul peak float32 {priced['matmul_peak_gflops']['float32']:.1f} GFLOP/s" in text
    if not llama_cpp_available():  # the default peer list asks for it: skipped, and said so
        assert "llama.cpp skipped: llama-cpp-python is not installed" in text


def test_throughput_runs_several_modes_in_one_run(tmp_path) -> None:
    """fp32 and fp32 + cpp give the same greedy tokens (the kernel's tests hold it to 1e-5 of the reference);
    a bf16 mode runs on a bf16 copy of the model and its engine holds half the weight bytes."""
    out = tmp_path / "m.json"
    invoke("throughput", "--model", "mini", "--requests", "3", "--max-tokens", "4", "--threads", "1",
           "--modes", "fp32,fp32+cpp,bf16+kv-bf16", "--peers", "hf-generate,hf-generate-bf16",
           "--json", str(out))  # fmt: skip
    rows = {r["peer"]: r for r in json.loads(out.read_text())}
    assert list(rows) == [
        "kvlab float32",
        "kvlab float32 + cpp",
        "kvlab bfloat16 + kv bfloat16",
        "hf-generate",
        "hf-generate bfloat16",
    ]
    assert rows["kvlab float32 + cpp"]["identical_outputs"] == 3
    assert rows["kvlab bfloat16 + kv bfloat16"]["resident_mib"] < rows["kvlab float32"]["resident_mib"]
    assert all(r["output_tokens"] == 12 for r in rows.values())


@pytest.mark.parametrize(
    ("text", "error"), [("fp32+bf16", "repeated word 'bf16'"), ("fp16", "unknown or repeated word 'fp16'")]
)
def test_a_bad_mode_is_refused_before_any_model_loads(text: str, error: str) -> None:
    res = runner.invoke(app, ["bench", "step", "--modes", text])
    assert res.exit_code == 2 and "Invalid value for '--modes'" in words(res.output) and error in words(res.output)


def test_modes_parse_into_engine_knobs() -> None:
    from kvlab.bench.modes import Mode, parse_mode, parse_modes

    assert parse_mode("bf16+gguf+cpp+kv-fp32") == Mode("bfloat16", "gguf", "cpp", "float32")
    assert parse_mode("cpp").engine_knobs() == {"quantization": None, "attention_backend": "cpp"}
    assert parse_mode("int8+kv-bf16").engine_knobs()["kv_cache_dtype"] == "bfloat16"
    assert parse_modes("fp32, fp32 ,bf16") == [Mode(), Mode("bfloat16")]
    assert Mode("bfloat16", "int4", "cpp").name == "bfloat16 + int4 + cpp"


def test_the_modes_help_names_every_kv_cache_dtype_and_each_word_parses() -> None:
    from kvlab.bench.modes import parse_mode
    from kvlab.cli.bench.options import KV_WORDS
    from kvlab.config import KV_CACHE_DTYPES

    assert {parse_mode(w).kv_cache_dtype for w in KV_WORDS} == set(KV_CACHE_DTYPES) - {"auto"}
    shown = "".join(runner.invoke(app, ["bench", "step", "--help"], terminal_width=400).output.split())
    assert "|".join(KV_WORDS) + "(KVcachedtype)" in shown


def test_throughput_rejects_an_unknown_peer() -> None:
    res = runner.invoke(app, ["bench", "throughput", "--model", "mini", "--peers", "sglang"])
    assert res.exit_code == 2
    known = "hf-generate, hf-generate-bf16, hf-generate-batch, llama.cpp, vllm, vllm-bf16, vllm-w8a8, vllm-w8a8-bf16, "
    known += "vllm-kv-fp8, vllm-bf16-kv-fp8, vllm-w8a8-bf16-kv-fp8"
    assert f"expected comma-separated peers from {known}, got 'sglang'" in words(res.output)


def test_a_result_table_is_drawn_with_its_heading_and_notes() -> None:
    from rich.console import Console

    from kvlab.bench.table import Column, result_table
    from kvlab.cli.common import render

    with pytest.raises(ValueError, match="a row of 1 cells for 2 columns"):
        result_table("t", ("a", "b"), [("x",)])
    table = result_table("the title", ("a", Column("b", "right")), [("x", "[red]NO[/red]")], ["a note"], "setup")
    assert table.headers == ("a", "b") and table.columns[1].justify == "right"
    out = Console(record=True, width=80)
    render(out, table)
    lines = [line.strip() for line in out.export_text().splitlines() if line.strip()]
    assert lines[0] == "setup" and lines[1] == "the title" and lines[-1] == "a note"
    assert any("x" in line and line.endswith("NO │") for line in lines)  # markup rendered, not printed


def test_peers_are_planned_before_any_model_loads(monkeypatch, tmp_path) -> None:
    from kvlab.bench.peers.plan import PeerError, PeerPlan, plan_peers

    with pytest.raises(PeerError, match=r"unknown peer\(s\) \['sglang'\]"):
        plan_peers("mini", ["hf-generate", "sglang"])
    plan = plan_peers("mini", ["hf-generate", "llama.cpp", "hf-generate"])
    why = "llama-cpp-python is not installed" if not llama_cpp_available() else "the model is not a GGUF file"
    assert plan == PeerPlan(("hf-generate",), (("llama.cpp", f"{why} (kvlab never installs it)"),))
    assert plan.needs_hf and not plan_peers("mini", []).needs_hf
    monkeypatch.delenv("KVLAB_VLLM_PYTHON", raising=False)
    monkeypatch.setattr("kvlab.bench.peers.vllm_peer.DEFAULT_PEERS", tmp_path)
    with pytest.raises(PeerError, match="needs --vllm-python"):
        plan_peers("mini", ["vllm"])
    with pytest.raises(PeerError, match="--peers vllm-bf16 needs --vllm-python"):  # the same worker, in bf16
        plan_peers("mini", ["hf-generate", "vllm-bf16"])
    with pytest.raises(PeerError, match="needs --vllm-model: an HF directory of mini's weights"):
        plan_peers("mini", ["vllm"], vllm_python="python")
    vllm = plan_peers("mini", ["vllm", "vllm-bf16"], vllm_python="python", vllm_model=str(tmp_path))
    assert (vllm.peers, vllm.vllm_python, vllm.vllm_model) == (("vllm", "vllm-bf16"), "python", str(tmp_path))
    # The W8A8 peers need a directory of int8 codes: one with a quantisation config, not the fp32 one.
    with pytest.raises(PeerError, match="--peers vllm-w8a8 needs --vllm-w8a8-model: .* as W8A8 int8 codes"):
        plan_peers("mini", ["vllm-w8a8"], vllm_python="python", vllm_w8a8_model=str(tmp_path))
    monkeypatch.delenv("KVLAB_VLLM_W8A8_MODEL", raising=False)
    with pytest.raises(PeerError, match=f"{tmp_path / 'smollm2-w8a8'} is not one; scripts/peers/vllm.sh writes"):
        plan_peers("smollm2", ["vllm-w8a8-bf16"], vllm_python="python")
    (tmp_path / "config.json").write_text('{"quantization_config": {"quant_method": "compressed-tensors"}}')
    w8a8 = plan_peers("mini", ["vllm-w8a8-bf16"], vllm_python="python", vllm_w8a8_model=str(tmp_path))
    assert (w8a8.peers, w8a8.vllm_model, w8a8.vllm_w8a8_model) == (("vllm-w8a8-bf16",), None, str(tmp_path))


def test_sweep_writes_points_and_plot(tmp_path) -> None:
    png, out = tmp_path / "s.png", tmp_path / "s.json"
    invoke(
        "sweep", "--model", "mini", "--num-prompts", "6", "--max-tokens", "3", "--max-num-seqs", "1,3",
        "--max-num-batched-tokens", "32,256", "--threads", "1", "--plot", str(png), "--json", str(out),
    )  # fmt: skip
    data = json.loads(out.read_text())
    assert [p["max_num_seqs"] for p in data["max_num_seqs"]] == [1, 3]
    assert [p["max_num_batched_tokens"] for p in data["max_num_batched_tokens"]] == [32, 256]
    for p in data["max_num_seqs"] + data["max_num_batched_tokens"]:
        assert p["output_tokens"] == 18
        assert 0 < p["ttft_p50"] <= p["ttft_p99"] <= p["e2e_p99"]
    # One seat: requests run one after another, so the steps are at least requests x tokens.
    assert data["max_num_seqs"][0]["steps"] >= 6 * 3
    assert data["max_num_seqs"][1]["steps"] < data["max_num_seqs"][0]["steps"]
    # A 32-token budget chunks the ~110-token prompts: more steps than with 256.
    assert data["max_num_batched_tokens"][0]["steps"] > data["max_num_batched_tokens"][1]["steps"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _point(seqs: int, tput: float, tpot: float) -> SweepPoint:
    return SweepPoint(seqs, 256, 1.0, int(tput), 1, 0.1, 0.1, tpot, tpot, 1.0, 1.0)


def test_knee_is_the_last_point_before_throughput_flattens_and_latency_climbs() -> None:
    points = [_point(8, 100, 0.010), _point(16, 180, 0.011), _point(32, 190, 0.020), _point(64, 192, 0.040)]
    assert find_knee(points).max_num_seqs == 16
    growing = [_point(8, 100, 0.01), _point(16, 200, 0.011), _point(32, 400, 0.012)]
    assert find_knee(growing) is None
    # Flat throughput but latency falling is not a knee (noise, or a better batch shape).
    assert find_knee([_point(8, 100, 0.02), _point(16, 101, 0.01)]) is None


def test_percentile_is_numpys_linear_one_as_bench_serve_reports() -> None:
    """p99 of n sorted values lies at 0-based position 0.99 * (n - 1), between the two values around it (numpy's
    default, as vLLM's and kvlab's bench serve): 1..100 puts it at 98.01, a hundredth of the way from 99 to 100,
    where the nearest rank said 99."""
    values = list(range(100, 0, -1))
    assert percentile(values, 99) == pytest.approx(99 + 0.01 * (100 - 99))
    assert percentile(values, 50) == pytest.approx(50.5)  # position 49.5: the mean of the middle two, the median
    assert percentile([1.0, 2.0, 4.0, 8.0], 99) == pytest.approx(4.0 + 0.97 * (8.0 - 4.0))  # position 2.97
    assert percentile([3.0], 99) == 3.0


def test_layout_reports_both_layouts(tmp_path) -> None:
    out = tmp_path / "l.json"
    invoke(
        "layout", "--model", "mini-gqa", "--batches", "2", "--contexts", "16,40", "--threads", "1",
        "--min-run-time", "0.01", "--json", str(out),
    )  # fmt: skip
    rows = json.loads(out.read_text())
    expected = [("write", 16), ("decode-read", 16), ("write", 40), ("decode-read", 40)]
    assert [(r["op"], r["context"]) for r in rows] == expected
    assert all(r["nhd_us"] > 0 and r["hnd_us"] > 0 for r in rows)


def test_memory_measurement_matches_the_calculator() -> None:
    lengths = mixed_lengths(12, 256, seed=3)
    m = measure_paging(lengths, 16, 256, get_preset("mini"))
    assert m.peak_blocks == m.predicted_blocks  # the manager holds exactly ceil(len / 16) blocks per sequence
    assert m.used_tokens == sum(p + o for p, o in lengths)
    assert m.paged_utilisation > m.contiguous_utilisation
    s = measure_sharing(5, 40, 3)  # 2 full blocks of 16 shared, the 8-token tail copied on write
    assert s.saved_blocks == s.predicted_saved_blocks == 4 * 2
    assert s.ideal_saved_tokens == 4 * 40


def test_memory_command_and_bad_sharing_spec(tmp_path) -> None:
    out = tmp_path / "m.json"
    invoke("memory", "--sequences", "6", "--max-seq-len", "128", "--sharing", "3:33:2", "--json", str(out))
    data = json.loads(out.read_text())
    assert data["sharing"][0]["saved_blocks"] == 2 * 2
    res = runner.invoke(app, ["bench", "memory", "--sharing", "3:x"])
    assert res.exit_code == 2
    assert "N:P:S" in res.output


@pytest.mark.parametrize("batch", [1, 4])
def test_step_times_the_forward_inside_the_step(batch: int) -> None:
    from kvlab.bench.studies.step import decode_step_timing

    t = decode_step_timing(mini(), batch=batch, context=20, steps=3, warmup=1)
    assert t.batch == batch
    assert 0 < t.forward_ms <= t.step_ms  # the forward is part of the step it was timed in
    assert 0 < t.prepare_ms <= t.step_ms
    assert t.flops > 0


def test_the_roofline_peak_is_the_better_of_matmul_and_the_engines_own_linears(monkeypatch) -> None:
    """In fp32 ``torch.matmul`` is MKL's sgemm, at half of oneDNN's rate on this AMD VM: a peak from it alone put
    fp32 + cpp's 64-row step "below the roofline" (0.80x). Both products are timed and the faster one counts: on a
    clock the two products advance by 10 and 1 seconds a call, the peak is the packed product's rate."""
    import torch

    from kvlab.bench.studies import step
    from kvlab.model.packed import PackedLinear, packable

    clock = [0.0]
    real_matmul, real_forward = torch.matmul, PackedLinear.forward

    def slow_matmul(*args):  # type: ignore[no-untyped-def]
        clock[0] += 10.0
        return real_matmul(*args)

    def fast_forward(self, x):  # type: ignore[no-untyped-def]
        clock[0] += 1.0
        return real_forward(self, x)

    monkeypatch.setattr(step.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(torch, "matmul", slow_matmul)
    monkeypatch.setattr(PackedLinear, "forward", fast_forward)
    peak = step.matmul_roofline(size=128, repeats=2)
    seconds = 1.0 if packable(torch.nn.Linear(128, 128, bias=False)) else 10.0
    assert peak == pytest.approx(2 * 128**3 / seconds / 1e9)
    before = clock[0]
    peaks = step.matmul_peaks(["float32", "float32"])
    assert peaks.keys() == {"float32"}
    # One measurement a dtype: each product once to warm up and once timed at side 256, then 1 + 5 runs. A product
    # of 10 (fake) seconds at 256 would take ~80 min at the default 2048: the side stays at 256.
    assert clock[0] - before == 8 * (10.0 + (1.0 if seconds == 1.0 else 0.0))
    assert peaks["float32"] == pytest.approx(2 * 256**3 / seconds / 1e9)


def test_the_roofline_keeps_its_side_where_a_product_is_fast(monkeypatch) -> None:
    """The side is cut only as far as the budget needs: at a (fake) 1 ms per 256-cube product, 2048 takes ~0.5 s,
    and six of those do not fit the 2 s budget; at 1024 they do."""
    import torch

    from kvlab.bench.studies import step

    clock = [0.0]
    sides: list[int] = []
    real_matmul = torch.matmul

    def timed(a, b):  # type: ignore[no-untyped-def]
        sides.append(a.shape[0])
        clock[0] += 1e-3 * (a.shape[0] / 256) ** 3
        return real_matmul(a, b)

    monkeypatch.setattr(step.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(torch, "matmul", timed)
    monkeypatch.setattr(step, "packable", lambda linear: False)
    step.matmul_roofline()
    assert sides == [256, 256] + [1024] * 6


def test_step_command(tmp_path) -> None:
    out = tmp_path / "st.json"
    invoke("step", "--model", "mini", "--batches", "2", "--context", "16", "--steps", "2", "--threads", "1",
           "--modes", "fp32,bf16+cpp", "--json", str(out))  # fmt: skip
    data = json.loads(out.read_text())
    assert set(data["matmul_peak_gflops"]) == {"float32", "bfloat16"} and data["memory_gbps"] > 0
    fp32, bf16 = data["steps"]
    assert (fp32["mode"], bf16["mode"]) == ("float32", "bfloat16 + cpp")
    assert fp32["batch"] == bf16["batch"] == 2
    assert fp32["step_over_forward"] >= 1  # the forward is timed inside the step
    assert bf16["weight_bytes"] * 2 == fp32["weight_bytes"]  # the same linears in half the bytes
    for row in (fp32, bf16):
        peak = data["matmul_peak_gflops"][row["mode"].split(" ")[0]]
        # The middle timed step is the 4th decode step (2 warm-up, then 2 timed): each of the 2 requests reads the
        # K/V of its 16 prompt positions and of the 4 tokens decoded up to it.
        assert row["work"]["context_tokens"] == 2 * row["context"] and row["context"] == 16 + 4
        nbytes = row["weight_bytes"] + row["kv_bytes"]
        floor = max(row["flops"] / peak / 1e6, nbytes / data["memory_gbps"] / 1e6)
        assert row["roofline_ms"] == pytest.approx(floor, rel=1e-9)
        assert row["step_over_roofline"] == pytest.approx(row["step_ms"] / floor, rel=1e-9)


def test_step_command_holds_int8_w8a8_to_the_int8_peak(tmp_path) -> None:
    """int8-w8a8's linears multiply int8 codes: its roofline's arithmetic runs at the measured int8 peak."""
    out = tmp_path / "st.json"
    invoke("step", "--model", "mini", "--batches", "2", "--context", "16", "--steps", "2", "--threads", "1",
           "--modes", "fp32,fp32+int8-w8a8", "--json", str(out))  # fmt: skip
    data = json.loads(out.read_text())
    assert set(data["matmul_peak_gflops"]) == {"float32", "int8"}
    _, w8a8 = data["steps"]
    assert w8a8["mode"] == "float32 + int8-w8a8"
    peaks = data["matmul_peak_gflops"]
    work, cfg = w8a8["work"], mini().config
    head = 2 * cfg.hidden_size * cfg.vocab_size * work["sampled_rows"]
    attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * work["attention_pairs"]
    arithmetic = (w8a8["flops"] - head - attention) / peaks["int8"] + (head + attention) / peaks["float32"]
    nbytes = w8a8["weight_bytes"] + w8a8["kv_bytes"]
    floor = max(arithmetic / 1e6, nbytes / data["memory_gbps"] / 1e6)
    assert w8a8["roofline_ms"] == pytest.approx(floor, rel=1e-9)


class _FakeLlama:
    """Stands in for ``llama_cpp.Llama`` (not installable here: its wheel compiles llama.cpp)."""

    calls: ClassVar[list[dict]] = []

    def __init__(self, model_path: str, n_ctx: int, n_threads: int, verbose: bool) -> None:
        self.init = {"model_path": model_path, "n_ctx": n_ctx, "n_threads": n_threads, "verbose": verbose}

    def generate(self, tokens, **kwargs):
        self.calls.append({"prompt": list(tokens), **kwargs})
        tok = tokens[-1]
        while True:  # like llama.cpp's generator: endless until the caller stops
            tok = (tok * 7 + 3) % 256
            yield tok


def test_llama_cpp_peer_runs_greedy_one_request_at_a_time(monkeypatch, tmp_path) -> None:
    import importlib.machinery
    import sys
    import types

    fake = types.ModuleType("llama_cpp")
    fake.__spec__ = importlib.machinery.ModuleSpec("llama_cpp", None)
    fake.Llama = _FakeLlama
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    _FakeLlama.calls.clear()
    assert llama_cpp_available()
    rows = compare_throughput(mini(), [3], 5, ["llama.cpp"], gguf=tmp_path / "m.gguf", threads=2)
    assert [r.result.name for r in rows] == ["kvlab float32", "llama.cpp"]
    theirs = rows[1]
    assert theirs.result.name == "llama.cpp" and "n_threads=2" in theirs.result.setup
    assert [len(t) for t in theirs.result.tokens] == [5, 5, 5]  # stopped at max_tokens
    timed = _FakeLlama.calls[-3:]  # after the 2-prompt warm-up
    assert [c["prompt"] for c in timed] == shared_prefix_prompts(mini(), 3)
    assert all(c["temp"] == 0.0 and c["top_k"] == 1 and c["repeat_penalty"] == 1.0 and c["reset"] for c in timed)
    assert theirs.identical == 0  # a different model gives different tokens, and the row says so


def test_bench_fidelity_rounds_the_prompt_pass_as_each_modes_cache_stores_kv(tmp_path) -> None:
    """``--kv-cache-dtype`` is a third axis: a float32 cache is fp32's own (no difference at all), an fp8 one's prompt
    logits come from the dense pass with K/V rounded to e4m3 (a difference, within test_dtypes.py's 0.2 for it)."""
    out = tmp_path / "f.json"
    args = ["bench", "fidelity", "--model", "mini", "--quantization", "none", "--kv-cache-dtype", "auto,float32,fp8"]
    res = runner.invoke(app, [*args, "--num-prompts", "3", "--max-tokens", "4", "--threads", "1", "--json", str(out)])
    assert res.exit_code == 0, res.output
    rows = {r["mode"]: r for r in json.loads(out.read_text())}
    assert list(rows) == ["float32", "float32 + kv float32", "float32 + kv fp8"]
    assert rows["float32 + kv float32"]["max_logit_diff"] == 0.0 and rows["float32 + kv float32"]["identical"] == 3
    assert 0 < rows["float32 + kv fp8"]["max_logit_diff"] < 0.2
