"""``kvlab.openai_http``'s readers on answers as servers write them: kvlab's (recorded from ``kvlab serve`` on
mini), vLLM's, llama.cpp's (OpenAI endpoint with ``timings``, and its native ``/completion``) and servers that
report no cache at all. The probe and ``kvlab bench serve`` read every answer through these."""

from __future__ import annotations

import json

import httpx

from kvlab.openai_http import (
    ERROR_EXCERPT,
    answered,
    auth_headers,
    cached_tokens_of,
    error_event,
    requested_url,
    server_root,
    token_ids_of,
    usage_int,
)

# kvlab serve, mini: a completion (its prompt's first block was cached) and the last chunk of its stream.
KVLAB = {
    "id": "cmpl-0a125c6dbcaa4975bd614e2b", "object": "text_completion", "created": 1796116292, "model": "mini",
    "choices": [{"index": 0, "text": "\ufffd\ufffd", "logprobs": None, "finish_reason": "length",
                 "stop_reason": None, "token_ids": [153, 147]}],
    "usage": {"prompt_tokens": 24, "completion_tokens": 2, "total_tokens": 26,
              "prompt_tokens_details": {"cached_tokens": 16}},
}  # fmt: skip
KVLAB_USAGE_CHUNK = {
    "id": "cmpl-ed4b0e6aadb24356a5198177", "object": "text_completion", "created": 1796116292, "model": "mini",
    "choices": [],
    "usage": {"prompt_tokens": 24, "completion_tokens": 2, "total_tokens": 26,
              "prompt_tokens_details": {"cached_tokens": 16}},
}  # fmt: skip
# vLLM with --enable-prompt-tokens-details, asked for return_token_ids.
VLLM = {
    "id": "cmpl-8e1f0c7a", "object": "text_completion", "created": 1733000000,
    "model": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "choices": [{"index": 0, "text": " Paris.", "logprobs": None, "finish_reason": "length", "stop_reason": None,
                 "prompt_logprobs": None, "token_ids": [7042, 30]}],
    "usage": {"prompt_tokens": 7, "total_tokens": 9, "completion_tokens": 2,
              "prompt_tokens_details": {"cached_tokens": 0}},
}  # fmt: skip
# vLLM without --enable-prompt-tokens-details: the field is there, and null.
VLLM_NO_DETAILS = {"choices": [], "usage": {"prompt_tokens": 7, "total_tokens": 9, "completion_tokens": 2,
                                            "prompt_tokens_details": None}}  # fmt: skip
# llama.cpp's server, /v1/completions (and its final stream chunk): usage without details, timings with cache_n.
LLAMA_CPP = {
    "choices": [{"text": " Paris", "index": 0, "logprobs": None, "finish_reason": "length"}],
    "created": 1733000000, "model": "gpt-3.5-turbo", "system_fingerprint": "b5002-8c3fd5c2",
    "object": "text_completion", "usage": {"completion_tokens": 2, "prompt_tokens": 7, "total_tokens": 9},
    "id": "chatcmpl-Xyz",
    "timings": {"cache_n": 6, "prompt_n": 1, "prompt_ms": 12.3, "prompt_per_token_ms": 12.3,
                "prompt_per_second": 81.3, "predicted_n": 2, "predicted_ms": 20.1, "predicted_per_token_ms": 10.05,
                "predicted_per_second": 99.5},
}  # fmt: skip
# llama.cpp's native /completion with return_tokens (older builds: no timings.cache_n, only tokens_cached).
LLAMA_CPP_NATIVE = {
    "content": " Paris", "tokens": [7042, 30], "id_slot": 0, "stop": True, "model": "gpt-3.5-turbo",
    "tokens_predicted": 2, "tokens_evaluated": 7, "stop_type": "limit", "tokens_cached": 5,
    "timings": {"prompt_n": 2, "prompt_ms": 14.0, "predicted_n": 2, "predicted_ms": 20.0},
}  # fmt: skip
# transformers serve (and other servers that report no cache): usage counts only.
NO_REPORT = {"choices": [{"index": 0, "text": " Paris", "finish_reason": "length"}],
             "usage": {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}}  # fmt: skip


