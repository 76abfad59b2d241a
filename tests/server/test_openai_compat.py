"""What a vLLM user expects of the server (issue 13, "Server"), through the official ``openai`` client where
it can say it: stop strings, logprobs, echo, a list of prompts, chat content parts, the usage chunk of a
stream, vLLM's sampling extensions, /tokenize /detokenize /version, the OpenAPI schema, and fields that are
refused by name instead of being silently ignored."""

from __future__ import annotations

import json
import logging
import math
from typing import Any

import pytest

from kvlab import LLM, SamplingParams

openai = pytest.importorskip("openai", reason="the openai client is in the dev extra")

PROMPT = "Stop test 0: the passphrase is"


@pytest.fixture(scope="module")
def client(server) -> Any:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", timeout=60, max_retries=0)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("mini")


def greedy(client, prompt: Any = PROMPT, max_tokens: int = 24, extra_body: dict | None = None, **kw: Any) -> Any:
    """A temperature-0 completion that runs to max_tokens unless a stop ends it (the mini model may emit EOS)."""
    body = {"ignore_eos": True, **(extra_body or {})}
    return client.completions.create(
        model="mini", prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body=body, **kw
    )


def printable_run(text: str, length: int = 3) -> str:
    """The first run of ``length`` printable ASCII characters in ``text`` after its first character."""
    for i in range(1, len(text) - length + 1):
        if all(" " <= ch <= "~" for ch in text[i : i + length]):
            return text[i : i + length]
    raise AssertionError(f"no printable run in {text!r}: pick another prompt")


