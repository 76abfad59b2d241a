"""``kvlab bench throughput --peers vllm``: the plumbing, with a fake vLLM interpreter (kvlab's own Python with a
stand-in ``vllm`` package on its path, serving ``vllm.LLM`` from kvlab's engine). vLLM itself is never needed
and no timing is checked: the prompts reach the worker, its tokens come back, are compared with kvlab fp32's,
and the worker (with what it spawned) is gone afterwards."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvlab.bench.peers.vllm_peer import (
    VLLMPeer,
    VLLMPeerError,
    default_vllm_model,
    default_vllm_python,
    preload_warning,
    vllm_env,
)
from kvlab.bench.studies.throughput import compare_throughput, run_kvlab, vllm_knobs
from kvlab.bench.workloads import WorkloadSizes, chat_rounds, shared_prefix_prompts
from kvlab.cli import app
from kvlab.model import load_model

FAKE_VLLM = '''
"""A stand-in for vLLM: vllm.LLM / vllm.SamplingParams over kvlab's engine. It prints to stdout as vLLM's
logger does, which must never reach the protocol."""
import json
import os

import kvlab

__version__ = "0.0-fake"


class SamplingParams:
    def __init__(self, **kw):
        self.kw = kw


class LLM:
    def __init__(self, model, **kw):
        print("INFO fake vLLM engine starting", flush=True)
        with open(os.environ["FAKE_VLLM_LOG"], "a") as f:
            f.write(json.dumps({"model": model, "kw": kw}) + "\\n")
        assert os.path.isdir(model), model  # an HF directory, as vLLM wants; the stand-in serves kvlab's mini
        self.llm = kvlab.LLM("mini", dtype=kw["dtype"], block_size=kw["block_size"], num_blocks=512)
        self.shift = int(os.environ.get("FAKE_VLLM_SHIFT", "0"))
        self.dtype = kw["dtype"]

    def reset_prefix_cache(self):
        self._log({"reset": True})
        return self.llm.reset_prefix_cache()

    def generate(self, prompts, params, use_tqdm=True):
        print("INFO generating", flush=True)
        self._log({"generate": [p["prompt_token_ids"] for p in prompts], "params": params.kw})
        outs = self.llm.generate(prompts, kvlab.SamplingParams(**params.kw), use_tqdm=False)
        if self.shift:  # a peer that disagrees: every token moved by one
            for c in (c for o in outs for c in o.outputs):
                c.token_ids = [t + self.shift for t in c.token_ids]
        return outs

    def _log(self, entry):
        with open(os.environ["FAKE_VLLM_LOG"], "a") as f:
            f.write(json.dumps({"dtype": self.dtype, **entry}) + "\\n")
'''


@pytest.fixture
def fake_python(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """An executable that behaves as vLLM's interpreter: kvlab's Python with the fake vllm package first.
    (The model it is given is ``hf_dir``: a directory, as vLLM wants.)"""
    pkg = tmp_path / "site" / "vllm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(FAKE_VLLM)
    exe = tmp_path / "bin" / "python"
    exe.parent.mkdir()
    exe.write_text(f'#!/bin/sh\nPYTHONPATH="{pkg.parent}${{PYTHONPATH:+:$PYTHONPATH}}" exec "{sys.executable}" "$@"\n')
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("FAKE_VLLM_LOG", str(tmp_path / "llm.jsonl"))
    monkeypatch.setenv("LD_PRELOAD", "")  # kept as it is: nothing preloaded into kvlab's own Python
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    return str(exe)


@pytest.fixture
def hf_dir(tmp_path: Path) -> str:
    """What the peer is told to load: a directory (the stand-in serves kvlab's mini whatever it holds)."""
    d = tmp_path / "hf"
    d.mkdir()
    return str(d)


def _log(tmp: Path, kind: str = "model") -> list[dict]:
    """The stand-in's log: the engines built ("model"), the cache resets ("reset"), the generate calls."""
    entries = [json.loads(line) for line in (tmp / "llm.jsonl").read_text().splitlines()]
    return [e for e in entries if kind in e]


def test_the_worker_answers_with_kvlabs_tokens_and_goes_away(fake_python: str, hf_dir: str, tmp_path: Path) -> None:
    loaded = load_model("mini")
    prompts = shared_prefix_prompts(loaded, 3)
    knobs = vllm_knobs(prompts, 4, loaded.config.max_position_embeddings, 256)
    with VLLMPeer(fake_python, hf_dir, knobs) as peer:
        assert peer.version == "0.0-fake" and "enable_prefix_caching=True" in peer.setup
        tokens, seconds = peer.generate(prompts, 4)
        again, _ = peer.generate(prompts[:1], 4)
        proc = peer._proc
    assert proc is not None and proc.poll() is not None, "the worker ended with the context"
    assert tokens == run_kvlab(loaded, prompts, 4).tokens and again == tokens[:1] and seconds >= 0
    (built,) = _log(tmp_path)
    assert built["model"] == hf_dir
    assert built["kw"] | {"max_model_len": 0} == {
        "dtype": "float32", "seed": 0, "enable_prefix_caching": True, "block_size": 32, "max_model_len": 0,
        "max_num_seqs": 64, "max_num_batched_tokens": 256,
    }  # fmt: skip


def test_compare_throughput_runs_vllm_as_a_peer_and_compares_tokens(fake_python: str, hf_dir: str, monkeypatch) -> None:
    loaded = load_model("mini")
    rows = compare_throughput(loaded, [2, 3], 4, ["vllm"], vllm_python=fake_python, vllm_model=hf_dir)
    peers = [(r.workload, r.result.name, r.identical) for r in rows]
    kvlab = rows[0].result.name  # the fp32 mode's name
    assert kvlab.startswith("kvlab ")
    assert peers == [("W2", kvlab, None), ("W2", "vllm 0.0-fake", 2), ("W3", kvlab, None), ("W3", "vllm 0.0-fake", 3)]
    monkeypatch.setenv("FAKE_VLLM_SHIFT", "1")
    (_, vllm_row) = compare_throughput(loaded, [2], 4, ["vllm"], vllm_python=fake_python, vllm_model=hf_dir)
    assert vllm_row.identical == 0 and vllm_row.common_prefix == 0
    with pytest.raises(ValueError, match="vllm_python"):
        compare_throughput(loaded, [2], 4, ["vllm"])


def test_the_worker_runs_rounds_of_n_samples_on_a_reset_cache(fake_python: str, hf_dir: str, tmp_path: Path) -> None:
    loaded = load_model("mini")
    prompts = shared_prefix_prompts(loaded, 2)
    with VLLMPeer(fake_python, hf_dir, vllm_knobs(prompts, 3, 512, 256)) as peer:
        tokens, seconds = peer.run([prompts, prompts[:1]], 3, n=3, temperature=1.0, top_k=1, reset_prefix_cache=True)
    greedy = run_kvlab(loaded, prompts, 3).tokens  # top_k 1 samples the argmax: the greedy tokens, n times
    assert tokens == [greedy[0]] * 3 + [greedy[1]] * 3 + [greedy[0]] * 3 and seconds >= 0
    assert len(_log(tmp_path, "reset")) == 1
    first, second = _log(tmp_path, "generate")  # the rounds one after another, in their order
    assert (first["generate"], second["generate"]) == (prompts, prompts[:1])
    assert first["params"] == {"temperature": 1.0, "max_tokens": 3, "ignore_eos": True, "n": 3, "top_k": 1}


def test_the_w8a8_peers_load_their_own_directory_and_say_so_in_their_name(
    fake_python: str, hf_dir: str, tmp_path: Path
) -> None:
    """``vllm-w8a8`` and ``vllm-w8a8-bf16`` load the directory of int8 codes (not the fp32 one), each in its dtype,
    one worker after the other; their rows name the quantisation."""
    codes = tmp_path / "w8a8"
    codes.mkdir()
    loaded = load_model("mini")
    rows = compare_throughput(
        loaded, [2], 3, ["vllm", "vllm-w8a8", "vllm-w8a8-bf16"], vllm_python=fake_python, vllm_model=hf_dir,
        vllm_w8a8_model=str(codes),
    )  # fmt: skip
    names = ["kvlab float32", "vllm 0.0-fake", "vllm 0.0-fake + int8-w8a8", "vllm 0.0-fake bfloat16 + int8-w8a8"]
    assert [r.result.name for r in rows] == names
    assert [(b["model"], b["kw"]["dtype"]) for b in _log(tmp_path)] == [
        (hf_dir, "float32"), (str(codes), "float32"), (str(codes), "bfloat16")
    ]  # fmt: skip
    with pytest.raises(ValueError, match="the vllm-w8a8 peers need vllm_python and vllm_w8a8_model"):
        compare_throughput(loaded, [2], 3, ["vllm-w8a8"], vllm_python=fake_python, vllm_model=hf_dir)


def test_the_fp8_kv_peers_ask_vllm_for_an_fp8_cache_and_say_so_in_their_name(
    fake_python: str, hf_dir: str, tmp_path: Path
) -> None:
    """``vllm-bf16-kv-fp8`` and ``vllm-w8a8-bf16-kv-fp8`` pass ``kv_cache_dtype="fp8"`` (what kvlab's ``kv-fp8``
    stores: e4m3, unscaled) to ``vllm.LLM``; the peers without it pass nothing, so vLLM keeps its default."""
    codes = tmp_path / "w8a8"
    codes.mkdir()
    rows = compare_throughput(
        load_model("mini"), [2], 3, ["vllm-bf16", "vllm-bf16-kv-fp8", "vllm-w8a8-bf16-kv-fp8"],
        vllm_python=fake_python, vllm_model=hf_dir, vllm_w8a8_model=str(codes),
    )  # fmt: skip
    names = ["vllm 0.0-fake bfloat16", "vllm 0.0-fake bfloat16 + kv fp8", "vllm 0.0-fake bfloat16 + int8-w8a8 + kv fp8"]
    assert [r.result.name for r in rows][1:] == names
    built = [(b["model"], b["kw"].get("kv_cache_dtype")) for b in _log(tmp_path)]
    assert built == [(hf_dir, None), (hf_dir, "fp8"), (str(codes), "fp8")]


def test_every_workload_runs_on_both_vllm_dtypes_one_worker_after_the_other(
    fake_python: str, hf_dir: str, tmp_path: Path
) -> None:
    loaded = load_model("mini")
    sizes = WorkloadSizes(sessions=2, turns=2, n=2, parallel_requests=2)
    rows = compare_throughput(
        loaded, [2], 3, ["vllm", "vllm-bf16"], vllm_python=fake_python, vllm_model=hf_dir,
        workloads=("chat", "parallel"), workload_sizes=sizes,
    )  # fmt: skip
    peers = ["kvlab float32", "vllm 0.0-fake", "vllm 0.0-fake bfloat16"]
    assert [(r.workload, r.result.name) for r in rows] == [(w, p) for w in ("chat 2x2", "W2 n=2") for p in peers]
    assert [r.identical for r in rows if r.result.name == "vllm 0.0-fake"] == [4, 4]  # fp32: kvlab's tokens
    assert all(len(r.result.tokens) == 4 for r in rows)
    built = _log(tmp_path)
    assert [b["kw"]["dtype"] for b in built] == ["float32", "bfloat16"]  # one worker per dtype
    longest = max(len(p) for p in chat_rounds(loaded, 2, 2, 3)[-1]) + 3  # the last turn's prompts are the longest
    assert all(b["kw"]["max_model_len"] >= longest and b["kw"]["max_num_seqs"] == 64 for b in built)
    calls = _log(tmp_path, "generate")
    dtypes = [c["dtype"] for c in calls]
    assert dtypes == sorted(dtypes, key=["float32", "bfloat16"].index)  # every fp32 run before the first bf16 one
    fp32 = [c for c in calls if c["dtype"] == "float32"]
    # chat: a warm-up round, then its two rounds (turn 1 extends turn 0, session by session); parallel: n=2
    warm, turn0, turn1, warm_n, parallel = fp32
    assert len(warm["generate"]) == 2 and warm_n["params"] == parallel["params"]
    assert all(b[: len(a)] == a for a, b in zip(turn0["generate"], turn1["generate"], strict=True))
    assert turn0["params"] == {"temperature": 0.0, "max_tokens": 3, "ignore_eos": True}
    assert parallel["params"] | {"max_tokens": 0} == {"temperature": 1.0, "max_tokens": 0, "ignore_eos": True, "n": 2,
                                                       "top_k": 1, "seed": 0}  # fmt: skip
    assert parallel["generate"] == shared_prefix_prompts(loaded, 2)
    # Every run on a cold cache: each worker reset before each of its 4 runs (2 warm-ups, 2 timed).
    assert [r["dtype"] for r in _log(tmp_path, "reset")] == ["float32"] * 4 + ["bfloat16"] * 4


def test_the_cli_takes_vllm_python_and_reports_identical_tokens(fake_python: str, hf_dir: str) -> None:
    args = ["bench", "throughput", "--model", "mini", "--requests", "2", "--max-tokens", "3", "--peers", "vllm"]
    res = CliRunner().invoke(app, [*args, "--vllm-python", fake_python, "--vllm-model", hf_dir, "--json", "-"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout[res.stdout.index("[") :])
    (vllm_row,) = [r for r in rows if r["peer"].startswith("vllm")]
    assert vllm_row["identical_outputs"] == 2 and "max_num_seqs=64" in vllm_row["setup"]


def test_a_broken_peer_is_an_error_with_its_reason(hf_dir: str, tmp_path: Path, monkeypatch) -> None:
    # kvlab's own Python has no vllm package: the worker says so, and the CLI exits 1 naming it.
    monkeypatch.setenv("LD_PRELOAD", "")
    with pytest.raises(VLLMPeerError, match="ModuleNotFoundError"):
        VLLMPeer(sys.executable, hf_dir).start()
    with pytest.raises(VLLMPeerError, match="no vLLM interpreter"):
        VLLMPeer(str(tmp_path / "nothing"), hf_dir).start()
    with pytest.raises(VLLMPeerError, match="HF directory"):  # never a name vLLM would look up on a hub
        VLLMPeer(sys.executable, "mini").start()
    args = ["bench", "throughput", "--model", "mini", "--requests", "2", "--max-tokens", "2", "--peers", "vllm"]
    res = CliRunner().invoke(app, [*args, "--vllm-python", sys.executable, "--vllm-model", hf_dir])
    assert res.exit_code == 1 and "the vllm peer" in res.output and "No module named 'vllm'" in res.output
    # mini has no HF directory vLLM could load: refused before anything starts, unless one is named.
    res = CliRunner().invoke(app, [*args, "--vllm-python", sys.executable])
    assert res.exit_code == 2 and "--vllm-model" in res.output
    # No interpreter named and none installed where scripts/peers/vllm.sh puts it: refused before any load.
    monkeypatch.delenv("KVLAB_VLLM_PYTHON", raising=False)
    monkeypatch.setattr("kvlab.bench.peers.vllm_peer.DEFAULT_PEERS", tmp_path)
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2 and "--vllm-python" in res.output


def test_defaults_and_environment(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr("kvlab.bench.peers.vllm_peer.DEFAULT_PEERS", tmp_path)
    monkeypatch.delenv("KVLAB_VLLM_PYTHON", raising=False)
    monkeypatch.delenv("KVLAB_VLLM_MODEL", raising=False)
    assert default_vllm_python() is None
    (tmp_path / "vllm" / "bin").mkdir(parents=True)
    (tmp_path / "vllm" / "bin" / "python").touch()
    assert default_vllm_python() == str(tmp_path / "vllm" / "bin" / "python")
    assert default_vllm_model("smollm2") == str(tmp_path / "smollm2-fp32")
    assert default_vllm_model(str(tmp_path)) == str(tmp_path)
    assert default_vllm_model("mini") is None and default_vllm_model("/no/such/dir") is None
    (tmp_path / "vllm" / "lib").mkdir()
    (tmp_path / "vllm" / "lib" / "libiomp5.so").touch()
    env = vllm_env(str(tmp_path / "vllm" / "bin" / "python"), threads=2, base={})
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2" and env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert env["HF_HUB_OFFLINE"] == "1"
    assert env["LD_PRELOAD"].endswith(str(tmp_path / "vllm" / "lib" / "libiomp5.so"))
    kept = vllm_env(sys.executable, threads=1, base={"LD_PRELOAD": "x.so", "VLLM_CPU_KVCACHE_SPACE": "4"})
    assert kept["LD_PRELOAD"] == "x.so" and kept["VLLM_CPU_KVCACHE_SPACE"] == "4"
    assert kept["VLLM_CPU_OMP_THREADS_BIND"] == "0-0"
    assert os.environ.get("FAKE_VLLM_LOG") is None


@pytest.mark.parametrize(
    ("preload", "warned"),
    [
        ("/peers/vllm/lib/libiomp5.so", True),
        ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4:/peers/vllm/lib/libiomp5.so", True),
        ("/usr/lib/libjemalloc.so", False),
        (None, False),
    ],
)
def test_a_bench_run_with_vllm_s_preloads_says_so(preload: str | None, warned: bool) -> None:
    # `eval "$(scripts/peers/vllm.sh --env)"` in kvlab's shell preloads vLLM's OpenMP and allocator into kvlab too.
    assert (preload_warning({"LD_PRELOAD": preload} if preload else {}) is not None) is warned
    # None removes the variable for the run, whatever the suite's own environment holds.
    res = CliRunner().invoke(
        app, ["bench", "scaling", "--parts", "memory", "--batches", "1"], env={"LD_PRELOAD": preload}
    )
    assert res.exit_code == 0, res.output
    assert ("LD_PRELOAD holds vLLM's libraries" in res.stderr) is warned