def test_cached_tokens_from_each_servers_field() -> None:
    assert cached_tokens_of(KVLAB) == cached_tokens_of(KVLAB_USAGE_CHUNK) == 16
    assert cached_tokens_of(VLLM) == 0  # reported, and zero: not the same as "not said"
    assert cached_tokens_of(LLAMA_CPP) == 6
    assert cached_tokens_of(LLAMA_CPP_NATIVE) == 5
    assert cached_tokens_of(VLLM_NO_DETAILS) is None
    assert cached_tokens_of(NO_REPORT) is None
    assert cached_tokens_of({}) is None
    # Only JSON integers count: a bool or a string is no count.
    assert cached_tokens_of({"usage": {"prompt_tokens_details": {"cached_tokens": True}}}) is None
    assert cached_tokens_of({"timings": {"cache_n": "6"}}) is None
    assert cached_tokens_of({"usage": "none", "timings": [6]}) is None


def test_usage_fields() -> None:
    for data, prompt, completion in ((KVLAB, 24, 2), (VLLM, 7, 2), (LLAMA_CPP, 7, 2), (NO_REPORT, 7, 2)):
        assert usage_int(data, "prompt_tokens") == prompt and usage_int(data, "completion_tokens") == completion
    assert usage_int(LLAMA_CPP_NATIVE, "prompt_tokens") is None  # the native endpoint has no usage
    assert usage_int({"usage": None}, "prompt_tokens") is None
    assert usage_int({"usage": {"prompt_tokens": 7.0}}, "prompt_tokens") is None


def test_token_ids() -> None:
    assert token_ids_of(KVLAB["choices"][0]["token_ids"]) == (153, 147)
    assert token_ids_of(VLLM["choices"][0]["token_ids"]) == (7042, 30)
    assert token_ids_of(LLAMA_CPP_NATIVE["tokens"]) == (7042, 30)
    assert token_ids_of(LLAMA_CPP["choices"][0].get("token_ids")) is None  # text only
    assert token_ids_of([]) == ()
    assert token_ids_of([1, True]) is None and token_ids_of([1, "2"]) is None and token_ids_of("12") is None


def test_error_bodies_and_events() -> None:
    kvlab_404 = {"error": {"message": "the model 'x' does not exist; this server serves 'mini'",
                           "type": "not_found_error", "param": "model", "code": "model_not_found"}}  # fmt: skip
    llama_cpp_400 = {"error": {"code": 400, "message": "the request exceeds the available context size",
                               "type": "exceed_context_size_error"}}  # fmt: skip
    vllm_event = {"error": {"object": "error", "message": "engine dead", "type": "InternalServerError",
                            "param": None, "code": 500}}  # fmt: skip
    for body in (kvlab_404, llama_cpp_400, vllm_event):
        assert error_event(body) == json.dumps(body["error"])
    assert error_event(KVLAB_USAGE_CHUNK) is None and error_event({"error": None}) is None
    long = {"error": {"message": "x" * 1000}}
    event = error_event(long)
    assert event is not None and len(event) == ERROR_EXCERPT and event.startswith('{"message": "xxx')
    url = "http://h:1/v1/completions"
    text = json.dumps(kvlab_404)
    assert answered("POST", url, 404, text) == f"POST {url} answered 404: {text}"
    assert answered("GET", url, 500, "y" * 1000) == f"GET {url} answered 500: {'y' * ERROR_EXCERPT}"


def test_where_requests_go() -> None:
    for base in ("http://h:1", "http://h:1/", "http://h:1/v1", "http://h:1/v1/", " http://h:1/v1 "):
        assert server_root(base) == "http://h:1"
    assert server_root("http://h:1/proxy/v1") == "http://h:1/proxy"
    assert auth_headers("k") == {"Authorization": "Bearer k"} and auth_headers(None) == auth_headers("") == {}
    bound = httpx.ConnectError("refused", request=httpx.Request("POST", "http://h:1/proxy/v1/completions"))
    assert requested_url(bound, "fallback") == "http://h:1/proxy/v1/completions"
    unbound = httpx.ConnectError("refused")  # never sent: httpx raises on reading its request
    assert requested_url(unbound, "http://h:1/v1/completions") == "http://h:1/v1/completions"
    assert requested_url(ValueError("no request"), "fallback") == "fallback"