# ------------------------------------------------------------------------------------------------ stop
def test_stop_string_cuts_the_text_and_the_stream_never_sends_its_beginning(client) -> None:
    """A stop string of 3 characters ends the answer before it, whole or streamed: the stream holds back the
    last 2 characters until they cannot begin the stop string, so no chunk ever carries "?l" of "?ln"."""
    full = greedy(client).choices[0].text
    stop = printable_run(full)
    want = full[: full.index(stop)]
    cut = greedy(client, stop=[stop, "never-matches"]).choices[0]
    assert (cut.text, cut.finish_reason, cut.model_extra["stop_reason"]) == (want, "stop", stop)
    chunks = list(greedy(client, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"
    kept = greedy(client, stop=stop, extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == want + stop
    # A stop string that never matches: the held-back tail is sent when the answer ends.
    streamed = greedy(client, stop="\x00\x00never", stream=True)
    assert "".join(c.choices[0].text for c in streamed) == full


def test_stop_token_ids_min_tokens_and_vllm_sampling_fields_match_the_engine(client, llm) -> None:
    """Every sampling field reaches the engine as SamplingParams: the server's tokens equal offline generate's."""
    first = greedy(client, max_tokens=8).choices[0].model_extra["token_ids"]
    cases: list[dict[str, Any]] = [
        {"stop_token_ids": [first[2]]},
        {"stop_token_ids": [first[0]], "min_tokens": 3},
        {"presence_penalty": 1.5, "frequency_penalty": 0.5},
        {"repetition_penalty": 1.3},
        {"temperature": 0.8, "seed": 7, "min_p": 0.2, "top_k": 5},
        {"allowed_token_ids": [65, 66, 67, 97, 98]},
        {"bad_words": ["a", "bc"]},
        {"truncate_prompt_tokens": 9},
        {"skip_special_tokens": False, "spaces_between_special_tokens": False},
        {"logit_bias": {"65": 100}},
    ]
    for extra in cases:
        body = {"ignore_eos": True, "temperature": 0, **extra}
        got = client.completions.create(model="mini", prompt=PROMPT, max_tokens=8, extra_body=body)
        kw = {**body, "logit_bias": {int(k): v for k, v in body.get("logit_bias", {}).items()} or None}
        if "truncate_prompt_tokens" in body:
            assert got.usage.prompt_tokens == body["truncate_prompt_tokens"]
        want = llm.generate([PROMPT], SamplingParams(max_tokens=8, **kw), use_tqdm=False)[0]
        assert got.choices[0].model_extra["token_ids"] == want.token_ids, extra
        assert got.choices[0].finish_reason == want.finish_reason, extra
    assert set(want.token_ids) == {65}, "a +100 bias all but forces the token"


# ------------------------------------------------------------------------------------------------ logprobs
def test_completion_logprobs_have_openais_shape_and_the_engines_values(client, llm) -> None:
    got = greedy(client, max_tokens=6, logprobs=3).choices[0]
    want = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True))[0]
    lp = got.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    for i, (tid, step) in enumerate(zip(want.token_ids, want.outputs[0].logprobs, strict=True)):
        assert math.isclose(lp.token_logprobs[i], step[tid].logprob, rel_tol=1e-9)
        # Greedy: the chosen token is the most likely one, so its log-probability is the top one.
        assert math.isclose(max(lp.top_logprobs[i].values()), lp.token_logprobs[i], rel_tol=1e-9)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    # Streamed, the same tokens and values arrive chunk by chunk.
    chunks = list(greedy(client, max_tokens=6, logprobs=3, stream=True))
    streamed = [t for c in chunks if c.choices for t in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(lp.token_logprobs)


def test_echo_prepends_the_prompt_with_its_logprobs(client) -> None:
    plain = greedy(client, max_tokens=4).choices[0]
    echo = greedy(client, max_tokens=4, echo=True, logprobs=1).choices[0]
    assert echo.text == PROMPT + plain.text
    n = len(PROMPT.encode())  # the byte tokenizer: a token per byte
    assert len(echo.logprobs.tokens) == n + 4 and "".join(echo.logprobs.tokens[:n]) == PROMPT
    assert echo.logprobs.token_logprobs[0] is None and echo.logprobs.top_logprobs[0] is None
    assert all(x is not None and x <= 0 for x in echo.logprobs.token_logprobs[1:])
    assert echo.logprobs.text_offset[n] == len(PROMPT), "the completion's offsets follow the echoed prompt"
    streamed = greedy(client, max_tokens=4, echo=True, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == echo.text


def test_chat_logprobs_and_top_logprobs(client) -> None:
    messages = [{"role": "user", "content": "hello"}]
    chat = client.chat.completions.create(
        model="mini", messages=messages, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 5 == chat.usage.completion_tokens
    for entry, tid in zip(content, chat.choices[0].model_extra["token_ids"], strict=True):
        assert entry.bytes == [tid], "the byte tokenizer: a token is one byte"
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert (entry.token, entry.logprob) == (entry.top_logprobs[0].token, entry.top_logprobs[0].logprob)
    stream = client.chat.completions.create(
        model="mini", messages=messages, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2, stream=True
    )
    streamed = [e.logprob for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert streamed == pytest.approx([e.logprob for e in content])
    plain = client.chat.completions.create(model="mini", messages=messages, max_tokens=5, temperature=0)
    assert plain.choices[0].logprobs is None


# ------------------------------------------------------------------------------------------------ shapes
def test_stream_include_usage_ends_with_a_usage_chunk(client) -> None:
    full = greedy(client, max_tokens=7)
    chunks = list(greedy(client, max_tokens=7, stream=True, stream_options={"include_usage": True}))
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (full.usage.prompt_tokens, 7)
    assert all(c.usage is None for c in chunks[:-1])
    assert "".join(c.choices[0].text for c in chunks[:-1]) == full.choices[0].text
    chat = list(
        client.chat.completions.create(
            model="mini", messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert chat[-1].choices == [] and chat[-1].usage.completion_tokens == 3
    without = list(greedy(client, max_tokens=3, stream=True))
    assert all(c.usage is None and c.choices for c in without)


def test_a_list_of_prompts_gets_choices_indexed_like_openai(client) -> None:
    prompts = ["first prompt", "second one", "third"]
    alone = [greedy(client, p, max_tokens=4).choices[0].text for p in prompts]
    both = greedy(client, prompts, max_tokens=4, n=2)
    assert [c.index for c in both.choices] == list(range(6))
    assert [c.text for c in both.choices] == [t for t in alone for _ in range(2)]
    assert both.usage.prompt_tokens == sum(len(p) for p in prompts) and both.usage.completion_tokens == 24
    ids = greedy(client, [list(p.encode()) for p in prompts[:2]], max_tokens=4)
    assert [c.text for c in ids.choices] == alone[:2]
    streamed: dict[int, str] = {}
    for chunk in greedy(client, prompts, max_tokens=4, stream=True):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == dict(enumerate(alone))


def test_chat_content_as_text_parts_and_other_parts_refused(client, http) -> None:
    parts = [{"type": "text", "text": "hello"}, {"type": "text", "text": "there"}]
    as_parts = client.chat.completions.create(
        model="mini", messages=[{"role": "user", "content": parts}], max_tokens=4, temperature=0
    )
    as_text = client.chat.completions.create(
        model="mini", messages=[{"role": "user", "content": "hello\nthere"}], max_tokens=4, temperature=0
    )
    assert as_parts.choices[0].message.content == as_text.choices[0].message.content
    image = [{"type": "image_url", "image_url": {"url": "data:,"}}]
    status, err = http.post("/v1/chat/completions", {"model": "mini", "messages": [{"role": "user", "content": image}]})
    assert status == 400 and err["error"]["param"] == "messages"
    assert "messages[0].content" in err["error"]["message"] and "'image_url'" in err["error"]["message"]


def test_chat_without_max_tokens_fills_the_context(client, server) -> None:
    chat = client.chat.completions.create(
        model="mini", messages=[{"role": "user", "content": "go on"}], temperature=0, extra_body={"ignore_eos": True}
    )
    max_model_len = server.engine.scheduler_config.max_model_len
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage.prompt_tokens + chat.usage.completion_tokens == max_model_len


# ------------------------------------------------------------------------------------------------ fields
def test_unknown_fields_are_refused_by_name(client, http) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        greedy(client, max_tokens=1, extra_body={"guided_json": {}})
    assert info.value.body["param"] == "guided_json" and "'guided_json'" in info.value.body["message"]
    for extra, param in [
        ({"suffix": "after"}, "suffix"),
        ({"best_of": 3}, "best_of"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream: it would do nothing
        ({"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}, "stream_options"),
    ]:
        status, err = http.post("/v1/completions", {"model": "mini", "prompt": "hi", "max_tokens": 1, **extra})
        assert status == 400 and err["error"]["param"] == param, (extra, err)
    chat = {"model": "mini", "messages": [{"role": "user", "content": "hi", "name": "bob"}], "max_tokens": 1}
    status, err = http.post("/v1/chat/completions", chat)
    assert status == 400 and "messages[0].name" in err["error"]["message"]
    no_logprobs = {"model": "mini", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}
    status, err = http.post("/v1/chat/completions", no_logprobs)
    assert status == 400 and err["error"]["param"] == "top_logprobs"
    # Values that ask for exactly what kvlab does are no-ops, not errors.
    noop = {
        "best_of": 2,
        "n": 2,
        "suffix": None,
        "tools": [],
        "tool_choice": "none",
        "response_format": {"type": "text"},
    }
    status, body = http.post("/v1/completions", {"model": "mini", "prompt": "hi", "max_tokens": 1, **noop})
    assert status == 200 and len(body["choices"]) == 2, body


def test_fields_clients_send_by_default_are_accepted_and_logged_once(http, caplog) -> None:
    caplog.set_level(logging.INFO, logger="kvlab.server.app")
    caplog.clear()
    body = {"model": "mini", "prompt": "hi", "max_tokens": 1, "user": "end-user-42", "store": False}
    for _ in range(3):
        status, resp = http.post("/v1/completions", body)
        assert status == 200, resp
    lines = [r.getMessage() for r in caplog.records if "accepted and ignored" in r.getMessage()]
    assert len([m for m in lines if "'user'" in m]) == 1 and len([m for m in lines if "'store'" in m]) == 1
    assert not any("end-user-42" in m for m in lines), "the value is not logged"


# ------------------------------------------------------------------------------------------------ return_token_ids
# vLLM 0.32's places (tests/server/vllm_server_parity_0.32.json, and its serving code for streams): completions,
# choices[].prompt_token_ids (a stream: the choice's first chunk); chat, the top-level prompt_token_ids (a
# stream: the first chunk, the role's); and in a stream every chunk's choices[].token_ids.
ASKED = {"return_token_ids": True, "ignore_eos": True}


def test_return_token_ids_on_completions_whole_and_streamed(client, server) -> None:
    tok = server.engine.tokenizer
    prompts = [PROMPT, "A second prompt, longer than the first one"]
    plain = greedy(client, prompts, max_tokens=6)
    whole = greedy(client, prompts, max_tokens=6, extra_body={"return_token_ids": True})
    for i, choice in enumerate(whole.choices):
        assert choice.model_extra["prompt_token_ids"] == tok.encode(prompts[i]), i
        assert choice.model_extra["token_ids"] == plain.choices[i].model_extra["token_ids"], i  # the same answer
        assert choice.text == plain.choices[i].text and "prompt_token_ids" not in plain.choices[i].model_extra
    # false is the default: nothing more than without the field.
    unasked = greedy(client, prompts, max_tokens=6, extra_body={"return_token_ids": False})
    assert unasked.choices[0].model_extra.keys() == plain.choices[0].model_extra.keys()
    chunks = list(greedy(client, prompts, max_tokens=6, stream=True, extra_body={"return_token_ids": True}))
    for i, choice in enumerate(whole.choices):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        assert mine[0].model_extra["prompt_token_ids"] == tok.encode(prompts[i]), i  # the first chunk only
        assert not any("prompt_token_ids" in c.model_extra for c in mine[1:]), i
        assert [t for c in mine for t in c.model_extra["token_ids"]] == choice.model_extra["token_ids"], i
        assert "".join(c.text for c in mine) == choice.text
    for c in greedy(client, prompts, max_tokens=6, stream=True):
        assert not {"token_ids", "prompt_token_ids"} & set(c.choices[0].model_extra), "as before without the field"


def test_return_token_ids_on_chat_whole_and_streamed(client, server, http) -> None:
    tok = server.engine.tokenizer
    messages = [{"role": "user", "content": "Name three colours."}]
    prompt_ids = tok.encode(tok.apply_chat_template(messages))  # the prompt the server renders and encodes
    assert http.post("/tokenize", {"model": "mini", "messages": messages}) == (
        200,
        {"tokens": prompt_ids, "count": len(prompt_ids), "max_model_len": server.engine.scheduler_config.max_model_len},
    )
    kw: dict[str, Any] = dict(model="mini", messages=messages, max_tokens=6, temperature=0)
    plain = client.chat.completions.create(**kw, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kw, extra_body=ASKED)
    assert whole.model_extra["prompt_token_ids"] == prompt_ids and "prompt_token_ids" not in plain.model_extra
    ids = plain.choices[0].model_extra["token_ids"]
    assert whole.choices[0].model_extra["token_ids"] == ids and whole.choices[0].message == plain.choices[0].message
    chunks = list(client.chat.completions.create(**kw, stream=True, extra_body=ASKED))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].model_extra["prompt_token_ids"] == prompt_ids
    assert not any("prompt_token_ids" in c.model_extra for c in chunks[1:])
    assert [t for c in chunks[1:] for t in c.choices[0].model_extra["token_ids"]] == ids
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == plain.choices[0].message.content
    assert "token_ids" not in chunks[0].choices[0].model_extra  # the role's chunk has no tokens of its own
    for c in client.chat.completions.create(**kw, stream=True, extra_body={"ignore_eos": True}):
        assert "prompt_token_ids" not in c.model_extra and "token_ids" not in c.choices[0].model_extra
    # A boolean, strictly, as every field.
    status, err = http.post("/v1/chat/completions", {"model": "mini", "messages": messages, "return_token_ids": "yes"})
    assert status == 400 and err["error"]["param"] == "return_token_ids", err


# ------------------------------------------------------------------------------------------------ vLLM routes
def test_tokenize_detokenize_version(http, server) -> None:
    status, tok = http.post("/tokenize", {"model": "mini", "prompt": "héllo"})
    assert status == 200 and tok == {
        "tokens": list("héllo".encode()),
        "count": 6,
        "max_model_len": server.engine.scheduler_config.max_model_len,
    }
    assert http.post("/detokenize", {"model": "mini", "tokens": tok["tokens"]}) == (200, {"prompt": "héllo"})
    messages = [{"role": "user", "content": "hi"}]
    status, chat = http.post("/tokenize", {"model": "mini", "messages": messages})
    assert status == 200 and chat["tokens"] == server.engine.tokenizer.encode(
        server.engine.tokenizer.apply_chat_template(messages)
    )
    assert http.post("/tokenize", {"prompt": "no model is fine"})[0] == 200
    for path, body, status, param in [
        ("/tokenize", {"model": "gpt-9", "prompt": "x"}, 404, "model"),
        ("/tokenize", {"model": "mini", "prompt": "x", "messages": messages}, 400, "prompt"),
        ("/tokenize", {"model": "mini", "prompt": "x", "add_special_tokens": True}, 400, "add_special_tokens"),
        ("/detokenize", {"model": "mini", "tokens": [1, 10**6]}, 400, "tokens"),
        ("/detokenize", {"model": "mini", "tokens": [-1]}, 400, "tokens"),
    ]:
        got, err = http.post(path, body)
        assert (got, err["error"]["param"]) == (status, param), (path, body, err)
    status, version = http.get("/version")
    assert status == 200 and json.loads(version)["version"]


def test_openapi_schema_and_docs_show_the_bodies(http) -> None:
    status, text = http.get("/openapi.json")
    assert status == 200
    schema = json.loads(text)
    components = schema["components"]["schemas"]
    completion = components["CompletionRequest"]
    assert {"model", "prompt", "stop", "logprobs", "echo", "stream_options", "cache_salt"} <= set(
        completion["properties"]
    )
    assert completion["additionalProperties"] is False and "prompt" in completion["required"]
    body = schema["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/CompletionRequest"}
    chat_ok = schema["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"]["application/json"]
    assert chat_ok["schema"] == {"$ref": "#/components/schemas/ChatCompletionResponse"}
    assert "ChatMessage" in components and {"/tokenize", "/detokenize", "/version"} <= set(schema["paths"])
    status, page = http.get("/docs")
    assert status == 200 and "swagger" in page.lower()
