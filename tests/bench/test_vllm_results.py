"""kvlab bench serve's results in vllm bench serve's layout: every key of a file vLLM 0.32 wrote (recorded by
scripts/peers/vllm_bench_serve.py against `kvlab serve smollm2`) with the same JSON types, vLLM's conventions
for failed requests and empty statistics, its one-second peaks, and --compare reading either tool's file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from kvlab.bench.serve_results import RequestResult, ServeBenchResult
from kvlab.bench.vllm_results import (
    REQUIRED,
    ResultFile,
    ResultFileError,
    compare_table,
    matching,
    per_second_peaks,
    result_path,
    vllm_result,
    write_result,
)
from kvlab.cli import app

VLLM_FILE = Path(__file__).with_name("vllm_bench_serve_0.32.json")
runner = CliRunner()


def scripted(index: int, start: float, tokens: tuple[float, ...], end: float, ok: bool = True) -> RequestResult:
    return RequestResult(
        index=index, url="http://x/v1/completions", ok=ok, status=200 if ok else 500, error=None if ok else "HTTP 500",
        text="t" * len(tokens), output_tokens=len(tokens), tokens_from="usage", content_chunks=len(tokens),
        prompt_tokens_sent=10 + index, prompt_tokens=10 + index, cached_tokens=None, arrival=start, start=start,
        token_times=tokens, end=end,
    )  # fmt: skip


REQS = (
    scripted(0, 0.0, (0.5, 0.6, 0.8, 1.1), 1.2),
    scripted(1, 1.0, (1.25, 1.65), 2.0),
    scripted(2, 2.0, (3.0,), 4.0),
    scripted(3, 0.2, (), 0.3, ok=False),
)


def result(reqs: tuple[RequestResult, ...] = REQS, concurrency: int | None = None) -> ServeBenchResult:
    return ServeBenchResult(
        "W4", "http://x/v1/completions", "smollm2", "token-ids", 8, True, 1, (4.0,), 0, reqs, None,
        workload_prompts=4, max_concurrency=concurrency,
    )  # fmt: skip


def json_type(value: Any) -> str:
    return "number" if isinstance(value, (int, float)) and not isinstance(value, bool) else type(value).__name__


def test_every_key_of_vllms_file_is_written_with_its_type() -> None:
    theirs = json.loads(VLLM_FILE.read_text())
    ours = json.loads(json.dumps(vllm_result(result(), date="20261202-000000", tokenizer_id="smollm2")))
    missing = sorted(set(theirs) - set(ours))
    assert not missing, f"keys of vLLM 0.32's file kvlab does not write: {missing}"
    for key, value in theirs.items():
        if value is not None and ours[key] is not None:
            assert json_type(ours[key]) == json_type(value), key
    for key in ("input_lens", "output_lens", "ttfts", "itls", "latencies", "generated_texts", "errors"):
        assert len(ours[key]) == ours["num_prompts"] == 4, key
    assert all(isinstance(gaps, list) for gaps in ours["itls"])
    assert all(k in ours for k in REQUIRED)


def test_vllms_conventions_for_a_failed_request_and_an_empty_statistic() -> None:
    d = vllm_result(result(), date="d", tokenizer_id="t")
    # The failed request (index 3): ttft 0, no ITLs, output 0, latency 0, its error; the others' error "".
    assert (d["ttfts"][3], d["itls"][3], d["output_lens"][3], d["latencies"][3]) == (0.0, [], 0, 0.0)
    assert d["errors"] == ["", "", "", "HTTP 500"] and d["generated_texts"][3] == ""
    assert d["ttfts"][:3] == pytest.approx([0.5, 0.25, 1.0]) and d["itls"][0] == pytest.approx([0.1, 0.2, 0.3])
    assert d["input_lens"] == [10, 11, 12, 13] and d["output_lens"][:3] == [4, 2, 1]
    assert (d["completed"], d["failed"], d["total_output_tokens"]) == (3, 1, 7)
    empty = vllm_result(result(REQS[3:]), date="d", tokenizer_id="t")
    assert empty["mean_ttft_ms"] == empty["p99_itl_ms"] == 0.0  # vLLM writes 0 where nothing was measured
    assert (empty["max_output_tokens_per_s"], empty["max_concurrent_requests"]) == (0.0, 0)
    assert "mean_client_queue_time_ms" not in d
    assert "mean_client_queue_time_ms" in vllm_result(result(concurrency=2), date="d", tokenizer_id="t")


def test_peaks_over_one_second_buckets_as_vllm_counts_them() -> None:
    # Buckets from the first successful send (0.0): tokens at 0.5, 0.6, 0.8 in [0, 1); 1.1, 1.25, 1.65 in
    # [1, 2); 3.0 in [3, 4). Active: request 0 in buckets 0-1, request 1 in 1-2, request 2 in 2-4.
    assert per_second_peaks(REQS) == (3.0, 2)
    assert per_second_peaks(REQS[3:]) == (0.0, 0)


def test_one_file_per_workload_when_there_are_several(tmp_path: Path) -> None:
    assert result_path("x.json", tmp_path, "W16", several=False) == tmp_path / "x.json"
    assert result_path("x.json", tmp_path, "W16", several=True) == tmp_path / "x-W16.json"
    assert result_path("x.json", None, "W64", several=True) == Path("x-W64.json")


def test_compare_reads_vllms_file_and_kvlabs_own(tmp_path: Path) -> None:
    theirs = ResultFile.read(VLLM_FILE)
    assert theirs.writer == "vllm bench serve (openai)" and theirs.traffic() == (8, "inf", None)
    ours_path = write_result(vllm_result(result(), date="d", tokenizer_id="t"), tmp_path / "kvlab.json")
    ours = ResultFile.read(ours_path)
    assert ours.writer == "kvlab"
    table = compare_table(ours, theirs)
    rows = {row[0]: row for row in table.rows}
    d = theirs.data
    assert rows["output tok/s"][2] == f"{d['output_throughput']:.1f}"
    assert rows["output tok/s"][3] == f"{d['output_throughput'] / ours.data['output_throughput']:.2f}"
    assert rows["TTFT p99 ms"][2] == f"{d['p99_ttft_ms']:.1f}"
    assert any("different traffic" in n for n in table.notes) and any("other prompts" in n for n in table.notes)
    same = compare_table(theirs, theirs)
    assert {row[3] for row in same.rows if row[3] != "-"} == {"1.00"} and not same.notes


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("not json", "not JSON"),
        ("[1, 2]", "one JSON object, got list"),
        ('{"workloads": []}', "kvlab's --json output"),
        ('{"backend": "openai"}', "not a vllm bench serve result: no model_id, num_prompts"),
    ],
)
def test_a_file_that_is_no_result_is_refused_naming_why(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "r.json"
    path.write_text(content)
    with pytest.raises(ResultFileError, match=message):
        ResultFile.read(path)


def test_the_workload_compared_is_the_one_that_sent_as_many_requests(tmp_path: Path) -> None:
    theirs = ResultFile.read(VLLM_FILE)  # 8 requests
    runs = [
        ResultFile(Path(n), vllm_result(result(REQS[:k]), date="d", tokenizer_id="t")) for n, k in (("a", 2), ("b", 4))
    ]
    with pytest.raises(ResultFileError, match="its run sent 8 requests; this run's workloads sent 2, 4"):
        matching(runs, theirs)
    assert matching(runs[:1], theirs) is runs[0]  # one workload: it, whatever it sent
    assert matching(runs, ResultFile(Path("x"), {**theirs.data, "num_prompts": 4})) is runs[1]


def test_compare_of_a_missing_file_fails_before_the_run() -> None:
    res = runner.invoke(app, ["bench", "serve", "--base-url", "http://127.0.0.1:9", "--compare", "/no/such.json"])
    assert res.exit_code == 2 and "does not exist" in res.output
