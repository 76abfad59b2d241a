"""The floor of a run (``bench.studies.floor``): the work each step did is counted exactly, and the floor is that
work at given peaks. No timing: the peaks are given, the counts are exact."""

from __future__ import annotations

import pytest

from kvlab import LLM, SamplingParams
from kvlab.bench.studies.floor import Machine, WorkCosts
from kvlab.bench.studies.throughput import compare_throughput, throughput_table
from kvlab.engine.stats import StepWork
from oracle_cache import mini


def run(prompts: list[list[int]], max_tokens: int, **knobs) -> LLM:
    llm = LLM(mini(), block_size=4, **knobs)
    llm.engine.work_log = []
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    return llm


def test_each_step_logs_its_rows_pairs_and_context() -> None:
    p, t = 10, 5
    log = run([list(range(1, p + 1))], t).engine.work_log
    assert log is not None and len(log) == t  # the prompt in one step, then one step per token but the first
    assert log[0] == StepWork(query_tokens=p, sampled_rows=1, attention_pairs=p * (p + 1) // 2, context_tokens=p)
    for k, w in enumerate(log[1:], start=1):  # decode: one row reading the whole context
        assert w == StepWork(1, 1, p + k, p + k)


def test_chunks_and_batches_add_up() -> None:
    prompts = [list(range(1, 12)), list(range(20, 27))]
    log = run(prompts, 3, max_num_batched_tokens=8).engine.work_log
    assert log is not None
    assert sum(w.query_tokens for w in log) == 11 + 7 + 2 * 2  # every prompt token once, then the decodes
    assert sum(w.sampled_rows for w in log) == 2 * 3
    assert all(w.query_tokens <= 8 for w in log)
    # Every token attends to itself and every token before it, exactly once over the run.
    pairs = sum(n * (n + 1) // 2 for n in (11 + 2, 7 + 2))
    assert sum(w.attention_pairs for w in log) == pairs


def test_the_floor_is_the_larger_bound_of_each_step() -> None:
    llm = run([list(range(1, 9))], 3)
    costs = WorkCosts.of(llm.engine)
    cfg = mini().config
    head = cfg.hidden_size * cfg.vocab_size
    linear = sum(m.weight.numel() for m in mini().model.modules() if m.__class__.__name__ == "Linear")
    assert costs.linear_flops_per_row == 2 * (linear - head) and costs.head_flops_per_row == 2 * head
    assert costs.attention_flops_per_pair == 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim
    assert costs.kv_bytes_per_position == 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
    log = llm.engine.work_log
    assert log is not None
    memory_bound = Machine({"float32": 1e12}, bandwidth_gbps=1.0)  # arithmetic is free: bytes decide
    want = sum(costs.weight_bytes + costs.kv_bytes_per_position * w.context_tokens for w in log) / 1e9
    assert costs.floor_s(log, memory_bound) == pytest.approx(want, rel=1e-9)
    compute_bound = Machine({"float32": 1.0}, bandwidth_gbps=1e12)  # bytes are free: FLOPs decide
    flops = sum(
        costs.linear_flops_per_row * w.query_tokens
        + costs.head_flops_per_row * w.sampled_rows
        + costs.attention_flops_per_pair * w.attention_pairs
        for w in log
    )
    assert costs.floor_s(log, compute_bound) == pytest.approx(flops / 1e9, rel=1e-9)


def test_throughput_rows_of_kvlab_carry_their_floor_and_peers_none() -> None:
    machine = Machine({"float32": 1e12}, bandwidth_gbps=1e12)
    rows = compare_throughput(mini(), [2], 4, [], machine=machine)
    assert rows and all(r.result.floor_seconds is not None and r.result.floor_share is not None for r in rows)
    table = throughput_table(rows, "mini", 4, 1)
    at = table.headers.index("of floor")
    assert all(row[at].endswith("%") for row in table.rows)
    assert rows[0].as_dict()["floor_share"] == round(rows[0].result.floor_share or 0, 3)
    plain = compare_throughput(mini(), [2], 4, [])
    assert plain[0].result.floor_seconds is None and throughput_table(plain, "mini", 4, 1).rows[0][at] == "-"
    # A share is read against the limits it was priced at (this VM's memory reads 34 or 58 GB/s minutes apart):
    # the table's title and each priced row's JSON say them; an unpriced row says none.
    assert "floors priced at matmul peak float32 1000000000000.0 GFLOP/s; memory 1000000000000.0 GB/s" in table.title
    assert rows[0].as_dict()["floor_priced_at"] == {"matmul_peak_gflops": {"float32": 1e12}, "memory_gbps": 1e12}
    assert plain[0].as_dict()["floor_priced_at"] is None and "priced" not in throughput_table(plain, "mini", 4, 1).title


def test_int8_w8a8_linears_run_at_the_int8_peak_and_the_rest_at_the_models() -> None:
    """In int8-w8a8 the layers' linears multiply int8 codes: their FLOPs count at the int8 peak, the LM head's and
    attention's at the model dtype's, and the weight bytes are the codes and their scales."""
    from kvlab.bench.modes import parse_mode

    llm = run([list(range(1, 9))], 3, quantization="int8-w8a8")
    costs = WorkCosts.of(llm.engine)
    assert (costs.dtype, costs.linear_dtype) == ("float32", "int8")
    assert parse_mode("bf16+int8-w8a8").peak_dtypes == ("bfloat16", "int8")
    assert parse_mode("fp32+int8").peak_dtypes == ("float32",)
    plain = WorkCosts.of(run([list(range(1, 9))], 3).engine)
    # int8 codes and an fp32 scale per (16-padded) output channel, against fp32 weights
    assert plain.weight_bytes / 4 < costs.weight_bytes < plain.weight_bytes / 3
    log = llm.engine.work_log
    assert log is not None
    slow_int8 = Machine({"float32": 1e6, "int8": 1.0}, bandwidth_gbps=1e12)
    slow_fp32 = Machine({"float32": 1.0, "int8": 1e6}, bandwidth_gbps=1e12)
    linear = sum(costs.linear_flops_per_row * w.query_tokens for w in log) / 1e9
    rest = sum(
        costs.head_flops_per_row * w.sampled_rows + costs.attention_flops_per_pair * w.attention_pairs for w in log
    )
    assert costs.floor_s(log, slow_int8) == pytest.approx(linear + rest / 1e15, rel=1e-9)
    assert costs.floor_s(log, slow_fp32) == pytest.approx(linear / 1e6 + rest / 1e9, rel=1e-9)


def test_int8_w8a8_head_runs_the_lm_head_at_the_int8_peak_too() -> None:
    """With the LM head quantised (int8-w8a8-head) its FLOPs count at the int8 peak with the linears' and its bytes
    are its codes: the floor's arithmetic moves by exactly the head's FLOPs, and the weights shrink."""
    llm = run([list(range(1, 9))], 3, quantization="int8-w8a8-head")
    costs = WorkCosts.of(llm.engine)
    assert (costs.dtype, costs.linear_dtype, costs.head_dtype) == ("float32", "int8", "int8")
    kept = WorkCosts.of(run([list(range(1, 9))], 3, quantization="int8-w8a8").engine)
    assert kept.head_dtype == "float32" and costs.weight_bytes < kept.weight_bytes
    log = llm.engine.work_log
    assert log is not None
    slow_int8 = Machine({"float32": 1e6, "int8": 1.0}, bandwidth_gbps=1e12)
    linear = sum(costs.linear_flops_per_row * w.query_tokens for w in log)
    head = sum(costs.head_flops_per_row * w.sampled_rows for w in log)
    attention = sum(costs.attention_flops_per_pair * w.attention_pairs for w in log)
    assert costs.floor_s(log, slow_int8) == pytest.approx((linear + head) / 1e9 + attention / 1e15, rel=1e-9)
